"""The method table, the harness and the report on a tiny random Llama."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hf_helpers import tiny_llama  # type: ignore[import-not-found]

from proxima.compression.spec import slot_spec
from proxima.integration.hf import ProximaCache, enable
from proxima.policy.loader import load_policy
from proxima.quality import harness, methods, report
from proxima.quality.datasets import NeedleSample, TextSample
from proxima.quality.h2o import AttentionSums
from proxima.quality.probe_records import probe_records

EXPERIMENTS = Path(__file__).resolve().parents[2] / "bench" / "policies"
"""The candidate policies bench/quality.py measures (the product never reads them itself)."""
ALL = methods.all_methods(EXPERIMENTS)
CONFIGS = Path(__file__).resolve().parents[2] / "proxima" / "policies"


class _Tok:
    def decode(self, toks: list[int]) -> str:
        return " ".join(map(str, toks))


@pytest.fixture(scope="module")
def prefilled():
    model = enable(tiny_llama(head_dim=64))  # SmolLM2's head_dim: every method's group size fits it
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (1, 512), generator=g)
    # Accumulated attention on, for h2o (the harness turns it on when a method needs it).
    hooks = (AttentionSums(),) if any(m.needs_accumulated_attention for m in ALL) else ()
    cache = ProximaCache(block_size=32, query_hooks=hooks)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    return model, cache


def _state(cache: ProximaCache, slot_ids: bool = True) -> list:
    """Everything a method could change in a cache: per layer the working copy, hot blocks,
    tail, formats, slots (the objects, or with `slot_ids=False` whether there is one) and masks;
    the engine's bookkeeping."""
    sums = [dict(h.sums) for h in cache.query_hooks if isinstance(h, AttentionSums)]
    out: list = [list(cache.chosen), sorted(cache.ineligible), len(probe_records(cache)), dict(cache._obs), sums]
    for layer in cache.proxima_layers:
        out += [
            [t.clone() if t is not None else None for t in layer.materialize()],
            [t.clone() if t is not None else None for t in layer.hot_k + layer.hot_v],
            layer.tail_k.clone(), list(layer.formats), [id(s) if slot_ids else s is None for s in layer.slots],
            list(layer.keep),
        ]
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("method", ALL, ids=[m.name for m in ALL])
def test_every_method_applies_and_keeps_its_budget(prefilled, method):
    model, base = prefilled
    before = _state(base)
    cache = base.fork()  # what the harness compresses: a fork of the prefill
    method.apply(cache)
    assert _same(_state(base), before), "compressing a fork changed the cache it was forked from"
    ratio = cache.nominal_ratio()
    # Bytes held include the metadata: the achieved ratio never exceeds the nominal one, and equals
    # it only where nothing carries metadata (eviction keeps 16-bit tokens).
    achieved = cache.achieved_ratio()
    assert achieved <= ratio + 1e-6
    layer = cache.proxima_layers[0]
    assert layer.tail_k is not None
    _, h, _, d = layer.tail_k.shape
    with_meta = any(
        slot_spec(f, block_size=cache.block_size, head_dim=d, num_kv_heads=h).meta_bytes_per_slot
        for f in cache.block_formats()
        if not f.is_hot
    )
    if with_meta:
        assert achieved < ratio
    else:
        assert achieved == pytest.approx(ratio, rel=1e-6)
    if method.family == "reference":
        assert ratio == pytest.approx(method.ratio, rel=0.02)  # exact budgets
    elif method.family == "format":
        assert 1.0 < ratio <= method.ratio + 1e-6  # first and last block stay hot
    elif method.family == "proxima":
        # The engine compresses (the pool is sized so the target means pressure) and may overshoot
        # the target (one action frees a whole 8x block), but never beyond its formats' ratios.
        name = method.name.split(":")[1].split("@")[0].removesuffix("-cal")
        policy = load_policy(methods.policy_path(name, EXPERIMENTS))
        assert 1.2 < ratio <= max(f.pack_ratio for f in policy.all_formats()) + 1e-6
    with torch.no_grad():
        out = model(torch.randint(0, 256, (1, 5)), past_key_values=cache).logits
    assert torch.isfinite(out).all()
    assert base.nominal_ratio() == 1.0  # the prefilled cache is untouched


FORK_METHODS = [
    "proxima:aggressive@4x", "proxima:quantized@8x", "proxima:balanced-cal@8x", "snapkv@4x", "streaming_llm@8x",
    "h2o@8x", "kivi-int4", "format:cluster(2)+int4", "format:sparse(4)",
]


