"""Where an engine step's GPU time goes, per row: vLLM's torch-profiler traces summed by kernel.

The equal-bytes benchmark says how long a step takes (`bench/results/step-*.md`: the model step,
Proxima's compression and attention by CUDA events); it cannot say what the rest of the model step
is, nor whether the GPU idles between steps (host-bound) or is busy all the time. This reads the
traces that `bench/capacity.py --profile SKIP:STEPS --profile-dir DIR` makes vLLM's worker write
(its own torch profiler, `ProfilerConfig`; CUPTI should trace the kernels of a CUDA-graph replay
one by one: not yet seen on a GPU, so read `device_events_per_step` against `graph_launches_per_step`)
and reports per row:

- device ms per step: every kernel, memcpy and memset of the window, summed, over the steps (the
  steps are counted in the trace: vLLM's `execute_context_...` annotation of each worker step);
- span ms per step: first device event's start to the last one's end, over the steps, and the
  busy share (device time / span): below 1, the GPU waited for the host;
- the same time by category: Proxima's compression kernels (`proxima/compression/kernels/`),
  Proxima's attention (the other Triton kernels of `proxima/compression/`), Proxima's importance
  kernel, vLLM's attention, GEMMs, torch.compile's fused kernels, copies, the rest;
- the kernels that take most of it.

Proxima's kernel names come from its sources (every `@triton.jit` function; Triton names a CUDA
kernel after its function), so a new kernel is counted in its category without a list to keep.

    python bench/capacity.py --mode equal-bytes --workload throughput --reps 1 --rows aggressive,vllm_int4_pth \\
        --profile 300:20 --profile-dir /tmp/prof --out /tmp/prof/runs.json --logs /tmp/prof/logs
    python bench/step_profile.py /tmp/prof --out $OUT/step-profile-h100
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `bench.common` when this runs as a script

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
"""Chrome-trace categories of work on the device (torch profiler / Kineto)."""

VLLM_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("vLLM attention", re.compile(r"unified_attention|reshape_and_cache|paged_attention|flash|fmha|reduce_segments")),
    ("GEMM", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas|splitk", re.IGNORECASE)),
    ("torch.compile fused", re.compile(r"^triton_(poi|red|per)_")),
)
"""Categories of the kernels that are not Proxima's, first match wins (names as CUDA reports them)."""

STEP_ANNOTATION = "execute_context"
"""vLLM's annotation of one worker step (`execute_context_<n>(<tokens>)_generation_<n>(<tokens>)`)."""
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
"""Runtime and driver calls that launch one kernel outside a graph."""
COPY = "memcpy / memset"
OTHER = "other"
RANK_SUFFIX = re.compile(r"(.+?)_(?:(?:dp|pp|tp|dcp|ep)\d+_)*rank\d+\.")
"""vLLM's worker rank suffix after the profile prefix (`dp0_pp0_tp0_dcp0_ep0_rank0`, or `rank0` on CPU)."""
JIT = re.compile(r"@triton\.jit[^\n]*\n(?:[ \t]*@[^\n]*\n)*[ \t]*def (\w+)")


def proxima_kernels(root: Path = ROOT / "proxima" / "compression") -> dict[str, str]:
    """Proxima's Triton functions -> category, read from the sources."""
    out: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        for name in JIT.findall(path.read_text()):
            if name == "_block_importance_kernel":
                out[name] = "Proxima importance"
            elif "kernels" in path.relative_to(root).parts:
                out[name] = "Proxima compression"
            else:
                out[name] = "Proxima attention"
    return out


def category(event: dict[str, Any], proxima: dict[str, str]) -> str:
    if event.get("cat") in ("gpu_memcpy", "gpu_memset"):
        return COPY
    name = str(event.get("name", ""))
    if name in proxima:
        return proxima[name]
    for cat, pattern in VLLM_RULES:
        if pattern.search(name):
            return cat
    return OTHER


