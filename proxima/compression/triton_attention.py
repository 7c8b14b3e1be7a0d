"""Triton split-K decode attention over one segment (one format) of paged slots.

One program handles (sequence, KV head, split): all G query heads of the KV head at once (the
GQA group padded to 16 rows so `tl.dot` runs on the tensor cores) and a contiguous range of the
sequence's entries, `EPT` entries (slots) per iteration. With one entry per iteration (every
shipped configuration at slot capacity 64; at vLLM's block 16 a 64-token tile holds 4) the slot
id is a scalar load and every address is a scalar base plus a loop-invariant row offset; with
several, each row's slot id and valid-token count are loaded as vectors the software pipeliner
prefetches together with the data tiles that depend on them. A padding entry's slot id is read as
0. KIVI key scales are loaded once per group of `RS` tokens and broadcast.

Dequantization happens in registers and never goes through an int -> float conversion
instruction (a unit at an eighth of the FMA rate on the H200): int4 / int2 codes become float16
through the hardware e4m3 -> f16 convert, int8 codes by the f16 magic number, fp8 by the e4m3
convert. With `planes` (the shipped int4 / int2 configs) a tile is unpacked into PER channel
planes (plane i: channels PER j + i, `_nibble_planes_f16`, `_crumb_planes_f16`), elementwise in
the loaded bytes, each contracted by its own dot (q, the key scales and the output are split /
interleaved per plane once, in registers); `unpack_asm` does the unpacking by inline PTX four
bytes at a time, which Triton's byte-wise code needed 3-4 instructions per code for.
Compressed formats multiply in f16, the hot path in bf16. Per-token scales (fp8 keys and values,
int8 values) are not applied per code: a key scale multiplies the score column, a value scale the
probability column before P @ V, or, with `scale_values` (fp8's shipped config), the value rows.

The launch configuration (tokens per iteration, warps, pipeline stages) is per format
(`DECODE_CONFIGS`, chosen by `bench/kernels.py --sweep` on the H200), and the split count follows
the compiled kernel's occupancy (`choose_splits`). Outputs per split: normalised output and
log-sum-exp; per entry: the log-sum-exp of its logits, from which `attention.decode_attention`
derives the entry's attention mass after the merge.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from proxima.compression.segment import KVSegment
from proxima.compression.spec import QUANT_CODE, VALUES_PER_BYTE
from proxima.compression.triton_ops import INTERPRET, _p2

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
LN2_C = tl.constexpr(LN2)
LOG2E_C = tl.constexpr(LOG2E)


@triton.jit
def _small_codes_f16(b, PER: tl.constexpr):
    """uint8 [..., P] packed int4 / int2 codes -> float16 code * 2^-9 [..., P * PER], channel order.

    A code below 16 placed alone in a byte *is* the float8 e4m3 encoding of code * 2^-9 (e4m3's
    subnormals and first binade are linear: bits 0..15 encode 0..15 * 2^-9), so each byte of codes
    becomes float16 by the hardware e4m3 -> f16 convert, two codes per instruction; no integer to
    float conversion is needed. `tl.join` adds an in-thread axis, so a byte's codes stay in the
    thread that loaded it and the reshape to channel order (byte j holds channels j*PER ..
    j*PER+PER-1, lowest bits first) moves no data.
    """
    if PER == 2:
        lo, hi = _nibble_planes_f16(b, False)
        return tl.reshape(tl.join(lo, hi), *b.shape[:-1], b.shape[-1] * 2)
    else:
        c0, c1, c2, c3 = _crumb_planes_f16(b, False)
        # join(join(c0, c2), join(c1, c3))[..., i, o] = c[2 * i + o]: flattening gives channel order
        return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), *b.shape[:-1], b.shape[-1] * 4)


_PLANES_PTX = tl.constexpr(
    "{\n.reg .b32 l, h;\n.reg .b16 l0, l1, h0, h1;\n"
    "and.b32 l, $4, 0x0F0F0F0F;\nshr.u32 h, $4, 4;\nand.b32 h, h, 0x0F0F0F0F;\n"
    "mov.b32 {l0, l1}, l;\nmov.b32 {h0, h1}, h;\n"
    "cvt.rn.f16x2.e4m3x2 $0, l0;\ncvt.rn.f16x2.e4m3x2 $1, l1;\n"
    "cvt.rn.f16x2.e4m3x2 $2, h0;\ncvt.rn.f16x2.e4m3x2 $3, h1;\n}"
)
"""Four bytes of packed int4 codes ($4) -> their low nibbles ($0, $1) and high nibbles ($2, $3) as
f16 code * 2^-9, two per register in byte order: one mask, one shift and mask, four e4m3 -> f16x2
converts for 8 codes (see `_small_codes_f16` for why a nibble alone in a byte is its e4m3 code)."""

_CRUMB_PLANES_PTX = tl.constexpr(
    "{\n.reg .b32 c;\n.reg .b16 c0, c1;\n"
    + "".join(
        (f"shr.u32 c, $8, {2 * i};\nand.b32 c, c, 0x03030303;\n" if i else "and.b32 c, $8, 0x03030303;\n")
        + f"mov.b32 {{c0, c1}}, c;\ncvt.rn.f16x2.e4m3x2 ${2 * i}, c0;\ncvt.rn.f16x2.e4m3x2 ${2 * i + 1}, c1;\n"
        for i in range(4)  # bits 2i, 2i+1 of each byte -> plane i ($2i, $2i+1)
    )
    + "}"
)
"""Four bytes of packed int2 codes ($8) -> their four planes (bits 2i..2i+1 of every byte, $2i and
$2i+1) as f16 code * 2^-9: a shift and a mask, then two e4m3 -> f16x2 converts per plane."""


@triton.jit
def _nibble_planes_f16(b, ASM: tl.constexpr):
    """uint8 [..., P] packed int4 codes -> (plane 0, plane 1), float16 code * 2^-9 [..., P] each:
    plane i holds channels 2j + i (byte j's low nibble, then its high nibble). No join, no
    reshape: each plane is elementwise in the loaded bytes, so it stays in the registers and the
    layout the load gave it, and a decode contracts each plane with its own part of the query
    channels (`PLANES` in `_decode_kernel`)."""
    if ASM:  # four bytes per instruction group, packed f16 pairs out: no byte extracts
        lo, hi = tl.inline_asm_elementwise(
            _PLANES_PTX, "=r,=r,=r,=r,r", [b], dtype=(tl.float16, tl.float16), is_pure=True, pack=4
        )
    else:  # the interpreter runs no PTX (and the compiled variant without it, for the sweep)
        lo = (b & 15).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        hi = (b >> 4).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return lo, hi


@triton.jit
def _crumb_planes_f16(b, ASM: tl.constexpr):
    """uint8 [..., P] packed int2 codes -> four planes, float16 code * 2^-9 [..., P] each: plane i
    holds channels 4j + i (`_nibble_planes_f16` for int4)."""
    if ASM:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            _CRUMB_PLANES_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [b], dtype=(tl.float16,) * 4, is_pure=True, pack=4
        )
    else:
        c0 = (b & 3).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        c1 = ((b >> 2) & 3).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        c2 = ((b >> 4) & 3).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        c3 = (b >> 6).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return c0, c1, c2, c3


@triton.jit
def _planes4(x, R: tl.constexpr, J: tl.constexpr):
    """[R, 4J] -> its four channel planes [R, J] (plane i: columns 4j + i), in registers."""
    even, odd = tl.split(tl.reshape(x, (R, J, 2, 2)))  # last axis: bit 0 of the column
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _dequant_plane(c, sc, zp, N: tl.constexpr, NG: tl.constexpr, W: tl.constexpr):
    """A value plane [N, NG * W] of codes -> codes * scale + zero, per token and group of W plane
    columns (sc, zp [N, NG], already in the plane's units)."""
    c = tl.reshape(c, (N, NG, W))
    return tl.reshape(c * sc[:, :, None] + zp[:, :, None], (N, NG * W))


def _bytes_ptx(signed: bool) -> str:
    """Four bytes ($2) -> four exact f16 ($0, $1, two per register in byte order): a byte permute
    puts each byte into the low mantissa byte of 1024.0 (0x64XX is 1024 + XX), one packed
    subtraction removes the 1024 (signed bytes are first offset by 128 with an xor, and 1152 is
    subtracted). 2-2.5 instructions per 2 codes, no convert."""
    src, magic = ("w", "0x64806480") if signed else ("$2", "0x64006400")
    return (
        "{\n.reg .b32 w, t, m;\n"
        + ("xor.b32 w, $2, 0x80808080;\n" if signed else "")
        + f"mov.b32 m, {magic};\n"
        + f"prmt.b32 t, {src}, 0x64646464, 0x4140;\nsub.f16x2 $0, t, m;\n"
        + f"prmt.b32 t, {src}, 0x64646464, 0x4342;\nsub.f16x2 $1, t, m;\n}}"
    )


_BYTES_PTX = tl.constexpr(_bytes_ptx(False))
_SBYTES_PTX = tl.constexpr(_bytes_ptx(True))


@triton.jit
def _codes_f16(b, SIGNED: tl.constexpr, ASM: tl.constexpr):
    """uint8 codes (SIGNED: int8 codes stored as bytes) -> exact float16, elementwise (same shape
    and layout). ASM: by PTX four bytes at a time (`_bytes_ptx`); else `_bytes_f16`."""
    if ASM:
        if SIGNED:
            return tl.inline_asm_elementwise(_SBYTES_PTX, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
        return tl.inline_asm_elementwise(_BYTES_PTX, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
    return _bytes_f16(b, 128 if SIGNED else 0)


@triton.jit
def _bytes_f16(b, OFFSET: tl.constexpr):
    """uint8 / int8 codes -> exact float16 (code + OFFSET must lie in [0, 1024)) without an integer
    to float conversion: OR code + OFFSET into the mantissa of 1024.0 (bits 0x6400), subtract
    1024 + OFFSET."""
    x = (b.to(tl.int16) + OFFSET) & 0x3FF
    return (x | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + OFFSET)


@triton.jit
def _decode_kernel(
    q_ptr,
    sq_s,
    sq_h,  # [S, Hq, D] queries (D contiguous)
    k_ptr,
    sk_slot,
    sk_t,
    sk_h,  # key pool [slots, C, H, P] (P contiguous); fp8 pools are passed as uint8
    v_ptr,
    sv_slot,
    sv_t,
    sv_h,  # value pool, same shape
    ks_ptr,
    kz_ptr,
    sks_slot,
    sks_t,
    sks_h,  # key scale / zero (see CompressedBlocks)
    vs_ptr,
    vz_ptr,
    svs_slot,
    svs_t,
    svs_h,  # value scale / zero
    lc_ptr,
    slc_slot,
    slc_t,
    slc_h,  # log(count) [slots, C, H] (cluster only)
    tab_ptr,
    ntok_ptr,  # [S, E] int32 slot ids and valid tokens per entry (contiguous)
    o_ptr,
    lse_ptr,  # [SPLITS, S, Hq, D] and [SPLITS, S, Hq] float32 partial results
    ent_ptr,  # [S, E, Hq] float32 per-entry log-sum-exp (natural log)
    S,
    E,
    Hq,
    E_PER_SPLIT,  # entries per split, a multiple of EPT
    sm_scale_log2,
    QUANT: tl.constexpr,  # spec.QUANT_CODE: 0 bf16, 1 fp8, 2 int8, 3 int4, 4 int2
    HAS_COUNT: tl.constexpr,
    GROUP: tl.constexpr,
    PER: tl.constexpr,  # codes per byte (1 for bf16 / fp8 / int8)
    G: tl.constexpr,  # query heads per KV head
    G_PAD: tl.constexpr,  # G padded to >= 16 (tl.dot's minimum)
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= D
    C: tl.constexpr,  # slot capacity (tokens), a power of two
    EPT: tl.constexpr,  # entries per iteration
    RS: tl.constexpr,  # tokens per row group: min(GROUP, C) for KIVI keys, else C
    DOT_F32: tl.constexpr,  # interpreter only: its 16-bit tl.dot is wrong (Triton 3.9), so dot in f32
    SCALE_V: tl.constexpr,  # fp8 / int8: per-token value scales on the value rows, not on P
    PLANES: tl.constexpr,  # int4 / int2: PER channel planes, PER key dots per tile (`_nibble_planes_f16`)
    UNPACK_ASM: tl.constexpr,  # int8; int4 / int2 with PLANES: unpack by PTX (compiled only): 1 keys, 2 + values
):
    """Dot dtypes: the hot path multiplies bf16 as cached. Compressed formats dequantize to
    float16 (codes are small integers or e4m3, exact in f16; scales are stored f16) and use f16
    tensor-core dots: q is scaled by a power of two into [-1, 1] first, so f16's range is never
    at stake. int4 / int2 tiles carry a factor 2^-9 (see `_small_codes_f16`), removed from the
    scores and the output in float32."""
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    BLOCK_N: tl.constexpr = EPT * C
    NR: tl.constexpr = BLOCK_N // RS  # row groups per tile (KIVI key scales)
    RPE: tl.constexpr = C // RS  # row groups per entry
    BP: tl.constexpr = BLOCK_D // PER  # stored elements per row, padded to a power of two
    P: tl.constexpr = D // PER
    SMALL: tl.constexpr = QUANT >= 3  # e4m3-unpacked int4 / int2: tiles hold code * 2^-9
    # PLANES (int4 / int2, see `_uses_planes`): channel plane i = channels PER j + i; q, the key
    # scales and the output are loaded / stored contiguously and split into planes / interleaved
    # back in registers; each tile is contracted plane by plane
    PL: tl.constexpr = PER if PLANES else 1
    og = tl.arange(0, G_PAD)
    od = tl.arange(0, BLOCK_D)
    mg = og < G
    md = od < D
    qh = h * G + og  # query heads of this KV head
    q = tl.load(q_ptr + seq * sq_s + qh[:, None] * sq_h + od[None, :], mask=mg[:, None] & md[None, :], other=0.0)
    q1 = q  # planes 1-3 of q (PLANES only)
    q2 = q
    q3 = q
    if PLANES:
        if PER == 2:
            q, q1 = tl.split(tl.reshape(q, (G_PAD, BP, 2)))
        else:
            q, q1, q2, q3 = _planes4(q, G_PAD, BP)
    score_scale = sm_scale_log2
    if SMALL:
        score_scale = score_scale * 512.0
    if DOT_F32:
        q = q.to(tl.float32)
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)
        q3 = q3.to(tl.float32)
        dot_t: tl.constexpr = tl.float32
    elif QUANT == 0:
        dot_t: tl.constexpr = q_ptr.dtype.element_ty  # type: ignore[no-redef]  # constexpr branches
    else:
        # q / 2^ceil(log2 max|q|) lies in [-1, 1]: exact in f16 down to 2^-14 of the largest element
        qmax = tl.max(tl.max(tl.abs(q.to(tl.float32)), axis=1), axis=0)
        if PLANES:
            qmax = tl.maximum(qmax, tl.max(tl.max(tl.abs(q1.to(tl.float32)), axis=1), axis=0))
            if PER == 4:
                qmax = tl.maximum(qmax, tl.max(tl.max(tl.abs(q2.to(tl.float32)), axis=1), axis=0))
                qmax = tl.maximum(qmax, tl.max(tl.max(tl.abs(q3.to(tl.float32)), axis=1), axis=0))
        qn = tl.where(qmax > 0, tl.math.exp2(tl.math.ceil(tl.math.log2(tl.maximum(qmax, 1e-30)))), 1.0)
        q = (q.to(tl.float32) * (1.0 / qn)).to(tl.float16)
        if PLANES:
            q1 = (q1.to(tl.float32) * (1.0 / qn)).to(tl.float16)
            q2 = (q2.to(tl.float32) * (1.0 / qn)).to(tl.float16)
            q3 = (q3.to(tl.float32) * (1.0 / qn)).to(tl.float16)
        score_scale = score_scale * qn
        dot_t: tl.constexpr = tl.float16  # type: ignore[no-redef]
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, BLOCK_D // PL), tl.float32)
    acc1 = tl.zeros((G_PAD, BLOCK_D // PL), tl.float32)  # planes 1-3 (PLANES only)
    acc2 = tl.zeros((G_PAD, BLOCK_D // PL), tl.float32)
    acc3 = tl.zeros((G_PAD, BLOCK_D // PL), tl.float32)
    e_begin = split * E_PER_SPLIT
    e_end = tl.minimum(e_begin + E_PER_SPLIT, E)
    orr = tl.arange(0, NR)
    op = tl.arange(0, BP)
    t0 = (orr % RPE) * RS  # first token of each row group within its slot
    col_entry = tl.arange(0, BLOCK_N) // C  # tile entry of each row / score column
    tn = tl.arange(0, BLOCK_N) % C  # token of each row within its slot
    oe = tl.arange(0, EPT)
    # loop-invariant parts of every per-row offset (the token within its slot, the KV head)
    k_row = tn * sk_t + h * sk_h
    v_row = tn * sv_t + h * sv_h
    ks_row = tn * sks_t + h * sks_h
    vs_row = tn * svs_t + h * svs_h
    lc_row = tn * slc_t + h * slc_h
    for e0 in range(e_begin, e_end, EPT):
        # ---- per-row metadata: the slot id and valid-token count of each row's entry.
        if EPT == 1:
            # one entry per tile: its slot id is a scalar, so every address below is a scalar base
            # plus a loop-invariant row offset (no per-row 64-bit multiply); e0 < e_end here
            nt_n = tl.load(ntok_ptr + seq * E + e0)
            # a padding entry's slot id is ignored (segment.py): slot 0, so no address is computed
            # from it (the KIVI key scales below are read unmasked by token)
            slot_n = tl.where(nt_n > 0, tl.load(tab_ptr + seq * E + e0), 0).to(tl.int64)
            valid_n = tn < nt_n
        else:
            # EPT distinct values per tile, loaded per row (the repeats hit L1); the software
            # pipeliner prefetches these and the data tiles that depend on them
            en = e0 + col_entry
            men = en < e_end
            nt_n = tl.load(ntok_ptr + seq * E + en, mask=men, other=0)
            slot_n = tl.where(nt_n > 0, tl.load(tab_ptr + seq * E + en, mask=men, other=0), 0).to(tl.int64)
            valid_n = men & (tn < nt_n)
        if P == BP:  # noqa: SIM108 - constexpr branch: Triton compiles one side
            m2 = valid_n[:, None]
        else:
            m2 = valid_n[:, None] & (op < P)[None, :]
        k_ptrs = k_ptr + (slot_n * sk_slot + k_row)[:, None] + op[None, :]
        v_ptrs = v_ptr + (slot_n * sv_slot + v_row)[:, None] + op[None, :]
        # ---- keys -> scores [G_PAD, BLOCK_N] in log2 units
        if QUANT == 0:
            k = tl.trans(tl.load(k_ptrs, mask=m2, other=0.0).to(dot_t))
        elif QUANT == 1:  # fp8 e4m3 is exact in f16; the per-token scale goes on the score column
            k = tl.trans(tl.load(k_ptrs, mask=m2, other=0).to(tl.float8e4nv, bitcast=True).to(dot_t))
        else:  # KIVI keys: per channel, one scale / zero row per row group of RS tokens
            if PLANES:
                if PER == 2:
                    kc, kc1 = _nibble_planes_f16(tl.load(k_ptrs, mask=m2, other=0), UNPACK_ASM >= 1)
                    kc2 = kc
                    kc3 = kc
                else:
                    kc, kc1, kc2, kc3 = _crumb_planes_f16(tl.load(k_ptrs, mask=m2, other=0), UNPACK_ASM >= 1)
                kc = tl.reshape(kc, (NR, RS, BP))
                kc1 = tl.reshape(kc1, (NR, RS, BP))
                kc2 = tl.reshape(kc2, (NR, RS, BP))
                kc3 = tl.reshape(kc3, (NR, RS, BP))
            elif SMALL:
                kc = _small_codes_f16(tl.load(k_ptrs, mask=m2, other=0), PER)
            else:
                kc = _codes_f16(tl.load(k_ptrs, mask=m2, other=0), False, UNPACK_ASM >= 1)
            if not PLANES:
                kc = tl.reshape(kc, (NR, RS, BLOCK_D))
            if EPT == 1:
                g_off = slot_n * sks_slot + ((t0 // GROUP) * sks_t + h * sks_h)[:, None] + od[None, :]
                gm = (orr >= 0)[:, None] & md[None, :]
            else:
                er = e0 + orr // RPE
                mr = er < e_end
                nt_r = tl.load(ntok_ptr + seq * E + er, mask=mr, other=0)
                slot_r = tl.where(nt_r > 0, tl.load(tab_ptr + seq * E + er, mask=mr, other=0), 0).to(tl.int64)
                g_off = slot_r[:, None] * sks_slot + (t0 // GROUP)[:, None] * sks_t + h * sks_h + od[None, :]
                gm = mr[:, None] & md[None, :]
            sc = tl.load(ks_ptr + g_off, mask=gm, other=0.0)
            zp = tl.load(kz_ptr + g_off, mask=gm, other=0.0)
            if SMALL:
                zp = zp * 0.001953125  # 2^-9, exact
            if PLANES:  # contiguous loads (the pipeliner prefetches them), split into planes in registers
                if PER == 2:
                    sc, sc1 = tl.split(tl.reshape(sc, (NR, BP, 2)))
                    zp, zp1 = tl.split(tl.reshape(zp, (NR, BP, 2)))
                    sc2, sc3, zp2, zp3 = sc, sc, zp, zp
                else:
                    sc, sc1, sc2, sc3 = _planes4(sc, NR, BP)
                    zp, zp1, zp2, zp3 = _planes4(zp, NR, BP)
            k = tl.reshape(kc.to(dot_t) * sc.to(dot_t)[:, None, :] + zp.to(dot_t)[:, None, :], (BLOCK_N, BLOCK_D // PL))
            k = tl.trans(k)
            if PLANES:  # the other planes
                k1 = kc1.to(dot_t) * sc1.to(dot_t)[:, None, :] + zp1.to(dot_t)[:, None, :]
                k1 = tl.trans(tl.reshape(k1, (BLOCK_N, BP)))
                if PER == 4:
                    k2 = kc2.to(dot_t) * sc2.to(dot_t)[:, None, :] + zp2.to(dot_t)[:, None, :]
                    k2 = tl.trans(tl.reshape(k2, (BLOCK_N, BP)))
                    k3 = kc3.to(dot_t) * sc3.to(dot_t)[:, None, :] + zp3.to(dot_t)[:, None, :]
                    k3 = tl.trans(tl.reshape(k3, (BLOCK_N, BP)))
        s = tl.dot(q, k)  # k is [BLOCK_D // PL, BLOCK_N]
        if PLANES:  # the other planes' partial scores add up
            s = tl.dot(q1, k1, s)
            if PER == 4:
                s = tl.dot(q3, k3, tl.dot(q2, k2, s))
        if QUANT == 1:
            ks = tl.load(ks_ptr + slot_n * sks_slot + ks_row, mask=valid_n, other=0.0)
            s = s * (ks * score_scale)[None, :]
        else:
            s = s * score_scale
        if HAS_COUNT:
            lc = tl.load(lc_ptr + slot_n * slc_slot + lc_row, mask=valid_n, other=0.0)
            s = s + lc[None, :] * LOG2E_C
        s = tl.where(valid_n[None, :], s, float("-inf"))
        # ---- online softmax
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        p_sum = tl.sum(p, axis=1)
        l_i = l_i * alpha + p_sum
        m_i = m_new
        # ---- values
        if QUANT == 0:
            v = tl.load(v_ptrs, mask=m2, other=0.0).to(dot_t)
        elif QUANT == 1:
            v = tl.load(v_ptrs, mask=m2, other=0).to(tl.float8e4nv, bitcast=True).to(dot_t)
        elif QUANT == 2:  # int8 values: symmetric codes in [-127, 127], exact in f16
            v = _codes_f16(tl.load(v_ptrs, mask=m2, other=0), True, UNPACK_ASM >= 2).to(dot_t)
        else:  # int4 / int2 values: scale and zero per (token, GROUP channels)
            NG: tl.constexpr = BLOCK_D // GROUP
            ogr = tl.arange(0, NG)
            vg_off = (slot_n * svs_slot + vs_row)[:, None] + ogr[None, :]
            vgm = valid_n[:, None] & (ogr < D // GROUP)[None, :]
            vsc = tl.load(vs_ptr + vg_off, mask=vgm, other=0.0).to(dot_t)
            vzp = tl.load(vz_ptr + vg_off, mask=vgm, other=0.0).to(dot_t)
            if PLANES:
                # plane column j is channel PER j + i: its value group is j // (GROUP / PER) in all
                vb = tl.load(v_ptrs, mask=m2, other=0)
                vzp = vzp * 0.001953125
                # Each plane gets its own dot and accumulator (`acc`, `acc1`..): joining the planes
                # back into channel order before one dot measured slower on the H200 (int4 315 vs
                # 274 us at 32k x 8, 2026-12-02), although it has fewer instructions.
                if PER == 2:
                    v, v1 = _nibble_planes_f16(vb, UNPACK_ASM >= 2)
                    v2, v3 = v, v
                else:
                    v, v1, v2, v3 = _crumb_planes_f16(vb, UNPACK_ASM >= 2)
                v = _dequant_plane(v, vsc, vzp, BLOCK_N, NG, GROUP // PER)
                v1 = _dequant_plane(v1, vsc, vzp, BLOCK_N, NG, GROUP // PER)
                if PER == 4:
                    v2 = _dequant_plane(v2, vsc, vzp, BLOCK_N, NG, GROUP // PER)
                    v3 = _dequant_plane(v3, vsc, vzp, BLOCK_N, NG, GROUP // PER)
            else:
                vc = tl.reshape(_small_codes_f16(tl.load(v_ptrs, mask=m2, other=0), PER), (BLOCK_N, NG, GROUP))
                if SMALL:
                    vzp = vzp * 0.001953125  # 2^-9, exact
                v = vc.to(dot_t) * vsc[:, :, None] + vzp[:, :, None]
            if not PLANES:
                v = tl.reshape(v, (BLOCK_N, BLOCK_D))
        if QUANT == 1 or QUANT == 2:
            # per-token value scale relative to the tile's largest (so f16 operands stay in range);
            # the dot is scaled back in f32
            vs = tl.load(vs_ptr + slot_n * svs_slot + vs_row, mask=valid_n, other=0.0)
            vmax = tl.maximum(tl.max(vs, axis=0), 1e-30)
            if SCALE_V:
                # on the value rows (one f16 multiply per code); this also keeps the compiler from
                # reading the 8-bit tile from shared memory byte by byte in the dot-operand layout
                # (compile-only: no byte loads, fp8 / int8 at 244 / 188 registers instead of 255)
                pv = tl.dot(p.to(dot_t), v * (vs * (1.0 / vmax)).to(dot_t)[:, None]) * vmax
            else:  # on the probability column (int8's default: the faster of the two on the H200)
                pv = tl.dot((p * (vs * (1.0 / vmax))[None, :]).to(dot_t), v) * vmax
        else:
            pv = tl.dot(p.to(dot_t), v)
        acc = acc * alpha[:, None] + pv
        if PLANES:
            acc1 = acc1 * alpha[:, None] + tl.dot(p.to(dot_t), v1)
            if PER == 4:
                acc2 = acc2 * alpha[:, None] + tl.dot(p.to(dot_t), v2)
                acc3 = acc3 * alpha[:, None] + tl.dot(p.to(dot_t), v3)
        # ---- per-entry log-sum-exp, for the block attention mass
        if EPT == 1:
            pe = p_sum[:, None]  # [G_PAD, 1]
        else:
            pe = tl.zeros((G_PAD, EPT), tl.float32)
            for j in tl.static_range(EPT):
                pj = tl.sum(tl.where((col_entry == j)[None, :], p, 0.0), axis=1)
                pe = tl.where((oe == j)[None, :], pj[:, None], pe)
        ent = tl.where(pe > 0, (tl.math.log2(tl.maximum(pe, 1e-30)) + m_use[:, None]) * LN2_C, float("-inf"))
        me = mg[:, None] & (e0 + oe < e_end)[None, :]
        tl.store(ent_ptr + (seq * E + e0 + oe[None, :]) * Hq + qh[:, None], ent, mask=me)
    has = l_i > 0
    out_scale = 512.0 if SMALL else 1.0
    inv_l = (out_scale / tl.where(has, l_i, 1.0))[:, None]
    o = acc * inv_l
    if PLANES:  # the planes interleave back into channel order
        if PER == 2:
            o = tl.reshape(tl.join(o, acc1 * inv_l), (G_PAD, BLOCK_D))
        else:
            o = tl.reshape(tl.join(tl.join(o, acc2 * inv_l), tl.join(acc1 * inv_l, acc3 * inv_l)), (G_PAD, BLOCK_D))
    lse = tl.where(has, (m_i + tl.math.log2(tl.where(has, l_i, 1.0))) * LN2_C, float("-inf"))
    row = (split * S + seq) * Hq + qh
    tl.store(o_ptr + row[:, None] * D + od[None, :], o, mask=mg[:, None] & md[None, :])
    tl.store(lse_ptr + row, lse, mask=mg)


# ============================================================================================
# launch configuration


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of `_decode_kernel` for one format."""

    tokens: int
    """Tokens per iteration (EPT = tokens / slot capacity entries, at least one entry)."""
    num_warps: int
    num_stages: int
    scale_values: bool = False
    """fp8 / int8: apply per-token value scales to the value rows instead of the probabilities
    (fewer instructions and registers when compiled; fp8 ships with it, the H200 sweep's fastest)."""
    planes: bool = False
    """int4 / int2 with a power-of-two head dim: unpack each tile into PER channel planes (plane i:
    channels PER j + i, `_nibble_planes_f16` / `_crumb_planes_f16`), one key dot and one value dot
    with its own accumulator per plane, with no join or reshape of the codes."""
    unpack_asm: int = 0
    """Unpack by inline PTX, four bytes at a time, the keys (1) or the keys and the values (2):
    int4 / int2 with `planes`, and int8 (no planes needed: its codes are whole bytes). Compiled
    kernels only (the interpreter runs the same arithmetic in plain ops)."""
    max_registers: int | None = None
    """Register cap per thread passed to ptxas (`maxnreg`; None: the compiler's choice). A lower cap
    fits more programs per SM (65,536 registers: 4 programs of 4 warps at <= 128) at the price of
    spills; chosen by the sweep."""

    @property
    def variant(self) -> str:
        """The fields beyond tokens / warps / stages that differ from the defaults, e.g.
        'planes, unpack_asm=2, max_registers=128' ('' for none): a label for benchmark tables."""
        out = []
        for f in dataclasses.fields(self):
            if f.name in ("tokens", "num_warps", "num_stages"):
                continue
            v = getattr(self, f.name)
            if v != f.default:
                out.append(f.name if v is True else f"{f.name}={v}")
        return ", ".join(out)


DECODE_CONFIGS: dict[str, DecodeConfig] = {
    "bf16": DecodeConfig(64, 4, 2),
    "fp8": DecodeConfig(64, 2, 2, scale_values=True),
    "int8": DecodeConfig(64, 2, 2, unpack_asm=2),
    "int4": DecodeConfig(64, 2, 3, planes=True, unpack_asm=2),
    "int2": DecodeConfig(64, 2, 2, planes=True, unpack_asm=2),
}
"""Per quantization, from `bench/kernels.py --sweep` on the H200 at 32k x 8 (us, each against the
previous shipped config in the same run). 2026-12-04: the compressed formats moved to 2 warps
with no register cap: int4 269.9 -> 232.1 (2 warps at 2 stages 235.6; 2 warps capped at 168 / 128
registers 299.3 / 540.4, spills; 1 warp 499.4), int2 296.3 -> 241.4, int8 314.3 -> 260.0 (PTX
unpacking of the values too; keys only 295.5), fp8 276.9 -> 264.5; bf16 247.1 at 4 warps, 246.7 at
2. Two warps of 255 registers fit 4 programs (8 warps) per SM, as 4 warps at 128 did, but each
warp holds twice the tile in registers with no spills, and the softmax reductions cross 2 warps
instead of 4. Earlier (2026-12-02, 4 warps): int4 344.4 before channel planes, 274.0 with them,
269.2 with the 128 cap; int2 364.1 before planes; int8 318.5 without PTX unpacking. At vLLM's
block 16 (`bench/paged_decode.py`, half the blocks compressed, CUDA-graph medians, 2026-12-04) the
new configs are faster as well: int4 313 vs 342 us, int8 300 vs 378, int2 318 vs 353, fp8 291 vs 314."""

_SPEC_KEYS = {"tokens": "tokens", "warps": "num_warps", "stages": "num_stages", "maxnreg": "max_registers"}


def parse_decode_spec(spec: str) -> tuple[str, DecodeConfig]:
    """`FMT[:key=integer...]` -> (format, its shipped `DecodeConfig` with those fields changed), e.g.
    `int4:planes=1:unpack_asm=2:maxnreg=128`; keys: tokens, warps, stages, maxnreg and the boolean /
    integer fields of `DecodeConfig` by name; maxnreg=0 means no register cap. For the benchmarks'
    command lines."""
    fmt, *kvs = spec.split(":")
    if fmt not in DECODE_CONFIGS:
        raise ValueError(f"{spec!r}: unknown format {fmt!r} (one of {', '.join(DECODE_CONFIGS)})")
    fields = dict(DECODE_CONFIGS[fmt].__dict__)
    for kv in kvs:
        key, _, val = kv.partition("=")
        name = _SPEC_KEYS.get(key, key)
        if name not in fields or not val.isdigit():
            keys = ", ".join(sorted(set(_SPEC_KEYS) | set(fields) - set(_SPEC_KEYS.values())))
            raise ValueError(f"{spec!r}: {kv!r} is not key=integer with key in {keys}")
        fields[name] = bool(int(val)) if isinstance(fields[name], bool) else int(val)
    if not fields["max_registers"]:
        fields["max_registers"] = None  # maxnreg=0: no cap
    if fields["unpack_asm"] not in (0, 1, 2):
        raise ValueError(f"{spec!r}: unpack_asm must be 0, 1 or 2, got {fields['unpack_asm']}")
    return fmt, DecodeConfig(**fields)


KERNEL_INFO: dict[tuple, dict[str, int]] = {}
"""Registers, spills, shared memory and programs per SM of each compiled decode specialization
(filled on the GPU after a specialization's first launch; read by bench/kernels.py)."""
_OCCUPANCY: dict[tuple, int] = {}
"""Programs per SM of each compiled specialization, read from the compiled kernel after its
first launch (registers, shared memory, warps); the split count is planned from it."""
_DEFAULT_OCCUPANCY = 2


def _occupancy_of(kernel, num_warps: int, device: torch.device) -> int:  # type: ignore[no-untyped-def]
    """Resident programs per SM for a compiled Triton kernel (0 if unknown, e.g. interpreter)."""
    n_regs = getattr(kernel, "n_regs", None)
    if kernel is None or n_regs is None:
        return 0
    props = torch.cuda.get_device_properties(device)
    threads = 32 * num_warps
    # registers are allocated per warp in units of 256
    regs_per_warp = -(-max(int(n_regs), 1) * 32 // 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * num_warps)
    by_threads = props.max_threads_per_multi_processor // threads
    smem = int(kernel.metadata.shared) + 1024  # the driver reserves 1 KiB per block
    by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // smem if smem else 32
    return max(1, min(by_regs, by_threads, by_smem, 32))


def _launch_key(seg: KVSegment, q: torch.Tensor, cfg: DecodeConfig) -> tuple:
    st = seg.store
    return (st.fmt.quant, st.slot_tokens, q.shape[-1], q.shape[1] // st.num_kv_heads, st.log_count is not None, cfg)


@functools.lru_cache(maxsize=4096)
def choose_splits(programs_per_split: int, tiles: int, slots: int) -> int:
    """Split count minimising the modelled time waves x (tiles per program + 2): a program that
    waits for a second wave costs a whole program's time, and a program's fixed cost (queries in,
    partials out) is about two tiles. Ties go to fewer splits (less merging).

    Only split counts that just fill a whole number of waves (up to 8) can be optimal, so only
    those are scored: a few dozen candidates, cached, since the CUDA backend asks once per
    segment, layer and step.
    """
    cands = {1, max(1, tiles)}
    for waves in range(1, 9):
        full = waves * slots // max(1, programs_per_split)
        cands.update(x for x in (full, full + 1) if 1 <= x <= max(1, tiles))
    best, best_t = 1, None
    for sp in sorted(cands):
        waves = -(-(programs_per_split * sp) // slots)
        cost = waves * (-(-tiles // sp) + 2)
        if best_t is None or cost < best_t:
            best, best_t = sp, cost
    return best


def _entries_per_it(seg: KVSegment, cfg: DecodeConfig) -> int:
    return max(1, cfg.tokens // seg.store.slot_tokens)


def plan_splits(q: torch.Tensor, seg: KVSegment, num_splits: int | None) -> int:
    if num_splits:
        return num_splits
    cfg = DECODE_CONFIGS[seg.store.fmt.quant]
    ept = _entries_per_it(seg, cfg)
    tiles = -(-max(int(seg.slot_table.shape[1]), 1) // ept)
    if q.device.type != "cuda":
        return max(1, min(4, tiles))
    occ = _OCCUPANCY.get(_launch_key(seg, q, cfg), _DEFAULT_OCCUPANCY)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return choose_splits(q.shape[0] * seg.store.num_kv_heads, tiles, sms * occ)


def _uses_planes(cfg: DecodeConfig, quant: str, head_dim: int, group_size: int) -> bool:
    """Whether a launch takes the channel-plane path: int4 / int2 with `planes`, a power-of-two
    head dim whose planes are at least 16 channels wide (`tl.dot`'s smallest K on the tensor
    cores), and value groups that split evenly over the planes."""
    per = VALUES_PER_BYTE.get(quant, 0)
    return cfg.planes and per > 0 and _p2(head_dim, 16) == head_dim and head_dim // per >= 16 and group_size % per == 0


def _strides3(t: torch.Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if t is None else tuple(t.stride()[:3])  # type: ignore[return-value]


def segment_partial(
    q: torch.Tensor, seg: KVSegment, sm_scale: float, splits: int, o: torch.Tensor, lse: torch.Tensor
) -> torch.Tensor:
    """Fill o [SPLITS, S, Hq, D] f32 and lse [SPLITS, S, Hq] f32 (contiguous) with one segment's
    partial attention; returns entry_lse [S, E, Hq] f32."""
    st = seg.store
    s, hq, d = q.shape
    h, c = st.num_kv_heads, st.slot_tokens
    e = seg.slot_table.shape[1]
    if o.shape != (splits, s, hq, d) or not o.is_contiguous() or not lse.is_contiguous():
        raise ValueError(f"o must be contiguous [{splits}, {s}, {hq}, {d}], got {tuple(o.shape)}")
    if c & (c - 1):
        raise ValueError(f"{st.fmt}: the Triton decode kernel needs a power-of-two slot capacity, got {c}")
    if d < 32:  # int4 at head_dim 16 computed wrong attention compiled on the H200 (cause not found)
        raise ValueError(f"{st.fmt}: the Triton decode kernel needs head_dim >= 32, got {d}")
    for name, t in (("k_data", st.k_data), ("v_data", st.v_data), ("q", q)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    quant = st.fmt.quant
    cfg = DECODE_CONFIGS[quant]
    ept = _entries_per_it(seg, cfg)
    # whole iterations per split, so an iteration's entries never straddle a split boundary
    e_per_split = triton.cdiv(triton.cdiv(max(e, 1), splits), ept) * ept
    dev = q.device
    # every entry lies in exactly one split's range and is written there: no fill needed
    ent = torch.empty((s, e, hq), device=dev, dtype=torch.float32)
    tab = seg.slot_table.to(device=dev, dtype=torch.int32).contiguous()
    ntok = seg.slot_tokens.to(device=dev, dtype=torch.int32).contiguous()
    per = VALUES_PER_BYTE.get(quant, 1)
    g = hq // h
    kivi = quant in ("int8", "int4", "int2")
    k_data, v_data = st.k_data, st.v_data
    if quant == "fp8":  # loaded as bytes (a masked fp8 load has no `other`), bitcast in the kernel
        k_data, v_data = k_data.view(torch.uint8), v_data.view(torch.uint8)
    dummy = st.k_data
    lc = st.log_count
    kernel = _decode_kernel[(s, h, splits)](
        q, *q.stride()[:2],
        k_data, *k_data.stride()[:3],
        v_data, *v_data.stride()[:3],
        st.k_scale if st.k_scale is not None else dummy, st.k_zero if st.k_zero is not None else dummy,
        *_strides3(st.k_scale),
        st.v_scale if st.v_scale is not None else dummy, st.v_zero if st.v_zero is not None else dummy,
        *_strides3(st.v_scale),
        lc if lc is not None else dummy, *_strides3(lc),
        tab, ntok, o, lse, ent,
        s, e, hq, e_per_split, sm_scale * LOG2E,
        QUANT=QUANT_CODE[quant], HAS_COUNT=lc is not None, GROUP=st.group_size,
        PER=per, G=g, G_PAD=_p2(g, 16), D=d, BLOCK_D=_p2(d, 16), C=c, EPT=ept,
        RS=min(st.group_size, c) if kivi else c, DOT_F32=INTERPRET, SCALE_V=cfg.scale_values,
        PLANES=_uses_planes(cfg, quant, d, st.group_size),
        UNPACK_ASM=0 if INTERPRET else cfg.unpack_asm,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.max_registers} if cfg.max_registers and not INTERPRET else {}),
    )  # fmt: skip
    key = _launch_key(seg, q, cfg)
    if dev.type == "cuda" and key not in _OCCUPANCY:
        occ = _occupancy_of(kernel, cfg.num_warps, dev)
        if occ:
            _OCCUPANCY[key] = occ
            KERNEL_INFO[key] = {
                "regs": int(kernel.n_regs), "spills": int(kernel.n_spills),
                "smem": int(kernel.metadata.shared), "occupancy": occ,
            }  # fmt: skip
    return ent


@triton.jit
def _merge_kernel(
    o_ptr,  # [P, S*Hq, D] float32 partial outputs (each normalised over its part)
    lse_ptr,  # [P, S*Hq] float32 partial log-sum-exp (-inf: the part saw nothing)
    out_ptr,  # [S*Hq, D] output, q's dtype
    lse_out_ptr,  # [S*Hq] float32
    P,
    ROWS,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    od = tl.arange(0, BLOCK_D)
    md = od < D
    m = tl.full((), float("-inf"), tl.float32)
    tot = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for p0 in range(0, P, BLOCK_P):
        op = p0 + tl.arange(0, BLOCK_P)
        mp = op < P
        lp = tl.load(lse_ptr + op * ROWS + row, mask=mp, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lp, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp(lp - m_use)
        alpha = tl.exp(m - m_use)
        o = tl.load(o_ptr + (op[:, None] * ROWS + row) * D + od[None, :], mask=mp[:, None] & md[None, :], other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        tot = tot * alpha + tl.sum(w, axis=0)
        m = m_new
    has = tot > 0
    res = acc / tl.where(has, tot, 1.0)
    tl.store(out_ptr + row * D + od, res.to(out_ptr.dtype.element_ty), mask=md)
    lse = tl.where(has, tl.where(m == float("-inf"), 0.0, m) + tl.log(tl.where(has, tot, 1.0)), float("-inf"))
    tl.store(lse_out_ptr + row, lse)


def merge(o: torch.Tensor, lse: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch merging P partials: o [P, S, Hq, D], lse [P, S, Hq] -> ([S, Hq, D], [S, Hq])."""
    p, s, hq, d = o.shape
    out = torch.empty(s, hq, d, device=o.device, dtype=out_dtype)
    lse_out = torch.empty(s, hq, device=o.device, dtype=torch.float32)
    _merge_kernel[(s * hq,)](o, lse, out, lse_out, p, s * hq, D=d, BLOCK_D=_p2(d, 16), BLOCK_P=32)
    return out, lse_out
