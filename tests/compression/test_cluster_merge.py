"""Merging on the Triton path: the first merge of a quantized block and the recompression of a
merged one (centroids merge, counts add), against the torch reference (`reference.cluster`).

Tolerance: the kernel's seeds, assignments and counts are the reference's exactly on these data
(integer counts are compared exactly); the means differ only by float32 summation order (tensor
core dots against torch matmuls) before the single rounding to the source dtype, so centroids
and value means agree to a relative error below 2e-3 (a few bf16 ulps on a few elements), and
quantized outputs to the quantization step those ulps can move.
"""

import pytest
import torch

from proxima.compression import attention_errors, compress_blocks, decompress_blocks
from proxima.compression import reference as ref
from proxima.compression import triton_ops as ops
from tests.compression.conftest import rel_err
from tests.compression.synthetic import realistic_kv


def _merged_source(device: str, n: int = 3, t: int = 64, h: int = 2, d: int = 64, seed: int = 0):
    """A cluster(2) block decompressed: 32 centroid rows, their log-counts, its importance."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(n, t, h, d, generator=g).bfloat16().to(device) for _ in range(2))
    imp = torch.rand(n, t, h, generator=g).to(device)
    c2 = compress_blocks("cluster(2)", k, v, token_importance=imp, backend="torch")
    kh, vh, lc = decompress_blocks(c2, backend="torch")
    imp_rows = torch.rand(n, kh.shape[1], h, generator=g).to(device)
    return kh, vh, lc, imp_rows


@pytest.mark.parametrize("target", ["cluster(4)", "cluster(8)+int4", "cluster(4)+int8"])
def test_recompression_triton_matches_reference(target, device):
    kh, vh, lc, imp = _merged_source(device)
    kw = dict(log_count=lc, source_tokens=64, token_importance=imp)
    a = compress_blocks(target, kh, vh, backend="torch", **kw)
    b = compress_blocks(target, kh, vh, backend="triton", **kw)
    assert a.log_count is not None and b.log_count is not None
    assert torch.equal(a.log_count.exp().round(), b.log_count.exp().round())  # the same assignment
    assert torch.allclose(b.log_count.exp().sum(1), torch.full_like(b.log_count[:, 0], 64.0))
    ka, va, _ = decompress_blocks(a, backend="torch")
    kb, vb, _ = decompress_blocks(b, backend="torch")
    tol = 2e-3 if target == "cluster(4)" else 2e-2
    assert rel_err(kb, ka) < tol and rel_err(vb, va) < tol


def test_merge_kernel_sums_counts_and_ignores_empty_rows(device):
    """Rows of count 0 (empty centroids, log-count -inf) carry far-off keys: with weight 0 and the
    last rank they are never seeds nor move a mean, so the result equals the reference's, whose
    rule is the same; counts are sums of the rows' counts, not numbers of rows."""
    g = torch.Generator().manual_seed(3)
    n, t, h, d, c = 2, 32, 2, 32, 8
    k, v = (torch.randn(n, t, h, d, generator=g).to(device) for _ in range(2))
    counts = torch.randint(1, 5, (n, t, h), generator=g).float().to(device)
    counts[:, -4:] = 0
    k[:, -4:] = 1e3  # an empty row's key: were it a seed or weighted, the centroids would show it
    imp = torch.rand(n, t, h, generator=g).to(device)
    w = imp.clamp_min(1e-6) * counts
    rank_imp = torch.where(counts > 0, imp, torch.full_like(imp, -1.0))
    kc, vc, lcr, _ = ref.cluster(k, v, w, ref.token_ranks(rank_imp, None), c, 4, counts=counts)
    kt, vt, lct = ops.cluster(k, v, w, None, c, 4, importance=rank_imp, counts=counts)
    assert torch.equal(lct.exp().round(), lcr.exp().round())
    assert torch.allclose(lct.exp().sum(1), counts.sum(1))
    assert rel_err(kt, kc) < 1e-4 and rel_err(vt, vc) < 1e-4
    assert float(kt.abs().max()) < 100.0


def test_triton_merge_of_repeated_keys_is_exact(device):
    """16 distinct keys four times each, cluster(2) then cluster(4) on the Triton path: 16
    centroids of count 4, so attention over the block is exact."""
    g = torch.Generator().manual_seed(0)
    n, h, d = 2, 2, 32
    k = torch.randn(n, 16, h, d, generator=g).bfloat16().repeat(1, 4, 1, 1).to(device)
    v = torch.randn(n, 16, h, d, generator=g).bfloat16().repeat(1, 4, 1, 1).to(device)
    c2 = compress_blocks("cluster(2)", k, v, backend="triton")
    kh, vh, lc = decompress_blocks(c2, backend="triton")
    c4 = compress_blocks("cluster(4)", kh, vh, log_count=lc, source_tokens=64, backend="triton")
    assert c4.log_count is not None
    assert torch.allclose(c4.log_count.exp(), torch.full_like(c4.log_count, 4.0))
    q = torch.randn(8, 2 * h, d, generator=g).to(device)
    assert float(attention_errors(q, k, v, c4).max()) < 1e-5


@pytest.mark.parametrize("source", ["int4", "bf16"])
def test_first_merge_of_a_quantized_block_triton_matches_reference(source, device):
    """int4 (or bf16) -> cluster(2)+int4: the rows are single tokens (count 1 each)."""
    k, v = realistic_kv(2, 64, 2, 64, seed=5)
    k, v = k.bfloat16().to(device), v.bfloat16().to(device)
    kh, vh, lc = decompress_blocks(compress_blocks(source, k, v, backend="torch"), backend="torch")
    a = compress_blocks("cluster(2)+int4", kh, vh, log_count=lc, backend="torch")
    b = compress_blocks("cluster(2)+int4", kh, vh, log_count=lc, backend="triton")
    assert a.log_count is not None and b.log_count is not None
    assert torch.equal(a.log_count.exp().round(), b.log_count.exp().round())
    ka, va, _ = decompress_blocks(a, backend="torch")
    kb, vb, _ = decompress_blocks(b, backend="torch")
    assert rel_err(kb, ka) < 2e-2 and rel_err(vb, va) < 2e-2