def read_trace(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    events = doc.get("traceEvents", doc) if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ValueError(f"{path}: no traceEvents list (not a torch profiler trace)")
    return [e for e in events if isinstance(e, dict)]


def summarize(events: Iterable[dict[str, Any]], steps: int | None, proxima: dict[str, str],
              top: int = 15) -> dict[str, Any]:
    """One trace's device work per step (see the module docstring). The steps are counted in the
    trace (vLLM's worker annotates each `execute_model` as `execute_context_...` when the profiler
    records CPU activity); `steps` is used only when it holds none."""
    events = list(events)
    counted = sum(1 for e in events if e.get("cat") == "user_annotation"
                  and str(e.get("name", "")).startswith(STEP_ANNOTATION))
    if counted:
        steps = counted
    elif steps is None or steps <= 0:
        raise ValueError(f"no `{STEP_ANNOTATION}` annotations in the trace: give the profiled steps (got {steps})")
    by_cat: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    name_cat: dict[str, str] = {}
    start, end, total, count = float("inf"), float("-inf"), 0.0, 0
    runtime: dict[str, int] = defaultdict(int)
    for e in events:
        cat = e.get("cat")
        if cat in ("cuda_runtime", "cuda_driver"):
            runtime[str(e.get("name"))] += 1
        if cat not in DEVICE_CATS or e.get("ph") != "X":
            continue
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))  # microseconds
        start, end = min(start, ts), max(end, ts + dur)
        c = category(e, proxima)
        name = str(e.get("name", ""))
        by_cat[c] += dur
        by_name[name][0] += dur
        by_name[name][1] += 1
        name_cat[name] = c
        total += dur
        count += 1
    if not count:
        return {"steps": steps, "steps_counted": bool(counted), "device_events": 0,
                "note": "no device events in the trace (a CPU run, or the window fell after the run's end)"}
    span = end - start
    launches = sum(runtime.get(k, 0) for k in LAUNCH_CALLS)
    ms = 1000.0 * steps  # microseconds over the window -> milliseconds per step
    return {
        "steps": steps,
        "steps_counted": bool(counted),
        "device_events": count,
        "device_ms_per_step": round(total / ms, 3),
        "span_ms_per_step": round(span / ms, 3),
        "busy": round(total / span, 3) if span > 0 else None,
        "device_events_per_step": round(count / steps, 1),
        "kernel_launches_per_step": round(launches / steps, 1),
        "graph_launches_per_step": round(runtime.get("cudaGraphLaunch", 0) / steps, 2),
        "by_category_ms": {c: round(v / ms, 3) for c, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n, "category": name_cat[n], "ms_per_step": round(v[0] / ms, 3),
                         "calls_per_step": round(v[1] / steps, 2)}
                        for n, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def traces_by_row(trace_dir: Path) -> dict[str, list[Path]]:
    """Trace files by row: vLLM names them `<prefix>_<rank suffix>.<time>.pt.trace.json[.gz]`, the
    prefix being the row (`capacity_rows.profile_prefix`)."""
    rows: dict[str, list[Path]] = defaultdict(list)
    for p in sorted(trace_dir.rglob("*.pt.trace.json*")):
        m = RANK_SUFFIX.match(p.name)
        rows[m.group(1) if m else p.name.split(".", 1)[0]].append(p)
    return dict(rows)


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [f"# {doc['name']}", "", f"`{doc['command']}`", "",
             f"Machine: {m.get('gpu') or m.get('cpu')}; commit {m.get('git_commit')}; {m.get('date')}; "
             f"vllm {m.get('vllm')}, torch {m.get('torch')}", "",
             "Device time per engine step over the profiled window (vLLM's torch profiler). Busy = device time / "
             "the window's span: below 1 the GPU waited.", ""]
    cats = sorted({c for r in doc["rows"].values() for c in r.get("by_category_ms", {})})
    head = ["row", "steps", "device ms/step", "span ms/step", "busy", "device events/step", "graph launches/step",
            *cats]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row, r in doc["rows"].items():
        if not r.get("device_events"):
            lines.append(f"| {row} | {r.get('steps')} | {r.get('note', '-')} |")
            continue
        cells = [row, r["steps"], r["device_ms_per_step"], r["span_ms_per_step"], r["busy"],
                 r["device_events_per_step"], r["graph_launches_per_step"],
                 *(r["by_category_ms"].get(c, 0.0) for c in cats)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    for row, r in doc["rows"].items():
        if r.get("top_kernels"):
            lines += ["", f"## {row}: kernels by device time", "", "| kernel | category | ms/step | calls/step |",
                      "|---|---|---|---|"]
            lines += [f"| `{k['name'][:90]}` | {k['category']} | {k['ms_per_step']} | {k['calls_per_step']} |"
                      for k in r["top_kernels"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from bench.common import machine_info

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace_dir", type=Path, help="--profile-dir of bench/capacity.py")
    ap.add_argument("--steps", type=int, default=None,
                    help="the STEPS of --profile SKIP:STEPS, for a trace without vLLM's step annotations "
                         "(CPU activity off); otherwise the steps are counted in the trace")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per row")
    args = ap.parse_args(argv)
    rows = traces_by_row(args.trace_dir)
    if not rows:
        ap.error(f"{args.trace_dir}: no *.pt.trace.json[.gz] files (did the profiled runs finish?)")
    proxima = proxima_kernels()
    doc = {"name": args.out.name, "command": " ".join(["bench/step_profile.py", *(argv or sys.argv[1:])]),
           "machine": machine_info(),
           "rows": {row: summarize((e for p in paths for e in read_trace(p)), args.steps, proxima, args.top)
                    | {"traces": [p.name for p in paths]} for row, paths in rows.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    text = markdown(doc)
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
