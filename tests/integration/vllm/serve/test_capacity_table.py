"""The capacity benchmark's scoring and table (no engine: fast)."""

from __future__ import annotations

import math

import pytest
from vllm.logprobs import Logprob

from proxima.integration.vllm.serve import demo_workload as capacity
from proxima.integration.vllm.serve.demo_workload import common_prefix, prompt_scores, table_markdown, tabulate


def test_prompt_scores_cover_the_second_half_of_the_prompt() -> None:
    ids = [5, 6, 7, 8]
    # vLLM: no entry for the first token; each entry maps the actual token to its logprob and rank.
    lps = [None, {6: Logprob(-9.0, rank=7)}, {7: Logprob(-1.0, rank=1)}, {8: Logprob(-3.0, rank=2)}]
    nll, top1 = prompt_scores(ids, lps)
    assert nll == pytest.approx(2.0) and top1 == pytest.approx(0.5)  # tokens 2 and 3 only
    assert all(math.isnan(x) for x in prompt_scores(ids, None))


def test_table_compares_each_config_with_vanilla() -> None:
    base = {"wall_s": 10.0, "tokens_per_s": 2.0, "kv_blocks": 73}
    results = {
        "vanilla": base | {"outputs": [[1, 2, 3], [4, 5]], "prompt_nll": [2.0, 4.0], "prompt_top1": [0.5, 0.5],
                           "proxima": {"peak_resident": 2, "mean_resident": 1.5, "preemptions": 0}},
        "balanced": base | {"outputs": [[1, 2, 9], [7, 5]], "prompt_nll": [3.0, float("nan")], "prompt_top1": [0.25],
                            "proxima": {"peak_resident": 8, "mean_resident": 6.0, "preemptions": 1,
                                        "committed_by_format": {"int4": 3},
                                        "time_split_s": {"forward_s": 9.0, "compress_s": 0.5}}},
        "vanilla_fp8": {"error": "not measurable here"},
    }
    t = tabulate(results)
    assert t["vanilla"]["greedy_prefix_tokens"] == 2.5 and t["balanced"]["greedy_prefix_tokens"] == 1.0
    assert t["vanilla"]["prompt_nll"] == 3.0 and t["balanced"]["prompt_nll"] == 3.0  # NaN skipped
    assert t["balanced"]["peak_running"] == 8 and t["balanced"]["prompt_top1"] == 0.25
    # PROXIMA_TIME_SPLIT=1 runs carry where their time went; runs without it have no such key
    assert t["balanced"]["time_split_s"] == {"forward_s": 9.0, "compress_s": 0.5}
    assert "time_split_s" not in t["vanilla"]
    md = table_markdown(t)
    assert "| balanced | 72 | 8 | 6.0 | 1 |" in md and "int4 3" in md and "not measurable here" in md
    assert common_prefix([1, 2], [1, 2, 3]) == 2


def test_a_child_result_is_its_last_json_line_or_its_last_error() -> None:
    """`child_result` reads the `--child` run's merged stdout and stderr: the result is the last
    line that starts with `{`; a non-zero exit or no such line is an error naming the last line
    that says Error."""
    out = 'INFO engine up\n{"peak": 1}\nINFO more\n{"peak": 2, "fmt": "int4"}\nINFO shut down\n'
    assert capacity.child_result(0, out) == {"peak": 2, "fmt": "int4"}
    err = capacity.child_result(1, 'INFO x\nValueError: no pool\n{"partial": true}\n')
    assert err == {"error": "exit 1: ValueError: no pool"}
    assert capacity.child_result(0, "INFO nothing printed\n")["error"].startswith("exit 0: INFO nothing")


def test_run_config_runs_its_child_through_run_logged(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each configuration's engine child goes through `child.run_logged` (whose tests show its whole
    process group ends with the call, SIGTERM included): a plain subprocess.run once left an
    orphaned vLLM worker that skewed the next rows' tokens/s. Its timeout is reported as such."""
    import subprocess

    seen: list[list[str]] = []

    def fake(cmd, env, timeout_s, log_path):  # type: ignore[no-untyped-def]
        seen.append(list(cmd))
        if timeout_s < 1:
            raise subprocess.TimeoutExpired(cmd, timeout_s)
        log_path.write_text('INFO vLLM\n{"peak_running": 3}\n')
        return 0

    monkeypatch.setattr(capacity, "run_logged", fake)
    wl = capacity.Workload(model=str(tmp_path), requests=2, prompt_tokens=64, output_tokens=4)
    assert capacity.run_config(wl, "balanced", timeout_s=30) == {"peak_running": 3}
    child_module = "proxima.integration.vllm.serve.demo_workload"
    assert seen[0][1:4] == ["-m", child_module, "--child"] and seen[0][4] == "balanced"
    assert capacity.run_config(wl, "balanced", timeout_s=0.5) == {"error": "timed out after 0 s"}
