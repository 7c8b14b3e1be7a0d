"""The equal-bytes benchmark's schedule, runs file, table and step file (no engine: runs are given)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.capacity_rows import stats_delta, step_split, summarize
from bench.capacity_runs import (
    aggregate,
    document,
    load_runs,
    markdown,
    new_runs,
    pending,
    record,
    rep_order,
    save,
    schedule,
)
from bench.kv_budget import Pool
from bench.step_report import step_document, write_step_file

SPEC = {"requests": 4, "prompt_tokens": 64, "output_tokens": 8, "score_prompts": True}
POOL = Pool(blocks=6, block_bytes=1 << 20)


def _raw(rate_tokens: int, running: list[int], proxima: dict | None = None) -> dict:
    return {"build_s": 3.0, "wall_s": 2.0, "truncated": False, "finished_requests": 4,
            "generated_tokens": rate_tokens, "steps": [(0.1 * i, r, int(i == 1)) for i, r in enumerate(running)],
            "graph_modes": {"NONE": 1, "PIECEWISE": 3}, "cudagraph_mode": "PIECEWISE", "device": "cuda",
            "enforce_eager": False, "async_scheduling": True, "ttft_s": [0.1, 0.2, 0.3, 0.4],
            "tpot_s": [0.01, 0.02, 0.03, 0.04], "proxima": proxima or {}, "prompt_nll": [2.0, 2.2],
            "prompt_top1": [0.5, 0.7], "scored_prompts": 2}


def test_reps_alternate_their_order() -> None:
    rows = ["a", "b", "c"]
    assert rep_order(rows, 1) == rows and rep_order(rows, 2) == ["c", "b", "a"] and rep_order(rows, 3) == rows
    assert [(r, row) for r, _, row in schedule(rows, 2)] == [(1, "a"), (1, "b"), (1, "c"), (2, "c"), (2, "b"),
                                                              (2, "a")]
    with pytest.raises(ValueError, match="repetition 0"):
        rep_order(rows, 0)


def test_resume_skips_what_the_file_holds_and_checks_it_is_the_same_benchmark(tmp_path: Path) -> None:
    path = tmp_path / "runs.json"
    doc = new_runs("quality", SPEC, ["a", "b"], {"date": "d1"})
    record(doc, 1, 0, "a", summarize("vanilla", _raw(40, [1, 2]), POOL), 10.0, "t")
    save(path, doc)
    again = load_runs(path, "quality", SPEC, ["a", "b"])
    assert pending(again, 2) == [(1, 1, "b"), (2, 0, "b"), (2, 1, "a")]
    assert pending(again, 2, only=["a"]) == [(2, 1, "a")]
    with pytest.raises(ValueError, match="holds workload 'quality'"):
        load_runs(path, "throughput", SPEC, ["a", "b"])
    with pytest.raises(ValueError, match="requests"):
        load_runs(path, "quality", SPEC | {"requests": 5}, ["a", "b"])
    with pytest.raises(ValueError, match="row order"):
        load_runs(path, "quality", SPEC, ["b", "a"])
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="not a runs file"):
        load_runs(tmp_path / "other.json", "quality", SPEC, ["a"])


def test_summarize_reads_vllm_steps_stream_timing_and_proxima_split() -> None:
    px = {"steps": 4, "committed": 3, "time_split_s": {"forward_s": 0.08, "compress_s": 0.004, "plan_s": 0.002,
                                                       "commit_s": 0.002, "attention_proxima_s": 0.01},
          "launches_per_step": 12}
    s = summarize("balanced", _raw(40, [1, 3, 2], px), POOL)
    assert (s["tokens_per_s"], s["peak_running"], s["mean_running"], s["preemptions"]) == (20.0, 3, 2.0, 1)
    assert (s["ttft_p50_ms"], s["ttft_p99_ms"], s["tpot_p50_ms"], s["tpot_p99_ms"]) == (300.0, 400.0, 30.0, 40.0)
    assert s["cuda_graphs"] is True and s["graph_replays"] == 3 and s["kv_bytes"] == 6 << 20
    assert s["step_ms"] == {"model_ms": 20.0, "compress_ms": 1.0, "planning_ms": 1.0, "attention_proxima_ms": 2.5}
    assert s["step_counters"] == {"launches_per_step": 12} and s["prompt_nll"] == 2.1
    eager = summarize("vanilla", _raw(40, [1]) | {"cudagraph_mode": "NONE", "graph_modes": {"NONE": 2}}, POOL)
    assert eager["cuda_graphs"] is False and eager["graph_replays"] == 0 and "step_ms" not in eager
    assert summarize("vllm_int4_pth", {"error": "illegal memory access"}, POOL)["error"] == "illegal memory access"
    assert step_split({}) == {}


def test_stats_delta_leaves_out_the_warmup() -> None:
    before = {"steps": 5, "committed": 1, "time_split_s": {"compress_s": 0.5}, "committed_by_format": {"int4": 1}}
    after = {"steps": 15, "committed": 4, "time_split_s": {"compress_s": 0.75, "forward_s": 1.0},
             "committed_by_format": {"int4": 3, "fp8": 1}, "peak_resident": 7}
    d = stats_delta(before, after)
    assert (d["steps"], d["committed"], d["peak_resident"]) == (10, 3, 7)
    assert d["time_split_s"] == {"compress_s": 0.25, "forward_s": 1.0} and d["committed_by_format"] == {"int4": 2,
                                                                                                        "fp8": 1}


def _two_reps() -> dict:
    doc = new_runs("quality", SPEC, ["vanilla", "balanced", "vllm_int4_pth"],
                   {"date": "2026-12-06", "machine": "H200", "versions": {"vllm": "0.32.0"}, "model": "m",
                    "weights": "real", "source_digest": "abc", "command": "c1", "engine": "graphs"})
    for rep in (1, 2):
        for pos, row in enumerate(rep_order(doc["rows"], rep)):
            raw = {"error": "exit 1: illegal memory access"} if row == "vllm_int4_pth" else _raw(
                40 * rep if row == "vanilla" else 20 + rep, [1, 2], {"steps": 2, "time_split_s": {"compress_s": 0.002}}
                if row == "balanced" else None)
            record(doc, rep, pos, row, summarize(row, raw, POOL), 5.0, "t")
    return doc


def test_aggregate_gives_medians_spread_and_every_run() -> None:
    table = aggregate(_two_reps()["runs"], ["vanilla", "balanced", "vllm_int4_pth"])
    assert list(table) == ["vanilla", "balanced", "vllm_int4_pth"]
    v = table["vanilla"]
    assert v["tokens_per_s_runs"] == [20.0, 40.0] and v["tokens_per_s"] == 30.0
    assert (v["tokens_per_s_min"], v["tokens_per_s_max"], v["runs"], v["reps"]) == (20.0, 40.0, 2, [1, 2])
    assert table["balanced"]["step_ms"] == {"compress_ms": 1.0}
    assert v["peak_running"] == 2 and isinstance(v["peak_running"], int) and v["tpot_p50_ms"] == 30.0
    assert table["vllm_int4_pth"]["error"].endswith("illegal memory access")
    assert len(table["vllm_int4_pth"]["errors"]) == 2 and table["vllm_int4_pth"]["kv_bytes"] == 6 << 20


def test_merge_document_and_step_file(tmp_path: Path) -> None:
    doc = document([_two_reps()], "abc1234", "abc", "bench/capacity.py --merge x")
    w = doc["workloads"]["quality"]
    assert doc["commit"] == "abc1234" and w["orders"] == {"1": ["vanilla", "balanced", "vllm_int4_pth"],
                                                         "2": ["vllm_int4_pth", "balanced", "vanilla"]}
    for key in ("tokens_per_s", "tokens_per_s_runs", "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms",
                "peak_running", "kv_bytes", "cuda_graphs", "prompt_nll"):
        assert key in w["results"]["vanilla"], key
    assert len(w["runs"]) == 6 and "## quality" in markdown(doc) and "error: exit 1" in markdown(doc)
    assert document([_two_reps()], "abc1234", "other", "c")["commit"] is None  # code that ran is not this commit
    step = write_step_file(doc, tmp_path / "step.json")
    bal = step["rows"]["balanced"]
    assert step["workload"] == "quality" and set(step["rows"]) == {"balanced"}
    assert bal["compress_ms_per_step"] == 1.0 and bal["attention_ms_per_step"] is None
    assert bal["launches_per_step"] is None and "launch" in bal["missing"]["launches_per_step"]
    assert bal["graph_replays"] == 3
    assert json.loads((tmp_path / "step.json").read_text())["rows"]["balanced"]["syncs_per_step"] is None
    assert (tmp_path / "step.md").read_text().count("| balanced |") == 1
    assert step_document(doc)["by_workload"]["quality"] == step["rows"]


def test_row_env_gives_proxima_only_to_proxima_rows() -> None:
    from bench.capacity_rows import row_env

    base = {"PROXIMA_POLICY": "x.yaml", "PROXIMA_TIME_SPLIT": "1", "PATH": "/bin"}
    vanilla = row_env("vllm_int4_pth", base, "/tmp/s.json")
    assert "PROXIMA_POLICY" not in vanilla and "PROXIMA_TIME_SPLIT" not in vanilla and vanilla["PATH"] == "/bin"
    bal = row_env("balanced", base, "/tmp/s.json")
    assert bal["PROXIMA_POLICY"].endswith("balanced.yaml") and bal["PROXIMA_STATS_FILE"] == "/tmp/s.json"
    assert bal["PROXIMA_TIME_SPLIT"] == "1"
    assert "PROXIMA_TIME_SPLIT" not in row_env("balanced", base, "/tmp/s.json", time_split=False)


def test_a_resumed_file_keeps_every_call() -> None:
    runs = _two_reps()
    runs["calls"] = [runs["meta"] | {"command": "call 1", "date": "d1"}, runs["meta"] | {"command": "call 2",
                                                                                         "date": "d2"}]
    w = document([runs], "abc1234", "abc", "merge")["workloads"]["quality"]
    assert w["commands"] == ["call 1", "call 2"] and w["dates"] == ["d1", "d2"]


def test_the_step_file_gives_a_reason_only_for_an_absent_counter() -> None:
    from bench.step_report import policy_rows

    counted = {"step_ms": {"compress_ms": 1.0},
               "step_counters": {"launches_per_step": 5, "memcpys_per_step": 1, "syncs_per_step": 0,
                                 "counted_steps": 3}}
    rows = policy_rows({"balanced": counted, "aggressive": {"step_ms": {}}})
    bal, agg = rows["balanced"], rows["aggressive"]
    assert (bal["launches_per_step"], bal["memcpys_per_step"], bal["syncs_per_step"]) == (5, 1, 0)
    assert bal["counted_steps"] == 3
    assert not {"launches_per_step", "memcpys_per_step", "syncs_per_step"} & set(bal["missing"])
    assert agg["launches_per_step"] is None and "sampled" in agg["missing"]["syncs_per_step"]
