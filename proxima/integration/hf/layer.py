"""One layer's KV in the transformers cache: full blocks (hot tensors or compressed slots) and a hot tail.

The storage half of `ProximaCache` (`cache.py`): block lists, the compressed slots
(`CompressedBlocks` rows, the payload vLLM stores), the working copy attention reads (decompressed
blocks at their logical length plus a per-key bias) and byte accounting. Token-eviction masks
(`keep`, the baselines') are part of it because attention and byte counts read them.

Invariant relied on by `ProximaCache.fork`: block tensors and slots are only ever replaced, never
written in place; only the working copy (`_work`) is patched in place.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from proxima.compression.blocks import Backend, CompressedBlocks, decompress_blocks
from proxima.compression.spec import kv16_bytes
from proxima.formats import HOT, Format

NEG_INF = float("-inf")


Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(k_hat [N, C, H, D], v_hat, log_count [N, C, H]) of a `CompressedBlocks`, as `decompress_blocks` returns."""


@dataclass
class Slot:
    """Where a compressed block's data lives: rows `rows` of a batch `cb` (rows are (block, batch) pairs)."""

    cb: CompressedBlocks
    rows: list[int]
    """Row of each batch element in `cb`."""
    nbytes: int
    """Held bytes of this block's rows (data and metadata)."""
    backend: Backend = "auto"

    def decode(self) -> Decoded:
        return decompress_blocks(self.cb, backend=self.backend)


