"""A worker step's (source, target) group over every layer in one launch per stage (issue 37).

The worker compresses the actions of a step grouped by (source, target) format, over every KV
layer at once. These kernels read the sources and write the results where they live, addressed
from the step's one uploaded action table (`common._step_slot`: long [A, 3], source page, source
slot row, destination slot row) and the layers' strides, so no torch gather, cast or scatter
runs around them:

- `quantize_step`: keys and values of every (layer, action) block into the destination slots
  and their side-table rows, one launch (keys and values are a grid axis). The source is the
  blocks' KV pages, in the attention kernel's page order (`worker.page_layout` positions), or a
  contiguous [R * A, T, H, D] batch (a dequantized or merged one).
- `dequantize_step`: the source slots of every (layer, action) into a contiguous batch, keys,
  values and (a merge of centroids) the slots' log-counts, one launch.

Their arithmetic is the batch kernels' own (`_quant_*_tile`, `_dequant_*_tile`: the same code,
other addresses), so a slot written here holds the bytes `compress_blocks` + a scatter write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from proxima.compression.kernels.common import INTERPRET, ROW_TILE, STEP_TABLE, STEP_VARYING, _kivi, _p2, _step_slot
from proxima.compression.kernels.dequantize import _dequant_keys_tile, _dequant_rows_tile
from proxima.compression.kernels.quantize import KEY_ROWS, KEY_TILE_W, _quant_keys_tile, _quant_rows_tile
from proxima.compression.spec import FP8_E4M3_MAX, INT8_MAX, QUANT_CODE, VALUES_PER_BYTE

STEP_QUANTS = ("fp8", "int8", "int4", "int2")
"""Quantizations the step kernels read and write (the lean ones and bf16 take the batch path)."""

@triton.jit(do_not_specialize=STEP_VARYING, do_not_specialize_on_alignment=STEP_TABLE)
def _quant_step_kernel(
    xk_ptr, xv_ptr,  # source keys / values: the KV pages (PAGES) or [N, T, H, D] contiguous
    kpos_ptr, vpos_ptr,  # PAGES: page position of canonical element t * D + d, keys / values
    x_layer, x_block, HS,  # PAGES: element strides of a layer, a block and a head's page
    dk_ptr, dv_ptr, d_layer, d_slot,  # destination codes: slot pools [L, S, T, H, P], strides
    ks_ptr, kz_ptr, km_layer, km_slot,  # key scale / zero side tables and their strides
    vs_ptr, vz_ptr, vm_layer, vm_slot,  # value scale / zero side tables
    tbl_ptr, rows_ptr, A, T, H,
    NKC,  # key channel blocks (KIVI keys)
    NK, NV,  # key / value programs per block
    PAGES: tl.constexpr, HAS_ROWS: tl.constexpr, K_KIVI: tl.constexpr, QK: tl.constexpr, QV: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr, GROUP: tl.constexpr,
    RT: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, QMAX_K: tl.constexpr, QMAX_V: tl.constexpr,
    EVEN: tl.constexpr,
    HW_CVT: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)  # block: layer-major over (layer, action)
    p = tl.program_id(1)
    if PAGES:
        layer, blk = _step_slot(tbl_ptr, rows_ptr, n, A, 0, HAS_ROWS)
        x_base = layer * x_layer + blk * x_block
    else:
        x_base = n * T * H * D
    layer, dst = _step_slot(tbl_ptr, rows_ptr, n, A, 2, HAS_ROWS)
    d_base = layer * d_layer + dst * d_slot
    if tl.program_id(2) == 0:
        mk = layer * km_layer + dst * km_slot
        if K_KIVI:
            if p < NK:
                _quant_keys_tile(xk_ptr, x_base, kpos_ptr, HS, dk_ptr, d_base, ks_ptr, kz_ptr, mk, p // NKC, p % NKC, T,
                                 PAGES, D, H * D, BLOCK_W, GROUP, RT, BITS, PER, EVEN, HW_CVT)
        elif p < NV:  # fp8 keys: per token, as values
            _quant_rows_tile(xk_ptr, x_base, kpos_ptr, HS, dk_ptr, d_base, ks_ptr, ks_ptr, mk,
                             p * ROWS + tl.arange(0, ROWS), T * H, H, PAGES, QK, D, BLOCK_D, ROWS, GROUP, BITS, PER,
                             QMAX_K, HW_CVT)
    elif p < NV:
        mv = layer * vm_layer + dst * vm_slot
        _quant_rows_tile(xv_ptr, x_base, vpos_ptr, HS, dv_ptr, d_base, vs_ptr, vz_ptr, mv,
                         p * ROWS + tl.arange(0, ROWS), T * H, H, PAGES, QV, D, BLOCK_D, ROWS, GROUP, BITS, PER,
                         QMAX_V, HW_CVT)


@triton.jit(do_not_specialize=STEP_VARYING, do_not_specialize_on_alignment=STEP_TABLE)
def _dequant_step_kernel(
    dk_ptr, dv_ptr, d_layer, d_slot,  # source codes: slot pools [L, S, T, H, P], strides
    ks_ptr, kz_ptr, km_layer, km_slot,  # key scale / zero side tables
    vs_ptr, vz_ptr, vm_layer, vm_slot,  # value scale / zero side tables
    lc_ptr, lc_layer, lc_slot,  # LC: the source slots' log-counts [L, S, T, H]
    ok_ptr, ov_ptr, olc_ptr,  # outputs [N, T, H, D] keys / values, [N, T, H] float32 log-counts
    tbl_ptr, rows_ptr, A, T, H,
    NKC, NK, NV,
    HAS_ROWS: tl.constexpr, K_KIVI: tl.constexpr, QK: tl.constexpr, QV: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
    PER: tl.constexpr, LC: tl.constexpr, BLOCK_L: tl.constexpr, HW_CVT: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    part = tl.program_id(2)  # 0 keys, 1 values, 2 log-counts (LC)
    layer, src = _step_slot(tbl_ptr, rows_ptr, n, A, 1, HAS_ROWS)
    d_base = layer * d_layer + src * d_slot
    o_base = n * T * H * D
    if part == 0:
        mk = layer * km_layer + src * km_slot
        if K_KIVI:
            if p < NK:
                _dequant_keys_tile(dk_ptr, d_base, ks_ptr, kz_ptr, mk, ok_ptr, o_base, p // NKC, p % NKC, T,
                                   H * D, BLOCK_W, GROUP, BITS, PER, HW_CVT)
        elif p < NV:
            _dequant_rows_tile(dk_ptr, d_base, ks_ptr, ks_ptr, mk, ok_ptr, o_base, p * ROWS + tl.arange(0, ROWS),
                               T * H, QK, D, BLOCK_D, ROWS, GROUP, BITS, PER, HW_CVT)
    elif part == 1:
        if p < NV:
            mv = layer * vm_layer + src * vm_slot
            _dequant_rows_tile(dv_ptr, d_base, vs_ptr, vz_ptr, mv, ov_ptr, o_base, p * ROWS + tl.arange(0, ROWS),
                               T * H, QV, D, BLOCK_D, ROWS, GROUP, BITS, PER, HW_CVT)
    elif LC and p == 0:  # a slot's T * H log-counts, copied
        oi = tl.arange(0, BLOCK_L)
        mi = oi < T * H
        lc = tl.load(lc_ptr + layer * lc_layer + src * lc_slot + oi, mask=mi, other=0.0)
        tl.store(olc_ptr + n * T * H + oi, lc, mask=mi)


def _tiles(quant: str, t: int, h: int, d: int, group: int, key_w: int) -> tuple[int, int, int, int, int, bool]:
    """(block_d, rows, block_w, key channel blocks, key programs, value programs) of one block,
    as the batch kernels tile it (`kernels.quantize.quantize`, `kernels.dequantize.dequantize`)."""
    block_d = _p2(d, 16)
    rows = max(1, min(_p2(t * h), ROW_TILE // block_d))
    nv = triton.cdiv(t * h, rows)
    kivi = _kivi(quant, True)
    block_w = min(_p2(h * d, 16), key_w)
    nkc = triton.cdiv(h * d, block_w)
    nk = triton.cdiv(t, group) * nkc if kivi else nv
    return block_d, rows, block_w, nkc, nk, nv


def _strides(t: torch.Tensor) -> tuple[int, int]:
    return t.stride(0), t.stride(1)


def quantize_step(
    quant: str, group: int, table: torch.Tensor, rows: torch.Tensor | None, n_layers: int,
    k_dst: torch.Tensor, v_dst: torch.Tensor, meta: dict[str, torch.Tensor],
    *, pages: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    k: torch.Tensor | None = None, v: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Quantize the group's blocks of `n_layers` layers into the destination slots (table column 2).

    k_dst, v_dst: [L, S, T, H, P] slot pools in the stored element types; `meta` the format's side
    tables [L, S, ...] (`SlotPool.meta`). The source: `pages` = (kv [L, N, H, B, 2D], key_pos,
    value_pos [B * D] on the device) read at table column 0, or `k`, `v` [n_layers * A, T, H, D]
    contiguous, layer-major. `rows`: the group's stack rows, None for every layer in order."""
    a = table.shape[0]
    if pages is not None:
        kv, kpos, vpos = pages
        _, _, h, t, d2 = kv.shape
        d = d2 // 2
        xk = xv = kv
        x_layer, x_block, hs = kv.stride(0), kv.stride(1), kv.stride(2)
    else:
        assert k is not None and v is not None
        _, t, h, d = k.shape
        xk, xv, kpos, vpos = k, v, k, k
        x_layer = x_block = hs = 0
    n = n_layers * a
    if n == 0:
        return
    per = VALUES_PER_BYTE.get(quant, 1)
    block_d, nrows, block_w, nkc, nk, nv = _tiles(quant, t, h, d, group, KEY_TILE_W)
    ks = meta["k_scale"]
    kz = meta.get("k_zero", ks)
    vs = meta["v_scale"]
    vz = meta.get("v_zero", vs)
    _quant_step_kernel[(n, max(nk, nv), 2)](
        xk, xv, kpos, vpos, x_layer, x_block, hs,
        k_dst, v_dst, *_strides(k_dst), ks, kz, *_strides(ks), vs, vz, *_strides(vs),
        table, rows if rows is not None else table, a, t, h, nkc, nk, nv,
        PAGES=pages is not None, HAS_ROWS=rows is not None, K_KIVI=_kivi(quant, True),
        QK=QUANT_CODE[quant], QV=QUANT_CODE[quant], D=d, BLOCK_D=block_d, ROWS=nrows, BLOCK_W=block_w,
        GROUP=group, RT=min(KEY_ROWS, group), BITS=8 // per, PER=per,
        QMAX_K=FP8_E4M3_MAX, QMAX_V=FP8_E4M3_MAX if quant == "fp8" else INT8_MAX,
        EVEN=t % group == 0 and (h * d) % block_w == 0,
        HW_CVT=not INTERPRET, num_warps=4,
    )  # fmt: skip


