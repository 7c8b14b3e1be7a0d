"""Sparsify kernel: keep each (block, head)'s best-ranked tokens, in their order (reference.sparsify)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from proxima.compression.kernels.common import _p2, _ranks


@triton.jit
def _sparsify_kernel(
    k_ptr,
    v_ptr,  # [N, T, H, D] source, contiguous
    imp_ptr,  # [N, T, H] importance, contiguous
    prot_ptr,  # [N, T] uint8 protected flags, contiguous (unused without HAS_PROT)
    ko_ptr,
    vo_ptr,  # [N, C, H, D] kept tokens, contiguous
    idx_ptr,  # [N, C, H] int32 source token of each kept token
    T,
    H,
    C,
    HAS_PROT: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    rank = _ranks(imp_ptr, prot_ptr, n, h, T, H, HAS_PROT, BLOCK_T, True)
    oi = tl.arange(0, BLOCK_T)
    kept = (rank < C) & (oi < T)
    pos = tl.cumsum(kept.to(tl.int32), axis=0) - 1
    tl.store(idx_ptr + (n * C + pos) * H + h, oi, mask=kept)
    for d0 in range(0, D, BLOCK_D):
        od = d0 + tl.arange(0, BLOCK_D)
        m = kept[:, None] & (od < D)[None, :]
        src = ((n * T + oi[:, None]) * H + h) * D + od[None, :]
        dst = ((n * C + pos[:, None]) * H + h) * D + od[None, :]
        tl.store(ko_ptr + dst, tl.load(k_ptr + src, mask=m), mask=m)
        tl.store(vo_ptr + dst, tl.load(v_ptr + src, mask=m), mask=m)


def sparsify(
    k: torch.Tensor, v: torch.Tensor, importance: torch.Tensor, protected: torch.Tensor | None, keep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, t, h, d = k.shape
    k, v = k.contiguous(), v.contiguous()
    imp = importance.float().contiguous()
    ko = torch.empty(n, keep, h, d, device=k.device, dtype=k.dtype)
    vo = torch.empty_like(ko)
    idx = torch.empty(n, keep, h, device=k.device, dtype=torch.int32)
    prot = protected.to(torch.uint8).contiguous() if protected is not None else imp
    if n:
        _sparsify_kernel[(n, h)](
            k, v, imp, prot, ko, vo, idx, t, h, keep,
            HAS_PROT=protected is not None, D=d, BLOCK_T=_p2(t, 16), BLOCK_D=min(64, _p2(d, 16)),
        )  # fmt: skip
    return ko, vo, idx


