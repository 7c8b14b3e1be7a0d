"""The H2O baseline: accumulated attention (`proxima.quality.h2o`, a hook on `ProximaCache`) and
the `h2o@<r>x` methods."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import tiny_llama  # type: ignore[import-not-found]

from proxima.integration.hf import ProximaCache, enable
from proxima.quality import h2o as cache_mod
from proxima.quality import harness, methods, report
from proxima.quality.h2o import AttentionSums, attention_sums

T, BLOCK = 300, 32  # 9 full blocks (288 tokens) and a 12-token hot tail


def _ids(n: int = T, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _by_name(name: str) -> methods.Method:
    (m,) = [m for m in methods.all_methods() if m.name == name]
    return m


def _eager_column_sums(ids: torch.Tensor) -> list[torch.Tensor]:
    """The reference, written out independently of the cache: transformers' eager attention
    returns each layer's causal softmax `[B, Hq, T(query), T(key)]`; sum it over the queries,
    then over each KV head's query heads (query head h reads KV head h // group, as
    `repeat_kv` lays them out). Returns per layer `[B, H_kv, T]`."""
    model = tiny_llama()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    sums = []
    for probs in out.attentions:
        b, hq, tq, tk = probs.shape
        assert (hq, tq, tk) == (cfg.num_attention_heads, ids.shape[1], ids.shape[1])
        per_query_head = probs.sum(dim=2)  # [B, Hq, T]
        sums.append(per_query_head.view(b, hq // group, group, tk).sum(dim=2))
    return sums


@pytest.mark.parametrize(
    ("pieces", "chunk"),
    [((T,), cache_mod.ACCUMULATE_CHUNK), ((T,), 37), ((200, 100), 64), ((150, 1, 149), 256)],
    ids=["one-forward", "odd-chunks", "two-forwards", "with-a-decode-step"],
)
def test_accumulated_attention_is_the_full_attention_column_sum(monkeypatch, pieces, chunk):
    """Over every query the cache saw, in query chunks and over several forwards (a prompt fed in
    pieces, a one-token step), the sums equal eager attention's probabilities summed over queries
    and each KV head's query heads, for every cached token (full blocks and the tail)."""
    monkeypatch.setattr(cache_mod, "ACCUMULATE_CHUNK", chunk)
    ids = _ids()
    want = _eager_column_sums(ids)
    model = enable(tiny_llama())
    cache = ProximaCache(block_size=BLOCK, query_hooks=(AttentionSums(),))
    with torch.no_grad():
        start = 0
        for n in pieces:
            model(ids[:, start : start + n], past_key_values=cache)
            start += n
    assert start == T and len(want) == len(cache.layers) == 2
    for li, ref in enumerate(want):
        got = attention_sums(cache).scores(cache, li)
        assert got.shape == (1, 2, 9 * BLOCK)  # full blocks only, per KV head
        torch.testing.assert_close(got, ref[..., : 9 * BLOCK], rtol=1e-4, atol=1e-4)
        whole, seen = attention_sums(cache).sums[li]
        assert seen == T
        torch.testing.assert_close(whole, ref, rtol=1e-4, atol=1e-4)  # the tail's tokens too
        # each query's softmax sums to 1 for each of the 4 query heads: the total is T x 4
        assert float(whole.sum()) == pytest.approx(T * 4, rel=1e-5)


def test_accumulation_is_off_by_default_and_h2o_says_what_to_enable():
    model = enable(tiny_llama())
    cache = ProximaCache(block_size=BLOCK)
    assert cache.query_hooks == []
    with torch.no_grad():
        model(_ids(), past_key_values=cache)  # no second attention pass was paid: there is no hook to pay it
    with pytest.raises(RuntimeError, match=r"h2o@4x: .*attach proxima.quality.h2o.AttentionSums"):
        _by_name("h2o@4x").apply(cache.fork())
    assert all(kp is None for layer in cache.proxima_layers for kp in layer.keep)  # nothing evicted
    # Switched on after the prefill: the sums would miss the prompt's queries, and say so.
    late = ProximaCache(block_size=BLOCK)
    with torch.no_grad():
        model(_ids()[:, :200], past_key_values=late)
        late.query_hooks.append(AttentionSums())
        model(_ids()[:, 200:], past_key_values=late)
    with pytest.raises(RuntimeError, match="covers 100 of its 300 queries"):
        _by_name("h2o@8x").apply(late)


