"""Reduction formats end to end (Triton vs torch) and recompression of reduced blocks."""

import pytest
import torch

from proxima.compression import compress_blocks, decompress_blocks
from proxima.formats import Format
from tests.compression.conftest import rel_err
from tests.compression.synthetic import realistic_kv


@pytest.mark.parametrize("fmt", ["sparse(4)", "cluster(4)", "sparse(2)+int4", "cluster(2)+int8"])
def test_reduction_formats_end_to_end_triton_vs_torch(fmt, device):
    k, v = realistic_kv(2, 64, 2, 64, seed=9, device=device)
    imp = torch.rand(2, 64, 2, device=device)
    prot = torch.zeros(2, 64, dtype=torch.bool, device=device)
    prot[:, :2] = True
    outs = [
        decompress_blocks(compress_blocks(fmt, k, v, token_importance=imp, protected=prot, backend=b), backend=b)
        for b in ("torch", "triton")
    ]
    (ka, va, la), (kb, vb, lb) = outs
    assert ka.shape == (2, 16 if "(4)" in fmt else 32, 2, 64)
    assert rel_err(kb, ka) < 2e-3 and rel_err(vb, va) < 2e-3
    assert torch.equal(la, lb) if fmt.startswith("sparse") else torch.allclose(la, lb)


def test_recompressible_rules():
    from proxima.formats import recompressible

    def r(a: str, b: str) -> bool:
        return recompressible(Format.parse(a), Format.parse(b))

    assert r("int8", "int4") and r("int4", "cluster(2)+int4") and r("fp8", "sparse(4)")
    assert r("cluster(2)+int4", "cluster(4)+int4") and r("cluster(2)", "cluster(2)+int4")
    assert r("sparse(2)", "sparse(4)") and r("sparse(2)+int8", "cluster(4)+int4")
    assert not r("int4", "int4") and not r("int2", "int4")  # never towards a lower ratio
    assert not r("cluster(2)+int4", "int2") and not r("cluster(2)+int4", "sparse(4)+int4")
    assert not r("cluster(4)", "cluster(2)+int8")  # fewer centroids cannot become more


def test_merging_centroids_adds_counts_and_stays_exact():
    """cluster(2) then cluster(4) of a block holding 16 distinct keys four times each: the second
    merge gives the 16 keys with count 4 each, so attention over the block is exact, and every
    (block, head) still accounts for all 64 tokens."""
    from proxima.compression import attention_errors, compress_blocks, decompress_blocks

    g = torch.Generator().manual_seed(0)
    n, h, d = 2, 2, 32
    base_k = torch.randn(n, 16, h, d, generator=g).bfloat16()
    base_v = torch.randn(n, 16, h, d, generator=g).bfloat16()
    k, v = base_k.repeat(1, 4, 1, 1), base_v.repeat(1, 4, 1, 1)  # [N, 64, H, D]
    c2 = compress_blocks("cluster(2)", k, v, backend="torch")
    kh, vh, lc = decompress_blocks(c2, backend="torch")
    c4 = compress_blocks("cluster(4)", kh, vh, log_count=lc, source_tokens=64, backend="torch")
    assert c4.slot_tokens == 16 and c4.source_tokens == 64
    assert c4.log_count is not None
    assert torch.allclose(c4.log_count.exp().sum(1), torch.full((n, h), 64.0))
    q = torch.randn(8, 2 * h, d, generator=g)
    assert float(attention_errors(q, k, v, c4).max()) < 1e-5


@pytest.mark.parametrize("target", ["cluster(4)", "cluster(8)+int4", "cluster(2)+int4"])
def test_recompressed_clusters_account_for_every_token(target):
    from proxima.compression import compress_blocks, decompress_blocks

    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(3, 64, 2, 64, generator=g).bfloat16() for _ in range(2))
    imp = torch.rand(3, 64, 2, generator=g)
    c2 = compress_blocks("cluster(2)", k, v, token_importance=imp, backend="torch")
    kh, vh, lc = decompress_blocks(c2, backend="torch")
    out = compress_blocks(target, kh, vh, log_count=lc, source_tokens=64, backend="torch")
    f = Format.parse(target)
    assert out.slot_tokens == 64 // f.reduction_ratio
    assert out.log_count is not None
    assert torch.allclose(out.log_count.exp().sum(1), torch.full((3, 2), 64.0))


def test_centroids_cannot_be_sparsified_or_unreduced():
    from proxima.compression import compress_blocks, decompress_blocks

    k = torch.randn(1, 64, 1, 32).bfloat16()
    kh, vh, lc = decompress_blocks(compress_blocks("cluster(2)", k, k, backend="torch"), backend="torch")
    with pytest.raises(ValueError, match="only be merged further by a cluster format"):
        compress_blocks("sparse(4)", kh, vh, log_count=lc, source_tokens=64, backend="torch")
    with pytest.raises(ValueError, match="keeps 64 of source_tokens=64, but 32 rows"):
        compress_blocks("int4", kh, vh, source_tokens=64, backend="torch")
