"""The step split (`timing.py`) and how the rows' table reads it."""

from __future__ import annotations

import time

from bench.capacity_rows import summarize
from bench.kv_budget import Pool
from proxima.integration.vllm.plan import ProximaReport
from proxima.integration.vllm.worker.timing import StepTimes


def test_step_times_sum_spans_and_reset_on_take() -> None:
    t = StepTimes(enabled=True)
    with t.span("compress_s"):
        time.sleep(0.01)
    t.begin("forward_s")
    time.sleep(0.01)
    t.end("forward_s")
    t.end("never_begun")  # ignored
    got = t.take()
    assert set(got) == {"compress_s", "forward_s"} and all(v >= 0.009 for v in got.values())
    assert t.take() == {}


def test_step_times_off_records_nothing() -> None:
    t = StepTimes(enabled=False)
    with t.span("compress_s"):
        pass
    assert t.take() == {}


def test_step_times_skip_parts_inside_a_cuda_graph_capture(monkeypatch) -> None:
    """An event recorded while a graph is captured becomes a node of it and cannot be queried
    (`cudaErrorInvalidValue` killed the engine on the H100 with the one-pass decode): a part
    that begins during a capture records nothing, on CUDA only."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    made: list[object] = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: made.append(kw))
    t = StepTimes(enabled=True)
    with t.span("attention_proxima_s", torch.device("cuda", 0)):
        pass
    assert made == [] and t.take() == {}
    with t.span("compress_s", torch.device("cpu")):  # host timers are not graph nodes
        pass
    assert set(t.take()) == {"compress_s"}


def test_reports_aggregate_timings_by_the_slowest_worker() -> None:
    a = ProximaReport(timings={"forward_s": 0.02, "compress_s": 0.001})
    b = ProximaReport(timings={"forward_s": 0.03})
    agg = a.aggregate(b)
    assert isinstance(agg, ProximaReport) and agg.timings == {"forward_s": 0.03, "compress_s": 0.001}


def _result(t0: float, steps: list[tuple[float, int, int]], gen: int) -> dict:
    return {"build_s": 1.0, "wall_s": steps[-1][0], "truncated": False, "finished_requests": 2,
            "generated_tokens": gen, "steps": steps, "ttft_s": [0.5, 1.5], "tpot_s": [0.01, 0.03], "proxima": {},
            "prompt_nll": [2.0, float("nan")], "prompt_top1": [0.5, 0.5]}


def test_summarize_gives_the_schema_of_the_table() -> None:
    pool = Pool(blocks=192, block_bytes=4 << 20)
    row = summarize("vllm_int4_pth", _result(0.0, [(1.0, 2, 0), (2.0, 3, 1)], 20), pool)
    for key in ("peak_running", "mean_running", "preemptions", "tokens_per_s", "kv_bytes", "prompt_nll",
                "pool_blocks", "block_bytes", "ttft_p50_ms", "tpot_p99_ms"):
        assert key in row, key
    assert (row["peak_running"], row["mean_running"], row["preemptions"]) == (3, 2.5, 1)
    assert row["kv_bytes"] == 192 * (4 << 20) and row["kv_cache_dtype"] == "int4_per_token_head"
    assert row["prompt_nll"] == 2.0 and row["tokens_per_s"] == 10.0 and row["ttft_p99_ms"] == 1500.0
    assert summarize("balanced", {"error": "timed out"}, pool)["error"] == "timed out"