@pytest.fixture(scope="module")
def accumulated() -> ProximaCache:
    model = enable(tiny_llama())
    cache = ProximaCache(block_size=BLOCK, query_hooks=(AttentionSums(),))
    with torch.no_grad():
        model(_ids(), past_key_values=cache)
    return cache


def _keep_mask(cache: ProximaCache, layer_idx: int) -> torch.Tensor:
    """The layer's eviction masks over its full blocks, `[B, H_kv, T_full]` (None: block kept whole)."""
    layer = cache.proxima_layers[layer_idx]
    assert layer.tail_k is not None
    b, h = layer.tail_k.shape[:2]
    whole = torch.ones(b, h, layer.block_size, dtype=torch.bool)
    return torch.cat([whole if kp is None else kp for kp in layer.keep], dim=-1)


@pytest.mark.parametrize("ratio", methods.RATIOS)
def test_h2o_keeps_the_budget_the_window_and_the_heaviest_tokens(accumulated, ratio):
    cache = accumulated.fork()
    _by_name(f"h2o@{ratio}x").apply(cache)
    full, tail = 9 * BLOCK, T - 9 * BLOCK
    budget = round(T / ratio) - tail  # the hot tail is kept and counts against the budget
    window = methods.SNAP_WINDOW - tail  # ... and against the recent window
    assert 0 < window < budget < full
    assert cache.nominal_ratio() == pytest.approx(T / (budget + tail))
    for li in range(len(cache.layers)):
        keep = _keep_mask(cache, li)
        scores = attention_sums(accumulated).scores(accumulated, li)  # the fork's scores are the prefill's
        assert keep.shape == scores.shape == (1, 2, full)
        assert (keep.sum(-1) == budget).all(), keep.sum(-1)  # exactly the budget, per KV head
        assert keep[..., full - window :].all()  # the recent window, always
        older_kept = scores[..., : full - window].masked_fill(~keep[..., : full - window], float("inf"))
        evicted = scores.masked_fill(keep, float("-inf"))
        # every kept token outside the window outweighs every evicted one, per head
        assert (older_kept.amin(-1) >= evicted.amax(-1)).all()
    # snapkv keeps as many tokens, chosen by the last 32 queries (pooled): not the same ones
    snap = accumulated.fork()
    _by_name(f"snapkv@{ratio}x").apply(snap)
    assert not torch.equal(_keep_mask(snap, 0), _keep_mask(cache, 0))


def test_the_harness_accumulates_only_when_a_method_needs_it(monkeypatch):
    assert [m.name for m in methods.all_methods() if m.needs_accumulated_attention] == [
        f"h2o@{r}x" for r in methods.RATIOS
    ]
    seen: list[bool] = []
    real = harness._prefill

    def spy(*args, **kwargs):
        cache, logits = real(*args, **kwargs)
        seen.append(any(isinstance(h, AttentionSums) for h in cache.query_hooks))
        return cache, logits

    monkeypatch.setattr(harness, "_prefill", spy)
    from proxima.quality.datasets import NeedleSample, TextSample

    class Tok:
        def decode(self, toks: list[int]) -> str:
            return " ".join(map(str, toks))

    text = [TextSample("t", _ids(128).flatten().tolist(), list(range(10, 26)))]
    needles = [NeedleSample("n", _ids(160, 6).flatten().tolist(), [1, 2], "7", 0.5)]
    kw = {"block_size": BLOCK, "greedy_tokens": 0, "settings": ("after",), "log": lambda _m: None}
    model = tiny_llama()
    rows = harness.evaluate(model, Tok(), methods.select(["kivi-int4"]), text, needles, **kw)
    assert seen == [False, False] and len(rows) == 2
    seen.clear()
    rows = harness.evaluate(model, Tok(), methods.select(["h2o@4x", "snapkv@4x"]), text, needles, **kw)
    assert seen == [True, True]
    by = {r.method: r for r in rows}
    assert by["h2o@4x"].achieved_ratio == by["snapkv@4x"].achieved_ratio == pytest.approx(4.0, rel=0.02)


