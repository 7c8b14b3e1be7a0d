"""numba kernels of the CPU decode attention over compressed rows (`cpu_compact.py`).

One online softmax per (row, query head), carried across calls in three arrays the caller owns:
running max `m` [R, HQ], normaliser `norm` [R, HQ] and unnormalised output `acc` [R, HQ, D], all
float32. Each call adds one kind of entries to it: `attend_pages` a row's bf16 tokens in vLLM's
pages (its hot blocks and its tail, read where they lie, in the kernel's page order), and
`attend_slots` one format group's compressed slots, each stored token or centroid decoded once
and weighted by its count (`log_count` added to its logit). A task is one (row, KV head): it
decodes an entry once for all the query heads that share that KV head.

Entries are taken a block (or a slot) at a time, flash-attention style: the block's logits first,
then one rescale of the running state, then the weighted values. Queries come pre-scaled.

Decoding matches the scratch's kernels (`worker/cpu_kernels.py`) in its arithmetic up to the
final bf16 rounding, which is skipped: values go straight from their codes to float32.

Modes of a half (keys or values) of a slot group, a `Half` tuple (mode, u8 codes, u16 data,
float32 data, byte table, float32 scale, float16 scale, float16 zero, bits): BF16 (u16 data
[S, C, H, D]), LUT (u8 codes [S, C, H, D] through a 256-entry table, times a float32 scale per
token [S, C, H]), KIVI_CHANNEL (keys: packed codes, float16 scale/zero per channel of each group
of `group` tokens [S, G, H, D]), KIVI_GROUP (values: float16 scale/zero per group of `group`
channels [S, C, H, D / group]), F32 (float32 data [S, C, H, D]: slots decoded beforehand by the
torch reference, for formats these kernels do not read).

fastmath without `nnan`/`ninf`: -inf is meaningful here (an empty centroid, a fresh state).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange  # type: ignore[import-untyped]

BF16, LUT, KIVI_CHANNEL, KIVI_GROUP, F32 = 0, 1, 2, 3, 4
TOKEN_MAJOR, CHANNEL_MAJOR, SCATTERED = 0, 1, 2
_FAST = {"reassoc", "contract", "nsz", "arcp"}


@njit(cache=True, inline="always")
def _exp_nonpositive(x, n, bits):  # type: ignore[no-untyped-def]
    """x[:n] <- exp(x[:n]) for x <= 0, -inf -> 0, within 4e-6 relative: 2^k by its exponent bits
    (int32 scratch `bits`) times a degree-5 polynomial of 2^f on [0, 1). numba calls libm's exp
    one value at a time, and that was a third of a block's time (13.0 against 1.2 ns per token
    for 3 query heads, 2026-12-07); this loop vectorizes."""
    for t in range(n):
        y = max(x[t], np.float32(-87.0)) * np.float32(1.4426950408889634)
        k = np.floor(y)
        f = y - k
        p = np.float32(1.3333558e-3)
        p = p * f + np.float32(9.6181291e-3)
        p = p * f + np.float32(5.5504109e-2)
        p = p * f + np.float32(2.4022650e-1)
        p = p * f + np.float32(6.9314718e-1)
        p = p * f + np.float32(1.0)
        bits[t] = (np.int32(k) + np.int32(127)) << 23
        x[t] = p
    scale = bits.view(np.float32)
    for t in range(n):  # below 2^-125 (x < -86.6, and -inf) the weight is 0
        x[t] = x[t] * scale[t] if scale[t] > np.float32(1.2e-38) else np.float32(0.0)


@njit(cache=True, inline="always")
def _attend_block(qg, kb, vb, wb, n, s, bits, tmp, m, norm, acc):  # type: ignore[no-untyped-def]
    """Fold entries 0..n-1 into the task's state: keys kb and values vb [*, D], log-weights wb
    [*] (-inf: no entry). qg [G, D]: the task's query heads; s [G, *]: a logit buffer; bits
    int32 [*] and tmp float32 [D]: scratch; m, norm [G] and acc [G, D]: the task's running state
    (local copies). Each logit is a dot product along the channels, which numba vectorizes as a
    reduction (reassoc); the same loop along tokens over transposed keys stayed scalar, 7x slower
    (measured 2026-12-07: 65.6 against 9.6 ns per token for 3 query heads at D = 64). The values
    accumulate in `tmp`, an array of its own, so the compiler keeps it apart from `vb`."""
    groups, d = qg.shape
    for g in range(groups):
        top = m[g]
        for t in range(n):
            dot = np.float32(0.0)
            for j in range(d):
                dot += qg[g, j] * kb[t, j]
            x = wb[t] + dot
            s[g, t] = x
            top = max(top, x)
        if top == -np.inf:
            continue
        corr = np.exp(m[g] - top)  # 0 for a fresh state (m = -inf)
        m[g] = top
        row = s[g]
        for t in range(n):
            row[t] -= top
        _exp_nonpositive(row, n, bits)  # an empty entry (-inf) weighs 0
        total = norm[g] * corr
        for t in range(n):
            total += row[t]
        norm[g] = total
        for j in range(d):
            tmp[j] = acc[g, j] * corr
        for t in range(n):
            p = row[t]
            for j in range(d):
                tmp[j] += p * vb[t, j]
        for j in range(d):
            acc[g, j] = tmp[j]


@njit(cache=True, inline="always")
def _load(q, r, h0, m, norm, acc, qg, ml, ll, accl):  # type: ignore[no-untyped-def]
    """The task's query heads and running state into local buffers (`_store` writes them back)."""
    for g in range(qg.shape[0]):
        ml[g], ll[g] = m[r, h0 + g], norm[r, h0 + g]
        for j in range(qg.shape[1]):
            qg[g, j] = q[r, h0 + g, j]
            accl[g, j] = acc[r, h0 + g, j]