class ProximaLayer(CacheLayerMixin):
    """One layer's KV: full blocks (hot tensors or compressed slots) and a hot tail."""

    is_sliding = False
    is_croppable = False

    def __init__(self, block_size: int, keep_working_copy: bool = True) -> None:
        super().__init__()
        self.block_size = block_size
        self.keep_working_copy = keep_working_copy
        self.hot_k: list[torch.Tensor | None] = []  # per full block [B, H, bs, D], None once compressed
        self.hot_v: list[torch.Tensor | None] = []
        self.slots: list[Slot | None] = []
        self.formats: list[Format] = []
        self.keep: list[torch.Tensor | None] = []  # token-eviction mask per block [B, H, bs] (baselines)
        self.tail_k: torch.Tensor | None = None
        self.tail_v: torch.Tensor | None = None
        self._work: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        self.n_tokens = 0
        self.last_bias: torch.Tensor | None = None

    # -- transformers' layer interface -------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.tail_k = key_states[..., :0, :]
        self.tail_v = value_states[..., :0, :]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.tail_k is not None and self.tail_v is not None
        tk = torch.cat([self.tail_k, key_states], dim=-2)
        tv = torch.cat([self.tail_v, value_states], dim=-2)
        bs = self.block_size
        n_full = tk.shape[-2] // bs
        if n_full:
            new_k = [tk[..., i * bs : (i + 1) * bs, :].clone() for i in range(n_full)]
            new_v = [tv[..., i * bs : (i + 1) * bs, :].clone() for i in range(n_full)]
            self.hot_k += new_k
            self.hot_v += new_v
            self.slots += [None] * n_full
            self.formats += [HOT] * n_full
            self.keep += [None] * n_full
            if self._work is not None:
                wk, wv, wb = self._work
                wk = torch.cat([wk, *new_k], dim=-2)
                wv = torch.cat([wv, *new_v], dim=-2)
                if wb is not None:
                    wb = torch.cat([wb, wb.new_zeros(*wb.shape[:2], n_full * bs)], dim=-1)
                self._work = (wk, wv, wb)
            tk, tv = tk[..., n_full * bs :, :].clone(), tv[..., n_full * bs :, :].clone()
        self.tail_k, self.tail_v = tk, tv
        self.n_tokens += key_states.shape[-2]
        wk, wv, wb = self.materialize()
        keys = torch.cat([wk, tk], dim=-2)
        values = torch.cat([wv, tv], dim=-2)
        bias = None if wb is None else torch.cat([wb, wb.new_zeros(*wb.shape[:2], tk.shape[-2])], dim=-1)
        self.last_bias = bias
        return keys, values

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        # transformers >= 5.19 passes the query length; 5.2 passes `cache_position` (one per query).
        q = int(query_length.shape[0]) if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.n_tokens + q, 0

    def get_max_cache_shape(self) -> int:
        return -1  # grows without bound, like DynamicLayer (transformers 5.2 asks)

    def get_seq_length(self) -> int:
        return self.n_tokens

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.block_size, self.keep_working_copy)  # type: ignore[misc]

    def fork(self) -> ProximaLayer:
        """A copy that can be compressed, evicted or extended without touching this layer (see
        `ProximaCache.fork`): new block lists sharing the block tensors, which are only ever
        replaced, never written in place; the working copy, which `_patch_work` / `_patch_stored`
        write in place, cloned."""
        out = copy.copy(self)
        out.hot_k, out.hot_v = list(self.hot_k), list(self.hot_v)
        out.slots, out.formats, out.keep = list(self.slots), list(self.formats), list(self.keep)
        if self._work is not None:
            wk, wv, wb = self._work
            out._work = (wk.clone(), wv.clone(), None if wb is None else wb.clone())
        return out

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("ProximaCache does not support beam search")

    # -- Proxima -------------------------------------------------------------------------------

    @property
    def n_blocks(self) -> int:
        return len(self.formats)

    def block_kv(
        self, i: int, decoded: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Block i as attention sees it: k, v `[B, H, bs, D]` and bias `[B, H, bs]` (None = all 0).
        `decoded`: the slot's batch already decoded (a batch holds many blocks; decode it once)."""
        slot = self.slots[i]
        if slot is None:
            k, v = self.hot_k[i], self.hot_v[i]
            assert k is not None and v is not None, f"block {i} has neither hot data nor a slot"
            bias = None
        else:
            kh, vh, lc = decoded if decoded is not None else slot.decode()  # [N, C, H, D], [N, C, H]
            rows = slot.rows
            c = kh.shape[1]
            b, h, d = len(rows), kh.shape[2], kh.shape[3]
            # Decoded blocks are in the KV storage dtype; attention runs in the model's.
            k = torch.zeros(b, h, self.block_size, d, dtype=self.dtype, device=kh.device)
            v = torch.zeros(b, h, self.block_size, d, dtype=self.dtype, device=vh.device)
            k[:, :, :c] = kh[rows].transpose(1, 2).to(self.dtype)
            v[:, :, :c] = vh[rows].transpose(1, 2).to(self.dtype)
            if c == self.block_size and not self.formats[i].attention_uses_counts:
                bias = None
            else:
                bias = torch.full((b, h, self.block_size), NEG_INF, dtype=torch.float32, device=k.device)
                bias[:, :, :c] = lc[rows].transpose(1, 2).float()
        keep = self.keep[i]
        if keep is not None:
            kb = torch.where(keep, 0.0, NEG_INF)
            bias = kb if bias is None else bias + kb
        return k, v, bias

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """All full blocks as attention sees them (cached when `keep_working_copy`)."""
        if self._work is None:
            assert self.tail_k is not None and self.tail_v is not None
            ks, vs, bs_ = [], [], []
            decoded: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
            for i in range(self.n_blocks):
                slot = self.slots[i]
                dec = None
                if slot is not None:
                    if id(slot.cb) not in decoded:
                        decoded[id(slot.cb)] = slot.decode()
                    dec = decoded[id(slot.cb)]
                k, v, b = self.block_kv(i, dec)
                ks.append(k)
                vs.append(v)
                bs_.append(b)
            if any(b is not None for b in bs_):
                ref = self.tail_k
                bias = torch.cat(
                    [
                        b
                        if b is not None
                        else torch.zeros(ref.shape[0], ref.shape[1], self.block_size, device=ref.device)
                        for b in bs_
                    ],
                    dim=-1,
                )
            else:
                bias = None
            wk = torch.cat([self.tail_k[..., :0, :], *ks], dim=-2)
            wv = torch.cat([self.tail_v[..., :0, :], *vs], dim=-2)
            if not self.keep_working_copy:
                return wk, wv, bias
            self._work = (wk, wv, bias)
        return self._work

    def _patch_work(self, i: int, decoded: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """Rewrite block i inside the cached working copy after its storage changed."""
        if self._work is None:
            return
        wk, wv, wb = self._work
        k, v, b = self.block_kv(i, decoded)
        sl = slice(i * self.block_size, (i + 1) * self.block_size)
        wk[..., sl, :] = k
        wv[..., sl, :] = v
        if b is not None and wb is None:
            wb = torch.zeros(*wk.shape[:2], wk.shape[2], dtype=torch.float32, device=wk.device)
        if wb is not None:
            wb[..., sl] = 0.0 if b is None else b
        self._work = (wk, wv, wb)

    def store(
        self, blocks: Sequence[int], fmt: Format, cb: CompressedBlocks, batch: int, backend: Backend = "auto"
    ) -> None:
        """Commit compressed blocks: `cb` rows are ordered (block, batch element)."""
        if cb.num_slots != len(blocks) * batch:
            raise ValueError(f"{cb.num_slots} compressed rows for {len(blocks)} blocks x batch {batch}")
        per_row = cb.held_nbytes // max(1, cb.num_slots)  # every row has the same shapes
        decoded = decompress_blocks(cb, backend=backend) if self._work is not None else None
        for j, i in enumerate(blocks):
            self.slots[i] = Slot(cb, [j * batch + b for b in range(batch)], per_row * batch, backend)
            self.hot_k[i] = None
            self.hot_v[i] = None
            self.formats[i] = fmt
        if decoded is None:
            return
        if any(self.keep[i] is not None for i in blocks):
            for i in blocks:  # token-evicted blocks (baselines) take the per-block path
                self._patch_work(i, decoded)
        else:
            self._patch_stored(list(blocks), fmt, decoded)

    def _patch_stored(self, blocks: list[int], fmt: Format, decoded: Decoded) -> None:
        """`block_kv` + `_patch_work` for all `blocks` of one stored batch at once (rows ordered
        (block, batch element)): one scatter per working-copy tensor instead of a dozen small ops
        per block, which is what bounds a GPU run (kernel launches, not arithmetic)."""
        assert self._work is not None
        wk, wv, wb = self._work
        kh, vh, lc = decoded  # [N, C, H, D], [N, C, H]
        n, bs = len(blocks), self.block_size
        c, h, d = kh.shape[1], kh.shape[2], kh.shape[3]
        b = kh.shape[0] // n
        tot = wk.shape[2] // bs  # the working copy covers the full blocks exactly
        idx = torch.tensor(blocks, device=wk.device)
        wk5, wv5 = wk.view(b, h, tot, bs, d), wv.view(b, h, tot, bs, d)
        wk5[:, :, idx, :c] = kh.view(n, b, c, h, d).permute(1, 3, 0, 2, 4).to(self.dtype)
        wv5[:, :, idx, :c] = vh.view(n, b, c, h, d).permute(1, 3, 0, 2, 4).to(self.dtype)
        if c < bs:
            wk5[:, :, idx, c:] = 0.0
            wv5[:, :, idx, c:] = 0.0
        if c < bs or fmt.attention_uses_counts:
            bias = torch.full((b, h, n, bs), NEG_INF, dtype=torch.float32, device=wk.device)
            bias[..., :c] = lc.view(n, b, c, h).permute(1, 3, 0, 2).float()
            if wb is None:
                wb = torch.zeros(b, h, wk.shape[2], dtype=torch.float32, device=wk.device)
            wb.view(b, h, tot, bs)[:, :, idx] = bias
        elif wb is not None:
            wb.view(b, h, tot, bs)[:, :, idx] = 0.0
        self._work = (wk, wv, wb)

    def evict(self, keep: torch.Tensor) -> None:
        """Token eviction (baselines): keep `[B, H, n_blocks * bs]` bool over the full blocks."""
        bs = self.block_size
        for i in range(self.n_blocks):
            kb = keep[..., i * bs : (i + 1) * bs]
            self.keep[i] = None if bool(kb.all()) else kb.clone()
            self._patch_work(i)

    def stored_nbytes(self) -> int:
        """Bytes this layer's store really holds (hot tensors, compressed payloads; no working copy)."""
        total = 0
        for i in range(self.n_blocks):
            slot = self.slots[i]
            if slot is not None:
                total += slot.nbytes
            else:
                k = self.hot_k[i]
                assert k is not None
                total += 2 * k.numel() * k.element_size()
        if self.tail_k is not None:
            total += 2 * self.tail_k.numel() * self.tail_k.element_size()
        return total

    def kv16_nbytes(self) -> int:
        """Bytes of this layer's tokens (batch included) held uncompressed in 16 bits: the reference."""
        if self.tail_k is None:
            return 0
        b, h, _, d = self.tail_k.shape
        return b * kv16_bytes(self.n_tokens, h, d)

    def held_nbytes(self, hot_itemsize: int) -> int:
        """Bytes a serving cache holds for this layer: compressed payloads (data and metadata, as
        `CompressedBlocks.held_nbytes` counts them), hot tokens at `hot_itemsize` bytes per element,
        evicted tokens (the baselines' masks) at nothing."""
        if self.tail_k is None:
            return 0
        b, h, _, d = self.tail_k.shape
        per_token_head = 2 * d * hot_itemsize  # keys and values
        total = b * h * self.tail_k.shape[-2] * per_token_head
        for i in range(self.n_blocks):
            slot = self.slots[i]
            if slot is not None:
                total += slot.nbytes
                continue
            keep = self.keep[i]
            kept = b * h * self.block_size if keep is None else int(keep.sum())
            total += kept * per_token_head
        return total

    def working_nbytes(self) -> int:
        if self._work is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self._work if t is not None)
