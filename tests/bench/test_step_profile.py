"""`bench/step_profile.py` reading a profiler trace, and `bench/capacity.py --profile`'s plumbing."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from bench.capacity import profile_spec
from bench.capacity_rows import profile_prefix, summarize
from bench.capacity_runs import aggregate
from bench.kv_budget import Pool
from bench.step_profile import main, proxima_kernels, read_trace, traces_by_row
from bench.step_profile import summarize as summarize_trace

ROOT = Path(__file__).resolve().parents[2]


def _kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


TRACE = [
    # two steps of 10 ms: 6 ms busy each (one GEMM, one Proxima attention, one vLLM attention kernel,
    # a compression in the first step, a copy); a CPU op and runtime calls that are not device time
    _kernel("nvjet_tst_128x64_64x4_1x2_h_bz_TNT", 0, 3000),
    _kernel("_mixed_decode_kernel", 3000, 1000),
    _kernel("kernel_unified_attention_2d", 4000, 500),
    _kernel("_quant_step_kernel", 4500, 500),
    _kernel("Memcpy HtoD (Pinned -> Device)", 5000, 250, cat="gpu_memcpy"),
    _kernel("nvjet_tst_128x64_64x4_1x2_h_bz_TNT", 10000, 3000),
    _kernel("_mixed_decode_kernel", 13000, 1000),
    _kernel("kernel_unified_attention_2d", 14000, 500),
    _kernel("triton_poi_fused_add_mul_0", 14500, 500),
    _kernel("Memcpy HtoD (Pinned -> Device)", 15000, 250, cat="gpu_memcpy"),
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9000},
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1, "dur": 5},
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 10001, "dur": 5},
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 4400, "dur": 5},
]


def test_every_launched_proxima_kernel_has_its_category() -> None:
    """Names come from the sources: each kernel a module launches (`NAME[grid](...)`) is known."""
    kernels = proxima_kernels()
    launched = set()
    for path in (ROOT / "proxima" / "compression").rglob("*.py"):
        launched |= set(re.findall(r"\b(_\w+)\[\(?", path.read_text())) & set(kernels)
    assert {"_quant_step_kernel", "_cluster_kernel", "_mixed_decode_kernel", "_block_importance_kernel"} <= launched
    assert kernels["_cluster_kernel"] == kernels["_quant_step_kernel"] == "Proxima compression"
    assert kernels["_mixed_decode_kernel"] == kernels["_comp_decode_kernel"] == "Proxima attention"
    assert kernels["_block_importance_kernel"] == "Proxima importance"
    assert "_quant_keys_tile" in kernels  # helpers are listed too: they never appear as a launch


def test_a_trace_is_summed_per_step_by_category_and_kernel() -> None:
    s = summarize_trace(TRACE, 2, proxima_kernels(), top=3)
    assert s["device_events"] == 10 and s["device_events_per_step"] == 5.0
    assert s["device_ms_per_step"] == pytest.approx(5.25)  # (3 + 1 + 0.5 + 0.5 + 0.25) ms a step
    assert s["span_ms_per_step"] == pytest.approx(7.625)  # 0 .. 15.25 ms over two steps
    assert s["busy"] == pytest.approx(10.5 / 15.25, abs=1e-3)
    assert s["by_category_ms"] == {"GEMM": 3.0, "Proxima attention": 1.0, "vLLM attention": 0.5,
                                   "memcpy / memset": 0.25, "Proxima compression": 0.25,
                                   "torch.compile fused": 0.25}
    assert s["graph_launches_per_step"] == 1.0 and s["kernel_launches_per_step"] == 0.5
    assert [k["name"] for k in s["top_kernels"]] == ["nvjet_tst_128x64_64x4_1x2_h_bz_TNT", "_mixed_decode_kernel",
                                                      "kernel_unified_attention_2d"]
    assert s["top_kernels"][1] == {"name": "_mixed_decode_kernel", "category": "Proxima attention",
                                   "ms_per_step": 1.0, "calls_per_step": 1.0}


def test_a_trace_without_device_work_says_so() -> None:
    s = summarize_trace([e for e in TRACE if e["cat"] == "cpu_op"], 2, {})
    assert s["device_events"] == 0 and "no device events" in s["note"]
    with pytest.raises(ValueError, match="give the profiled steps"):
        summarize_trace(TRACE, None, {})


def test_the_steps_are_counted_in_the_trace_when_vllm_annotated_them() -> None:
    # vLLM's worker annotates each step it runs while the profiler records CPU activity
    steps = [{"ph": "X", "cat": "user_annotation", "name": f"execute_context_1({n})_generation_15(15)", "ts": t,
              "dur": 9000} for n, t in ((512, 0), (16, 10000))]
    s = summarize_trace(TRACE + steps, 20, proxima_kernels())  # (the --steps given is not used)
    assert s["steps"] == 2 and s["steps_counted"] and s["device_ms_per_step"] == pytest.approx(5.25)
    assert not summarize_trace(TRACE, 2, {})["steps_counted"]


def test_traces_are_found_by_row_and_summarized_into_files(tmp_path: Path) -> None:
    # vLLM's worker writes `<prefix>_<rank suffix>.<time>.pt.trace.json.gz` (tensorboard handler)
    # (the rank suffix as vLLM's GPU worker writes it, and as its CPU worker does)
    for name in ("vllm_int4_pth_dp0_pp0_tp0_dcp0_ep0_rank0", "aggressive_rank0"):
        with gzip.open(tmp_path / f"{name}.1765.pt.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": TRACE}, f)
    assert sorted(traces_by_row(tmp_path)) == ["aggressive", "vllm_int4_pth"]
    assert len(read_trace(next(tmp_path.glob("aggressive*")))) == len(TRACE)
    out = tmp_path / "res" / "step-profile-test"
    main([str(tmp_path), "--steps", "2", "--out", str(out)])
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["rows"]["vllm_int4_pth"]["device_ms_per_step"] == pytest.approx(5.25)
    md = out.with_suffix(".md").read_text()
    assert "| aggressive | 2 | 5.25 |" in md and "`_mixed_decode_kernel` | Proxima attention | 1.0 | 1.0 |" in md


def test_a_trace_that_is_not_one_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "x_dp0_pp0.1.pt.trace.json"
    bad.write_text(json.dumps({"traceEvents": 3}))
    with pytest.raises(ValueError, match="no traceEvents list"):
        read_trace(bad)


def test_the_profile_option_is_checked_and_names_rows_as_vllm_allows(tmp_path: Path) -> None:
    def error(msg: str):
        raise SystemExit(msg)

    assert profile_spec("300:20", tmp_path / "t", error) == {"dir": str((tmp_path / "t").resolve()), "skip": 300,
                                                              "steps": 20}
    for bad in ("300", "a:2", "3:0", "-1:5"):
        with pytest.raises(SystemExit, match="expected SKIP:STEPS"):
            profile_spec(bad, tmp_path, error)
    with pytest.raises(SystemExit, match="needs --profile-dir"):
        profile_spec("1:2", None, error)
    assert profile_prefix("vllm_int4_pth") == "vllm_int4_pth"
    assert profile_prefix("bench/policies/balanced-lean.yaml") == "balanced-lean"
    assert profile_prefix("_odd name+x.yml") == "odd-name-x"


def test_a_profiled_run_stays_out_of_the_table() -> None:
    raw = {"build_s": 3.0, "wall_s": 2.0, "truncated": False, "finished_requests": 4, "generated_tokens": 100,
           "steps": [(0.1, 2, 0)], "graph_modes": {}, "ttft_s": [0.1], "tpot_s": [0.01], "proxima": {}}
    pool = Pool(blocks=6, block_bytes=1 << 20)
    plain = summarize("vanilla", raw, pool)
    profiled = summarize("vanilla", raw | {"profiled": {"dir": "/t", "skip": 1, "steps": 2}}, pool)
    assert "profiled" not in plain and profiled["profiled"]["steps"] == 2
    runs = [{"rep": 1, "position": 0, "row": "vanilla", "result": profiled},
            {"rep": 2, "position": 0, "row": "vanilla", "result": plain | {"tokens_per_s": 7.0}}]
    table = aggregate(runs, ["vanilla"])
    assert table["vanilla"]["runs"] == 1 and table["vanilla"]["tokens_per_s_runs"] == [7.0]