@njit(cache=True, inline="always")
def _store(r, h0, m, norm, acc, ml, ll, accl):  # type: ignore[no-untyped-def]
    for g in range(ml.shape[0]):
        m[r, h0 + g], norm[r, h0 + g] = ml[g], ll[g]
        for j in range(accl.shape[1]):
            acc[r, h0 + g, j] = accl[g, j]


@njit(cache=True, inline="always")
def _order(pos):  # type: ignore[no-untyped-def]
    """How a half lies in its page, from its positions pos [B, D] (element (t, j) at pos[t, j]):
    TOKEN_MAJOR or CHANNEL_MAJOR when it is one contiguous run in that order (vLLM's x86 pages:
    values token-major, keys channel-major), else SCATTERED."""
    b, d = pos.shape
    rows = cols = True
    for t in range(b):
        for j in range(d):
            rows = rows and pos[t, j] == pos[0, 0] + t * d + j
            cols = cols and pos[t, j] == pos[0, 0] + j * b + t
    return TOKEN_MAJOR if rows else CHANNEL_MAJOR if cols else SCATTERED


@njit(cache=True, inline="always")
def _page_half(page, order, pos, n, out):  # type: ignore[no-untyped-def]
    """Tokens 0..n-1 of one half (keys or values) of a bf16 page (uint16 [2BD]) -> their float32
    bit patterns in out (uint32 [*, D]). Indices are loop counters into reshaped views: an index
    computed from signed values makes numba check it for wraparound, and that kept these loops
    scalar (measured 2026-12-07: 49 against 2.2 ns per token for the values)."""
    b, d = pos.shape
    start = pos[0, 0]
    if order == TOKEN_MAJOR:
        run = page[start:start + b * d].reshape(b, d)
        for t in range(n):
            for j in range(d):
                out[t, j] = np.uint32(run[t, j]) << 16
    elif order == CHANNEL_MAJOR:
        run = page[start:start + d * b].reshape(d, b)
        for t in range(n):
            for j in range(d):
                out[t, j] = np.uint32(run[j, t]) << 16
    else:
        for t in range(n):
            for j in range(d):
                out[t, j] = np.uint32(page[np.uint64(pos[t, j])]) << 16


@njit(parallel=True, fastmath=_FAST, cache=True)
def attend_pages(q, pages, key_pos, value_pos, blk_ptr, blk_ids, blk_len, m, norm, acc):  # type: ignore[no-untyped-def]
    """bf16 tokens in pages: pages uint16 [NB, H, 2BD] (vLLM's cache, its kernel's page order);
    key_pos / value_pos int64 [B * D]: page position of element (t, j) at t * D + j. Row r reads
    blocks blk_ids[blk_ptr[r]:blk_ptr[r + 1]], the first blk_len[i] tokens of each. A half
    stored as one contiguous run (token- or channel-major: vLLM's x86 pages) is read as such; any
    other order through its positions (`_order`, `_page_half`)."""
    rows, hq, d = q.shape
    heads = pages.shape[1]
    groups = hq // heads
    b = key_pos.shape[0] // d
    kpos, vpos = key_pos.reshape(b, d), value_pos.reshape(b, d)
    key_order, value_order = _order(kpos), _order(vpos)
    for task in prange(rows * heads):
        r, h = task // heads, task % heads
        kb = np.empty((b, d), np.float32)
        vb = np.empty((b, d), np.float32)
        kw, vw = kb.view(np.uint32), vb.view(np.uint32)
        wb = np.zeros(b, np.float32)
        s = np.empty((groups, b), np.float32)
        bits, tmp = np.empty(b, np.int32), np.empty(d, np.float32)
        qg, accl = np.empty((groups, d), np.float32), np.empty((groups, d), np.float32)
        ml, ll = np.empty(groups, np.float32), np.empty(groups, np.float32)
        _load(q, r, h * groups, m, norm, acc, qg, ml, ll, accl)
        for i in range(blk_ptr[r], blk_ptr[r + 1]):
            blk, n = blk_ids[i], blk_len[i]
            page = pages[blk, h]
            _page_half(page, key_order, kpos, n, kw)
            _page_half(page, value_order, vpos, n, vw)
            _attend_block(qg, kb, vb, wb, n, s, bits, tmp, ml, ll, accl)
        _store(r, h * groups, m, norm, acc, ml, ll, accl)