@pytest.mark.parametrize("name", FORK_METHODS)
def test_a_fork_compresses_exactly_like_a_deepcopy(prefilled, name):
    """`ProximaCache.fork` (the harness's copy per method, and `apply_policy`'s byte passes)
    gives what `copy.deepcopy` gives: same formats, bytes, working copy and logits."""
    import copy

    model, base = prefilled
    (method,) = [m for m in ALL if m.name == name]
    before = _state(base)
    forked, deep = base.fork(), copy.deepcopy(base)
    method.apply(forked)
    method.apply(deep)
    assert forked.block_formats() == deep.block_formats() and forked.chosen == deep.chosen
    assert forked.held_nbytes() == deep.held_nbytes() and forked.ineligible == deep.ineligible
    assert _same(_state(forked, slot_ids=False)[5:], _state(deep, slot_ids=False)[5:])
    nxt = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(nxt, past_key_values=forked).logits, model(nxt, past_key_values=deep).logits)
    assert _same(_state(base), before)  # appending tokens to the fork left the prefill as it was


def test_select_puts_baseline_first():
    chosen = methods.select(["snapkv"])
    assert [m.name for m in chosen] == ["baseline", "snapkv@2x", "snapkv@4x", "snapkv@8x"]
    with pytest.raises(ValueError, match="unknown methods"):
        methods.select(["nope"])


def test_harness_metrics_and_report(tmp_path):
    model = tiny_llama()
    g = torch.Generator().manual_seed(0)
    text = [TextSample("t", torch.randint(0, 256, (128,), generator=g).tolist(), list(range(10, 26)))]
    needles = [NeedleSample("n", torch.randint(0, 256, (128,), generator=g).tolist(), [1, 2], "7", 0.5)]
    chosen = methods.select(
        ["proxima:balanced@4x", "streaming_llm@4x", "snapkv@4x", "h2o@4x", "kivi-int4", "format:int8"]
    )
    rows = harness.evaluate(model, _Tok(), chosen, text, needles, block_size=32, greedy_tokens=8, log=lambda _m: None)
    assert [(r.method, r.setting) for r in rows[:2]] == [("baseline", "after"), ("baseline", "inside")]
    assert all(r.needle_n == 1 for r in rows)
    base = rows[0]
    assert base.tf_top1 == 1.0 and base.kl == pytest.approx(0.0, abs=1e-6) and base.agreement == 1.0
    assert all(0 <= r.tf_top1 <= 1 and r.kl >= 0 and math.isfinite(r.ppl) for r in rows)
    md = report.markdown(rows, {"run": "test"})
    assert "| baseline | 1 |" in md and "## Setting `after`" in md and "## Setting `inside`" in md
    assert "At >= 4x" in md or ">= 4x: no policy reaches it" in md
    report.plot(rows, tmp_path / "q.png")
    assert (tmp_path / "q.png").stat().st_size > 10_000
    as_json = json.loads(json.dumps([r.as_dict() for r in rows]))
    assert {
        "method", "family", "setting", "ratio", "achieved_ratio", "nominal_ratio", "needle_acc", "needle_n",
        "ppl", "tf_top1", "kl", "agreement",
    } <= set(as_json[0])


def test_targets_read_the_rows():
    rows = [
        {"method": "baseline", "ratio": 1, "achieved_ratio": 1, "needle_acc": 1.0, "ppl": 10.0, "tf_top1": 1.0},
        {"method": "proxima:x@4x", "ratio": 4, "achieved_ratio": 4.0, "needle_acc": 1.0, "ppl": 10.2, "tf_top1": 0.96},
        {"method": "snapkv@4x", "ratio": 4, "achieved_ratio": 4.0, "needle_acc": 0.5, "ppl": 10.1, "tf_top1": 0.8},
    ]
    lines = report.check_targets(rows)
    at4 = lines[: lines.index(next(x for x in lines if "6x" in x))]
    assert at4[0].startswith("At >= 4x: `proxima:x@4x`")
    assert all(line.startswith("- PASS") for line in at4[1:]), lines
    assert "- FAIL: >= 6x: no policy reaches it (best achieved 4.00)" in lines
    assert "- FAIL: >= 8x: no policy reaches it (best achieved 4.00)" in lines


def _suite():
    g = torch.Generator().manual_seed(0)
    text = [TextSample("t", torch.randint(0, 256, (128,), generator=g).tolist(), list(range(10, 26)))]
    needles = [
        NeedleSample(f"n{i}", torch.randint(0, 256, (160,), generator=g).tolist(), [1, 2, 3], "7", 0.5)
        for i in range(2)
    ]
    return text, needles


