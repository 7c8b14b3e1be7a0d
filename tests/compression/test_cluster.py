"""cluster(R) (STAR-KV k-means): the Triton kernel against the reference, semantics, quality."""

import numpy as np
import pytest
import torch
from sklearn.cluster import KMeans

from proxima.compression import attention_error, compress_block, compress_blocks, decompress_blocks
from proxima.compression import reference as ref
from proxima.compression import triton_ops as ops
from tests.compression.conftest import rel_err
from tests.compression.synthetic import realistic_kv


@pytest.mark.parametrize("t,c,h,d", [(64, 16, 2, 64), (63, 8, 1, 128), (32, 1, 3, 64)])
def test_cluster_triton_matches_reference(t, c, h, d, device):
    k, v = realistic_kv(2, t, h, d, seed=c, device=device)
    # Seeded: with free draws a near-tie in one assignment now and then split the two objectives
    # by 0.13% (seen once in a suite run); the comparison is of one algorithm, not of luck.
    w = torch.rand(2, t, h, device=device, generator=torch.Generator(device=device).manual_seed(c)) + 0.1
    ranks = ref.token_ranks(w, None)
    kc, vc, lc, _ = ref.cluster(k, v, w, ranks, c, 4)
    kt, vt, lt = ops.cluster(k, v, w, None, c, 4)
    # Same algorithm in float32; a near-tie in an assignment could differ, so compare objectives
    # tightly and the centroids loosely.
    obj_r, obj_t = ref.kmeans_objective(k, w, kc), ref.kmeans_objective(k, w, kt)
    assert torch.allclose(obj_r, obj_t, rtol=1e-3)
    assert rel_err(kt, kc) < 1e-3 and rel_err(vt, vc) < 1e-3
    assert torch.equal(lt.exp().round(), lc.exp().round())
    assert torch.allclose(lc.exp().sum(1), torch.full_like(lc[:, 0], float(t)))  # counts add up to T


def test_cluster_kernel_writes_the_source_dtype_rounded_once(device):
    """compress_blocks takes bf16 centroids from the kernel directly: they must equal its float32
    centroids rounded to nearest even (the reference's `.to(k.dtype)`)."""
    k, v = realistic_kv(2, 64, 2, 64, seed=3, device=device)
    w = torch.rand(2, 64, 2, device=device) + 0.1
    k32, v32, l32 = ops.cluster(k, v, w, None, 16, 4)
    k16, v16, l16 = ops.cluster(k, v, w, None, 16, 4, out_dtype=torch.bfloat16)
    assert k.dtype == k16.dtype == v16.dtype == torch.bfloat16
    assert torch.equal(k16, k32.to(torch.bfloat16)) and torch.equal(v16, v32.to(torch.bfloat16))
    assert torch.equal(l16, l32)


def test_cluster_c1_is_the_weighted_mean(device):
    k, v = realistic_kv(1, 32, 2, 64, seed=4, dtype=torch.float32, device=device)
    imp = torch.rand(1, 32, 2, device=device) + 0.5
    for backend in ("torch", "triton"):
        cb = compress_blocks("cluster(32)", k, v, token_importance=imp, backend=backend)
        kh, vh, lc = decompress_blocks(cb)
        wk = (k * imp.unsqueeze(-1)).sum(1) / imp.sum(1).unsqueeze(-1)
        wv = (v * imp.unsqueeze(-1)).sum(1) / imp.sum(1).unsqueeze(-1)
        assert rel_err(kh[:, 0], wk) < 1e-5 and rel_err(vh[:, 0], wv) < 1e-5
        assert torch.allclose(lc, torch.full_like(lc, float(np.log(32))))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_identical_keys_give_exact_attention(backend, device):
    """Four groups of 8 identical keys, uniform importance: cluster(8) -> 4 centroids of count 8,
    and attention with log(count) equals attention over the original 32 tokens."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 2, 64, generator=g)
    k = base.repeat_interleave(8, 0).to(device)  # [32, 2, 64]
    v = torch.randn(32, 2, 64, generator=g).to(device)
    cb = compress_block("cluster(8)", k, v, backend=backend)
    _, _, lc = decompress_blocks(cb)
    assert torch.allclose(lc, torch.full_like(lc, float(np.log(8))))
    q = torch.randn(5, 6, 64, generator=g).to(device)  # GQA 3
    assert attention_error(q, k, v, cb) < 1e-5


def test_cluster_objective_vs_sklearn():
    """Our weighted Lloyd (4 iterations) from the importance seeds vs scikit-learn's KMeans with
    the same sample weights: (a) started from the same seeds with n_init=1, ours is within 1% of
    sklearn's converged objective; (b) it is never worse than 1.5x sklearn's best of 10 k-means++
    restarts. Keys come from a Gaussian mixture, as clustered keys do."""
    g = torch.Generator().manual_seed(0)
    t, c, d = 64, 8, 32
    centers = torch.randn(c, d, generator=g) * 4
    k = (centers[torch.randint(0, c, (t,), generator=g)] + torch.randn(t, d, generator=g)).view(1, t, 1, d)
    w = torch.rand(1, t, 1, generator=g) + 0.2
    ranks = ref.token_ranks(w, None)
    kc, *_ = ref.cluster(k, k, w, ranks, c, 4)
    ours = ref.kmeans_objective(k, w, kc).item()
    x = k[0, :, 0].double().numpy()
    sw = w[0, :, 0].double().numpy()
    seeds = x[ref.seed_tokens(k, w, ranks, c)[0, :, 0].numpy()]
    same_init = KMeans(c, init=seeds, n_init=1, max_iter=300, tol=0).fit(x, sample_weight=sw)
    best = KMeans(c, init="k-means++", n_init=10, random_state=0).fit(x, sample_weight=sw)
    assert ours <= same_init.inertia_ * 1.01
    assert ours <= best.inertia_ * 1.5
