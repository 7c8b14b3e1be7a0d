"""sparse(R): the Triton kernel against the reference, top-k and protected tokens, edge cases."""

import pytest
import torch

from proxima.compression import compress_blocks
from proxima.compression import reference as ref
from proxima.compression import triton_ops as ops
from tests.compression.synthetic import realistic_kv


@pytest.mark.parametrize("t,keep", [(64, 16), (63, 16), (32, 32), (5, 1)])
def test_sparsify_keeps_top_k_and_protected(t, keep, device):
    n, h, d = 2, 3, 64
    k, v = realistic_kv(n, t, h, d, seed=t, device=device)
    imp = torch.rand(n, t, h, device=device)
    imp[0, :4] = 1.0  # ties: the lower index wins
    protected = torch.zeros(n, t, dtype=torch.bool, device=device)
    protected[:, -1] = True  # the least important by rank, yet protected
    imp[:, -1] = -1.0
    ranks = ref.token_ranks(imp, protected)
    kr, vr, idx = ref.sparsify(k, v, ranks, keep)
    kt, vt, idxt = ops.sparsify(k, v, imp, protected, keep)
    assert torch.equal(idx, idxt) and torch.equal(kr, kt) and torch.equal(vr, vt)
    for b in range(n):
        for hh in range(h):
            kept = set(idx[b, :, hh].tolist())
            assert t - 1 in kept
            order = sorted(range(t - 1), key=lambda j: (-imp[b, j, hh].item(), j))
            assert kept == {t - 1, *order[: keep - 1]}
            assert idx[b, :, hh].tolist() == sorted(kept)  # original order
    assert torch.equal(kr, k.gather(1, idx.long().unsqueeze(-1).expand(-1, -1, -1, d)))


def test_sparse_format_keeps_whole_block_when_small(device):
    """k = B: a partial block of 3 tokens under sparse(2) keeps ceil(3/2) = 2; keep == T is the identity."""
    k, v = realistic_kv(1, 8, 2, 64, seed=1, device=device)
    kt, vt, idx = ops.sparsify(k, v, torch.rand(1, 8, 2, device=device), None, 8)
    assert torch.equal(kt, k) and torch.equal(vt, v)
    assert torch.equal(idx[0, :, 0].cpu(), torch.arange(8, dtype=torch.int32))
    cb = compress_blocks("sparse(2)", k[:, :3], v[:, :3])
    assert cb.slot_tokens == 2


def test_too_many_protected_tokens_is_an_error():
    k = torch.randn(1, 16, 1, 64)
    with pytest.raises(ValueError, match="protected"):
        compress_blocks("sparse(4)", k, k, protected=torch.ones(1, 16, dtype=torch.bool))
