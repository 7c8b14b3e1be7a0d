"""Attention over compressed blocks on CPU: a subclass of vLLM's CPU_ATTN backend.

Rows (requests) of the batch split in two once per step, in the metadata builder:

* rows without compressed blocks: vLLM's kernel on vLLM's cache, exactly as vanilla (and when no
  row has compressed blocks the parent's path runs untouched);
* rows with compressed blocks (found by their *key block*, see `plan.ProximaPlan`; decode rows,
  or prefill chunks of a long prompt whose earlier chunks were compressed): per layer, a
  transient bf16 scratch cache holds their tokens (`scratch.py`: hot blocks copied, compressed
  ones decompressed in one batched call per format, sparse blocks' kept tokens packed, cluster
  centroids repeated by count) and vLLM's own kernel reads it through a scratch block table.

Importance: in one layer (`STORE.observe_layer`), the scheduled rows' observation-window queries
(the last `observation_window` prompt tokens of a prefill chunk, the new token of a decode row)
are scored against their hot keys with torch; the attention mass per token feeds the worker's
token importance (sparse and cluster use it) and, per block, the scheduler's policy engine.
"""

from __future__ import annotations

import os
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

from proxima.integration.vllm.scratch import ScratchPlan, ScratchRow, fill_scratch, plan_scratch, store_reader
from proxima.integration.vllm.worker import STORE

DEBUG_ENV = "PROXIMA_DEBUG"
"""`read-sources`: compressed rows read their freed source blocks through the scratch path
(valid only while those blocks are not reused): isolates the row split and scratch plumbing
from the formats' loss. Diagnostics only."""


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
class _Observation:
    """Which queries to score against which keys in the observed layer (importance)."""

    decode_rids: list[str]
    decode_q: torch.Tensor  # long [Rd]: query token of each decode row
    decode_table: torch.Tensor  # long [Rd, W]: physical blocks (compressed ones point at block 0)
    decode_visible: torch.Tensor  # bool [Rd, W * B]: token exists and is hot
    decode_lens: list[int]
    prefill: list[tuple[str, torch.Tensor, torch.Tensor, int, list[int]]]
    """Per prefill row: (request, its observation-window query tokens, its blocks, seq_len, its
    compressed blocks: their table entries are freed sources, never read)."""