def test_batched_methods_give_the_rows_of_one_at_a_time():
    """The harness decodes `method_batch` methods as one batch (what makes the GPU run fit its
    time): every metric equals the one-method-per-forward run."""
    model = tiny_llama()
    text, needles = _suite()
    chosen = methods.select(
        ["proxima:aggressive@4x", "snapkv@4x", "streaming_llm@8x", "kivi-int4", "format:cluster(2)+int4"]
    )
    kw = {"block_size": 32, "greedy_tokens": 6, "log": lambda _m: None}
    one = harness.evaluate(model, _Tok(), chosen, text, needles, method_batch=1, **kw)
    many = harness.evaluate(model, _Tok(), chosen, text, needles, method_batch=4, **kw)
    for a, b in zip(one, many, strict=True):
        assert (a.method, a.setting, a.needle_n, a.text_n) == (b.method, b.setting, 2, 1)
        assert a.achieved_ratio == b.achieved_ratio and a.formats == b.formats
        assert a.needle_acc == b.needle_acc and a.agreement == b.agreement
        assert a.ppl == pytest.approx(b.ppl, rel=1e-5) and a.kl == pytest.approx(b.kl, abs=1e-5)
        assert a.tf_top1 == b.tf_top1


def test_time_budget_stops_before_a_sample_and_checkpoints_every_one():
    import time

    model = tiny_llama()
    text, needles = _suite()
    chosen = methods.select(["kivi-int4"])
    seen: list[list[harness.Row]] = []
    rows = harness.evaluate(
        model, _Tok(), chosen, text, needles, block_size=32, greedy_tokens=0, log=lambda _m: None,
        checkpoint=seen.append,
    )
    assert [r[0].needle_n for r in seen] == [0, 1, 2] and [r[0].text_n for r in seen] == [1, 1, 1]
    # A deadline already passed: the first sample is expected to end after it, nothing starts.
    logs: list[str] = []
    rows = harness.evaluate(
        model, _Tok(), chosen, text, needles, block_size=32, greedy_tokens=0, log=logs.append,
        deadline=time.monotonic() - 1,
    )
    assert all(r.needle_n == 0 and r.text_n == 0 for r in rows)
    assert any(line.startswith("[budget] text window 1/1 not started") for line in logs)


def test_the_gpu_kernels_give_the_cpu_rows():
    """What `bench/quality.py --device cuda` runs differs from the CPU run only in the compression
    kernels (Triton for CUDA tensors); here they run interpreted (conftest: TRITON_INTERPRET=1) on CPU
    tensors through the same harness: same formats and bytes, metrics within rounding."""
    model = tiny_llama()
    text, needles = _suite()
    chosen = methods.select(
        ["proxima:aggressive@4x", "proxima:quantized@4x", "kivi-int4", "format:sparse(4)"], EXPERIMENTS
    )
    kw = {"block_size": 32, "greedy_tokens": 0, "method_batch": 8, "log": lambda _m: None}
    ref = harness.evaluate(model, _Tok(), chosen, text, needles[:1], backend="torch", **kw)
    tri = harness.evaluate(model, _Tok(), chosen, text, needles[:1], backend="triton", **kw)
    for a, b in zip(ref, tri, strict=True):
        assert a.method == b.method and a.formats == b.formats and a.achieved_ratio == b.achieved_ratio
        assert a.ppl == pytest.approx(b.ppl, rel=2e-3) and a.kl == pytest.approx(b.kl, abs=2e-3)
    assert any(r.formats.get("int4") for r in tri) and any(r.formats.get("sparse(4)") for r in tri)


