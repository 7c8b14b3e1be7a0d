"""Runs the end-to-end scenarios in ONE vLLM engine and prints a JSON summary (last stdout line).

Started as a subprocess by `test_vllm_e2e.py` because vLLM reads the plugin environment
(`PROXIMA_POLICY`, ...) when its processes start. Scenarios, in order:

1. pressure: distinct prompts against a pool of a few requests (compression, preemption, resume);
2. prefix: requests sharing a long prompt prefix (prefix caching on);
3. abort: requests aborted mid-decode through the engine API;
4. churn: many short requests (accounting after hundreds of requests).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, churn = sys.argv[1], int(sys.argv[2])  # churn 0: skip scenario 4
    b = 32
    llm = LLM(model=model, dtype="bfloat16", max_model_len=512, enforce_eager=True, block_size=b,
              num_gpu_blocks_override=24, seed=0, max_num_seqs=32, enable_prefix_caching=True)
    vocab = 49000

    def toks(seed: int, n: int) -> list[int]:
        return [100 + (seed * 7919 + i * 104729) % vocab for i in range(n)]

    out: dict[str, object] = {}
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    t0 = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=toks(s, 150)) for s in range(8)], sp, use_tqdm=False)
    out["pressure"] = [list(r.outputs[0].token_ids) for r in res]

    prefix = toks(999, 128)
    res = llm.generate([TokensPrompt(prompt_token_ids=prefix + toks(s, 40)) for s in range(4)], sp, use_tqdm=False)
    out["prefix"] = [list(r.outputs[0].token_ids) for r in res]

    engine = llm.llm_engine
    long_sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"abort-{i}", TokensPrompt(prompt_token_ids=toks(50 + i, 120)), long_sp)
    finished: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for r in engine.step():
            if r.finished:
                finished[r.request_id] = len(r.outputs[0].token_ids)
        steps += 1
        if steps == 8:
            engine.abort_request([f"abort-{i}" for i in range(0, 6, 2)])
    out["abort_finished"] = finished

    if churn:
        sp_short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        res = llm.generate([TokensPrompt(prompt_token_ids=toks(1000 + s, 40)) for s in range(churn)], sp_short,
                           use_tqdm=False)
        out["churn_lengths"] = [len(r.outputs[0].token_ids) for r in res]
    out["wall_s"] = time.perf_counter() - t0
    stats = os.environ.get("PROXIMA_STATS_FILE")
    del llm
    time.sleep(1)
    out["proxima"] = json.loads(Path(stats).read_text()) if stats and Path(stats).exists() else None
    print(json.dumps(out))


if __name__ == "__main__":
    main()