@dataclass
class ProximaCPUMetadata(CPUAttentionMetadata):
    px_rest: _Subset | None = None
    px_comp: _Subset | None = None
    px_plan: ScratchPlan | None = None
    px_scratch: torch.Tensor | None = None
    px_obs: _Observation | None = None
    px_builder: ProximaCPUAttentionMetadataBuilder | None = None
    """Set until the step's first layer resolves the split (then None)."""
    px_num_reqs: int = 0


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
        if not STORE.active or self.is_cross_attention or self.is_encoder_only_attention:
            return meta
        # vLLM builds attention metadata *before* it binds this step's connector metadata (the
        # plan that tells which rows have compressed blocks), so the split waits for the first
        # layer's forward (`resolve`), when STORE holds this step's plan.
        px = ProximaCPUMetadata(**{f: getattr(meta, f) for f in CPUAttentionMetadata.__dataclass_fields__})
        px.px_builder = self
        px.px_num_reqs = common_attn_metadata.num_reqs
        return px

    def resolve(self, m: ProximaCPUMetadata) -> None:
        """Split the batch for this step's plan (once per step, at the first layer)."""
        m.px_builder = None
        if not STORE.key_blocks:
            return
        b = self.block_size
        n = m.px_num_reqs  # vLLM's tensors may be padded past the batch's requests
        qsl = m.query_start_loc[: n + 1].tolist()
        first_slots = m.slot_mapping[torch.tensor(qsl[:n], dtype=torch.long)].tolist()
        rids = [STORE.key_blocks.get(first_slots[r] // b) for r in range(n)]
        seq_lens = m.seq_lens[:n].tolist()
        bt = m.block_table
        nblk = [-(-sl // b) for sl in seq_lens]
        remaps = [STORE.remap.get(rid) or {} if rid is not None else {} for rid in rids]
        m.px_obs = _observation(rids, remaps, qsl, seq_lens, nblk, bt, b, STORE.observation_window)
        comp_rows = [r for r in range(n) if remaps[r]]
        if not comp_rows:
            return
        debug_hot = os.environ.get(DEBUG_ENV) == "read-sources"
        rows = [ScratchRow(bt[r, : nblk[r]].tolist(), seq_lens[r], {} if debug_hot else remaps[r],
                           qsl[r + 1] - qsl[r]) for r in comp_rows]
        plan = plan_scratch(rows, b)
        causal = bool(m.causal)
        m.px_plan = plan
        m.px_comp = self._subset_meta(comp_rows, qsl, plan.seq_lens, plan.block_table.to(bt.dtype), causal)
        comp_set = set(comp_rows)
        rest_rows = [r for r in range(n) if r not in comp_set]
        if rest_rows:
            m.px_rest = self._subset_meta(rest_rows, qsl, m.seq_lens[rest_rows], bt[rest_rows], causal)


def _observation(rids: list[str | None], remaps: list[dict], qsl: list[int], seq_lens: list[int],  # type: ignore[type-arg]
                 nblk: list[int], bt: torch.Tensor, b: int, window: int) -> _Observation | None:
    dec = [r for r, rid in enumerate(rids) if rid is not None and qsl[r + 1] - qsl[r] == 1]
    pre = [r for r, rid in enumerate(rids) if rid is not None and qsl[r + 1] - qsl[r] > 1]
    if not dec and not pre:
        return None
    width = max((nblk[r] for r in dec), default=1)
    table = torch.zeros(len(dec), width, dtype=torch.long)
    visible = torch.zeros(len(dec), width * b, dtype=torch.bool)
    for i, r in enumerate(dec):
        table[i, : nblk[r]] = bt[r, : nblk[r]].long()
        visible[i, : seq_lens[r]] = True
        for j in remaps[r]:  # compressed: the table's entry is a freed source, never read
            table[i, j] = 0
            visible[i, j * b: (j + 1) * b] = False
    prefill = []
    for r in pre:
        w = min(window, qsl[r + 1] - qsl[r])
        blocks = bt[r, : nblk[r]].long().clone()
        blocks[list(remaps[r])] = 0
        prefill.append((rids[r], torch.arange(qsl[r + 1] - w, qsl[r + 1]), blocks, seq_lens[r], sorted(remaps[r])))
    return _Observation([rids[r] for r in dec], torch.tensor([qsl[r] for r in dec], dtype=torch.long),  # type: ignore[misc]
                        table, visible, [seq_lens[r] for r in dec], prefill)  # type: ignore[arg-type]


def observe(layer_kv: torch.Tensor, query: torch.Tensor, obs: _Observation, scale: float, aggregate: str) -> None:
    """Attention mass of the observed queries over each row's hot tokens, folded into `STORE`.

    Computed in float32 with torch, beside vLLM's kernel (which returns no probabilities), in
    one layer only: about 1/L of the attention's cost.
    """
    _nb, h, b, d2 = layer_kv.shape
    d = d2 // 2
    layout = STORE.page_layout(layer_kv)
    g = query.shape[1] // h

    def fold(p: torch.Tensor) -> torch.Tensor:  # [..., G, T] probabilities -> [..., T] per KV head
        return p.amax(-2) if aggregate == "max" else p.mean(-2)

    if obs.decode_rids:
        rd, w = obs.decode_table.shape
        k = layout.read_keys(layer_kv, obs.decode_table).permute(0, 2, 1, 3, 4).reshape(rd, h, w * b, d).float()
        q = query[obs.decode_q].view(rd, h, g, d).float()
        s = torch.einsum("rhgd,rhtd->rhgt", q, k) * scale
        s = s.masked_fill(~obs.decode_visible[:, None, None, :], float("-inf"))
        mass = fold(torch.softmax(s, -1))  # [Rd, H, T]
        mass = mass.masked_fill(~obs.decode_visible[:, None, :], float("nan"))
        for i, (rid, n) in enumerate(zip(obs.decode_rids, obs.decode_lens, strict=True)):
            STORE.observe(rid, mass[i, :, :n].transpose(0, 1).contiguous(), reset=False)
    for rid, qt, blocks, seq_len, compressed in obs.prefill:
        k = layout.read_keys(layer_kv, blocks).permute(1, 0, 2, 3).reshape(h, -1, d)[:, :seq_len].float()  # [H, L, D]
        q = query[qt].view(len(qt), h, g, d).permute(1, 2, 0, 3).float()  # [H, G, W, D]
        s = torch.einsum("hgwd,hld->hgwl", q, k) * scale
        qpos = torch.arange(seq_len - len(qt), seq_len).view(-1, 1)
        hidden = torch.zeros(seq_len, dtype=torch.bool)  # compressed earlier chunks: not seen here
        for j in compressed:
            hidden[j * b: (j + 1) * b] = True
        s = s.masked_fill((torch.arange(seq_len).view(1, -1) > qpos) | hidden, float("-inf"))
        mass = fold(torch.softmax(s, -1).mean(2)).transpose(0, 1)  # [H, G, L] -> [H, L] -> [L, H]
        mass[hidden] = float("nan")
        STORE.observe(rid, mass.contiguous(), reset=True)


class ProximaCPUAttentionBackendImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        STORE.readers.add(type(self).__name__)

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
        if m.px_builder is not None:
            m.px_builder.resolve(m)
        if m.px_obs is not None and layer.layer_name == STORE.observe_layer:
            try:
                observe(kv_cache, query, m.px_obs, self.scale, STORE.aggregate)
            except Exception as e:  # importance is advisory: never fail a request over it
                STORE.report.errors.append(f"importance: {type(e).__name__}: {e}")
        if m.px_comp is None or m.px_plan is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        nb, h, b, d2 = kv_cache.shape
        d = d2 // 2
        causal = bool(m.causal)
        if m.px_rest is not None:
            kc, vc = kv_cache.view(nb, h, 2 * b, d).chunk(2, dim=2)
            self._run(layer, query, kc, vc, output, m.px_rest, causal)
        if m.px_scratch is None:  # first layer of the step: one buffer for every layer
            m.px_scratch = kv_cache.new_empty((m.px_plan.num_blocks, h, 2 * b, d))
        name = layer.layer_name
        fill_scratch(m.px_plan, kv_cache, lambda f, dst, slot: STORE.read_with_counts(name, f, dst, slot),
                     m.px_scratch, raw=store_reader(STORE, name), layout=STORE.page_layout(kv_cache))
        kc, vc = m.px_scratch.chunk(2, dim=2)
        self._run(layer, query, kc, vc, output, m.px_comp, causal)
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
