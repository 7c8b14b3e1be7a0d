"""Runs the end-to-end scenarios in ONE vLLM engine and prints a JSON summary (last stdout line).

Started as a subprocess by `test_vllm_e2e.py` because vLLM reads the plugin environment
(`PROXIMA_POLICY`, ...) when its processes start. Scenarios, in order:

1. pressure: distinct prompts against a pool of a few requests (compression, preemption, resume);
2. prefix: requests sharing a long prompt prefix (prefix caching on);
3. abort: requests aborted mid-flight through the engine API (the scheduler's pool counters are
   recorded when they are aborted and once the scenario's last request finished);
4. api (only with PROXIMA_API_PORT): compression disabled through the runtime API while requests
   run, then restored by a rollback;
5. churn: many short requests (accounting after hundreds of requests).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from proxima.integration.vllm.serve.demo_workload import engine_args

    model, churn = sys.argv[1], int(sys.argv[2])  # churn 0: skip scenario 4
    b = 32
    # Chunked prefill with 64-token chunks: prompts of 120-170 tokens take 2-3 steps, so policies
    # with `protect.prefilling: false` compress a prompt's first chunks while the rest is prefilled.
    llm = LLM(**engine_args(model=model, dtype="bfloat16", max_model_len=512, enforce_eager=True, block_size=b,
                            num_gpu_blocks_override=24, seed=0, max_num_seqs=32, enable_prefix_caching=True,
                            max_num_batched_tokens=64))
    vocab = 49000

    def toks(seed: int, n: int) -> list[int]:
        return [100 + (seed * 7919 + i * 104729) % vocab for i in range(n)]

    out: dict[str, object] = {}
    nonfinite = checked = generated = 0

    def count_nonfinite(res: list[Any]) -> None:
        """Logprobs of prompt and sampled tokens that are not finite: a NaN anywhere in a block
        vLLM's CPU kernel reads (it reads whole blocks) poisons a row, and greedy decoding would
        still return the right number of (wrong) tokens."""
        nonlocal nonfinite, checked, generated
        for r in res:
            generated += len(r.outputs[0].token_ids)
            for lps in (r.prompt_logprobs or [], r.outputs[0].logprobs or []):
                values = [lp.logprob for d in lps if d for lp in d.values()]
                checked += len(values)
                nonfinite += sum(1 for x in values if not math.isfinite(x))

    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    t0 = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=toks(s, 150)) for s in range(8)], sp, use_tqdm=False)
    out["pressure"] = [list(r.outputs[0].token_ids) for r in res]
    # Teacher-forced: the log-probability of each prompt token (after the first), for comparing engines.
    out["pressure_prompt_logprobs"] = [[d[t].logprob for t, d in zip(r.prompt_token_ids[1:], r.prompt_logprobs[1:],
                                                                      strict=True)] for r in res]
    count_nonfinite(res)

    prefix = toks(999, 128)
    # No prompt_logprobs here: vLLM skips reading the prefix cache for requests that ask for them.
    sp_prefix = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
    res = llm.generate([TokensPrompt(prompt_token_ids=prefix + toks(s, 40)) for s in range(4)], sp_prefix,
                       use_tqdm=False)
    out["prefix"] = [list(r.outputs[0].token_ids) for r in res]
    count_nonfinite(res)

    engine = llm.llm_engine
    stats = os.environ.get("PROXIMA_STATS_FILE")

    def pool_now() -> dict[str, Any] | None:
        """The scheduler's counters as it last wrote them (at every step and after every free;
        the file is replaced atomically, and written before the step's outputs are sent)."""
        if not stats or not Path(stats).exists():
            return None
        px = json.loads(Path(stats).read_text())
        return {k: px[k] for k in ("resident_now", "compressed_slots_now", "dest_blocks_now", "free_blocks",
                                   "total_blocks")}

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
            out["pool_at_abort"] = pool_now()
            engine.abort_request([f"abort-{i}" for i in range(0, 6, 2)])
    out["abort_finished"] = finished
    out["pool_after_abort"] = pool_now()

    if os.environ.get("PROXIMA_API_PORT") and stats:
        out["api"] = api_scenario(engine, toks, Path(stats))

    if churn:
        sp_short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0, prompt_logprobs=0)
        res = llm.generate([TokensPrompt(prompt_token_ids=toks(1000 + s, 40)) for s in range(churn)], sp_short,
                           use_tqdm=False)
        out["churn_lengths"] = [len(r.outputs[0].token_ids) for r in res]
        count_nonfinite(res)
    out["nonfinite_logprobs"] = nonfinite
    out["checked_logprobs"] = checked
    out["wall_s"] = time.perf_counter() - t0
    out["generated_tokens"] = generated  # (scenarios that check logprobs: pressure, prefix, churn)
    out["async_scheduling"] = bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
    out["enforce_eager"] = bool(llm.llm_engine.vllm_config.model_config.enforce_eager)
    out["attention_backend"] = str(llm.llm_engine.vllm_config.attention_config.backend)
    del llm
    time.sleep(1)
    out["proxima"] = json.loads(Path(stats).read_text()) if stats and Path(stats).exists() else None
    print(json.dumps(out))