def dequantize_step(
    quant: str, group: int, table: torch.Tensor, rows: torch.Tensor | None, n_layers: int,
    k_src: torch.Tensor, v_src: torch.Tensor, meta: dict[str, torch.Tensor], head_dim: int, out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The group's source slots (table column 1) of `n_layers` layers, layer-major: k, v
    [n_layers * A, T, H, D] in out_dtype and, when the slots have log-counts (`meta`), those
    [n_layers * A, T, H] float32 (a copy); else None. Arguments as `quantize_step`'s."""
    a = table.shape[0]
    _, _, t, h, _ = k_src.shape
    d = head_dim
    n = n_layers * a
    ok = torch.empty(n, t, h, d, device=k_src.device, dtype=out_dtype)
    ov = torch.empty_like(ok)
    lc_src = meta.get("log_count")
    olc = torch.empty(n, t, h, device=k_src.device, dtype=torch.float32) if lc_src is not None else None
    if n == 0:
        return ok, ov, olc
    per = VALUES_PER_BYTE.get(quant, 1)
    block_d, nrows, block_w, nkc, nk, nv = _tiles(quant, t, h, d, group, max(16, ROW_TILE // group))
    ks = meta["k_scale"]
    kz = meta.get("k_zero", ks)
    vs = meta["v_scale"]
    vz = meta.get("v_zero", vs)
    lc = lc_src if lc_src is not None else ks
    _dequant_step_kernel[(n, max(nk, nv), 3 if lc_src is not None else 2)](
        k_src, v_src, *_strides(k_src), ks, kz, *_strides(ks), vs, vz, *_strides(vs), lc, *_strides(lc),
        ok, ov, olc if olc is not None else ok,
        table, rows if rows is not None else table, a, t, h, nkc, nk, nv,
        HAS_ROWS=rows is not None, K_KIVI=_kivi(quant, True), QK=QUANT_CODE[quant], QV=QUANT_CODE[quant], D=d,
        BLOCK_D=block_d, ROWS=nrows, BLOCK_W=block_w, GROUP=group, BITS=8 // per, PER=per, LC=lc_src is not None,
        BLOCK_L=_p2(t * h), HW_CVT=not INTERPRET, num_warps=4,
    )  # fmt: skip
    return ok, ov, olc


def cluster_step(
    k: torch.Tensor, v: torch.Tensor, keep: int, iters: int, table: torch.Tensor, rows: torch.Tensor | None,
    lc_dst: torch.Tensor, *, importance: torch.Tensor | None = None, counts: torch.Tensor | None = None,
    n_pinned: int = 0, pin_by: str = "mixed",
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Merge the group's blocks k, v [n_layers * A, T, H, D] (layer-major) into `keep` centroids:
    returns their keys and values [n_layers * A, keep, H, D] (k's dtype) and writes their
    log-counts straight into the destination slots' side table `lc_dst` [L, S, keep, H] (table
    column 2). A first merge weighs by `importance` [A, T, H] (every layer the same: the host's
    per-token importance, clamped > 0), a merge of centroids by their `counts` [n, T, H]: what
    `compress_blocks` passes `kernels.cluster.cluster` in either case, computed in the kernel."""
    from proxima.compression.kernels.cluster import CLUSTER_BF16, CLUSTER_MAX_REGISTERS, CLUSTER_WARPS, _cluster_kernel
    from proxima.compression.reference import PIN_BY

    if (importance is None) == (counts is None):
        raise ValueError("cluster_step: exactly one of importance (a first merge) and counts (a re-merge)")
    if not 0 <= n_pinned < keep:
        raise ValueError(f"n_pinned must be in [0, {keep}) for {keep} centroids, got {n_pinned}")
    n, t, h, d = k.shape
    ko = torch.empty(n, keep, h, d, device=k.device, dtype=k.dtype)
    vo = torch.empty_like(ko)
    w = importance if importance is not None else counts
    assert w is not None
    if n:
        _cluster_kernel[(n, h)](
            k, v, w, w, w, ko, vo, lc_dst, w, table, rows if rows is not None else table, table.shape[0],
            lc_dst.stride(0), lc_dst.stride(1), t, h, keep, n_pinned,
            W_MODE=1 if importance is not None else 2, LC_SLOTS=True, HAS_ROWS=rows is not None, ITERS=iters,
            HAS_PROT=False, HAS_PIN=n_pinned > 0, PIN_BY=PIN_BY.index(pin_by), COUNTS=counts is not None, D=d,
            BLOCK_T=_p2(t, 16), BLOCK_D=_p2(d, 16), BLOCK_C=_p2(keep, 16),
            EXACT16=k.dtype in (torch.bfloat16, torch.float16), BF16=k.dtype == torch.bfloat16 and CLUSTER_BF16,
            PRECISION="ieee" if INTERPRET else "tf32", HW_CVT=not INTERPRET, num_warps=CLUSTER_WARPS,
            **({"maxnreg": CLUSTER_MAX_REGISTERS} if CLUSTER_MAX_REGISTERS and not INTERPRET else {}),
        )  # fmt: skip
    return ko, vo