def test_shards_merge_into_the_whole_run():
    """`bench/quality.py --shard I/N` runs (one per GPU) joined by `--merge` give the rows of one
    run over all the samples."""
    model = tiny_llama()
    text, needles = _suite()
    text = [*text, TextSample("t2", list(range(30, 158)), list(range(40, 56)))]
    chosen = methods.select(["proxima:aggressive@4x", "kivi-int4", "snapkv@8x"])
    kw = {"block_size": 32, "greedy_tokens": 4, "method_batch": 8, "log": lambda _m: None}
    whole = harness.evaluate(model, _Tok(), chosen, text, needles, **kw)
    shards = [harness.evaluate(model, _Tok(), chosen, text[i::2], needles[i::2], **kw) for i in range(2)]
    as_dicts = [json.loads(json.dumps([r.as_dict() for r in rows])) for rows in shards]
    rows, meta = report.merge_shards(as_dicts, [{"shard": "0/2", "complete": True}, {"shard": "1/2"}], ["a", "b"])
    assert meta["shards"] == ["0/2", "1/2"] and meta["complete"] is False
    for a, b in zip(whole, rows, strict=True):
        assert (a.method, a.setting, a.needle_n, a.text_n) == (b["method"], b["setting"], b["needle_n"], b["text_n"])
        for key in ("needle_acc", "ppl", "tf_top1", "kl", "achieved_ratio", "nominal_ratio", "agreement"):
            assert getattr(a, key) == pytest.approx(b[key], rel=1e-3, abs=1e-3), key
        assert a.formats == b["formats"]
    with pytest.raises(ValueError, match="b: its rows are not the same"):
        report.merge_shards([as_dicts[0], as_dicts[1][:2]], [{}, {}], ["a", "b"])


def test_merged_meta_counts_every_shard_and_is_complete_only_when_all_ran():
    """The merged meta plans the samples of all shards; a shard cut by its budget (`complete`
    false) or killed mid-run (`partial`, no `complete`) makes the whole run incomplete, and the
    markdown says so above the tables."""
    row = {
        "method": "baseline", "family": "baseline", "setting": "after", "ratio": 1.0, "achieved_ratio": 1.0,
        "nominal_ratio": 1.0, "needle_acc": 1.0, "needle_n": 2, "text_n": 1, "ppl": 10.0, "tf_top1": 1.0,
        "kl": 0.0, "agreement": None, "formats": {}, "seconds": 1.0,
    }
    metas = [
        {"shard": f"{i}/2", "passkey_samples": 2, "text_samples": [f"t{i}"], "passkey_lengths": [1020 * (i + 1)],
         "command": f"run {i}", "budget_s": 450.0, "complete": True}
        for i in range(2)
    ]
    rows, meta = report.merge_shards([[row], [row]], metas, ["a", "b"])
    assert meta["complete"] is True and meta["passkey_samples"] == 4 and meta["passkey_samples_run"] == 4
    assert meta["text_samples"] == ["t0", "t1"] and meta["passkey_lengths"] == [1020, 2040]
    assert meta["commands"] == ["run 0", "run 1"] and "command" not in meta and meta["budgets_s"] == [450.0] * 2
    assert "Not the whole suite" not in report.markdown(rows, meta)
    cut = {**row, "needle_n": 1}
    rows, meta = report.merge_shards([[row], [cut]], metas, ["a", "b"])
    assert meta["complete"] is False and meta["passkey_samples_run"] == 3
    assert "**Not the whole suite**: 3 of 4 passkeys and 2 of 2 text windows ran" in report.markdown(rows, meta)
    killed = {k: v for k, v in metas[1].items() if k != "complete"} | {"partial": True}
    assert report.merge_shards([[row], [row]], [metas[0], killed], ["a", "b"])[1]["complete"] is False


def test_a_shard_of_the_unstarted_samples_completes_the_merge():
    """`bench/quality.py --samples` runs what a budget left unstarted; the merge counts distinct
    passkeys by name (the first `needle_n` of a shard's `passkey_names` ran) and refuses a sample
    that ran twice."""
    row = {
        "method": "baseline", "family": "baseline", "setting": "after", "ratio": 1.0, "achieved_ratio": 1.0,
        "nominal_ratio": 1.0, "needle_acc": 1.0, "needle_n": 1, "text_n": 1, "ppl": 10.0, "tf_top1": 1.0,
        "kl": 0.0, "agreement": None, "formats": {}, "seconds": 1.0,
    }
    cut = {"shard": "0/1", "passkey_samples": 2, "passkey_names": ["p0", "p1"], "text_samples": ["t0"],
           "complete": False}
    rest = {"shard": None, "passkey_samples": 1, "passkey_names": ["p1"], "text_samples": [], "complete": True}
    _, meta = report.merge_shards([[row], [{**row, "text_n": 0}]], [cut, rest], ["a", "b"])
    assert meta["complete"] is True and meta["passkey_samples"] == 2 and meta["passkey_samples_run"] == 2
    alone = report.merge_shards([[row]], [cut], ["a"])[1]
    assert alone["complete"] is False and alone["passkey_samples"] == 2
    with pytest.raises(ValueError, match="ran in more than one shard: p0"):
        report.merge_shards([[row], [row]], [cut, {**rest, "passkey_names": ["p0"]}], ["a", "b"])


