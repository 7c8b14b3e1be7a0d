"""Thin adapter between the HF cache and `proxima.compression`: one call per layer that
compresses N blocks into a format and hands back what attention needs.

Why an adapter: the cache works on `[N, T, H, D]` batches of blocks of one layer and needs, per
block, the materialised keys/values, the log-counts and the stored bytes. `proxima.compression`
(the kernels issue) provides the ops; this module composes them, so the cache never depends on
the exact shape of the public `CompressedBlock` API while that API settles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from proxima.formats import Format

CLUSTER_ITERS = 4
"""Lloyd iterations of STAR-KV k-means (DESIGN.md: 'a few')."""


@dataclass
class Encoded:
    """N compressed blocks of one layer, one format: the stored payload and how to read it."""

    fmt: Format
    n_kept: int
    """Kept tokens or centroids per block (C)."""
    payload: list[torch.Tensor]
    """Everything a real store keeps (packed data, scales, zero points, counts); its bytes are the cost."""
    decode: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(repr=False)
    """-> (k_hat [N, C, H, D], v_hat [N, C, H, D], log_count [N, C, H] with -inf for empty centroids)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.payload)


def encode(
    fmt: Format,
    k: torch.Tensor,
    v: torch.Tensor,
    token_importance: torch.Tensor | None = None,
    *,
    group_size: int = 32,
) -> Encoded:
    """Compress N blocks. k, v: `[N, T, H, D]`; token_importance: `[N, T, H]` (>= 0) or None."""
    from proxima.compression import reference as ref

    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [N, T, H, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    n, t, h, d = k.shape
    if token_importance is None:
        token_importance = torch.ones(n, t, h, device=k.device)
    if token_importance.shape != (n, t, h):
        raise ValueError(f"token_importance must be [N, T, H] = {(n, t, h)}, got {tuple(token_importance.shape)}")
    kf, vf = k.float(), v.float()
    log_count: torch.Tensor | None = None
    if fmt.reduction is not None:
        c = fmt.kept_tokens(t)
        imp = token_importance.float()
        ranks = ref.token_ranks(imp, None)
        if fmt.reduction == "sparse":
            kf, vf, _ = ref.sparsify(kf, vf, ranks, c)
        else:
            # Weights must be positive: a small floor keeps unattended tokens in the mean.
            w = imp + 1e-6 * imp.amax(1, keepdim=True).clamp_min(1e-12)
            kf, vf, log_count, _ = ref.cluster(kf, vf, w, ranks, c, CLUSTER_ITERS)
    c = kf.shape[1]
    q = fmt.quant
    out_dtype = k.dtype
    lc = log_count

    def zeros_lc() -> torch.Tensor:
        return torch.zeros(n, c, h, device=k.device)

    if q == "bf16":
        # Reduction only: the kept tokens stay in the hot cache dtype (bf16 in vLLM).
        ks, vs = kf.to(out_dtype), vf.to(out_dtype)
        payload = [ks, vs]

        def decode() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return ks.to(out_dtype), vs.to(out_dtype), lc if lc is not None else zeros_lc()

    elif q in ("fp8", "int8"):
        kd, ksc = ref.quantize_per_token(kf, q)
        vd, vsc = ref.quantize_per_token(vf, q)
        payload = [kd, ksc, vd, vsc]

        def decode() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return (
                ref.dequantize_per_token(kd, ksc).to(out_dtype),
                ref.dequantize_per_token(vd, vsc).to(out_dtype),
                lc if lc is not None else zeros_lc(),
            )

    else:
        bits = ref.bits_of(q)
        kp, kscale, kzero = ref.quantize_kivi_keys(kf, bits, group_size)
        # The reference (as of this writing) returns key scales as [N, Gk, 1, H, D]; the documented
        # shape is [N, Gk, H, D]. Normalise so either form works.
        kscale, kzero = kscale.reshape(n, -1, h, d), kzero.reshape(n, -1, h, d)
        vp, vscale, vzero = ref.quantize_kivi_values(vf, bits, group_size)
        vscale, vzero = vscale.reshape(n, c, h, -1), vzero.reshape(n, c, h, -1)
        payload = [kp, kscale, kzero, vp, vscale, vzero]

        def decode() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return (
                ref.dequantize_kivi_keys(kp, kscale, kzero, bits, group_size).to(out_dtype),
                ref.dequantize_kivi_values(vp, vscale, vzero, bits, group_size).to(out_dtype),
                lc if lc is not None else zeros_lc(),
            )

    if log_count is not None:
        payload.append(log_count)
    return Encoded(fmt=fmt, n_kept=c, payload=payload, decode=decode)
