"""Attention over compressed blocks on CPU: a subclass of vLLM's CPU_ATTN backend.

Rows (requests) of the batch split in two once per step, in the metadata builder:

* rows without compressed blocks: vLLM's kernel on vLLM's cache, exactly as vanilla (and when no
  row has compressed blocks the parent's path runs untouched);
* rows with compressed blocks (found by their *key block*, see `plan.ProximaPlan`): per layer, a
  transient bf16 scratch cache holds their blocks (hot ones copied with one `index_select`,
  compressed ones decompressed in one batched call per format) and vLLM's own kernel reads it
  through a scratch block table. The scratch is allocated once per step and reused by every
  layer, so it costs one layer's worth of those rows' KV, not a copy of the cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from proxima.formats import Format
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
class ProximaCPUMetadata(CPUAttentionMetadata):
    px_rest: _Subset | None = None
    px_comp: _Subset | None = None
    px_scratch_blocks: int = 0
    px_hot_src: torch.Tensor | None = None  # long [Nh]: physical blocks to copy
    px_hot_dst: torch.Tensor | None = None  # long [Nh]: their scratch blocks
    px_groups: list[tuple[Format, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """Per format: (scratch blocks, destination blocks, slots), long tensors of equal length."""
    px_scratch: torch.Tensor | None = None


class ProximaCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def _subset_meta(self, rows: list[int], qsl: list[int], seq_lens: torch.Tensor,
                     block_table: torch.Tensor, causal: bool) -> _Subset:
        lens = [qsl[r + 1] - qsl[r] for r in rows]
        sub_qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
        sub_qsl[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
        empty = torch.zeros(0, dtype=torch.long)
        tokens = torch.cat([torch.arange(qsl[r], qsl[r + 1]) for r in rows]) if rows else empty
        sl = seq_lens[rows].contiguous()
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
        if not STORE.key_blocks or self.is_cross_attention or self.is_encoder_only_attention:
            return meta
        b = self.block_size
        n = common_attn_metadata.num_reqs
        qsl = meta.query_start_loc[: n + 1].tolist()
        first_slots = meta.slot_mapping[torch.tensor(qsl[:n], dtype=torch.long)].tolist()
        comp_rows: list[int] = []
        comp_maps: list[dict[int, tuple[Format, int, int]]] = []
        debug_hot = os.environ.get(DEBUG_ENV) == "read-sources"
        for r in range(n):
            rid = STORE.key_blocks.get(first_slots[r] // b)
            remap = STORE.remap.get(rid) if rid is not None else None
            if remap:
                comp_rows.append(r)
                comp_maps.append(remap)
                if debug_hot:  # the worker's block table still holds the sources (append-only)
                    comp_maps[-1] = {}
        if not comp_rows:
            return meta
        seq_lens = meta.seq_lens
        comp_set = set(comp_rows)
        rest_rows = [r for r in range(n) if r not in comp_set]
        bt = meta.block_table
        hot_src: list[int] = []
        hot_dst: list[int] = []
        groups: dict[Format, tuple[list[int], list[int], list[int]]] = {}
        nblk = [-(-int(seq_lens[r]) // b) for r in comp_rows]
        width = max(nblk)
        table = torch.zeros(len(comp_rows), width, dtype=bt.dtype)
        bt_rows = bt[comp_rows, :width].tolist()
        base = 0
        for i, (remap, nb) in enumerate(zip(comp_maps, nblk, strict=True)):
            table[i, :nb] = torch.arange(base, base + nb, dtype=bt.dtype)
            row = bt_rows[i]
            for j in range(nb):
                hit = remap.get(j)
                if hit is None:
                    hot_src.append(row[j])
                    hot_dst.append(base + j)
                else:
                    g = groups.setdefault(hit[0], ([], [], []))
                    g[0].append(base + j)
                    g[1].append(hit[1])
                    g[2].append(hit[2])
            base += nb
        causal = bool(meta.causal)
        px = ProximaCPUMetadata(**{f: getattr(meta, f) for f in CPUAttentionMetadata.__dataclass_fields__})
        px.px_comp = self._subset_meta(comp_rows, qsl, seq_lens, table, causal)
        if rest_rows:
            px.px_rest = self._subset_meta(rest_rows, qsl, seq_lens, bt[rest_rows], causal)
        px.px_scratch_blocks = base
        L = torch.long
        px.px_hot_src = torch.tensor(hot_src, dtype=L)
        px.px_hot_dst = torch.tensor(hot_dst, dtype=L)
        px.px_groups = [(f, torch.tensor(a, dtype=L), torch.tensor(d, dtype=L), torch.tensor(s, dtype=L))
                        for f, (a, d, s) in groups.items()]
        return px


class ProximaCPUAttentionBackendImpl(CPUAttentionBackendImpl):
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
        if not isinstance(attn_metadata, ProximaCPUMetadata) or attn_metadata.px_comp is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        m = attn_metadata
        nb, h, b, d2 = kv_cache.shape
        d = d2 // 2
        kv = kv_cache.view(nb, h, 2 * b, d)
        causal = bool(m.causal)
        if m.px_rest is not None:
            kc, vc = kv.chunk(2, dim=2)
            self._run(layer, query, kc, vc, output, m.px_rest, causal)
        if m.px_scratch is None:  # first layer of the step: one buffer for every layer
            m.px_scratch = kv_cache.new_empty((m.px_scratch_blocks, h, 2 * b, d))
        scratch = m.px_scratch
        if len(m.px_hot_src):
            scratch.index_copy_(0, m.px_hot_dst, kv.index_select(0, m.px_hot_src))
        s5 = scratch.view(-1, h, 2, b, d)
        for fmt, sidx, dst, slot in m.px_groups:
            kh, vh = STORE.read(layer.layer_name, fmt, dst, slot)  # [N, B, H, D]
            s5[sidx, :, 0] = kh.transpose(1, 2)
            s5[sidx, :, 1] = vh.transpose(1, 2)
        kc, vc = scratch.chunk(2, dim=2)
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
