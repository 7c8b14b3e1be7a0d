"""Attention over compressed blocks on CUDA: a subclass of vLLM's TRITON_ATTN backend.

Why TRITON_ATTN and not FLASH_ATTN:

* its kernel reads the cache through strides, in any physical layout, so the backend can pin the
  block-contiguous LBHNC layout that the worker's slot views assume (a compressed slot is a byte
  range of one physical block, `worker.py`); FlashAttention wants NHD pages;
* its module imports on every platform (Triton only, no compiled CUDA op at import), so the
  class wiring is tested on the CPU CI;
* neither vLLM kernel gives what the compressed rows need: FLASH_ATTN can return a log-sum-exp
  but reads only vLLM's bf16 pages; TRITON_ATTN's `unified_attention` returns no log-sum-exp at
  all. So compressed rows do not use vLLM's kernel for their hot part either: they run
  Proxima's own split-K Triton kernels (`proxima.compression.paged`) over one hot segment read in
  place from vLLM's cache plus one segment per compressed format read from its slot pool, each
  yielding partial (output, log-sum-exp), merged in one launch.

The worker's maps and slot pools are the `WorkerStore` of Proxima's KV connector
(`connector.worker_store()`); without that connector (or with Proxima not configured in it) every
method is the parent's.

Importance: in the observed layer every scheduled row's observation-window queries are scored
against its hot keys (`importance.py`, the same code as the CPU backend), so the scheduler gets
per-block attention mass on CUDA as it does on CPU.

Per step the metadata builder finds the rows of requests with compressed blocks (their key
block, as the CPU backend does) and plans their tables. `forward` first runs the parent on the
whole batch, unchanged, then overwrites the compressed rows' outputs. Running the parent on every
row wastes its work on the compressed rows (their table holds vLLM's null block where a block was
compressed, so their parent output is garbage, never kept), but it keeps every other row
bit-identical to vanilla vLLM in the same batch: a sub-batch would change the parent's kernel
choice (2D or 3D split by batch size) and so its summation order. When no row is compressed,
`build` returns the parent's metadata object and `forward` is the parent's.

Uniform single-token decode batches take another path on CUDA (`PROXIMA_ONE_PASS_DECODE`, on by
default there): one `mixed_decode` launch per layer serves every row from the device block table,
nothing is planned on the host, and the builder declares graph support for those batches
(`get_cudagraph_support`), so decode steps replay from vLLM's full CUDA graphs. Mixed and prefill
batches keep the split path above, eager (vLLM's piecewise graphs).

Limits: compressed rows support neither ALiBi, sliding windows, soft-capping, sinks nor an fp8 KV
cache (they raise).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from proxima.compression.blocks import Backend
from proxima.compression.layout import KVLayout, hot_store
from proxima.compression.mixed_decode import mixed_decode, update_block_importance
from proxima.compression.paged import PagedPlan, PagedRow, paged_attention, plan_rows
from proxima.formats import Format, recompressible
from proxima.integration.vllm.connector import worker_block_table, worker_store
from proxima.integration.vllm.worker.block_table import ONE_PASS_ENV, DeviceBlockTable, one_pass_decode
from proxima.integration.vllm.worker.debug import reads_sources
from proxima.integration.vllm.worker.decode_descriptors import layer_descriptors, slot_pool_of
from proxima.integration.vllm.worker.importance import Observation, observe_safely, plan_observation
from proxima.integration.vllm.worker.page_layout import PageLayout, token_interleaved_layout
from proxima.integration.vllm.worker.store import SlotReader, WorkerStore

logger = logging.getLogger("proxima.vllm")
BACKEND_PATH = "proxima.integration.vllm.attention.triton.ProximaTritonAttentionBackend"


@dataclass
class ProximaTritonMetadata(TritonAttentionMetadata):
    px_tokens: torch.Tensor | None = None
    """long [Sq] (device): the batch's query tokens that belong to compressed requests, plan order."""
    px_plan: PagedPlan | None = None
    px_request_ids: list[str] = field(default_factory=list)
    px_obs: Observation | None = None
    """This step's importance observation (rows of every request, compressed or not)."""
    px_builder: ProximaTritonMetadataBuilder | None = None
    """Set until the step's first layer resolves the split (then None)."""
    px_common: Any = None
    """vLLM's CommonAttentionMetadata of the step, kept for `resolve`."""
    px_store: WorkerStore | None = None
    """The worker's store (an active one: metadata of this type is built only then)."""
    px_table: DeviceBlockTable | None = None
    """Set for a uniform single-token decode batch with the one-pass kernel on (`ONE_PASS_ENV`):
    every row is served by `mixed_decode` from this device table."""


