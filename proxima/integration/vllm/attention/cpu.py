"""Attention over compressed blocks on CPU: a subclass of vLLM's CPU_ATTN backend.

Rows (requests) of the batch split in three once per step, at the first layer (`resolve`):

* rows without compressed blocks: vLLM's kernel on vLLM's cache, exactly as vanilla (and when no
  row has compressed blocks the parent's path runs untouched);
* decode rows with compressed blocks (found by their *key block*, see `plan.ProximaPlan`): per
  layer, numba kernels fold every stored entry (hot token, quantized token, centroid) into one
  count-weighted online softmax, reading each where it lies (`cpu_compact.py`);
* prefill chunks of a long prompt whose earlier chunks were compressed (and every compressed row
  of a model whose attention needs more than that softmax: ALiBi, a window, a soft cap, sinks):
  per layer, a transient bf16 scratch cache holds their tokens (`cpu_scratch.py`: hot blocks
  copied, compressed ones decompressed in one batched call per format, sparse blocks' kept tokens
  packed, cluster centroids repeated by count) and vLLM's own kernel reads it through a scratch
  block table, causal mask included.

The worker's maps and slot pools are the `WorkerStore` of Proxima's KV connector
(`connector.worker_store()`); without that connector (or with Proxima not configured in it) every
method is the parent's.

Importance: in one layer (`WorkerStore.observe_layer`), the scheduled rows' observation-window queries
(the last `observation_window` prompt tokens of a prefill chunk, the new token of a decode row)
are scored against their hot keys with torch; the attention mass per token feeds the worker's
token importance (sparse and cluster use it) and, per block, the scheduler's policy engine.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from proxima.integration.vllm.attention import cpu_compact
from proxima.integration.vllm.attention.cpu_compact import CompactPlan, attend_compact, plan_compact
from proxima.integration.vllm.attention.cpu_scratch import (
    ScratchPlan,
    ScratchRow,
    fill_scratch,
    plan_scratch,
    store_reader,
)
from proxima.integration.vllm.connector import worker_store
from proxima.integration.vllm.worker.debug import reads_sources
from proxima.integration.vllm.worker.importance import Observation, observe_safely, plan_observation
from proxima.integration.vllm.worker.page_layout import PageLayout, probe_layout
from proxima.integration.vllm.worker.store import SlotReader, WorkerStore

logger = logging.getLogger("proxima.vllm")


@dataclass
class _Subset:
    """A subset of the batch's rows, with its own kernel metadata."""

    tokens: torch.Tensor  # long [T_sub]: token rows of query/output
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scheduler_metadata: torch.Tensor
    max_seq_len: int


@dataclass
class ProximaCPUMetadata(CPUAttentionMetadata):
    px_rest: _Subset | None = None
    px_comp: _Subset | None = None
    px_plan: ScratchPlan | None = None
    px_scratch: torch.Tensor | None = None
    px_obs: Observation | None = None
    px_builder: ProximaCPUAttentionMetadataBuilder | None = None
    """Set until the step's first layer resolves the split (then None)."""
    px_num_reqs: int = 0
    px_store: WorkerStore | None = None
    """The worker's store (an active one: metadata of this type is built only then)."""
    px_compact: CompactPlan | None = None
    px_compact_tokens: torch.Tensor | None = None  # long [R]: token row of each compact row's query


class ProximaCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def _subset_meta(self, rows: list[int], qsl: list[int], seq_lens: torch.Tensor,
                     block_table: torch.Tensor, causal: bool) -> _Subset:
        """Kernel metadata for `rows` of the batch; `seq_lens` and `block_table` are the subset's own."""
        lens = [qsl[r + 1] - qsl[r] for r in rows]
        sub_qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
        sub_qsl[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
        empty = torch.zeros(0, dtype=torch.long)
        tokens = torch.cat([torch.arange(qsl[r], qsl[r + 1]) for r in rows]) if rows else empty
        sl = seq_lens.to(torch.int32).contiguous()
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(rows), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=sl, dtype=self.dtype,  # type: ignore[arg-type]  # vLLM's own value
            query_start_loc=sub_qsl, causal=causal,
            sliding_window_size=self.window_size, isa=self.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        return _Subset(tokens, sub_qsl, sl, block_table.contiguous(), sched, int(sl.max()) if rows else 0)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):  # type: ignore[no-untyped-def]
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        store = worker_store()
        if store is None or not store.active or self.is_cross_attention or self.is_encoder_only_attention:
            return meta
        # vLLM builds attention metadata *before* it binds this step's connector metadata (the
        # plan that tells which rows have compressed blocks), so the split waits for the first
        # layer's forward (`resolve`), when the store holds this step's plan.
        px = ProximaCPUMetadata(**{f: getattr(meta, f) for f in CPUAttentionMetadata.__dataclass_fields__})
        px.px_builder, px.px_store = self, store
        px.px_num_reqs = common_attn_metadata.num_reqs
        return px

    def resolve(self, m: ProximaCPUMetadata, compact_ok: bool) -> None:
        """Split the batch for this step's plan (once per step, at the first layer). `compact_ok`:
        the layers need nothing the count-weighted softmax leaves out, so decode rows may take
        `cpu_compact`."""
        m.px_builder = None
        store = m.px_store
        if store is None or not store.key_blocks:
            return
        b = self.block_size
        n = m.px_num_reqs  # vLLM's tensors may be padded past the batch's requests
        qsl = m.query_start_loc[: n + 1].tolist()
        first_slots = m.slot_mapping[torch.tensor(qsl[:n], dtype=torch.long)].tolist()
        rids = [store.key_blocks.get(first_slots[r] // b) for r in range(n)]
        seq_lens = m.seq_lens[:n].tolist()
        bt = m.block_table
        nblk = [-(-sl // b) for sl in seq_lens]
        remaps = [store.remap.get(rid) or {} if rid is not None else {} for rid in rids]
        m.px_obs = plan_observation(rids, remaps, qsl, seq_lens, bt, b, store.observation_window)
        comp_rows = [r for r in range(n) if remaps[r]]
        if not comp_rows:
            return
        debug_hot = reads_sources()
        rows = {r: ScratchRow(bt[r, : nblk[r]].tolist(), seq_lens[r], {} if debug_hot else remaps[r],
                              qsl[r + 1] - qsl[r]) for r in comp_rows}
        # Decode rows read their entries once (`cpu_compact`); prefill chunks, and any row when the
        # layer needs what the count-weighted softmax does not do, take the scratch and vLLM's kernel.
        compact = [r for r in comp_rows if rows[r].query_len == 1 and compact_ok and not debug_hot]
        if compact:
            m.px_compact = plan_compact([rows[r] for r in compact], b)
            m.px_compact_tokens = torch.tensor([qsl[r] for r in compact], dtype=torch.long)
        compact_set = set(compact)
        scratch = [r for r in comp_rows if r not in compact_set]
        causal = bool(m.causal)
        if scratch:
            plan = plan_scratch([rows[r] for r in scratch], b)
            m.px_plan = plan
            m.px_comp = self._subset_meta(scratch, qsl, plan.seq_lens, plan.block_table.to(bt.dtype), causal)
        comp_set = set(comp_rows)
        rest_rows = [r for r in range(n) if r not in comp_set]
        if rest_rows:
            m.px_rest = self._subset_meta(rest_rows, qsl, m.seq_lens[rest_rows], bt[rest_rows], causal)


class ProximaCPUAttentionBackendImpl(CPUAttentionBackendImpl, SlotReader):
    def page_layout(self, kv: torch.Tensor) -> PageLayout:
        # The CPU kernel's page order depends on its ISA: asked of vLLM's own cache writer.
        return probe_layout(kv.shape[2], kv.shape[3] // 2, kv.dtype)

    @functools.cached_property
    def compact_ok(self) -> bool:
        """numba is there, and the layer needs nothing `cpu_compact` leaves out: ALiBi (entries have
        no positions), a sliding window, a soft cap, sinks, a quantized vLLM cache. With these (or a
        cache other than bf16, which the kernels read as bf16) every compressed row takes the scratch."""
        return (cpu_compact.AVAILABLE and self.alibi_slopes is None and self.sliding_window in (None, -1)
                and not self.logits_soft_cap and self.sinks is None and self.kv_cache_dtype == "auto")

    def warm_up(self, store: WorkerStore) -> None:
        """The compact kernels of every format the policy can store, compiled (or loaded from
        numba's cache) before the engine serves, on the real pools (same array types)."""
        if not self.compact_ok or not store.kv_caches:
            return
        import time

        t0 = time.perf_counter()
        kv = next(iter(store.kv_caches.values()))
        if kv.dtype != torch.bfloat16:
            return
        one = torch.zeros(1, dtype=torch.long)
        stored = [store_reader(store, layer)(chosen, one, one) for chosen, layer in store.stored_formats().values()]
        if not stored:  # a policy that stores nothing (off): no row will take the kernels
            return
        cpu_compact.warm_up(kv, store.page_layout(kv), stored)
        logger.info("proxima: CPU decode kernels ready for %d stored formats in %.1f s", len(stored),
                    time.perf_counter() - t0)

    def _run(self, layer, query, key_cache, value_cache, output, sub: _Subset, causal: bool) -> None:  # type: ignore[no-untyped-def]
        q = query.index_select(0, sub.tokens)
        out = output.new_empty((len(sub.tokens), *output.shape[1:]))
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=sub.query_start_loc, seq_lens=sub.seq_lens, scale=self.scale, causal=causal,
            alibi_slopes=self.alibi_slopes,  # type: ignore[arg-type]  # vLLM's own attribute, passed as vLLM does
            sliding_window=self.sliding_window, block_table=sub.block_table,
            softcap=self.logits_soft_cap, scheduler_metadata=sub.scheduler_metadata, s_aux=self.sinks,
            dynamic_causal=None, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        output.index_copy_(0, sub.tokens, out)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,  # type: ignore[no-untyped-def]
                output_scale=None, output_block_scale=None):
        if not isinstance(attn_metadata, ProximaCPUMetadata):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        m = attn_metadata
        store = m.px_store
        assert store is not None  # set by build() together with the metadata's type
        if m.px_builder is not None:
            with store.counter.region(kv_cache.device):  # the step's row planning, counted in a sampled step
                m.px_builder.resolve(m, self.compact_ok and kv_cache.dtype == torch.bfloat16)
        if m.px_obs is not None and layer.layer_name == store.observe_layer:
            observe_safely(store, kv_cache, query, m.px_obs, self.scale)
        if m.px_comp is None and m.px_compact is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        nb, h, b, d2 = kv_cache.shape
        d = d2 // 2
        causal = bool(m.causal)
        if m.px_rest is not None:
            kc, vc = kv_cache.view(nb, h, 2 * b, d).chunk(2, dim=2)
            self._run(layer, query, kc, vc, output, m.px_rest, causal)
        name = layer.layer_name
        read = functools.partial(store.read_with_counts, name)
        layout = store.page_layout(kv_cache)
        if m.px_comp is not None and m.px_plan is not None:
            if m.px_scratch is None:  # first layer of the step: one buffer for every layer
                m.px_scratch = kv_cache.new_empty((m.px_plan.num_blocks, h, 2 * b, d))
            fill_scratch(m.px_plan, kv_cache, read, m.px_scratch, raw=store_reader(store, name), layout=layout)
            kc, vc = m.px_scratch.chunk(2, dim=2)
            self._run(layer, query, kc, vc, output, m.px_comp, causal)
        if m.px_compact is not None:
            assert m.px_compact_tokens is not None  # set with px_compact
            q = query.index_select(0, m.px_compact_tokens)
            out = attend_compact(m.px_compact, q, kv_cache, layout, read, store_reader(store, name), self.scale)
            output.index_copy_(0, m.px_compact_tokens, out.to(output.dtype))
        return output


class ProximaCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type[ProximaCPUAttentionBackendImpl]:
        return ProximaCPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls() -> type[ProximaCPUAttentionMetadataBuilder]:
        return ProximaCPUAttentionMetadataBuilder
