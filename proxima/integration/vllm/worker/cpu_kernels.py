"""Fused numba kernels that decompress slots straight into the bf16 scratch KV (vLLM CPU path).

Why: the scratch (`scratch.py`) is refilled for every layer of every decode step. The torch
reference does it in many passes (gather the slot bytes, unpack, broadcast scales, dequantize
in float32, round to bf16, expand centroids, scatter into the scratch), each materializing a
full-size temporary; on CPU that was 20-40x a plain copy of the same blocks (360 ms per layer
for int4 at SmolLM2 geometry, ~10 s per decode step).

What is fused: per output row (slot n, output token t, head h) a kernel reads the packed codes
of the slot's source token `src[n, t, h]` from the pool, the row's scales/zeros, dequantizes in
float32 with exactly the reference's operations and order (`code * scale + zero`, no FMA: numba
does not contract without fastmath), rounds to bf16 (round-to-nearest-even, as torch does) and
writes the 16-bit pattern at scratch position `dst[n, t]`, at the page position a table `pos`
gives: the CPU kernel's own order for whole blocks (keys channel-major on x86 without AMX), so
they need no reordering pass afterwards, or the canonical order for token-level parts. So the
result is bit-identical to `decompress_blocks(backend="torch")` followed by the scratch copy.
The token mapping covers the three layouts: aligned (t -> t in the target block), sparse (kept token t -> its packed
position), cluster (position t -> the centroid whose cumulative count first exceeds t).

Keys and values are separate calls (they have different quantization schemes); each writes
its own half of the scratch. numba has no bf16 nor float16: the scratch is passed as a uint16
view, float16 side tables as uint16 decoded through a 65536-entry table (exact). Kernels read the
pools and side tables in place through `rows` (slot n is pool row rows[n]): on a loaded CPU
every extra multi-threaded torch op (a gather, a float cast) costs a scheduling round (~8 ms).
"""

from __future__ import annotations

import numba  # type: ignore[import-untyped]
import numpy as np
from numba import njit, prange  # type: ignore[import-untyped]

# vLLM's CPU attention kernel checks that it runs with the OpenMP thread count its scheduler
# metadata was built for; numba's OpenMP layer changes that count. The workqueue layer leaves
# OpenMP alone (the worker calls these kernels from one thread, which is all workqueue needs).
numba.config.THREADING_LAYER = "workqueue"

HALF_TO_FLOAT = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
"""float32 value of every float16 bit pattern (the exact widening torch's `.float()` does).
A constant: read-only, so no caller can change what the kernels read."""
HALF_TO_FLOAT.flags.writeable = False