def request_of_rows(store: WorkerStore, first_slots: list[int], block_size: int) -> list[str | None]:
    """Each batch row's request (None: not planned by Proxima this step, e.g. a padding row).

    A row's request is found through the physical block receiving its first query token (the
    scheduler's key block: exclusively owned, so unambiguous without request ids)."""
    return [store.key_blocks.get(slot // block_size) for slot in first_slots]


class ProximaTritonMetadataBuilder(TritonAttentionMetadataBuilder):
    # The row split reads the worker's maps on the host every step: not capturable.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        """What vLLM reads to choose its graph mode. With the one-pass decode, a uniform
        single-token decode batch is served from device tensors only, with buffers of fixed
        addresses (vLLM's persistent ones, the device block table, its importance and scratch,
        the pool descriptors) and a grid fixed by the batch size: capturable. Mixed and prefill
        batches keep the host-planned split path, so they stay eager (vLLM's piecewise graphs).
        A sliding window or a non-16-bit cache (what the one-pass kernel does not read, seen here
        in the cache spec) keeps NEVER; the impl-level limits (ALiBi, sinks, soft-capping) are
        refused at capture by the forward, with a clear error."""
        window = getattr(kv_cache_spec, "sliding_window", None)
        dtype = getattr(kv_cache_spec, "dtype", torch.bfloat16)
        if one_pass_decode() and window is None and dtype in (torch.bfloat16, torch.float16):
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return AttentionCGSupport.NEVER

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):  # type: ignore[no-untyped-def]
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        store = worker_store()
        if store is None or not store.active or common_attn_metadata.causal is False:
            return meta
        # vLLM builds attention metadata *before* it binds this step's connector metadata (the
        # plan saying which rows have compressed blocks): the split waits for the first layer.
        px = ProximaTritonMetadata(**{f.name: getattr(meta, f.name) for f in fields(TritonAttentionMetadata)})
        px.px_builder, px.px_common, px.px_store = self, common_attn_metadata, store
        if one_pass_decode(self.device) and common_attn_metadata.max_query_len == 1:
            # host ints and device tensors only: nothing read back (the rows are found on the device)
            table = px.px_table = worker_block_table()
            if table is not None and store.observe_layer is not None:
                # the observed layer updates the device importance: the connector reads it back
                table.observed = -(-common_attn_metadata.max_seq_len // self.block_size)
        return px

    def resolve(self, m: ProximaTritonMetadata) -> None:
        """Find this step's rows (importance observation, compressed rows) and plan the compressed
        rows' segments (once per step, first layer of the split path; the one-pass decode reads the
        device table instead)."""
        cm, store = m.px_common, m.px_store
        m.px_builder = m.px_common = None
        if store is None or not store.key_blocks or cm is None:
            return
        n = cm.num_reqs
        qsl = cm.query_start_loc_cpu[: n + 1].tolist()
        # one device-to-host copy: the slot of every row's first query token
        first_slots = cm.slot_mapping[torch.tensor(qsl[:n], device=cm.slot_mapping.device)].tolist()
        rids = request_of_rows(store, first_slots, self.block_size)
        remaps = [store.remap.get(rid) or {} if rid is not None else {} for rid in rids]
        seq_lens_all = cm.seq_lens[:n].tolist()
        if store.observe_layer is not None:
            m.px_obs = plan_observation(rids, remaps, qsl, seq_lens_all, cm.block_table_tensor[:n], self.block_size,
                                        store.observation_window)
        rows = [r for r in range(n) if remaps[r]]
        if not rows:
            return
        idx = torch.tensor(rows, device=cm.seq_lens.device)
        tables = cm.block_table_tensor.index_select(0, idx).tolist()
        # (read-sources diagnostics: the same rows, every block read from vLLM's cache)
        debug = reads_sources()
        paged = [PagedRow(tables[i], seq_lens_all[r], qsl[r + 1] - qsl[r], {} if debug else remaps[r])
                 for i, r in enumerate(rows)]
        m.px_plan = plan_rows(paged, self.block_size).to(self.device)
        m.px_tokens = torch.cat([torch.arange(qsl[r], qsl[r + 1]) for r in rows]).to(self.device)
        m.px_request_ids = [rids[r] for r in rows]  # type: ignore[misc]


class ProximaTritonAttentionImpl(TritonAttentionImpl, SlotReader):
    kernel_backend: Backend = "auto"
    """Proxima's kernels: Triton on CUDA tensors; tests on CPU force "triton" (the interpreter)."""

    def page_layout(self, kv: torch.Tensor) -> PageLayout:
        # vLLM's forward splits the content axis: kv_cache.split(head_size, dim=-1) (key, value).
        return token_interleaved_layout(kv.shape[2], kv.shape[3] // 2)

    def warm_up(self, store: WorkerStore) -> None:
        """Compile the compression, decompression and decode kernels of every format the policy
        can store, on the real slot pools of a layer storing it (same strides, so the same
        specializations).

        Why: Triton compiles a kernel on its first launch. Without this, the first steps that
        compress stalled for seconds each on the H200 (5-7x vanilla's step time over a 30 s
        window of the 8B-shaped capacity run), and a server would stall its first requests under
        pressure. A policy changed later through the API may still compile a new format once.
        Writes nothing that vLLM reads: the compressed dummy block is discarded, the decode reads
        slot 0 of the null block (whatever it holds) and its output is dropped."""
        formats = store.stored_formats() if self.kernel_backend != "torch" else {}
        if not formats:
            return
        import time

        from proxima.compression import attention_errors, compress_blocks, decompress_blocks

        t0 = time.perf_counter()
        decoded: dict[Format, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for stored, (chosen, layer) in formats.items():
            kv = store.kv_caches[layer]
            _n, h, b, d = store.geometry(layer)
            k = torch.zeros(1, b, h, d, dtype=kv.dtype, device=kv.device)
            imp = torch.ones(1, b, h, device=kv.device) if stored.reduction is not None else None
            prot = store.policy.protect if store.policy is not None else None
            # the policy's pinned merge is its own kernel specialization: compiled here too
            cb = compress_blocks(stored, k, k, token_importance=imp, group_size=store.group_for(stored),
                                 backend=self.kernel_backend, pinned_tokens=prot.merged_tokens if prot else 0,
                                 pin_by=prot.merged_by if prot else "mixed")
            decoded[stored] = decompress_blocks(cb, backend=self.kernel_backend)
            q_obs = torch.zeros(1, 1, self.num_heads, d, device=kv.device)
            if store.probes_compressions:  # the probe's error kernel: one variant per format
                attention_errors(q_obs, k, k, cb, sm_scale=self.scale, on_host=False, backend=self.kernel_backend)
            store.dtypes.setdefault(stored, (cb.k_data.dtype, cb.v_data.dtype))
            hot = hot_store(kv, KVLayout.FLASH_ATTN, num_kv_heads=h, head_dim=d)
            # Keyed by the scheduler's format, as a step's plan is (the pool maps it to `stored`).
            pools = {chosen: slot_pool_of(store, layer, chosen, kv.device)}
            # Two rows, each reading a compressed slot and a hot block: the launches of a step.
            plan = plan_rows([PagedRow([0, 0], b + 1, 1, {0: (chosen, 0, 0)}),
                              PagedRow([0, 0], b + 2, 1, {0: (chosen, 0, 0)})], b).to(kv.device)
            q = torch.zeros(2, self.num_heads, self.head_size, dtype=kv.dtype, device=kv.device)
            paged_attention(q, plan, hot, pools, sm_scale=self.scale, backend=self.kernel_backend)
        # A recompression (a reduced block reduced further) compiles its own variants: the k-means
        # with counts over the source's rows, and the probe over those rows with their counts. Run
        # through the worker's own compress call (an H100 run compiled them mid-serving, 0.6 s and
        # 1.5 s a step, before this).
        for src, (k_src, _v, lc) in decoded.items():
            for dst in formats:
                if src.reduction is None or dst == src or not recompressible(src, dst):
                    continue
                cb = store.compress_read(src, dst, k_src, k_src, lc, [])
                if store.probes_compressions:
                    attention_errors(q_obs, k_src, k_src, cb, sm_scale=self.scale, ref_log_count=lc, on_host=False,
                                     backend=self.kernel_backend)
        if next(iter(store.kv_caches.values())).is_cuda:  # every launch above done before serving
            torch.cuda.synchronize()
        logger.info("proxima: kernels compiled for %s in %.1f s", ", ".join(map(str, formats)),
                    time.perf_counter() - t0)

    def _check_compressed_rows_supported(self) -> None:
        unsupported = {
            "ALiBi": self.alibi_slopes is not None,
            "sliding window": tuple(self.sliding_window) != (-1, -1),
            "logit soft-capping": bool(self.logits_soft_cap),
            "attention sinks": self.sinks is not None,
            f"KV cache dtype {self.kv_cache_dtype}": self.kv_cache_dtype not in ("auto", "bfloat16", "float16"),
            f"attention type {self.attn_type}": self.attn_type != AttentionType.DECODER,
        }
        bad = [name for name, on in unsupported.items() if on]
        if bad:
            raise NotImplementedError(f"proxima: compressed blocks cannot be read with {', '.join(bad)}")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,  # type: ignore[no-untyped-def]
                output_scale=None, output_block_scale=None):
        m = attn_metadata
        if not isinstance(m, ProximaTritonMetadata):  # Proxima is not active in this worker
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        store = m.px_store
        assert store is not None  # set by build() together with the metadata's type
        times, dev = store.times, kv_cache.device
        one_pass = m.px_table is not None and output_scale is None and self._one_pass_supported()
        if one_pass:  # rows, blocks and importance all from the device: nothing planned on the host
            assert m.px_table is not None
            with times.span("attention_proxima_s", dev):
                return self._one_pass(layer.layer_name, query, kv_cache, m, store, m.px_table, output)
        if kv_cache.is_cuda and torch.cuda.is_current_stream_capturing():
            # A graph of this path would replay without its host plan: compressed rows would read
            # garbage. Whatever the reason (no device table, or a layer the one-pass kernel cannot read).
            raise NotImplementedError(
                "proxima: this layer cannot run the one-pass decode (no device block table, or ALiBi, sinks, "
                "soft-capping or fused output quantization) and its split path cannot be captured in a CUDA "
                f"graph; set {ONE_PASS_ENV}=0 (graphs for decode off) or run eagerly")
        if m.px_table is not None and layer.layer_name == store.observe_layer:
            m.px_table.observed = None  # observed on the host below: the device importance was not updated
        if m.px_builder is not None:
            # host work (and its small device-to-host copies), counted in a sampled step
            with times.span("row_plan_s"), store.counter.region(dev):
                m.px_builder.resolve(m)
        if m.px_obs is not None and layer.layer_name == store.observe_layer:
            with times.span("importance_s", dev):
                observe_safely(store, kv_cache, query.view(query.shape[0], self.num_heads, self.head_size),
                               m.px_obs, self.scale)
        with times.span("attention_vllm_s", dev):
            out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                  output_scale, output_block_scale)
        if m.px_plan is None or m.px_tokens is None:
            return out
        with times.span("attention_proxima_s", dev):
            return self._split_rows(layer, query, kv_cache, m, store, output, output_scale)

    def _one_pass_supported(self) -> bool:
        try:
            self._check_compressed_rows_supported()
        except NotImplementedError:
            return False
        return True

    def layer_descriptors(self, layer: str, store: WorkerStore, table: DeviceBlockTable,
                          device: torch.device) -> torch.Tensor:
        """This layer's pool descriptor table (`worker/decode_descriptors.py`: one persistent
        tensor per layer, kept current by the connector outside the forward)."""
        return layer_descriptors(store, table, layer)

    def _one_pass(self, layer: str, query: torch.Tensor, kv_cache: torch.Tensor, m: ProximaTritonMetadata,
                  store: WorkerStore, table: DeviceBlockTable, output: torch.Tensor) -> torch.Tensor:
        """Every row of a uniform decode batch in one launch (`mixed_decode`), output in place."""
        s = m.seq_lens.shape[0]
        q = query.view(query.shape[0], self.num_heads, self.head_size)[:s]
        out = output.view(output.shape[0], self.num_heads, self.head_size)[:s]
        observe = layer == store.observe_layer
        entry_lse = lse = None
        if observe:  # the observed layer: per-block log-sum-exp into fixed scratch, then the average
            ent_all, lse_all = table.observe_scratch(self.num_heads)
            if s > ent_all.shape[0]:
                raise RuntimeError(f"proxima: a decode batch of {s} rows, the observed layer's scratch holds "
                                   f"{ent_all.shape[0]} (max_num_seqs)")
            entry_lse, lse = ent_all[:s], lse_all[:s]
        mixed_decode(q, out, kv_cache, m.block_table, m.seq_lens, m.query_start_loc, m.slot_mapping,
                     table.owner, table.entries, self.layer_descriptors(layer, store, table, kv_cache.device),
                     sm_scale=self.scale, entry_lse=entry_lse, lse=lse, key_group=store.storage.smallest_group,
                     lean=store.one_pass_lean)
        if entry_lse is not None and lse is not None:
            update_block_importance(entry_lse, lse, m.seq_lens, m.query_start_loc, m.slot_mapping, table.owner,
                                    table.entries, table.imp_owner, table.importance, decay=store.ema_decay,
                                    aggregate=store.aggregate, block_size=kv_cache.shape[2])
        return output

    def _split_rows(self, layer, query, kv_cache, m, store, output, output_scale):  # type: ignore[no-untyped-def]
        """Overwrite the compressed rows' outputs with Proxima's split path."""
        self._check_compressed_rows_supported()
        if output_scale is not None:
            raise NotImplementedError("proxima: fused output quantization with compressed blocks")
        q = query.view(query.shape[0], self.num_heads, self.head_size).index_select(0, m.px_tokens)
        hot = hot_store(kv_cache, KVLayout.FLASH_ATTN, num_kv_heads=self.num_kv_heads, head_dim=self.head_size)
        pools = {
            s.fmt: slot_pool_of(store, layer.layer_name, s.fmt, kv_cache.device)
            for s in m.px_plan.segments
            if not s.fmt.is_hot
        }
        res = paged_attention(q, m.px_plan, hot, pools, sm_scale=self.scale, backend=self.kernel_backend)
        flat = output.view(output.shape[0], -1)
        mine = res.out.reshape(res.out.shape[0], -1).to(output.dtype)
        if reads_sources():
            theirs = flat.index_select(0, m.px_tokens).float()  # vLLM's kernel, same full batch
            err = float((mine.float() - theirs).norm() / theirs.norm().clamp_min(1e-30))
            store.split_errors.add(layer.layer_name, err, len(m.px_request_ids))
            store.split_errors.dump()
        flat.index_copy_(0, m.px_tokens, mine)
        return output


class ProximaTritonAttentionBackend(TritonAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the registry member it is registered under

    @staticmethod
    def get_impl_cls() -> type[ProximaTritonAttentionImpl]:
        return ProximaTritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[ProximaTritonMetadataBuilder]:
        return ProximaTritonMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # The worker reinterprets a physical block's bytes as slots of a contiguous
        # [num_blocks, H, B, 2D] tensor: only the identity layout makes that view valid.
        return (KVCacheLayout.LBHNC,)


def register_cuda_backend() -> None:
    """Make `--attention-backend CUSTOM` (or `attention_config={"backend": "CUSTOM"}`) Proxima's."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
