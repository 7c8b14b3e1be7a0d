"""Compress and decompress KV blocks: the public entry points and the `CompressedBlocks` record.

Every op exists twice with identical semantics: a torch reference (`reference.py`) and a Triton
kernel (`kernels/`, imported through `triton_ops.py`). `backend="auto"` picks Triton for CUDA tensors and the reference
otherwise; "triton" forces Triton (the interpreter on CPU when TRITON_INTERPRET=1); "torch"
forces the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

from proxima.compression import reference as ref
from proxima.compression.spec import DEFAULT_GROUP_SIZE, LEAN_BITS
from proxima.formats import Format

Backend = Literal["auto", "triton", "torch"]
DEFAULT_CLUSTER_ITERS = 4
"""Lloyd steps for STAR-KV; the objective changes by < 1% after the 3rd on Gaussian-mixture keys."""

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class CompressedBlocks:
    """N compressed blocks of one format, indexed by slot along dim 0.

    The same record serves as a compress output (contiguous tensors, slot i = block i) and as a
    *pool* view onto vLLM's KV tensor plus the side table (see `layout.py`), which is what the
    attention kernels read. Named dims: N slots, C tokens per slot (kept tokens or centroids,
    the slot capacity for pools), H KV heads, P packed dim, Gk key groups.
    """

    fmt: Format
    k_data: torch.Tensor
    """[N, C, H, P]: source dtype for bf16, float8_e4m3fn for fp8, uint8 codes for int8 keys,
    int8 for int8 values, uint8 packed (along D) for int4/int2."""
    v_data: torch.Tensor
    head_dim: int
    dtype: torch.dtype
    """dtype that decompression returns (the source KV dtype)."""
    group_size: int = DEFAULT_GROUP_SIZE
    k_scale: torch.Tensor | None = None
    """fp8: [N, C, H] f32; int8/int4/int2: [N, Gk, H, D] f16 (per channel, token groups);
    int4h/int2h: [N, C, H] f16 (per token, of the rotated key)."""
    k_zero: torch.Tensor | None = None
    """int8/int4/int2: like k_scale; int4h/int2h: [N, 1, H, D] f16, the slot's per-channel key mean."""
    v_scale: torch.Tensor | None = None
    """fp8/int8: [N, C, H] f32; int4/int2: [N, C, H, D/G] f16 (per token, channel groups);
    int4h/int2h: [N, C, H] f16."""
    v_zero: torch.Tensor | None = None
    log_count: torch.Tensor | None = None
    """cluster only: [N, C, H] f32, log(tokens merged into the centroid), -inf for an empty one."""
    token_index: torch.Tensor | None = None
    """sparse only, compress outputs only: [N, C, H] int32 source token of each kept token."""
    source_tokens: int = 0
    """Tokens per block before reduction (T)."""

    @property
    def held_nbytes(self) -> int:
        """Bytes a store keeps for these blocks: data, scales, zero points and log-counts
        (`token_index` is a compress-time diagnostic, not stored). For full blocks this equals
        N x `slot_spec(...).held_bytes_per_slot` (tested), so byte accounting from a `SlotSpec`
        and from a payload agree."""
        kept = (self.k_data, self.v_data, self.k_scale, self.k_zero, self.v_scale, self.v_zero, self.log_count)
        return sum(t.numel() * t.element_size() for t in kept if t is not None)

    @property
    def num_slots(self) -> int:
        return int(self.k_data.shape[0])

    @property
    def slot_tokens(self) -> int:
        return int(self.k_data.shape[1])

    @property
    def num_kv_heads(self) -> int:
        return int(self.k_data.shape[2])

    def select(self, idx: torch.Tensor | slice | int) -> CompressedBlocks:
        """The slots `idx` (a batch of one for an int), tensors indexed along dim 0."""
        if isinstance(idx, int):
            idx = slice(idx, idx + 1)

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[idx]

        return replace(
            self,
            k_data=self.k_data[idx],
            v_data=self.v_data[idx],
            k_scale=pick(self.k_scale),
            k_zero=pick(self.k_zero),
            v_scale=pick(self.v_scale),
            v_zero=pick(self.v_zero),
            log_count=pick(self.log_count),
            token_index=pick(self.token_index),
        )