def api_scenario(engine: Any, toks: Any, stats_file: Path) -> dict[str, Any]:
    """PATCH `enabled: false` through the runtime API (served inside the EngineCore process) while
    requests decode; measure when the scheduler adopts it and that it stops planning compressions."""
    import httpx
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    api = httpx.Client(base_url=f"http://127.0.0.1:{os.environ['PROXIMA_API_PORT']}", timeout=30)
    auth = {"Authorization": f"Bearer {os.environ['PROXIMA_API_TOKEN']}"}
    res: dict[str, Any] = {"version_before": api.get("/v1/policy").json()["version"]}
    finished: dict[str, int] = {}

    def planned() -> int:
        return int(json.loads(stats_file.read_text())["planned"])

    def step() -> None:
        for r in engine.step():
            if r.finished:
                finished[r.request_id] = len(r.outputs[0].token_ids)

    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"api-{i}", TokensPrompt(prompt_token_ids=toks(300 + i, 150)), sp)
    p0 = planned()
    while planned() == p0 and engine.has_unfinished_requests():  # until the live policy compresses
        step()
    res["planned_before_patch"] = planned() - p0
    res["stats_before"] = api.get("/v1/stats").json()

    patch = {"enabled": False}
    res["status_no_token"] = api.patch("/v1/policy", json=patch).status_code
    res["status_bad_token"] = api.patch("/v1/policy", json=patch, headers={"Authorization": "Bearer nope"}).status_code
    r = api.patch("/v1/policy", json=patch, headers=auth, params={"comment": "e2e: stop compressing"})
    res["patch_status"], res["patch_version"] = r.status_code, r.json()["version"]
    res["running_at_patch"] = engine.has_unfinished_requests()
    at_patch = api.get("/v1/stats").json()
    engine_steps = 0
    while True:
        now = api.get("/v1/stats").json()
        if now["applied_policy_version"] == res["patch_version"] or not engine.has_unfinished_requests():
            break
        step()
        engine_steps += 1
    res["engine_steps_until_applied"] = engine_steps
    res["scheduler_steps_until_applied"] = now["step"] - at_patch["step"]
    res["applied_version"], res["live_version"] = now["applied_policy_version"], now["policy_version"]
    planned_at_apply = planned()
    while engine.has_unfinished_requests():
        step()
    res["planned_after_apply"] = planned() - planned_at_apply
    res["finished"] = finished
    res["stats_after"] = api.get("/v1/stats").json()
    res["metrics"] = [ln for ln in api.get("/metrics").text.splitlines() if ln.startswith("proxima_")]
    # Later scenarios need compression again: a rollback re-installs version 1 as a new version.
    res["rollback_version"] = api.post("/v1/policy/rollback", json={"version": 1}, headers=auth).json()["version"]
    res["planned_at_rollback"] = planned()
    api.close()
    return res


if __name__ == "__main__":
    main()