@njit(cache=True, inline="always")
def _unpack_into(packed, r, c, h, bits, out, t):  # type: ignore[no-untyped-def]
    """Codes of packed[r, c, h] (packed along D, little end first) -> float32 out[t, :]."""
    src, row = packed[r, c, h], out[t]
    if bits == 8:
        for j in range(row.shape[0]):
            row[j] = np.float32(src[j])
    elif bits == 4:
        pairs = row.reshape(-1, 2)
        for i in range(src.shape[0]):
            x = np.uint32(src[i])
            pairs[i, 0] = np.float32(x & 15)
            pairs[i, 1] = np.float32(x >> 4)
    else:
        quads = row.reshape(-1, 4)
        for i in range(src.shape[0]):
            x = np.uint32(src[i])
            for k in range(4):
                quads[i, k] = np.float32((x >> (2 * k)) & 3)


@njit(cache=True, inline="always")
def _decode(half, r, c, h, group, half_lut, out, t, meta):  # type: ignore[no-untyped-def]
    """Entry c of slot row r, head h, of one half (see the module's modes) -> float32 out[t, :].
    Entries of a slot come in order (c = 0, 1, ...): KIVI_CHANNEL decodes its group's scales and
    zeros into `meta` float32 [2, D] at the group's first entry only (a table lookup per channel
    and entry was most of a merged block's decode)."""
    mode, u8, u16, f32, lut, s32, s16, z16, bits = half
    d = out.shape[1]
    row = out[t]
    if mode == BF16:
        w, src16 = row.view(np.uint32), u16[r, c, h]
        for j in range(d):
            w[j] = np.uint32(src16[j]) << 16
    elif mode == LUT:
        sc, src8 = s32[r, c, h], u8[r, c, h]
        for j in range(d):
            row[j] = lut[src8[j]] * sc
    elif mode == KIVI_CHANNEL:
        _unpack_into(u8, r, c, h, bits, out, t)
        if c % group == 0:
            sc16, ze16 = s16[r, c // group, h], z16[r, c // group, h]
            for j in range(d):
                meta[0, j], meta[1, j] = half_lut[sc16[j]], half_lut[ze16[j]]
        for j in range(d):
            row[j] = row[j] * meta[0, j] + meta[1, j]
    elif mode == KIVI_GROUP:
        _unpack_into(u8, r, c, h, bits, out, t)
        sc16, ze16 = s16[r, c, h], z16[r, c, h]
        chunks = row.reshape(-1, group)
        for gi in range(chunks.shape[0]):
            sc, ze = half_lut[sc16[gi]], half_lut[ze16[gi]]
            for k in range(group):
                chunks[gi, k] = chunks[gi, k] * sc + ze
    else:
        src32 = f32[r, c, h]
        for j in range(d):
            row[j] = src32[j]


@njit(parallel=True, fastmath=_FAST, cache=True)
def attend_slots(q, heads, rows, slot_ptr, entries, log_count, kh, vh, group, half_lut, m, norm, acc):  # type: ignore[no-untyped-def]
    """One format group: row r reads slots n in slot_ptr[r]:slot_ptr[r + 1] (pool rows rows[n]),
    `entries` tokens or centroids each; log_count float32 [S, C, H] (cluster slots) or empty.
    kh / vh: the halves' `Half` tuples."""
    n_rows, hq, d = q.shape
    groups = hq // heads
    counted = log_count.shape[0] > 0
    for task in prange(n_rows * heads):
        r, h = task // heads, task % heads
        kb = np.empty((entries, d), np.float32)
        vb = np.empty((entries, d), np.float32)
        wb = np.zeros(entries, np.float32)
        s = np.empty((groups, entries), np.float32)
        bits, tmp = np.empty(entries, np.int32), np.empty(d, np.float32)
        kmeta, vmeta = np.empty((2, d), np.float32), np.empty((2, d), np.float32)
        qg, accl = np.empty((groups, d), np.float32), np.empty((groups, d), np.float32)
        ml, ll = np.empty(groups, np.float32), np.empty(groups, np.float32)
        _load(q, r, h * groups, m, norm, acc, qg, ml, ll, accl)
        for n in range(slot_ptr[r], slot_ptr[r + 1]):
            row = rows[n]
            for c in range(entries):
                if counted:
                    wb[c] = log_count[row, c, h]
                _decode(kh, row, c, h, group, half_lut, kb, c, kmeta)
                _decode(vh, row, c, h, group, half_lut, vb, c, vmeta)
            _attend_block(qg, kb, vb, wb, entries, s, bits, tmp, ml, ll, accl)
        _store(r, h * groups, m, norm, acc, ml, ll, accl)
