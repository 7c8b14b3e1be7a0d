"""Protected tokens inside merged blocks (`compress_blocks(pinned_tokens=)`, a policy's
`protect.merged_tokens`): P rows per (block, head) stay as they are, each its own centroid of
count 1, and the other rows merge into the remaining C - P centroids, in the torch reference and
in the Triton merge (interpreted here).

Tolerance between the kernel and the reference: the picks, assignments and counts are equal (the
outlier scores and the means differ only by float32 summation order, far from a tie on these data),
so counts are compared exactly and centroids to a few bf16 ulps, as in test_cluster_merge.py.
"""

from __future__ import annotations

import pytest
import torch

from proxima.compression import compress_blocks, decompress_blocks
from proxima.compression import reference as ref
from tests.compression.conftest import rel_err


def _kv(n: int = 3, t: int = 64, h: int = 2, d: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(n, t, h, d, generator=g).bfloat16() for _ in range(2))
    imp = torch.rand(n, t, h, generator=g)
    return k, v, imp


def _rows_of(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [N, T, H, D] at rows idx [N, P, H] -> [N, P, H, D]."""
    return x.gather(1, idx.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))


@pytest.mark.parametrize("by", ref.PIN_BY)
@pytest.mark.parametrize("p", [1, 4])
def test_reference_keeps_pinned_tokens_bit_exact_with_count_one(by, p):
    k, v, imp = _kv()
    cb = compress_blocks("cluster(4)", k, v, token_importance=imp, backend="torch", pinned_tokens=p, pin_by=by)
    kh, vh, lc = decompress_blocks(cb, backend="torch")
    pins = ref.pinned_rows(k, imp, ref.token_ranks(imp, None), None, p, by)
    assert torch.equal(kh[:, :p], _rows_of(k, pins)) and torch.equal(vh[:, :p], _rows_of(v, pins))
    assert torch.equal(lc[:, :p], torch.zeros_like(lc[:, :p]))  # log 1
    assert torch.allclose(lc.exp().sum(1), torch.full_like(lc[:, 0], 64.0))  # the rest hold the others
    # each pinned token is nowhere else: no other centroid's count includes it
    assert int((lc[:, p:].exp().round() == 1).sum()) < lc[:, p:].numel()


def test_pinned_tokens_survive_int4_within_its_error():
    """Quantized after the merge: a pinned row is dequantized within int4's step of its group."""
    k, v, imp = _kv(seed=1)
    cb = compress_blocks("cluster(2)+int4", k, v, token_importance=imp, backend="torch", pinned_tokens=2)
    kh, vh, lc = decompress_blocks(cb, backend="torch")
    pins = ref.pinned_rows(k, imp, ref.token_ranks(imp, None), None, 2, "mixed")
    kp, vp = _rows_of(k, pins).float(), _rows_of(v, pins).float()
    assert torch.equal(lc[:, :2], torch.zeros_like(lc[:, :2]))
    # keys: per channel over the slot's 32 rows, 15 levels; values: per row in groups of 32 channels
    kstep = (cb.k_scale.float()).amax()  # type: ignore[union-attr]
    assert float((kh[:, :2].float() - kp).abs().max()) <= 0.5 * float(kstep) * 1.01
    vstep = cb.v_scale[:, :2].float().amax()  # type: ignore[index]
    assert float((vh[:, :2].float() - vp).abs().max()) <= 0.5 * float(vstep) * 1.01


@pytest.mark.parametrize("by", ref.PIN_BY)
@pytest.mark.parametrize(("fmt", "p"), [("cluster(2)", 4), ("cluster(4)+int4", 2), ("cluster(8)", 7)])
def test_triton_merge_with_pins_matches_reference(fmt, p, by, device):
    k, v, imp = _kv()
    k[1, 17, 0] *= 6  # one clear outlier
    k, v, imp = k.to(device), v.to(device), imp.to(device)
    a = compress_blocks(fmt, k, v, token_importance=imp, backend="torch", pinned_tokens=p, pin_by=by)
    b = compress_blocks(fmt, k, v, token_importance=imp, backend="triton", pinned_tokens=p, pin_by=by)
    assert a.log_count is not None and b.log_count is not None
    # The same counts; their logs may differ by one float32 ulp: torch's log and the kernel's (numpy's
    # under the interpreter, libdevice on a GPU) are not all correctly rounded, and which one is
    # depends on the machine's vector units (a 2026-12-07 CI VM: torch log(7) = 1.94591010, the
    # interpreter 1.94591022, one ulp apart; earlier machines agreed bit for bit).
    assert torch.equal(a.log_count.exp().round(), b.log_count.exp().round())
    torch.testing.assert_close(a.log_count, b.log_count, rtol=0.0, atol=2.5e-7)
    ka, va, _ = decompress_blocks(a, backend="torch")
    kb, vb, _ = decompress_blocks(b, backend="torch")
    assert torch.equal(ka[:, :p], kb[:, :p]) and torch.equal(va[:, :p], vb[:, :p])  # the pins: copies
    tol = 2e-3 if fmt.endswith(")") else 2e-2
    assert rel_err(kb, ka) < tol and rel_err(vb, va) < tol


@pytest.mark.parametrize("by", ref.PIN_BY)
def test_recompression_with_pins_triton_matches_reference_and_counts_add(by, device):
    """cluster(2) with 2 pins, then cluster(8) with 2 pins over the centroids (uniform row
    importance, as the vLLM worker ranks merged rows): same counts both backends, all 64 tokens
    accounted for; where the recompression pins a merged row, it keeps its count."""
    k, v, imp = _kv(seed=2)
    k[:, 9] *= 5
    k, v, imp = k.to(device), v.to(device), imp.to(device)
    c2 = compress_blocks("cluster(2)", k, v, token_importance=imp, backend="torch", pinned_tokens=2, pin_by=by)
    kh, vh, lc = decompress_blocks(c2, backend="torch")
    kw = dict(log_count=lc, source_tokens=64, token_importance=torch.ones(lc.shape, device=device),
              pinned_tokens=2, pin_by=by)
    a = compress_blocks("cluster(8)", kh, vh, backend="torch", **kw)
    b = compress_blocks("cluster(8)", kh, vh, backend="triton", **kw)
    assert a.log_count is not None and b.log_count is not None
    assert torch.equal(a.log_count.exp().round(), b.log_count.exp().round())
    assert torch.allclose(a.log_count.exp().sum(1), torch.full_like(a.log_count[:, 0], 64.0))
    ka, va, _ = decompress_blocks(a, backend="torch")
    kb, _vb, _ = decompress_blocks(b, backend="torch")
    assert torch.equal(ka[:, :2], kb[:, :2])
    # every pinned output row is one of the stored rows, with that row's count
    for n in range(ka.shape[0]):
        for hh in range(ka.shape[2]):
            for j in range(2):
                src = (kh[n, :, hh] == ka[n, j, hh]).all(-1).nonzero().flatten()
                assert len(src) >= 1
                assert torch.isclose(a.log_count[n, j, hh], lc[n, src[0], hh])
                assert torch.equal(va[n, j, hh], vh[n, src[0], hh])


def test_recompression_keeps_an_outlier_singleton_singleton():
    """The outlier token pinned at the first merge is still the block's outlier among the
    centroids: the recompression pins it again, bit-exact with count 1."""
    k, v, _ = _kv(n=2, seed=4)
    k[:, 30] = k[:, 30] * 8
    c2 = compress_blocks("cluster(2)", k, v, backend="torch", pinned_tokens=1, pin_by="outlier")
    kh, vh, lc = decompress_blocks(c2, backend="torch")
    assert torch.equal(kh[:, 0], k[:, 30]) and torch.equal(lc[:, 0], torch.zeros_like(lc[:, 0]))
    c8 = compress_blocks("cluster(8)", kh, vh, log_count=lc, source_tokens=64, backend="torch",
                         token_importance=torch.ones(lc.shape), pinned_tokens=1, pin_by="outlier")
    k8, v8, lc8 = decompress_blocks(c8, backend="torch")
    assert torch.equal(k8[:, 0], k[:, 30]) and torch.equal(v8[:, 0], v[:, 30])
    assert torch.equal(lc8[:, 0], torch.zeros_like(lc8[:, 0]))


def _passkey_block(seed: int = 0, t: int = 64, h: int = 2, d: int = 64):
    """A haystack of keys near one direction (prose tokens alike) and one token whose key points
    elsewhere (the passkey's digit), with a value of its own; importance marks it least (the
    question has not been seen: `after`)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(1, 1, h, d, generator=g)
    k = base + 0.3 * torch.randn(1, t, h, d, generator=g)
    v = torch.randn(1, t, h, d, generator=g)
    needle = 37
    k[0, needle] = 3.0 * torch.randn(h, d, generator=g)
    v[0, needle] = 4.0 * torch.randn(h, d, generator=g)
    imp = 0.5 + torch.rand(1, t, h, generator=g)
    imp[0, needle] = 0.01
    return k.bfloat16(), v.bfloat16(), imp, needle


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_passkey_like_token_stays_exact_only_with_outlier_protection(backend):
    """With `outlier` (or `mixed`) picks the distinct token is a singleton: a query aimed at it
    reads its value as the uncompressed block gives it; without pins (or with `importance`
    picks, which never saw it) it is averaged into a centroid and the value is lost."""
    k, v, imp, needle = _passkey_block()
    q = k[0, needle].float() * 4.0  # [H, D]: attends to the needle almost alone

    def read(cb) -> torch.Tensor:
        kh, vh, lc = decompress_blocks(cb, backend="torch")
        logits = torch.einsum("hd,thd->ht", q, kh[0].float()) / 8.0 + lc[0].T
        return torch.einsum("ht,thd->hd", logits.softmax(-1), vh[0].float())

    exact = read(compress_blocks("bf16", k, v, backend="torch"))
    errs = {}
    for name, kw in {"none": {}, "importance": {"pinned_tokens": 2, "pin_by": "importance"},
                     "outlier": {"pinned_tokens": 2, "pin_by": "outlier"},
                     "mixed": {"pinned_tokens": 2, "pin_by": "mixed"}}.items():
        cb = compress_blocks("cluster(4)", k, v, token_importance=imp, backend=backend, **kw)
        kh, _, lc = decompress_blocks(cb, backend="torch")
        kept = bool(((kh[0] == k[0, needle]).all(-1) & (lc[0] == 0)).any(0).all())  # a singleton row, every head
        errs[name] = (kept, float((read(cb) - exact).norm() / exact.norm()))
    assert errs["outlier"][0] and errs["mixed"][0]
    assert not errs["none"][0] and not errs["importance"][0]
    assert errs["outlier"][1] < 0.05 and errs["mixed"][1] < 0.05
    assert errs["none"][1] > 0.3 and errs["importance"][1] > 0.3


def test_pins_are_capped_below_the_slot_and_checked():
    k, v, imp = _kv(n=1)
    cb = compress_blocks("cluster(32)", k, v, token_importance=imp, backend="torch", pinned_tokens=9)
    _, _, lc = decompress_blocks(cb, backend="torch")
    assert lc.shape[1] == 2 and torch.equal(lc[:, 0], torch.zeros_like(lc[:, 0]))  # one pin, one centroid
    assert torch.allclose(lc.exp().sum(1), torch.full_like(lc[:, 0], 64.0))
    with pytest.raises(ValueError, match="pinned_tokens"):
        compress_blocks("cluster(2)", k, v, pinned_tokens=-1, backend="torch")
    with pytest.raises(ValueError, match="pin_by"):
        compress_blocks("cluster(2)", k, v, pinned_tokens=1, pin_by="norm", backend="torch")
    # formats without a merge ignore it
    a = compress_blocks("sparse(2)", k, v, token_importance=imp, backend="torch", pinned_tokens=3)
    b = compress_blocks("sparse(2)", k, v, token_importance=imp, backend="torch")
    assert torch.equal(a.k_data, b.k_data)


def test_zero_pins_is_todays_merge():
    k, v, imp = _kv()
    a = compress_blocks("cluster(4)+int4", k, v, token_importance=imp, backend="torch", pinned_tokens=0)
    ranks = ref.token_ranks(imp, None)
    kc, _vc, lc, _ = ref.cluster(k, v, imp.clamp_min(1e-6), ranks, 16, 4)
    b = compress_blocks("cluster(4)", k, v, token_importance=imp, backend="torch")
    assert torch.equal(b.k_data, kc.bfloat16()) and torch.equal(b.log_count, lc)  # type: ignore[arg-type]
    assert a.log_count is not None and torch.equal(a.log_count, lc)