@njit(cache=True, inline="always")
def _store_bf16(row: np.ndarray, out: np.ndarray, pos: np.ndarray, blk: int, h: int, half: int, tok: int) -> None:
    """float32 bit patterns (uint32 view of a row) -> bf16 bit patterns of token `tok`'s key
    (half 0) or value (half 1) in page out[blk, h], at the page positions `pos` gives the
    canonical index (half * B + tok) * D + j (the kernel's layout, or the identity), rounding to
    nearest even. Helpers take whole arrays and indices: a sub-array view in the inner loop costs
    reference counting per row (that doubled the kernel time)."""
    base = (half * (out.shape[2] // (2 * row.shape[0])) + tok) * row.shape[0]
    for j in range(row.shape[0]):
        x = np.int64(row[j])
        out[blk, h, pos[base + j]] = np.uint16((x + 0x7FFF + ((x >> 16) & 1)) >> 16)


@njit(cache=True, inline="always")
def _source(src: np.ndarray, n: int, t: int, h: int) -> int:
    """Slot token written at output token t: src[n, t, h], or t itself when src is empty (no cluster)."""
    return src[n, t, h] if src.shape[0] else t


@njit(parallel=True, cache=True)
def centroid_of_position(log_count, rows, b):  # type: ignore[no-untyped-def]
    """Cluster slots: [N, b, H] centroid at each of b positions, each centroid repeated by its count.

    log_count float32 [S, C, H] (the side table). Position t takes the number of centroids whose
    cumulative count is <= t (clamped to C - 1): what `scratch.expand_centroids` computes.
    """
    n_slots, c_max, heads = rows.shape[0], log_count.shape[1], log_count.shape[2]
    out = np.empty((n_slots, b, heads), np.int64)
    for n in prange(n_slots):
        r = rows[n]
        for h in range(heads):
            c, cum = 0, 0
            for t in range(b):
                while c < c_max:  # advance past every centroid whose members all sit before t
                    step = cum + np.int64(np.round(np.exp(log_count[r, c, h])))
                    if step > t:
                        break
                    cum, c = step, c + 1
                out[n, t, h] = min(c, c_max - 1)
    return out


@njit(parallel=True, cache=True)
def copy_bf16(data, rows, src, dst, half, out, pos):  # type: ignore[no-untyped-def]
    """bf16 slots (unquantized sparse / cluster): data uint16 [S, C, H, D] -> pages out uint16
    [B', H, 2bD] at positions `pos` (see `_store_bf16`)."""
    n_slots, t_out = dst.shape
    heads, d = data.shape[2], data.shape[3]
    b = out.shape[2] // (2 * d)
    for n in prange(n_slots):
        r = rows[n]
        for t in range(t_out):
            blk, tok = dst[n, t] // b, dst[n, t] % b
            base = (half * b + tok) * d
            for h in range(heads):
                c = _source(src, n, t, h)
                for j in range(d):
                    out[blk, h, pos[base + j]] = data[r, c, h, j]


@njit(parallel=True, cache=True)
def dequant_per_token(codes, rows, lut, scale, src, dst, half, out, pos):  # type: ignore[no-untyped-def]
    """fp8 keys/values and int8 values: `lut[code] * scale[r, c, h]`.

    codes uint8 [S, C, H, D] (the pool); lut float32 [256]: the exact float of each byte (fp8 e4m3
    or int8); scale float32 [S, C, H] (the side table).
    """
    n_slots, t_out = dst.shape
    heads, d = codes.shape[2], codes.shape[3]
    b = out.shape[2] // (2 * d)
    for n in prange(n_slots):
        buf = np.empty(d, np.float32)
        bits = buf.view(np.uint32)
        r = rows[n]
        for t in range(t_out):
            blk, tok = dst[n, t] // b, dst[n, t] % b
            for h in range(heads):
                c = _source(src, n, t, h)
                s = scale[r, c, h]
                for j in range(d):
                    buf[j] = lut[codes[r, c, h, j]] * s
                _store_bf16(bits, out, pos, blk, h, half, tok)


@njit(cache=True, inline="always")
def _unpack(packed: np.ndarray, r: int, c: int, h: int, bits: int, buf: np.ndarray) -> None:
    """The codes of packed[r, c, h] (packed along D, little end first) -> float32 in `buf` [D]."""
    if bits == 8:
        for j in range(buf.shape[0]):
            buf[j] = np.float32(packed[r, c, h, j])
    elif bits == 4:
        for q in range(packed.shape[3]):
            x = np.int64(packed[r, c, h, q])
            buf[2 * q] = np.float32(x & 15)
            buf[2 * q + 1] = np.float32(x >> 4)
    else:
        for q in range(packed.shape[3]):
            x = np.int64(packed[r, c, h, q])
            for i in range(4):
                buf[4 * q + i] = np.float32((x >> (2 * i)) & 3)


@njit(cache=True, inline="always")
def _decode_half(table: np.ndarray, r: int, m: int, h: int, half_lut: np.ndarray, out: np.ndarray,
                 repeat: int) -> None:
    """float16 bit patterns table[r, m, h, :] -> float32, each repeated `repeat` times (a value
    group's channels)."""
    for g in range(table.shape[3]):
        x = half_lut[table[r, m, h, g]]
        for i in range(repeat):
            out[g * repeat + i] = x


@njit(parallel=True, cache=True)
def dequant_kivi(packed, rows, scale, zero, half_lut, bits, group, per_channel, src, dst, half, out,  # type: ignore[no-untyped-def]
                 pos):
    """KIVI codes (int8/int4/int2): `code * scale + zero` in float32, as the reference.

    scale/zero: float16 side tables as uint16, decoded by `half_lut`. per_channel (keys):
    [S, Gk, H, D], token c uses key group c // group. Otherwise (int4/int2 values):
    [S, C, H, D / group], channel j uses j // group.
    """
    n_slots, t_out = dst.shape
    heads, d = packed.shape[2], packed.shape[3] * 8 // bits  # bytes per token and head -> channels
    b = out.shape[2] // (2 * d)
    for n in prange(n_slots):
        buf, sc, ze = np.empty(d, np.float32), np.empty(d, np.float32), np.empty(d, np.float32)
        word = buf.view(np.uint32)
        r = rows[n]
        for h in range(heads):
            row_of_meta = -1  # the side-table row decoded into sc/ze (keys: one per token group)
            for t in range(t_out):
                c = _source(src, n, t, h)
                m = c // group if per_channel else c
                if m != row_of_meta:
                    rep = 1 if per_channel else group
                    _decode_half(scale, r, m, h, half_lut, sc, rep)
                    _decode_half(zero, r, m, h, half_lut, ze, rep)
                    row_of_meta = m
                _unpack(packed, r, c, h, bits, buf)
                for j in range(d):
                    buf[j] = buf[j] * sc[j] + ze[j]
                blk, tok = dst[n, t] // b, dst[n, t] % b
                _store_bf16(word, out, pos, blk, h, half, tok)


@njit(parallel=True, cache=True)
def permute_pages(pages, blocks, pos):  # type: ignore[no-untyped-def]
    """In place, for each page of `blocks`: element i moves to page position pos[i].

    pages uint16 [N, H, P] (a scratch's pages); pos int64 [P], a permutation. What
    `PageLayout.to_kernel` does with torch (gather, scatter, copy back: ~10x slower), one page
    at a time through a private buffer."""
    heads, p = pages.shape[1], pages.shape[2]
    for i in prange(blocks.shape[0]):
        buf = np.empty(p, np.uint16)
        blk = blocks[i]
        for h in range(heads):
            for j in range(p):
                buf[j] = pages[blk, h, j]
            for j in range(p):
                pages[blk, h, pos[j]] = buf[j]