def _shard(needle_n: int, text_n: int, needle: float = 1.0, seconds: float = 1.0) -> list[dict]:
    return [{
        "method": "baseline", "family": "baseline", "setting": "after", "ratio": 1.0, "achieved_ratio": 1.0,
        "nominal_ratio": 1.0, "needle_acc": needle if needle_n else None, "needle_n": needle_n, "text_n": text_n,
        "ppl": 10.0 if text_n else None, "tf_top1": 1.0 if text_n else None, "kl": 0.0 if text_n else None,
        "agreement": None, "formats": {}, "seconds": seconds,
    }]


def _meta(shard: str | None, passkeys: list[str], texts: list[str], complete: bool) -> dict:
    return {"shard": shard, "passkey_samples": len(passkeys), "passkey_names": passkeys, "text_samples": texts,
            "command": f"run {shard}", "date": "d", "budget_s": 100.0, "seconds": 10, "complete": complete}


def test_a_merged_result_merges_again_with_a_later_shard():
    """The merged `passkey_names` / `text_samples` keep the order samples ran in (the first
    `needle_n` / `text_n` of them ran), so a merge of cut shards takes the shard that ran the rest
    and neither misreads which ran nor refuses a sample as run twice; its per-shard lists stay flat."""
    # A budget cut each shard after its first passkey: p2 and p3 ran, p1 and p0 did not.
    a = (_shard(1, 1), _meta("0/2", ["p2", "p1"], ["t0"], False))
    b = (_shard(1, 1), _meta("1/2", ["p3", "p0"], ["t1"], False))
    rows, first = report.merge_shards([a[0], b[0]], [a[1], b[1]], ["a.json", "b.json"])
    assert first["passkey_names"] == ["p2", "p3", "p1", "p0"]  # ran first, in shard order
    assert first["passkey_samples"] == 4 and first["passkey_samples_run"] == 2 and first["complete"] is False
    # `--samples p1,p0` in a later call, merged with the merged result (p0 fails its passkey)
    later = (_shard(2, 0, needle=0.5), _meta(None, ["p1", "p0"], [], True))
    rows, meta = report.merge_shards([rows, later[0]], [first, later[1]], ["ab.json", "c.json"])
    assert meta["complete"] is True and meta["passkey_samples"] == 4 and meta["passkey_samples_run"] == 4
    assert meta["passkey_names"] == ["p2", "p3", "p1", "p0"] and meta["text_samples"] == ["t0", "t1"]
    assert rows[0]["needle_acc"] == pytest.approx(0.75) and rows[0]["needle_n"] == 4 and rows[0]["text_n"] == 2
    assert meta["shards"] == ["0/2", "1/2", None] and meta["commands"] == ["run 0/2", "run 1/2", "run None"]
    assert meta["merged_from"] == ["a.json", "b.json", "c.json"] and meta["shard_seconds"] == [10, 10, 10]
    assert "Not the whole suite" not in report.markdown(rows, meta)
    # ... and a sample that really ran twice is still refused through a merged result
    again = (_shard(1, 0), _meta(None, ["p3"], [], True))
    with pytest.raises(ValueError, match="passkey samples ran in more than one shard: p3"):
        report.merge_shards([rows, again[0]], [meta, again[1]], ["abc.json", "d.json"])


def test_a_text_window_that_ran_in_two_shards_is_refused():
    """Text windows are counted by name as passkeys are: one that ran twice would weigh double."""
    a = (_shard(1, 1), _meta("0/1", ["p0"], ["t0", "t1"], False))  # t1 not started
    twice = (_shard(0, 1), _meta(None, [], ["t0"], True))
    with pytest.raises(ValueError, match="text windows ran in more than one shard: t0"):
        report.merge_shards([a[0], twice[0]], [a[1], twice[1]], ["a", "b"])
    rest = (_shard(0, 1), _meta(None, [], ["t1"], True))
    _, meta = report.merge_shards([a[0], rest[0]], [a[1], rest[1]], ["a", "b"])
    assert meta["text_samples"] == ["t0", "t1"] and meta["text_samples_run"] == 2 and meta["complete"] is True
    # a window planned but not run in one shard and not run anywhere else: not complete
    _, meta = report.merge_shards([a[0]], [a[1]], ["a"])
    assert meta["text_samples"] == ["t0", "t1"] and meta["complete"] is False


