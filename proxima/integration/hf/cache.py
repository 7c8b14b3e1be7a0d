"""`ProximaCache`: a transformers `Cache` that stores KV in Proxima's block formats.

    model = proxima.integration.hf.enable(model)          # attention that reads compressed blocks
    cache = ProximaCache(policy="proxima/policies/balanced.yaml", capacity_blocks=24)
    model.generate(**inputs, past_key_values=cache)

Layout per layer (why: the same logical blocks as vLLM, so the policy engine sees the same thing):
full blocks of `block_size` tokens, each hot (exact tensors) or compressed (a `CompressedBlocks`
payload from `proxima.compression.compress_blocks`, the very call the vLLM worker makes, on the
block cast to the 16-bit KV dtype vLLM caches: the payload is byte for byte what vLLM stores),
then a hot tail of fewer than `block_size` tokens. A block's format
is the same in every layer, except where the policy's `layer_overrides` substitute a format of
equal pack ratio (DESIGN.md). The batch is treated as one request: every row shares the block
formats (the quality harness runs batch 1).

Reads return keys/values at the *logical* length (one slot per token) plus a per-slot additive
bias handed to Proxima's attention function (`attention.py`): 0 for exact and quantized slots,
`log(count)` for centroids, `-inf` for slots a reduced block no longer uses. With policy `off`
nothing is ever compressed and `update` returns exactly what `DynamicCache` returns.

Policy application: `apply_policy(target_ratio=r)` (quality runs: compress until the context is
stored r times smaller) or automatically at the start of each forward when `capacity_blocks` is
set (a virtual pool of that many physical blocks; pressure = used / capacity). Both build a
`Snapshot` of the cache's blocks and call the real engine `proxima.policy.engine.decide`.
Block and token importance come from the observation window: the last W queries of each layer,
recorded by the attention function, scored in one layer (`proxima.observation.observed_layer`, the
middle one, as the vLLM worker observes it) for every layer's blocks and tokens.
With `accumulate_attention=True` each layer also sums the attention every query gives every key
(`accumulated_attention`, the H2O baseline's score): off by default, it is a second attention
pass over each forward's queries in every layer.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from proxima.compression.attention import attention_errors
from proxima.compression.blocks import Backend, CompressedBlocks, compress_blocks, decompress_blocks
from proxima.compression.spec import bytes_ratio, check_group_size, kv16_bytes
from proxima.formats import HOT, Format, recompressible
from proxima.integration.hf import attention
from proxima.observation import fold_heads, observed_layer
from proxima.policy import target
from proxima.policy.engine import Action, EngineState, decide
from proxima.policy.schema import OFF, Policy
from proxima.policy.snapshot import RequestBlocks, Snapshot

NEG_INF = float("-inf")
ACCUMULATE_CHUNK = 256
"""Queries per step of the accumulated-attention pass: its float32 probabilities are
`[B, Hq, 256, T]` at a time (SmolLM2, 9 query heads, a 4k prompt: 38 MB) where the whole prompt
at once would be `[B, Hq, T, T]` (600 MB). Cost: one such layer at 4k tokens took 0.8 s on one
CPU thread of this project's machine (SmolLM2's 30 layers: about 25 s per 4k prefill)."""


@dataclass
class ProbeRecord:
    """One block compressed in one layer: the features and error the damage model learns from."""

    layer: int
    block: int
    fmt: str
    importance: float
    """Attention mass the observation window gives the block in this layer (max over heads)."""
    key_norm_spread: float
    """Std / mean of the block's key norms (mean over heads)."""
    error: float
    """Relative error of the observation window's attention output over the block."""


Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(k_hat [N, C, H, D], v_hat, log_count [N, C, H]) of a `CompressedBlocks`, as `decompress_blocks` returns."""


@dataclass
class _Slot:
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
        self.slots: list[_Slot | None] = []
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
            self.slots[i] = _Slot(cb, [j * batch + b for b in range(batch)], per_row * batch, backend)
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


@dataclass
class CompressionReport:
    """What one `apply_policy` / `compress` call did."""

    actions: int = 0
    rejected: int = 0
    """Actions the compression-time probe refused (a milder format was tried, or the block stayed)."""
    formats: dict[str, int] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)


class ProximaCache(Cache):
    """A transformers cache applying Proxima's block formats and policy engine (see module doc).

    Args:
        policy: a `Policy`, a path to a policy YAML, or None (off: a pass-through).
        block_size: tokens per logical block (vLLM's CPU default is 128; 64 gives the quality
            harness finer blocks on short contexts).
        capacity_blocks: size of a virtual KV pool in physical blocks; when set, the engine runs
            at the start of every forward pass, as vLLM's scheduler would.
        keep_working_copy: keep the decompressed view cached between steps (fast; memory = store
            + working copy). False re-materialises compressed blocks on every read, so only the
            compressed store stays resident.
        observation_window: queries per layer kept to score tokens (default: the policy's).
        record_probes: keep a `ProbeRecord` per compressed (layer, block) for the damage model.
        group_size: the quantization group (`proxima.compression.spec.SlotSpec.group_size`);
            None (default): the policy's `storage` (`group_size`, per-format `group_sizes`), as
            the vLLM worker reads it.
        kv_dtype: the dtype a serving KV cache holds (vLLM: bf16). Blocks are cast to it before
            `compress_blocks`, so payloads equal vLLM's even when the model runs in float32 (the
            CPU harness), and hot blocks are counted at its size in `held_nbytes`. None: the
            model's dtype.
        backend: the compression kernels (`proxima.compression.blocks.Backend`): "auto" runs
            Triton on CUDA tensors and the torch reference on CPU tensors, as the vLLM worker
            does; "triton" forces the kernels (on CPU under TRITON_INTERPRET=1, to test the
            path a GPU run takes).
        accumulate_attention: sum, per layer, the attention every query gives every cached key
            (`accumulated_attention`; the H2O baseline ranks tokens by it). Off by default: it
            recomputes each forward's attention probabilities in every layer. Set it before the
            prefill; a cache that missed queries refuses to report the sums.
    """

    def __init__(
        self,
        policy: Policy | str | Path | None = None,
        *,
        block_size: int = 64,
        capacity_blocks: int | None = None,
        keep_working_copy: bool = True,
        observation_window: int | None = None,
        record_probes: bool = False,
        group_size: int | None = None,
        kv_dtype: torch.dtype | None = torch.bfloat16,
        backend: Backend = "auto",
        accumulate_attention: bool = False,
    ) -> None:
        super().__init__(layers=[])
        if isinstance(policy, (str, Path)):
            from proxima.policy.loader import load_policy

            policy = load_policy(policy)
        self.policy: Policy = policy if policy is not None else OFF
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.keep_working_copy = keep_working_copy
        self.window = observation_window or self.policy.importance.observation_window
        self.record_probes = record_probes
        self._group_size = group_size
        self.kv_dtype = kv_dtype
        self.backend: Backend = backend
        self.engine_state = EngineState()
        self.block_importance: torch.Tensor | None = None  # EMA per logical block
        self.probe_log: list[ProbeRecord] = []
        self.ineligible: set[int] = set()  # blocks the probe refused for every ladder format
        self._obs: dict[int, torch.Tensor] = {}
        self.accumulate_attention = accumulate_attention
        self._acc: dict[int, tuple[torch.Tensor, int]] = {}
        """Per layer: attention column sums `[B, H_kv, T]` (T: the tokens cached at the last
        forward) and how many queries they sum. Replaced on every forward, never written in place
        (forks share them)."""
        self._pending_bias: int | None = None
        self.chosen: list[Format] = []
        self._stacked = False  # set by `stacked()`: its hot blocks are views of the working copies
        """Per logical block, the format the engine (or a caller) chose; layers may store a substitute."""

    def fork(self) -> ProximaCache:
        """An independent copy of this cache, for compressing the same prefill several ways (the
        quality harness, one copy per method; `apply_policy`'s byte passes): what `copy.deepcopy`
        gives, without copying tensors nothing writes in place. Hot blocks, tails, compressed
        payloads and observation queries are shared (every change replaces them); block lists,
        the engine's bookkeeping and each layer's working copy (patched in place) are copied.
        A deepcopy of a 4k-token SmolLM2 cache is about 27k tensor operations (kernel launches
        on a GPU); a fork is two or three clones per layer. Relies on hot blocks not aliasing the
        working copy, which holds for every cache but a `stacked()` one (its hot blocks are views
        of its working copy, so a fork's would still view the original's): those refuse."""
        if self._stacked:
            raise ValueError("a stacked() cache cannot be forked: its hot blocks are views of its working copies")
        out = copy.copy(self)
        out.layers = [layer.fork() for layer in self.proxima_layers]
        out.engine_state = copy.copy(self.engine_state)
        out.probe_log = list(self.probe_log)
        out.ineligible = set(self.ineligible)
        out._obs = dict(self._obs)
        out._acc = dict(self._acc)
        out.chosen = list(self.chosen)
        return out

    @property
    def group_size(self) -> int | None:
        """The quantization group forced for every format (the constructor's), or None: the
        policy's `storage` decides per format (`group_for`)."""
        return self._group_size

    @group_size.setter
    def group_size(self, value: int | None) -> None:
        self._group_size = value

    def group_for(self, fmt: Format) -> int:
        """The quantization group of new `fmt` compressions: `group_size` if set, else the policy's
        `storage.group_for(fmt)` (what the vLLM worker uses). Each stored block keeps the group it
        was written with (`CompressedBlocks.group_size`), so reads never depend on this."""
        return self._group_size if self._group_size is not None else self.policy.storage.group_for(fmt)

    # -- transformers interface ----------------------------------------------------------------

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.layers) <= layer_idx:
            self.layers.append(ProximaLayer(self.block_size, self.keep_working_copy))
        if self._pending_bias is not None:
            raise RuntimeError(
                f"layer {self._pending_bias} had compressed blocks that need a per-key bias, but the model's "
                "attention never read it: call proxima.integration.hf.enable(model) (attn_implementation="
                f"{attention.ATTN_NAME!r}) before using sparse or cluster formats"
            )
        if layer_idx == 0 and self.capacity_blocks is not None and not self.policy.is_off:
            self.apply_policy()
        layer = self.proxima_layers[layer_idx]
        keys, values = layer.update(key_states, value_states)
        if layer.last_bias is not None:
            self._pending_bias = layer_idx
        attention.set_active(self)
        return keys, values

    def get_mask_sizes(self, query_length: int | torch.Tensor, layer_idx: int) -> tuple[int, int]:  # type: ignore[override]
        if layer_idx >= len(self.layers):
            q = int(query_length.shape[0]) if isinstance(query_length, torch.Tensor) else int(query_length)
            return q, 0
        return self.proxima_layers[layer_idx].get_mask_sizes(query_length)

    def _take_attention_bias(self, layer_idx: int, kv_len: int) -> torch.Tensor | None:
        if layer_idx >= len(self.layers):
            return None
        layer = self.proxima_layers[layer_idx]
        bias = layer.last_bias
        layer.last_bias = None
        if self._pending_bias == layer_idx:
            self._pending_bias = None
        if bias is not None and bias.shape[-1] != kv_len:
            raise RuntimeError(f"layer {layer_idx}: bias covers {bias.shape[-1]} keys, attention got {kv_len}")
        return bias

    def _observe_queries(self, layer_idx: int, query: torch.Tensor) -> None:
        prev = self._obs.get(layer_idx)
        q = query.detach()
        if prev is not None and prev.shape[:2] == q.shape[:2]:
            q = torch.cat([prev, q], dim=2)
        self._obs[layer_idx] = q[:, :, -self.window :].clone()
        if self.accumulate_attention and 0 <= layer_idx < len(self.layers):
            self._accumulate(layer_idx, query.detach())

    def _accumulate(self, layer_idx: int, query: torch.Tensor) -> None:
        """Add this forward's attention probabilities, summed over its queries, to the layer's
        column sums. Called after the layer's keys were cached, so its queries are the last Q of
        the T cached tokens (causal, bottom-right aligned), as in `token_importance`; the keys
        are what attention reads (working copy and tail, with the per-key bias).

        A KV head's score is the sum over its query heads, not `fold_heads` with the policy's
        aggregate: every query head sharing the KV head reads the same cached token, so the sum
        is the total attention that evicting it takes away (H2O's score, a sum over queries,
        extended over the group); it is linear, so chunks and forwards add up exactly with no
        per-query-head state; and it does not depend on which policy the cache holds at prefill
        (the baselines' caches run with policy off, and `proxima:` methods replace the policy
        afterwards). Mean over the group would rank identically (a constant factor)."""
        layer = self.proxima_layers[layer_idx]
        assert layer.tail_k is not None
        wk, _, wb = layer.materialize()
        keys = torch.cat([wk, layer.tail_k], dim=-2).float()  # [B, Hkv, T, D]
        b, hq, nq, d = query.shape
        hkv, t = keys.shape[1], keys.shape[2]
        g = hq // hkv
        qf = query.float().reshape(b, hkv, g, nq, d)  # query head h reads KV head h // g
        bias = None if wb is None else torch.cat([wb, wb.new_zeros(b, hkv, t - wb.shape[-1])], dim=-1)
        cols = keys.new_zeros(b, hkv, t)
        first = t - nq  # position of this forward's first query
        for s in range(0, nq, ACCUMULATE_CHUNK):
            qc = qf[:, :, :, s : s + ACCUMULATE_CHUNK]
            hi = first + s + qc.shape[3]  # the chunk's last query sees keys [0, hi)
            logits = torch.einsum("bhgqd,bhtd->bhgqt", qc, keys[:, :, :hi]) * d**-0.5
            if bias is not None:
                logits = logits + bias[:, :, None, None, :hi]
            qpos = torch.arange(first + s, hi, device=keys.device)
            future = torch.arange(hi, device=keys.device)[None, :] > qpos[:, None]  # [Qc, hi]
            p = torch.softmax(logits.masked_fill(future, NEG_INF), dim=-1)
            cols[..., :hi] += p.sum(dim=(2, 3))
        prev = self._acc.get(layer_idx)
        seen = nq
        if prev is not None and prev[0].shape[:2] == cols.shape[:2] and prev[0].shape[-1] <= t:
            cols[..., : prev[0].shape[-1]] += prev[0]  # tokens cached since then start at 0
            seen += prev[1]
        self._acc[layer_idx] = (cols, seen)

    # -- accounting ----------------------------------------------------------------------------

    @property
    def proxima_layers(self) -> list[ProximaLayer]:
        return self.layers  # type: ignore[return-value]

    def stored_nbytes(self) -> int:
        """Bytes of the store across layers (what a real deployment keeps resident)."""
        return sum(layer.stored_nbytes() for layer in self.proxima_layers)

    def resident_nbytes(self) -> int:
        """Store plus working copies: what this process holds right now."""
        return sum(layer.stored_nbytes() + layer.working_nbytes() for layer in self.proxima_layers)

    def held_nbytes(self) -> int:
        """Bytes a serving deployment holds for this cache: compressed payloads with their
        metadata, hot blocks and the tail at `kv_dtype` (vLLM's 16-bit cache), evicted tokens free."""
        if not self.layers:
            return 0
        itemsize = self.kv_dtype.itemsize if self.kv_dtype is not None else self.proxima_layers[0].dtype.itemsize
        return sum(layer.held_nbytes(itemsize) for layer in self.proxima_layers)

    def kv16_nbytes(self) -> int:
        """The same tokens' keys and values in 16 bits, uncompressed."""
        return sum(layer.kv16_nbytes() for layer in self.proxima_layers)

    def achieved_ratio(self) -> float:
        """The ratio Proxima reports: 16-bit KV bytes over bytes held, metadata included
        (`proxima.compression.spec.bytes_ratio`)."""
        return bytes_ratio(self.kv16_nbytes(), self.held_nbytes())

    def block_formats(self) -> list[Format]:
        return list(self.proxima_layers[0].formats) if self.layers else []

    def nominal_ratio(self) -> float:
        """The *nominal* ratio, shown next to `achieved_ratio` and labelled so: 16-bit KV bits over
        stored bits counting each format at its pack ratio (metadata excluded) and evicted tokens
        as free; averaged over layers."""
        ratios = []
        for layer in self.proxima_layers:
            bs = layer.block_size
            stored = float(layer.tail_k.shape[-2]) if layer.tail_k is not None else 0.0
            for i, fmt in enumerate(layer.formats):
                keep = layer.keep[i]
                frac = 1.0 if keep is None else float(keep.float().mean())
                stored += bs * frac / fmt.pack_ratio
            ratios.append(layer.n_tokens / stored if stored > 0 else 1.0)
        return sum(ratios) / len(ratios) if ratios else 1.0

    # -- importance ----------------------------------------------------------------------------

    def window_queries(self, layer_idx: int) -> torch.Tensor | None:
        """The observation window's queries of a layer, `[B, Hq, W, D]` after RoPE (what the
        compression-time probe attends with); None before any was recorded."""
        return self._obs.get(layer_idx)

    def accumulated_attention(self, layer_idx: int) -> torch.Tensor:
        """Attention mass each cached token received from every query so far (every prefill
        query, then every later one), `[B, H_kv, T_full]` over the full blocks: per KV head the
        sum over its query heads and over queries of the causal softmax (`_accumulate`). Needs
        `ProximaCache(accumulate_attention=True)` from the first forward on, and the model on
        Proxima's attention (`proxima.integration.hf.enable`), which hands the queries over."""
        if not self.accumulate_attention:
            raise RuntimeError(
                "accumulated attention was not recorded: build the cache with ProximaCache(accumulate_attention=True) "
                "before the prefill (the quality harness does when a method has needs_accumulated_attention=True)"
            )
        layer = self.proxima_layers[layer_idx]
        acc = self._acc.get(layer_idx)
        if acc is None or acc[1] != layer.n_tokens:
            got = 0 if acc is None else acc[1]
            raise RuntimeError(
                f"layer {layer_idx}: accumulated attention covers {got} of its {layer.n_tokens} queries: set "
                "accumulate_attention=True before the first forward, and run the model on Proxima's attention "
                f"(proxima.integration.hf.enable(model), attn_implementation={attention.ATTN_NAME!r})"
            )
        return acc[0][..., : layer.n_blocks * layer.block_size]

    def token_importance(self, layer_idx: int) -> torch.Tensor | None:
        """Attention mass each cached token gets from the observation window, `[B, H_kv, T_full]`
        over the full blocks (mean over window queries, each KV head's query heads folded by
        `observation.fold_heads`, as the vLLM worker does)."""
        q = self._obs.get(layer_idx)
        layer = self.proxima_layers[layer_idx]
        if q is None or layer.n_blocks == 0:
            return None
        wk, _, wb = layer.materialize()
        assert layer.tail_k is not None
        keys = torch.cat([wk, layer.tail_k], dim=-2).float()
        b, hq, w, d = q.shape
        hkv = keys.shape[1]
        g = hq // hkv
        qf = q.float().reshape(b, hkv, g, w, d)
        logits = torch.einsum("bhgwd,bhtd->bhgwt", qf, keys) * d**-0.5
        t = keys.shape[-2]
        if wb is not None:
            full_bias = torch.cat([wb, wb.new_zeros(b, hkv, t - wb.shape[-1])], dim=-1)
            logits = logits + full_bias[:, :, None, None, :]
        qpos = torch.arange(t - w, t, device=keys.device)
        causal = torch.arange(t, device=keys.device)[None, :] <= qpos[:, None]  # [W, T]
        logits = logits.masked_fill(~causal, NEG_INF)
        p = torch.softmax(logits, dim=-1)
        imp = fold_heads(p.mean(3), self.policy.importance.aggregate, 2)  # [B, Hkv, T]
        return imp[..., : layer.n_blocks * layer.block_size]

    def refresh_importance(self) -> torch.Tensor:
        """Per logical block: attention mass in the observed layer (`proxima.observation`, the one
        the vLLM worker observes), aggregated over batch and heads (policy's
        `importance.aggregate`), folded into an EMA. Returns `[n_blocks]` (float64)."""
        n = self.proxima_layers[0].n_blocks
        imp = self.token_importance(observed_layer(len(self.layers)))
        if imp is not None:
            blk = imp.view(*imp.shape[:2], n, self.block_size).sum(-1)  # [B, H, n]
            cur = fold_heads(blk, self.policy.importance.aggregate, (0, 1))
        else:
            cur = torch.ones(n)
        cur = cur.double().cpu()
        old = self.block_importance
        if old is not None and 0 < len(old) <= n:
            decay = self.policy.importance.ema_decay
            merged = cur.clone()
            merged[: len(old)] = decay * old + (1 - decay) * cur[: len(old)]
            cur = merged
        self.block_importance = cur
        return cur

    # -- compression ---------------------------------------------------------------------------

    def compress_blocks(
        self,
        blocks: Sequence[int],
        fmt: Format,
        *,
        ladder: Sequence[Format] = (),
        probe: bool = False,
    ) -> CompressionReport:
        """Compress `blocks` (logical indices) into `fmt` in every layer (with the policy's layer
        overrides), from what each block holds now: hot blocks exactly, quantized ones from their
        dequantised data, token-reduced ones from their stored rows and counts (centroids merge
        further, counts add: `proxima.formats.recompressible` says which moves exist;
        a reduced block asked for a move it cannot make takes the mildest `ladder` format it can
        reach at that ratio or more). With `probe`, a block whose attention-output error in the
        observed layer (`proxima.observation`: the one layer the vLLM worker's probe measures)
        exceeds the policy's bound for the format is retried with the next milder reachable
        `ladder` format, else left as it is and marked ineligible."""
        report = CompressionReport()
        self._extend_chosen()
        groups: dict[tuple[tuple[Format, ...], Format], list[int]] = {}
        for raw in blocks:
            i = int(raw)
            if self.chosen[i].pack_ratio >= fmt.pack_ratio:
                continue
            target = self._reachable(i, fmt, ladder)
            if target is None:
                self.ineligible.add(i)
                continue
            src = tuple(layer.formats[i] for layer in self.proxima_layers)
            groups.setdefault((src, target), []).append(i)
        for (src, target), todo in groups.items():
            milder = sorted(
                (f for f in ladder if f.pack_ratio < target.pack_ratio and self._reachable_from(src, f)),
                key=lambda f: -f.pack_ratio,
            )
            for cand in [target, *milder]:
                if not todo:
                    break
                encs, errs = self._encode_all_layers(todo, cand, measure=probe)
                err = errs[observed_layer(len(errs))]  # [len(todo)]: the layer vLLM's worker probes
                bound = self.policy.probes.compression.bound(cand) if probe else float("inf")
                ok = (err <= bound).tolist()
                accepted = [b for b, o in zip(todo, ok, strict=True) if o]
                if accepted:
                    if len(accepted) != len(todo):
                        encs = self._reencode(accepted, cand)  # the store holds no rejected rows
                    self._commit(accepted, cand, encs)
                    report.actions += len(accepted)
                    report.formats[cand.name] = report.formats.get(cand.name, 0) + len(accepted)
                todo = [b for b, o in zip(todo, ok, strict=True) if not o]
                report.rejected += len(todo)
                if not probe:
                    break
            self.ineligible.update(todo)
        return report

    def _reachable_from(self, src: tuple[Format, ...], fmt: Format) -> bool:
        """Every layer's stored format can be recompressed into its version of `fmt`."""
        return all(recompressible(s, self._layer_format(fmt, li)) for li, s in enumerate(src))

    def _reachable(self, i: int, fmt: Format, ladder: Sequence[Format]) -> Format | None:
        """`fmt` if block i can move there; else the mildest ladder format of at least that ratio it
        can reach (a merged block asked for a sparse format merges further instead); else None."""
        src = tuple(layer.formats[i] for layer in self.proxima_layers)
        if self._reachable_from(src, fmt):
            return fmt
        subs = sorted(
            (f for f in ladder if f.pack_ratio >= fmt.pack_ratio and self._reachable_from(src, f)),
            key=lambda f: f.pack_ratio,
        )
        return subs[0] if subs else None

    def _extend_chosen(self) -> None:
        n = self.proxima_layers[0].n_blocks if self.layers else 0
        self.chosen += [HOT] * (n - len(self.chosen))

    def _layer_format(self, fmt: Format, layer: int) -> Format:
        return self.policy.layer_format(fmt, layer)

    def _encode_all_layers(
        self, blocks: list[int], fmt: Format, *, measure: bool = True
    ) -> tuple[list[tuple[Format, CompressedBlocks]], list[torch.Tensor]]:
        """Compress `blocks` (each layer's stored format the same for all of them) into `fmt`.
        The probe error is measured in the observed layer when `measure`, in every layer when probes
        are recorded, else reported as 0 (nobody reads it: a third of an unprobed compression's
        time went to it)."""
        encs, errs = [], []
        for li, layer in enumerate(self.proxima_layers):
            lf = self._layer_format(fmt, li)
            kk, vv, lc, timp = self._block_rows(li, blocks)
            b = layer.tail_k.shape[0] if layer.tail_k is not None else 1
            # What vLLM holds hot is the 16-bit cache; compress exactly that, with the call its worker makes.
            kk, vv = kk.to(self.kv_dtype or kk.dtype), vv.to(self.kv_dtype or vv.dtype)
            group = self.group_for(lf)
            where = self.policy.storage.field_for(lf) if self._group_size is None else "ProximaCache(group_size=)"
            check_group_size(group, kk.shape[-1], (lf,), where)
            cb = compress_blocks(
                lf, kk, vv, token_importance=timp, group_size=group, log_count=lc,
                source_tokens=layer.block_size, backend=self.backend,
            )
            measured = (measure and li == observed_layer(len(self.proxima_layers))) or self.record_probes
            err = self._probe(li, kk, vv, cb, b, lc) if measured else torch.zeros(len(blocks))  # [n]
            if self.record_probes:
                self._record(li, blocks, lf, kk, timp, err, b)
            encs.append((lf, cb))
            errs.append(err)
        return encs, errs

    def _block_rows(
        self, layer_idx: int, blocks: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """What `blocks` hold now in one layer, rows ordered (block, batch element):
        k, v `[N, C, H, D]`, their log-counts `[N, C, H]` (None unless token-reduced) and token
        importance `[N, C, H]` (None before any observation). Hot blocks read exactly, quantized
        ones dequantised (C = block size); token-reduced ones as their stored rows."""
        layer = self.proxima_layers[layer_idx]
        bsz = layer.block_size
        src = layer.formats[blocks[0]]
        lc: torch.Tensor | None = None
        if src.reduction is None:
            wk, wv, _ = layer.materialize()
            k = torch.stack([wk[..., i * bsz : (i + 1) * bsz, :] for i in blocks])  # [n, B, H, bs, D]
            v = torch.stack([wv[..., i * bsz : (i + 1) * bsz, :] for i in blocks])
            n, b, h, c, d = k.shape
            kk = k.reshape(n * b, h, c, d).transpose(1, 2)  # [N, bs, H, D]
            vv = v.reshape(n * b, h, c, d).transpose(1, 2)
        else:
            c = src.kept_tokens(bsz)
            decoded: dict[int, Decoded] = {}
            ks, vs, ls = [], [], []
            for i in blocks:
                slot = layer.slots[i]
                assert slot is not None and layer.formats[i] == src, f"block {i} is not stored as {src}"
                if id(slot.cb) not in decoded:
                    decoded[id(slot.cb)] = slot.decode()
                kh, vh, lh = decoded[id(slot.cb)]
                ks.append(kh[slot.rows])
                vs.append(vh[slot.rows])
                ls.append(lh[slot.rows])
            kk, vv, lc = torch.cat(ks), torch.cat(vs), torch.cat(ls)
            h = kk.shape[2]
        # Every layer's tokens are ranked by the observed layer's attention, as in the vLLM worker.
        imp = self.token_importance(observed_layer(len(self.layers)))
        timp = None
        if imp is not None:
            t = torch.stack([imp[..., i * bsz : i * bsz + c] for i in blocks])  # [n, B, H, C]
            timp = t.reshape(-1, h, c).transpose(1, 2).contiguous()
        return kk, vv, lc, timp

    def _probe(
        self,
        layer_idx: int,
        k: torch.Tensor,
        v: torch.Tensor,
        cb: CompressedBlocks,
        batch: int,
        log_count: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Relative error of the observation window's attention output over each block alone,
        before vs after compression (`proxima.compression.attention_errors`, the probe every
        integration uses), averaged over the batch. Returns `[n_blocks]`."""
        q = self._obs.get(layer_idx)
        n = k.shape[0] // batch
        if q is None:
            return torch.zeros(n)
        q_rows = q.transpose(1, 2).repeat(n, 1, 1, 1)  # [N, W, Hq, D], rows ordered (block, batch)
        return attention_errors(q_rows, k, v, cb, ref_log_count=log_count).view(n, batch).mean(1).cpu()

    def _record(
        self,
        layer_idx: int,
        blocks: list[int],
        fmt: Format,
        k: torch.Tensor,
        timp: torch.Tensor | None,
        err: torch.Tensor,
        batch: int,
    ) -> None:
        norms = k.float().norm(dim=-1)  # [N, bs, H]
        spread = (norms.std(1) / norms.mean(1).clamp_min(1e-12)).mean(1).view(-1, batch).mean(1)
        mass = timp.sum(1).amax(1).view(-1, batch).amax(1) if timp is not None else torch.zeros(len(blocks))
        # One device-to-host copy per tensor (a float() per element would synchronise a GPU each time).
        masses, spreads, errs = mass.tolist(), spread.tolist(), err.tolist()
        for j, blk in enumerate(blocks):
            self.probe_log.append(ProbeRecord(layer_idx, blk, fmt.name, masses[j], spreads[j], errs[j]))

    def _commit(self, blocks: list[int], fmt: Format, encs: list[tuple[Format, CompressedBlocks]]) -> None:
        for layer, (lf, enc) in zip(self.proxima_layers, encs, strict=True):
            assert layer.tail_k is not None
            layer.store(blocks, lf, enc, layer.tail_k.shape[0], self.backend)
        for i in blocks:
            self.chosen[i] = fmt

    def _reencode(self, blocks: list[int], fmt: Format) -> list[tuple[Format, CompressedBlocks]]:
        record, self.record_probes = self.record_probes, False
        try:
            encs, _ = self._encode_all_layers(blocks, fmt, measure=False)
        finally:
            self.record_probes = record
        return encs

    def compress_all(self, fmt: Format | str, *, protect_sinks: int = 0, protect_recent: int = 0) -> CompressionReport:
        """Compress every full block outside the protected windows into `fmt` (uniform methods)."""
        fmt = Format.parse(fmt) if isinstance(fmt, str) else fmt
        layer0 = self.proxima_layers[0]
        bs = self.block_size
        blocks = [
            i
            for i in range(layer0.n_blocks)
            if i * bs >= protect_sinks and (i + 1) * bs <= layer0.n_tokens - protect_recent
        ]
        return self.compress_blocks(blocks, fmt)

    def evict_tokens(self, keep: Sequence[torch.Tensor]) -> None:
        """Token eviction for the baselines: per layer a bool `[B, H_kv, T_full]` over full blocks."""
        for layer, kp in zip(self.proxima_layers, keep, strict=True):
            layer.evict(kp)

    @classmethod
    def stacked(cls, caches: Sequence[ProximaCache]) -> ProximaCache:
        """The caches side by side as the rows of one batch (row i = `caches[i]`, each of batch 1),
        to decode their continuations in one forward pass instead of one per cache (the quality
        harness: every method's compressed copy of the same prefill reads the same question).

        Each layer of the result holds, as hot blocks, what attention reads from each cache: its
        working copy (decompressed blocks at their logical length) and per-key bias (log-counts,
        evicted and unused slots), its tail as the tail. Tokens appended later go to the tail and
        to new hot blocks exactly as they would in every cache alone, so row i's logits are those
        of `caches[i]` (up to the batched kernels' rounding). The compressed store is not carried:
        the result has policy off and is for reading and appending, not for compressing or for
        byte accounting (take ratios from the caches themselves)."""
        if not caches:
            raise ValueError("stacked() needs at least one cache")
        first = caches[0]
        n_layers, n_tok = len(first.layers), first.get_seq_length()
        for c in caches:
            if len(c.layers) != n_layers or c.get_seq_length() != n_tok or c.block_size != first.block_size:
                raise ValueError(
                    f"stacked caches must match: {len(c.layers)} layers / {c.get_seq_length()} tokens / block "
                    f"{c.block_size}, first has {n_layers} / {n_tok} / {first.block_size}"
                )
            if c.proxima_layers and c.proxima_layers[0].tail_k is not None and c.proxima_layers[0].tail_k.shape[0] != 1:
                raise ValueError("stacked() takes caches of batch 1")
        out = cls(block_size=first.block_size, kv_dtype=first.kv_dtype, observation_window=first.window)
        out._stacked = True
        for li in range(n_layers):
            src = [c.proxima_layers[li] for c in caches]
            layer = ProximaLayer(first.block_size, keep_working_copy=True)
            views = [s.materialize() for s in src]
            wk = torch.cat([v[0] for v in views])
            wv = torch.cat([v[1] for v in views])
            if any(v[2] is not None for v in views):
                wb: torch.Tensor | None = torch.cat(
                    [v[2] if v[2] is not None else v[0].new_zeros(v[0].shape[:3], dtype=torch.float32) for v in views]
                )
            else:
                wb = None
            tails_k = [s.tail_k for s in src]
            tails_v = [s.tail_v for s in src]
            assert all(t is not None for t in tails_k) and all(t is not None for t in tails_v)
            layer.lazy_initialization(torch.cat(tails_k), torch.cat(tails_v))  # type: ignore[arg-type]
            layer.tail_k, layer.tail_v = torch.cat(tails_k), torch.cat(tails_v)  # type: ignore[arg-type]
            bs, n = layer.block_size, src[0].n_blocks
            layer.hot_k = [wk[..., i * bs : (i + 1) * bs, :] for i in range(n)]
            layer.hot_v = [wv[..., i * bs : (i + 1) * bs, :] for i in range(n)]
            layer.slots = [None] * n
            layer.formats = [HOT] * n
            layer.keep = [None] * n
            layer.n_tokens = src[0].n_tokens
            layer._work = (wk, wv, wb)
            out.layers.append(layer)
        return out

    # -- the policy engine ---------------------------------------------------------------------

    def snapshot(self, total_blocks: int | target.VirtualPool) -> Snapshot:
        """The cache's blocks as the engine sees them (one request; the tail block included)."""
        layer0 = self.proxima_layers[0]
        n = layer0.n_blocks
        imp = self.block_importance
        if imp is None or len(imp) < n:
            imp = self.refresh_importance()
        self._extend_chosen()
        formats = list(self.chosen[:n])
        tokens = [self.block_size] * n
        importance = [float(x) for x in imp[:n]]
        tail = layer0.tail_k.shape[-2] if layer0.tail_k is not None else 0
        if tail:
            formats.append(HOT)
            tokens.append(tail)
            importance.append(max(importance, default=1.0))
        shared = [i in self.ineligible for i in range(len(formats))]
        return target.virtual_snapshot(RequestBlocks("seq", importance, formats, tokens, shared=shared),
                                       total_blocks, self.block_size)

    def used_blocks(self) -> float:
        """Physical blocks used, amortised over packing (`target.used_blocks`; the tail: one block)."""
        layer0 = self.proxima_layers[0]
        self._extend_chosen()
        tail = [HOT] if layer0.tail_k is not None and layer0.tail_k.shape[-2] else []
        return target.used_blocks([*self.chosen, *tail])

    def apply_policy(self, *, target_ratio: float | None = None, max_steps: int = 32) -> CompressionReport:
        """Run the engine until it has nothing left to do (or `max_steps`). With `target_ratio`,
        the pool is sized so that reaching the top band's target means a `target_ratio`x smaller
        store *in bytes* (`achieved_ratio`, metadata and hot blocks included). The engine counts
        blocks at their pack ratios, which overstate bytes by the metadata (int4: 4x packed, 3.2x
        in bytes), so a pass that ends short is redone from the same starting state with the ask
        raised by the shortfall, at most `target.BYTE_PASSES` passes; the first pass that reaches the
        target (else the last) is kept. Each pass is the policy as written on a fresh pool: a
        second engine round on the compressed state would start below the top band's `enter`
        and, in a policy whose lower band cannot upgrade, change nothing."""
        report = CompressionReport()
        if self.policy.is_off or not self.layers or self.proxima_layers[0].n_blocks == 0:
            return report
        if target_ratio is None:
            if self.capacity_blocks is None:
                raise ValueError("apply_policy needs target_ratio, or capacity_blocks set on the cache")
            self.refresh_importance()
            self._run_engine(self.capacity_blocks, max_steps, report)
            return report
        layer0 = self.proxima_layers[0]
        logical = layer0.n_blocks + (1 if layer0.tail_k is not None and layer0.tail_k.shape[-2] else 0)

        def trial(ask: float) -> tuple[ProximaCache, CompressionReport]:
            fork, rep = self.fork(), CompressionReport()
            fork.refresh_importance()
            fork._run_engine(target.pool_for_ratio(logical, self.policy, ask), max_steps, rep)
            return fork, rep

        band_before = self.engine_state.active_band
        kept, report = target.reach_ratio(target_ratio, trial, achieved=lambda t: t[0].achieved_ratio(),
                                          acted=lambda t: t[1].actions > 0)
        self.__dict__.update(kept.__dict__)  # the kept trial's state becomes this cache's
        # ... but not the band: on the virtual pool every band is entered at any pressure
        # (`target.engine_policy`), so the trial ends in the top band; carried into a later real
        # pool (`capacity_blocks`), hysteresis would hold the top band where a fresh state does not
        self.engine_state = replace(self.engine_state, active_band=band_before)
        return report

    def _run_engine(self, total: int | target.VirtualPool, max_steps: int, report: CompressionReport) -> None:
        probe = self.policy.probes.compression
        policy = target.engine_policy(self.policy, total)
        for _ in range(max_steps):
            snap = self.snapshot(total)
            dec = decide(snap, policy, self.engine_state)
            self.engine_state = dec.state
            report.reasons.append(dec.reason)
            if len(dec) == 0:
                break
            by_fmt: dict[Format, list[Action]] = {}
            for a in dec.actions:
                by_fmt.setdefault(a.to_format, []).append(a)
            band = next((b for b in self.policy.bands if b.name == dec.band), None)
            ladder = band.ladder if band is not None else []
            done_before = report.actions + report.rejected
            for fmt, acts in by_fmt.items():
                r = self.compress_blocks([a.block_index for a in acts], fmt, ladder=ladder, probe=probe.enabled)
                report.actions += r.actions
                report.rejected += r.rejected
                for k, v in r.formats.items():
                    report.formats[k] = report.formats.get(k, 0) + v
            if report.actions + report.rejected == done_before:
                break  # the engine only proposed blocks we cannot touch: no progress possible