def test_h2o_rows_are_an_eviction_curve_and_an_8x_reference():
    rows = [
        {"method": "baseline", "family": "baseline", "ratio": 1, "achieved_ratio": 1, "needle_acc": 1.0,
         "ppl": 10.0, "tf_top1": 1.0},
        {"method": "proxima:x@8x", "family": "proxima", "ratio": 8, "achieved_ratio": 8.0, "needle_acc": 0.5,
         "ppl": 11.0, "tf_top1": 0.9},
        {"method": "h2o@8x", "family": "reference", "ratio": 8, "achieved_ratio": 8.0, "needle_acc": 0.1,
         "ppl": 12.0, "tf_top1": 0.8},
        {"method": "h2o@4x", "family": "reference", "ratio": 4, "achieved_ratio": 4.0, "needle_acc": 0.2,
         "ppl": 11.5, "tf_top1": 0.85},
        {"method": "kivi-int4", "family": "reference", "ratio": 4, "achieved_ratio": 3.2, "needle_acc": 1.0,
         "ppl": 10.1, "tf_top1": 0.97},
    ]
    assert report.family_curve(rows[2]) == report.family_curve(rows[3]) == "h2o"
    assert [r["method"] for r in rows if report._uniform(r)] == ["kivi-int4"]  # eviction is not a format
    lines = report.check_targets(rows)
    assert "- PASS: beats `h2o@8x` on all three (needle, ppl, tf_top1)" in lines


def test_accumulation_over_compressed_blocks_follows_the_masks_attention_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """With merged (log-count bias) and sparsified (-inf for unused slots) blocks in the cache, a
    later forward adds to the scores exactly the attention that SDPA computes with the mask the
    `proxima` attention hands it: the bias is part of the accumulated softmax."""
    from transformers.integrations import sdpa_attention

    from proxima.formats import Format

    torch.manual_seed(0)
    model = enable(tiny_llama())
    ids = _ids(T, seed=0)
    c = ProximaCache(block_size=BLOCK, query_hooks=(AttentionSums(),))
    with torch.no_grad():
        model(ids[:, :200], past_key_values=c)
    c.compress_blocks([1, 2, 3], Format.parse("cluster(2)+int4"))
    c.compress_blocks([4], Format.parse("sparse(2)"))
    assert all(layer.materialize()[2] is not None for layer in c.proxima_layers)  # a per-key bias is in play
    seen: dict[int, torch.Tensor] = {}
    real = sdpa_attention.sdpa_attention_forward

    def spy(module, q, k, v, mask, **kw):  # type: ignore[no-untyped-def]
        group = q.shape[1] // k.shape[1]
        logits = q.float() @ k.repeat_interleave(group, 1).float().transpose(-1, -2) * kw["scaling"]
        if mask is None:
            tq, tk = q.shape[2], k.shape[2]
            future = torch.arange(tk)[None] > (torch.arange(tq)[:, None] + tk - tq)
            logits = logits.masked_fill(future, float("-inf"))
        elif mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask, float("-inf"))
        else:
            logits = logits + mask.float()
        p = logits.softmax(-1).sum(2)  # [B, Hq, T]
        seen[module.layer_idx] = p.view(p.shape[0], k.shape[1], group, -1).sum(2)
        return real(module, q, k, v, mask, **kw)

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", spy)
    sums = attention_sums(c)
    before = {li: acc.clone() for li, (acc, _) in sums.sums.items()}
    with torch.no_grad():
        model(ids[:, 200:], past_key_values=c)
    assert set(seen) == set(before)
    for li, prev in before.items():
        delta = sums.sums[li][0].clone()
        delta[..., : prev.shape[-1]] -= prev
        torch.testing.assert_close(delta, seen[li], atol=1e-5, rtol=1e-4)