CompressedBlock = CompressedBlocks
"""A single compressed block is a batch of one (`compress_block` returns N = 1)."""


def _as_format(fmt: Format | str) -> Format:
    return Format.parse(fmt) if isinstance(fmt, str) else fmt


def use_triton(backend: str, t: torch.Tensor) -> bool:
    if backend == "auto":
        return t.is_cuda
    if backend in ("triton", "torch"):
        return backend == "triton"
    raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")


def kept_count(fmt: Format, tokens: int) -> int:
    """Tokens (or centroids) kept from a block of `tokens` (partial blocks round up)."""
    return fmt.kept_count(tokens)  # (the rule lives in `proxima.formats`)


def _check_inputs(
    fmt: Format,
    k: torch.Tensor,
    v: torch.Tensor,
    importance: torch.Tensor | None,
    protected: torch.Tensor | None,
    group_size: int,
    check_values: bool = True,
) -> None:
    if k.dim() != 4:
        raise ValueError(f"k must be [N, T, H_kv, D], got shape {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.dtype not in _FLOAT_DTYPES or v.dtype != k.dtype:
        raise ValueError(f"k and v must share a dtype in {_FLOAT_DTYPES}, got {k.dtype} and {v.dtype}")
    n, t, h, d = k.shape
    if t == 0 or h == 0 or d == 0:
        raise ValueError(f"k must have T, H_kv and D > 0, got shape {tuple(k.shape)}")
    if check_values and not bool((torch.isfinite(k) & torch.isfinite(v)).all()):
        raise ValueError(f"{fmt}: the blocks to compress hold non-finite keys or values (the source was already bad)")
    if importance is not None and importance.shape != (n, t, h):
        raise ValueError(f"token_importance must be [N, T, H_kv] = {(n, t, h)}, got {tuple(importance.shape)}")
    if check_values and importance is not None and bool(torch.isnan(importance).any()):
        raise ValueError("token_importance contains NaN")
    if protected is not None:
        if protected.shape != (n, t) or protected.dtype != torch.bool:
            raise ValueError(
                f"protected must be bool [N, T] = {(n, t)}, got {protected.dtype} {tuple(protected.shape)}"
            )
        keep = kept_count(fmt, t)
        worst = int(protected.sum(1).max()) if n else 0
        if fmt.reduction == "sparse" and worst > keep:
            raise ValueError(f"{fmt}: {worst} protected tokens in a block but only {keep} can be kept")
    if fmt.quant in LEAN_BITS and (d < 16 or d & (d - 1)):
        raise ValueError(f"{fmt}: the Hadamard rotation needs a power-of-two head_dim >= 16, got D={d}")
    if fmt.quant in ("int8", "int4", "int2"):
        if group_size <= 0 or group_size & (group_size - 1):
            raise ValueError(f"{fmt}: group_size must be a power of two, got {group_size}")
        if fmt.quant != "int8" and d % group_size:
            raise ValueError(f"{fmt}: head_dim must be a multiple of group_size={group_size}, got D={d}")


def compress_blocks(
    fmt: Format | str,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    token_importance: torch.Tensor | None = None,
    protected: torch.Tensor | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    backend: Backend = "auto",
    cluster_iters: int = DEFAULT_CLUSTER_ITERS,
    log_count: torch.Tensor | None = None,
    source_tokens: int | None = None,
    check_values: bool = True,
    rows_merged: bool | None = None,
    pinned_tokens: int = 0,
    pin_by: str = "mixed",
) -> CompressedBlocks:
    """Compress N blocks of one format.

    k, v: [N, T, H_kv, D] bf16/fp16/fp32 (T may be less than the block size: a partial block);
    token_importance: [N, T, H_kv] non-negative (None = uniform), used by sparse (top-k) and
    cluster (seeds and weights); protected: bool [N, T], tokens sparse must keep (and cluster
    seeds first). Returns a `CompressedBlocks` with C = ceil(T / R) tokens per slot.

    Recompressing a token-reduced block (see `recompressible`): k, v are its C stored rows,
    `log_count` [N, C, H_kv] their log-counts as `decompress_blocks` returns them (-inf: an
    empty centroid) and `source_tokens` the tokens the block stood for originally; the new block
    keeps ceil(source_tokens / R) rows. Centroids merge weighted by importance x count, and the
    merged count is the sum.

    Reads back to the host (a GPU sync), which a caller on a GPU's hot path turns off:
    `check_values` (NaN in `token_importance` / `log_count` raises); `rows_merged` None finds out
    from `log_count` whether its rows stand for several tokens (True: they do, a cluster source;
    False: each is one token, the count is ignored).

    `pinned_tokens` P (cluster formats; a policy's `protect.merged_tokens`): a merge keeps the P
    rows `reference.pinned_rows` picks by `pin_by` as they are, each its own centroid, and merges
    the rest into the other C - P rows: a merged block is "P exact tokens plus C - P centroids"
    in the same bytes. A recompression picks again among its rows (a pinned row still picked
    stays a singleton; a merged row picked keeps its count). Capped at C - 1 (one centroid is
    left for the rest); 0 merges every row, as before.
    """
    fmt = _as_format(fmt)
    _check_inputs(fmt, k, v, token_importance, protected, group_size, check_values)
    if pinned_tokens < 0:
        raise ValueError(f"pinned_tokens must be >= 0, got {pinned_tokens}")
    if pin_by not in ref.PIN_BY:
        raise ValueError(f"pin_by must be one of {ref.PIN_BY}, got {pin_by!r}")
    if cluster_iters < 1:
        raise ValueError(f"cluster_iters must be >= 1, got {cluster_iters}")
    tri = use_triton(backend, k)
    if tri:
        from proxima.compression import triton_ops as ops
    n, t, h, d = k.shape
    src_t = t if source_tokens is None else int(source_tokens)
    keep = kept_count(fmt, src_t)
    if src_t < t or keep > t:
        raise ValueError(f"{fmt}: keeps {keep} of source_tokens={src_t}, but {t} rows were given")
    pins = min(pinned_tokens, keep - 1) if fmt.reduction == "cluster" else 0
    counts = _row_counts(fmt, log_count if rows_merged is not False else None, (n, t, h), check_values, rows_merged)
    imp = token_importance
    if imp is None:
        # Uniform. Quantize-only formats never read it (an empty placeholder: no device launch),
        # nor do re-merges (their counts weigh the rows; `counts` stands in: not even an op).
        if counts is not None:
            imp = counts
        else:
            imp = torch.ones(n, t, h, device=k.device) if fmt.reduction is not None else torch.empty(0)
    out = CompressedBlocks(fmt, k, v, head_dim=d, dtype=k.dtype, group_size=group_size, source_tokens=src_t)

    kr, vr = k, v
    if fmt.reduction is not None and keep == t and t < src_t:
        # Already reduced that far (e.g. cluster(2) -> cluster(2)+int4): rows pass through.
        if fmt.reduction == "cluster":
            out.log_count = torch.zeros(n, t, h, device=k.device) if log_count is None else log_count.float()
    elif fmt.reduction == "cluster" and counts is not None:
        # Re-merging rows that stand for several tokens (or none): weights carry the counts, empty
        # rows (count 0) rank last, and the new counts are sums of the old (same rule both backends).
        if token_importance is None:  # uniform importance (a recompression): the counts are the weights
            w, rank_imp = counts, torch.where(counts > 0, 1.0, -1.0)
        else:
            w = imp.float().clamp_min(1e-6) * counts
            rank_imp = torch.where(counts > 0, imp.float(), -1.0)
        if tri:
            kr, vr, out.log_count = ops.cluster(
                k, v, w, protected, keep, cluster_iters, importance=rank_imp, out_dtype=k.dtype, counts=counts,
                n_pinned=pins, pin_by=pin_by,
            )
        else:
            ranks = ref.token_ranks(rank_imp, protected)
            kc, vc, out.log_count, _ = ref.cluster(
                k, v, w, ranks, keep, cluster_iters, counts=counts, n_pinned=pins, pin_by=pin_by, importance=rank_imp
            )
            kr, vr = kc.to(k.dtype), vc.to(k.dtype)
    elif fmt.reduction == "sparse":
        if tri:
            kr, vr, out.token_index = ops.sparsify(k, v, imp, protected, keep)
        else:
            ranks = ref.token_ranks(imp, protected)
            kr, vr, out.token_index = ref.sparsify(k, v, ranks, keep)
    elif fmt.reduction == "cluster":
        # Weights must be positive: a zero-weight cluster would have no weighted mean.
        w = imp.float().clamp_min(1e-6)
        if tri:
            # the kernel writes the source dtype itself (a pass over the centroids fewer)
            kr, vr, out.log_count = ops.cluster(
                k, v, w, protected, keep, cluster_iters, importance=imp, out_dtype=k.dtype,
                n_pinned=pins, pin_by=pin_by,
            )
        else:
            ranks = ref.token_ranks(imp, protected)
            kc, vc, out.log_count, _ = ref.cluster(
                k, v, w, ranks, keep, cluster_iters, n_pinned=pins, pin_by=pin_by, importance=imp
            )
            kr, vr = kc.to(k.dtype), vc.to(k.dtype)

    q = fmt.quant
    if q == "bf16":
        out.k_data, out.v_data = kr.contiguous(), vr.contiguous()
    elif q in LEAN_BITS:  # one scale per (token, head); keys rotated (spec.LEAN_BITS)
        if tri:
            out.k_data, out.k_scale, out.k_zero = ops.quantize_lean(kr, q, is_key=True)
            out.v_data, out.v_scale, _ = ops.quantize_lean(vr, q, is_key=False)
        else:
            out.k_data, out.k_scale, out.k_zero = ref.quantize_lean(kr, LEAN_BITS[q], is_key=True)
            out.v_data, out.v_scale, _ = ref.quantize_lean(vr, LEAN_BITS[q], is_key=False)
    elif tri:
        out.k_data, out.k_scale, out.k_zero = ops.quantize(kr, q, group_size, is_key=True)
        out.v_data, out.v_scale, out.v_zero = ops.quantize(vr, q, group_size, is_key=False)
    elif q == "fp8":
        out.k_data, out.k_scale = ref.quantize_per_token(kr, q)
        out.v_data, out.v_scale = ref.quantize_per_token(vr, q)
    elif q == "int8":
        out.k_data, out.k_scale, out.k_zero = ref.quantize_kivi_keys(kr, 8, group_size)
        out.v_data, out.v_scale = ref.quantize_per_token(vr, q)
    else:
        bits = ref.bits_of(q)
        out.k_data, out.k_scale, out.k_zero = ref.quantize_kivi_keys(kr, bits, group_size)
        out.v_data, out.v_scale, out.v_zero = ref.quantize_kivi_values(vr, bits, group_size)
    if check_values:
        _check_finite(fmt, out)
    return out


def _check_finite(fmt: Format, out: CompressedBlocks) -> None:
    """`check_values`: every float a slot would store is finite (a log-count may be -inf: an empty
    centroid), so a compression that would hand attention a NaN fails instead (nothing is lost:
    the block stays where it was). Reads back to the host: a debug check, never on by default."""
    fields = {"k_data": out.k_data, "v_data": out.v_data, "k_scale": out.k_scale, "k_zero": out.k_zero,
              "v_scale": out.v_scale, "v_zero": out.v_zero}
    for name, t in fields.items():
        if t is not None and t.is_floating_point() and t.numel() and not bool(torch.isfinite(t.float()).all()):
            raise ValueError(f"{fmt}: compression produced a non-finite {name}")
    lc = out.log_count
    if lc is not None and bool((torch.isnan(lc) | (lc == float("inf"))).any()):
        raise ValueError(f"{fmt}: compression produced a NaN or +inf log_count")


def _row_counts(fmt: Format, log_count: torch.Tensor | None, shape: tuple[int, int, int],
                check_values: bool = True, rows_merged: bool | None = None) -> torch.Tensor | None:
    """Tokens each input row stands for, from its log-count; None when every row is one token
    (found out from the counts unless `rows_merged` says so)."""
    if log_count is None:
        return None
    if tuple(log_count.shape) != shape:
        raise ValueError(f"log_count must be [N, T, H_kv] = {shape}, got {tuple(log_count.shape)}")
    if check_values and bool(torch.isnan(log_count).any()):
        raise ValueError("log_count contains NaN")
    # exp(-inf) is exactly 0 (an empty centroid); a log-count is never +inf, and NaN is checked
    # above when values are checked (one op, not a where over isfinite: a step runs this per group).
    counts = log_count.float().exp()
    if rows_merged is None and bool((counts.round() == 1).all()):
        return None
    if fmt.reduction != "cluster":
        raise ValueError(
            f"{fmt}: rows that stand for several tokens (centroids) can only be merged further by a cluster format"
        )
    return counts


def decompress_blocks(
    cb: CompressedBlocks, *, backend: Backend = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `compress_blocks` (up to the format's loss).

    Returns (k_hat [N, C, H_kv, D], v_hat [N, C, H_kv, D] in `cb.dtype`, log_count [N, C, H_kv]
    float32: log(count) for centroids, zeros for other formats).
    """
    n, c, h = cb.num_slots, cb.slot_tokens, cb.num_kv_heads
    dev = cb.k_data.device
    log_count = cb.log_count.float().clone() if cb.log_count is not None else torch.zeros(n, c, h, device=dev)
    q = cb.fmt.quant
    if q == "bf16":
        return cb.k_data.to(cb.dtype), cb.v_data.to(cb.dtype), log_count
    if q in LEAN_BITS:
        assert cb.k_scale is not None and cb.k_zero is not None and cb.v_scale is not None
        if use_triton(backend, cb.k_data):
            from proxima.compression import triton_ops as ops

            kh = ops.dequantize_lean(cb.k_data, cb.k_scale, cb.k_zero, q, cb.head_dim, cb.dtype)
            vh = ops.dequantize_lean(cb.v_data, cb.v_scale, None, q, cb.head_dim, cb.dtype)
            return kh, vh, log_count
        kh = ref.dequantize_lean(cb.k_data, cb.k_scale, cb.k_zero, LEAN_BITS[q])
        vh = ref.dequantize_lean(cb.v_data, cb.v_scale, None, LEAN_BITS[q])
        return kh.to(cb.dtype), vh.to(cb.dtype), log_count
    if use_triton(backend, cb.k_data):
        from proxima.compression import triton_ops as ops

        kh = ops.dequantize(cb.k_data, cb.k_scale, cb.k_zero, q, cb.group_size, cb.head_dim, True, cb.dtype)
        vh = ops.dequantize(cb.v_data, cb.v_scale, cb.v_zero, q, cb.group_size, cb.head_dim, False, cb.dtype)
        return kh, vh, log_count
    if q == "fp8":
        assert cb.k_scale is not None and cb.v_scale is not None
        kh = ref.dequantize_per_token(cb.k_data, cb.k_scale)
        vh = ref.dequantize_per_token(cb.v_data, cb.v_scale)
    elif q == "int8":
        assert cb.k_scale is not None and cb.k_zero is not None and cb.v_scale is not None
        kh = ref.dequantize_kivi_keys(cb.k_data, cb.k_scale, cb.k_zero, 8, cb.group_size)
        vh = ref.dequantize_per_token(cb.v_data, cb.v_scale)
    else:
        assert cb.k_scale is not None and cb.k_zero is not None
        assert cb.v_scale is not None and cb.v_zero is not None
        bits = ref.bits_of(q)
        kh = ref.dequantize_kivi_keys(cb.k_data, cb.k_scale, cb.k_zero, bits, cb.group_size)
        vh = ref.dequantize_kivi_values(cb.v_data, cb.v_scale, cb.v_zero, bits, cb.group_size)
    return kh.to(cb.dtype), vh.to(cb.dtype), log_count


def compress_block(
    fmt: Format | str,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    token_importance: torch.Tensor | None = None,
    protected: torch.Tensor | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    backend: Backend = "auto",
    cluster_iters: int = DEFAULT_CLUSTER_ITERS,
) -> CompressedBlock:
    """One block: k, v [T, H_kv, D]; token_importance [T, H_kv]; protected bool [T]."""
    if k.dim() != 3:
        raise ValueError(f"k must be [T, H_kv, D], got shape {tuple(k.shape)}")
    return compress_blocks(
        fmt,
        k.unsqueeze(0),
        v.unsqueeze(0),
        token_importance=None if token_importance is None else token_importance.unsqueeze(0),
        protected=None if protected is None else protected.unsqueeze(0),
        group_size=group_size,
        backend=backend,
        cluster_iters=cluster_iters,
    )

