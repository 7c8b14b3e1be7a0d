"""Diagnostic (not a benchmark): NaN prompt logprobs under compression, found in session 3.

4 prompts x 512 tokens of the bench text, a KV pool of N blocks, chunked prefill (128 tokens),
`prompt_logprobs=0`; prints (mean NLL, top-1 accuracy) of the second half of each prompt and
writes per-token (logprob, rank) to OUT.json. Session 3, pool 40: policy `off` gives four finite
scores; `conservative` (and conservative with `protect.prefilling: true`) gives NaN for the 4th
prompt from token 97 on, with the numba fill or the torch fill, with or without importance.
Session 4, after the destination scrub (`ProximaPlan.scrub`), f232447: four finite scores (7 chunks
compressed during prefill; prompt 3: 3.5561 nats vs 3.5551 under `off`, the others equal).

    PROXIMA_POLICY=proxima/policies/conservative.yaml VLLM_CPU_KVCACHE_SPACE=1 \\
        .venv/bin/python bench/nan_repro.py OUT.json 40
"""

from __future__ import annotations

import json
import os
import sys

from proxima.integration.vllm.serve.demo_workload import _text, prompt_scores

MODEL = os.path.expanduser("~/.cache/proxima/models/smollm2-135m-instruct")


def main() -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ids = AutoTokenizer.from_pretrained(MODEL)(_text())["input_ids"]
    n, tokens = 4, 512
    prompts = [ids[i * 700 : i * 700 + tokens] for i in range(n)]
    llm = LLM(model=MODEL, dtype="bfloat16", max_model_len=tokens + 64, enforce_eager=True, block_size=32,
              num_gpu_blocks_override=int(sys.argv[2]), seed=0, max_num_seqs=n, max_num_batched_tokens=128)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    per_token = []
    for o, p in zip(outs, prompts, strict=True):
        lps = o.prompt_logprobs
        per_token.append([(lps[i][p[i]].logprob, lps[i][p[i]].rank) if lps[i] else None for i in range(len(p))])
        print("prompt (NLL, top-1):", prompt_scores(p, lps))
    with open(sys.argv[1], "w") as f:
        json.dump(per_token, f)


if __name__ == "__main__":
    main()