def test_shards_without_passkey_names_leave_no_partial_list():
    """A shard from before `passkey_names` was recorded: the merged meta has no list naming some
    shards' samples only (and counts completeness by the shards' own `complete`)."""
    named = (_shard(1, 1), _meta("0/2", ["p0"], ["t0"], True))
    old = {k: v for k, v in _meta("1/2", ["p1"], ["t1"], True).items() if k != "passkey_names"}
    rows, meta = report.merge_shards([named[0], _shard(1, 1)], [named[1], old], ["a", "b"])
    assert "passkey_names" not in meta and "passkey_names" not in report.markdown(rows, meta)
    assert meta["passkey_samples"] == 2 and meta["complete"] is True
    _, meta = report.merge_shards([_shard(1, 1), named[0]], [old, named[1]], ["b", "a"])
    assert "passkey_names" not in meta and meta["complete"] is True
    no_texts = {k: v for k, v in old.items() if k != "text_samples"}
    _, meta = report.merge_shards([named[0], _shard(1, 1)], [named[1], no_texts], ["a", "b"])
    assert "text_samples" not in meta and "passkey_names" not in meta


def _row(method, family, setting, ratio, needle, ppl, top1):
    return {"method": method, "family": family, "setting": setting, "achieved_ratio": ratio, "needle_acc": needle,
            "ppl": ppl, "tf_top1": top1}


def test_plot_curves_by_family_and_the_proxima_envelope(tmp_path):
    rows = []
    for st in ("after", "inside"):
        rows += [
            _row("baseline", "baseline", st, 1.0, 1.0, 10.0, 1.0),
            _row("proxima:quantized@4x", "proxima", st, 3.9, 0.8, 10.5, 0.9),
            _row("proxima:quantized@8x", "proxima", st, 7.5, 0.1, 12.0, 0.8),
            _row("proxima:aggressive@4x", "proxima", st, 4.2, 0.9, 11.0, 0.85),
            _row("kivi-int4", "reference", st, 3.1, 1.0, 10.0, 0.95),
            _row("fp8", "reference", st, 1.9, 1.0, 10.0, 0.99),
            _row("format:int2", "format", st, 4.4, 0.9, 11.5, 0.82),
            _row("format:cluster(2)+int4", "format", st, 4.9, 0.2, 11.0, 0.88),
            _row("snapkv@4x", "reference", st, 4.0, 0.1, 12.0, 0.85),
            _row("snapkv@8x", "reference", st, 8.0, 0.0, 40.0, 0.7),
            _row("h2o@8x", "reference", st, 8.0, 0.0, 38.0, 0.72),
        ]
    series = report._series([r for r in rows if r["setting"] == "after"])
    assert sorted(series) == sorted([
        "proxima:quantized", "proxima:aggressive", report.UNIFORM_EVERY, report.UNIFORM_FORMAT,
        report.REDUCING_FORMAT, "snapkv", "h2o",
    ])
    assert [r["method"] for r in series[report.UNIFORM_EVERY]] == ["kivi-int4", "fp8"]
    assert len(series["proxima:quantized"]) == 2 and len(series["snapkv"]) == 2
    # The envelope: the best value reachable at >= each ratio (aggressive@4x beats quantized@4x
    # at a higher ratio, so quantized@4x is not on it for passkeys; it is for top-1).
    needle = [(3.9, 0.8), (7.5, 0.1), (4.2, 0.9)]
    assert report.envelope(needle, higher_is_better=True) == [(4.2, 0.9), (7.5, 0.1)]
    assert report.envelope([(3.9, 0.9), (7.5, 0.8), (4.2, 0.85)], True) == [(3.9, 0.9), (4.2, 0.85), (7.5, 0.8)]
    assert report.envelope([(3.9, 10.5), (7.5, 12.0), (4.2, 11.0)], False) == [(3.9, 10.5), (4.2, 11.0), (7.5, 12.0)]
    report.plot(rows, tmp_path / "q.png")
    assert (tmp_path / "q.png").stat().st_size > 50_000
    lines = report.against_uniform([r for r in rows if r["setting"] == "after"])
    by = {line.split(" | ")[0].removeprefix("| "): line for line in lines[2:]}
    # quantized@4x (3.9x): kivi-int4 holds more bytes, so is not compared; int2 (4.4x) and
    # cluster(2)+int4 (4.9x) hold fewer: it beats both on perplexity and top-1.
    assert by["proxima:quantized@4x"].split(" | ")[2:4] == ["2", "format:int2, format:cluster(2)+int4"]
    assert by["proxima:quantized@8x"].split(" | ")[2] == "0"
