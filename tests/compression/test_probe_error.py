"""The compression-time probe's Triton kernel (`kernels/probe_error.py`) against the torch form of
`attention_errors`, which it replaces in the vLLM worker on a GPU."""

from __future__ import annotations

import pytest
import torch

from proxima.compression import attention_errors, compress_blocks, decompress_blocks
from proxima.compression.kernels.probe_error import probe_errors
from tests.compression.synthetic import queries_for, realistic_kv


def _queries(k: torch.Tensor, w: int, hq: int, device: str) -> torch.Tensor:
    """[N, W, Hq, D]: each block its own queries (a request's recent queries in the worker)."""
    return torch.stack([queries_for(k[i].cpu(), w, hq, seed=i + 1) for i in range(k.shape[0])]).to(device)


def _valid(n: int, w: int, device: str) -> torch.Tensor:
    """Padding queries at the end of some blocks (requests with fewer recent queries than W)."""
    valid = torch.ones(n, w, dtype=torch.bool)
    valid[0, w // 2:] = False
    if n > 2:
        valid[2, 1:] = False
    return valid.to(device)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4", "int2", "cluster(2)+int4", "cluster(4)+int4"])
@pytest.mark.parametrize("hq,h", [(4, 2), (2, 2)])
def test_the_kernel_gives_the_reference_errors(fmt: str, hq: int, h: int, device: str) -> None:
    n, t, d, w = 5, 32, 64, 12
    k, v = realistic_kv(n, t, h, d, seed=11, device=device)
    cb = compress_blocks(fmt, k, v, token_importance=torch.rand(n, t, h, device=device), backend="torch")
    q, valid = _queries(k, w, hq, device), _valid(n, w, device)
    want = attention_errors(q, k, v, cb, q_valid=valid, sm_scale=0.125, backend="torch")
    kh, vh, lc = decompress_blocks(cb, backend="torch")  # the same decompressed rows: the kernel alone
    got = probe_errors(q, k, v, kh, vh, lc, scale=0.125, q_valid=valid).cpu()
    assert want.shape == got.shape == (n,)
    assert (want > 0).all()
    torch.testing.assert_close(got, want, rtol=2e-4, atol=1e-6)


def test_a_recompression_is_measured_against_the_centroids_it_had(device: str) -> None:
    """Re-merging centroids: the reference rows carry their log-counts (-inf: an empty one)."""
    n, t, h, d, w = 4, 32, 2, 64, 8
    k, v = realistic_kv(n, t, h, d, seed=5, device=device)
    c2 = compress_blocks("cluster(2)+int4", k, v, token_importance=torch.rand(n, t, h, device=device), backend="torch")
    k2, v2, lc2 = decompress_blocks(c2, backend="torch")
    lc2[1, 3] = float("-inf")  # an empty centroid among the sources
    c4 = compress_blocks("cluster(4)+int4", k2, v2, log_count=lc2, source_tokens=t, backend="torch")
    q = _queries(k2, w, 2 * h, device)
    want = attention_errors(q, k2, v2, c4, ref_log_count=lc2, backend="torch")
    kh, vh, lc = decompress_blocks(c4, backend="torch")
    got = probe_errors(q, k2, v2, kh, vh, lc, scale=d ** -0.5, ref_log_count=lc2).cpu()
    torch.testing.assert_close(got, want, rtol=2e-4, atol=1e-6)


def test_attention_errors_with_triton_runs_the_kernel_and_agrees(device: str) -> None:
    """`attention_errors(backend="triton")` (the worker's call on a GPU): Triton decompression,
    then the kernel. The decompressions may differ by a rare bf16 step, so the errors are close,
    not equal; a block compressed losslessly (bf16) measures exactly 0 both ways."""
    n, t, h, d, w = 3, 32, 2, 64, 8
    k, v = realistic_kv(n, t, h, d, seed=9, device=device)
    q = _queries(k, w, 4, device)
    for fmt in ("int4", "cluster(2)+int4"):
        cb = compress_blocks(fmt, k, v, token_importance=torch.rand(n, t, h, device=device), backend="torch")
        ref = attention_errors(q, k, v, cb, backend="torch")
        tri = attention_errors(q, k, v, cb, backend="triton")
        torch.testing.assert_close(tri, ref, rtol=2e-2, atol=1e-4)
    lossless = compress_blocks("bf16", k, v, backend="torch")
    assert float(attention_errors(q, k, v, lossless, backend="triton").abs().max()) == 0.0


def test_no_rows_no_launch(device: str) -> None:
    z = torch.zeros(0, 32, 2, 64, device=device, dtype=torch.bfloat16)
    out = probe_errors(torch.zeros(0, 4, 2, 64, device=device), z, z, z[:, :16], z[:, :16],
                       torch.zeros(0, 16, 2, device=device), scale=0.125)
    assert out.shape == (0,)
