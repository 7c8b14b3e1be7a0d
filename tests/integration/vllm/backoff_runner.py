"""Compression faults switched on, then off, in ONE vLLM engine; prints a JSON summary (last line).

Started as a subprocess by `test_vllm_backoff.py` (vLLM reads the plugin environment when its
processes start). The engine runs a policy that compresses every eligible block, the runtime
API and `PROXIMA_FAULT_FILE`, which this script writes between engine steps:

1. healthy: requests under memory pressure until compressions commit;
2. fault: the file says `compress` (every batch fails) for `FAULT_STEPS` steps while more
   requests arrive; the planned compressions of every step are recorded;
3. cleared: the file is emptied; steps until compressions commit again, then every request runs
   to its end.

Also runs against a build without backoff (it only reads the stats file and the API), which is
how the "before" number of the docs was measured.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

FAULT_STEPS = 60
RESUME_LIMIT = 400
"""Steps after the fault clears within which compression must have resumed (the longest pause
is 128 steps)."""


def main() -> None:
    import httpx
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = sys.argv[1]
    stats_file = Path(os.environ["PROXIMA_STATS_FILE"])
    fault_file = Path(os.environ["PROXIMA_FAULT_FILE"])
    fault_file.write_text("")
    llm = LLM(model=model, dtype="bfloat16", max_model_len=512, enforce_eager=True, block_size=32,
              num_gpu_blocks_override=24, seed=0, max_num_seqs=32, enable_prefix_caching=True,
              max_num_batched_tokens=64)
    engine = llm.llm_engine
    api = httpx.Client(base_url=f"http://127.0.0.1:{os.environ['PROXIMA_API_PORT']}", timeout=30)
    vocab = 49000

    def toks(seed: int, n: int) -> list[int]:
        return [100 + (seed * 7919 + i * 104729) % vocab for i in range(n)]

    finished: dict[str, int] = {}
    expected: dict[str, int] = {}
    nonfinite = checked = 0

    def stats() -> dict[str, Any]:
        """The scheduler's counters as of its last plan (written before that step's report)."""
        return dict(json.loads(stats_file.read_text()))

    def counted(name: str) -> float:
        """A Prometheus counter summed over its labels: up to date with the last step's report."""
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in api.get("/metrics").text.splitlines()
                   if ln.startswith(name + "{") or ln.startswith(name + " "))

    def committed() -> float:
        return counted("proxima_engine_decisions_total")

    def add(prefix: str, n: int, seed: int, max_tokens: int) -> None:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        for i in range(n):
            rid = f"{prefix}-{i}"
            expected[rid] = max_tokens
            engine.add_request(rid, TokensPrompt(prompt_token_ids=toks(seed + i, 150)), sp)

    steps_total = 0

    def step() -> None:
        nonlocal nonfinite, checked, steps_total
        steps_total += 1
        if os.environ.get("PX_DEBUG") and steps_total % 25 == 0:
            s = stats()
            print(steps_total, {k: s[k] for k in ("planned", "committed", "failed", "preemptions", "resident_now",
                                                  "free_blocks", "emergencies")}, len(finished), file=sys.stderr)
        for r in engine.step():
            if r.finished:
                out = r.outputs[0]
                finished[r.request_id] = len(out.token_ids)
                values = [lp.logprob for d in (out.logprobs or []) if d for lp in d.values()]
                checked += len(values)
                nonfinite += sum(1 for x in values if not math.isfinite(x))

    res: dict[str, Any] = {}
    # 1. Healthy: compression commits.
    add("healthy", 6, 0, 40)
    while committed() == 0 and engine.has_unfinished_requests():
        step()
    res["healthy_committed"] = committed_at_fault = committed()
    failed_at_fault = counted("proxima_engine_compression_errors_total")

    # 2. Fault on for FAULT_STEPS steps; new requests keep the pool under pressure.
    fault_file.write_text("compress")
    add("fault", 8, 100, 60)
    steps_at_fault = stats()["steps"]
    per_step: list[int] = []
    running: list[bool] = []
    t0 = time.perf_counter()
    for _ in range(FAULT_STEPS):
        before = stats()["planned"]
        running.append(engine.has_unfinished_requests())
        step()
        per_step.append(stats()["planned"] - before)
    res["fault_seconds"] = time.perf_counter() - t0
    res["fault_planned_per_step"] = per_step
    res["fault_scheduler_steps"] = stats()["steps"] - steps_at_fault
    res["fault_running_every_step"] = all(running)
    res["fault_failed"] = counted("proxima_engine_compression_errors_total") - failed_at_fault
    res["fault_committed"] = (committed_at_clear := committed()) - committed_at_fault
    res["backoff_at_clear"] = stats().get("backoff")
    res["backoffs_at_clear"] = counted("proxima_engine_compression_backoffs_total")

    # 3. Fault off: compression resumes by itself.
    fault_file.write_text("")
    add("after", 6, 200, 40)
    steps = 0
    while committed() == committed_at_clear and steps < RESUME_LIMIT and engine.has_unfinished_requests():
        step()
        steps += 1
    res["steps_to_resume"] = steps
    res["resumed_committed"] = committed() - committed_at_clear
    while engine.has_unfinished_requests():
        step()
    res["finished"] = finished
    res["expected"] = expected
    res["nonfinite_logprobs"], res["checked_logprobs"] = nonfinite, checked
    res["alerts"] = api.get("/v1/alerts").json()
    res["metrics"] = [ln for ln in api.get("/metrics").text.splitlines()
                      if ln.startswith("proxima_engine_compression_backoff") and "_created" not in ln]
    api.close()
    del llm
    time.sleep(1)
    res["proxima"] = stats()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
