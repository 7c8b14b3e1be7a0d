"""Synthetic KV with the statistics that make KV quantization hard, for tests and benchmarks
(bench/kernels.py and bench/groups.py import it from here with the repository root on sys.path).

Real post-RoPE keys have a few *outlier channels* with magnitudes 10-20x the rest (the reason
KIVI quantizes keys per channel), plus a per-channel offset; values are closer to Gaussian per
token with a smaller shared offset. Queries correlate with keys so that attention is peaked on a
few tokens, as in trained models, rather than uniform. The generator is deterministic per seed.
"""

from __future__ import annotations

import torch


def realistic_kv(
    n: int,
    t: int,
    h: int,
    d: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    outlier_channels: int = 4,
    outlier_scale: float = 12.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [N, T, H, D] (see the module docstring)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    # Outlier channels: a large, mostly stable magnitude (offset +-outlier_scale, token-to-token
    # spread outlier_scale / 4), the pattern KIVI reports for post-RoPE keys; other channels are
    # unit Gaussians around a small offset.
    spread = torch.ones(h, d)
    k_off = torch.randn(h, d, generator=g) * 0.5
    for hh in range(h):
        idx = torch.randperm(d, generator=g)[:outlier_channels]
        sign = torch.randint(0, 2, (outlier_channels,), generator=g) * 2 - 1
        k_off[hh, idx] = sign * outlier_scale
        spread[hh, idx] = outlier_scale / 4
    k = torch.randn(n, t, h, d, generator=g) * spread + k_off
    v_off = torch.randn(h, d, generator=g) * 0.3
    v = torch.randn(n, t, h, d, generator=g) + v_off
    return k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)


def queries_for(k: torch.Tensor, w: int, hq: int, *, seed: int = 1, sharpness: float = 0.2) -> torch.Tensor:
    """w queries [W, Hq, D] for keys k [T, H, D]: noisy copies of random keys of the block, so each
    query attends mostly to a few tokens (GQA: query head i uses KV head i // (Hq / H))."""
    t, h, d = k.shape
    gq = hq // h
    g = torch.Generator(device="cpu").manual_seed(seed)
    pick = torch.randint(0, t, (w, hq), generator=g)
    kf = k.float().cpu()
    heads = torch.arange(hq) // gq
    base = kf[pick, heads.view(1, hq)]  # [W, Hq, D]
    base = base / base.norm(dim=-1, keepdim=True) * d**0.5
    # Unit-variance channels plus a pull toward one key: logits spread over a few units, so
    # attention is peaked on tens of tokens, not one (measured: about 10-30 effective tokens
    # of 128, like middle layers of small LMs).
    q = torch.randn(w, hq, d, generator=g) + sharpness * 0.5 * base
    return q.to(device=k.device, dtype=k.dtype)
