"""The equal-bytes benchmark's runs: which row runs when, the runs file, and the table built from it.

Fairness is in the order: every row runs alone (`capacity_rows.run_row`), and the rows of a
workload run in alternating order over the repetitions (rep 1 in the given order, rep 2 reversed,
rep 3 as rep 1, ...), so a drift of the machine over a lease (clocks, heat, caches filling) lands
on every row alike rather than on the last ones.

A runs file (JSON, `FORMAT`) holds one workload's runs, each as it finished: the workload, its
repetition and position, the order of its repetition, its duration and its summary
(`capacity_rows.summarize`). A device call of at most 10 minutes does part of the schedule; the
next call resumes the same file and runs what is missing. `aggregate` turns runs into the table
(per row: the median of its runs and their spread), `document` joins runs files (several calls,
several workloads) into `capacity-h200.json`.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

FORMAT = "proxima-capacity-runs/1"

WORKLOADS: dict[str, dict[str, Any]] = {
    # 1. Llama-3.1-8B-shaped, dummy weights, decode-dominated: a pool of 2 full requests, 8x as many requests.
    "throughput": {"shaped": True, "requests": 16, "prompt_tokens": 2048, "output_tokens": 1024, "pool_requests": 2,
                   "chunk_tokens": 512, "score_prompts": False, "deadline_s": 35.0},
    # 2. Long context, 8B shape: KV reads dominate each step.
    "long_context": {"shaped": True, "requests": 8, "prompt_tokens": 16384, "output_tokens": 512, "pool_requests": 2,
                     "chunk_tokens": 2048, "score_prompts": False, "deadline_s": 45.0},
    # 3. Real SmolLM2 weights, memory-bound: teacher-forced prompt NLL and top-1 (vLLM's prompt_logprobs).
    "quality": {"shaped": False, "requests": 32, "prompt_tokens": 1024, "output_tokens": 128, "pool_requests": 2,
                "chunk_tokens": 256, "score_prompts": True, "deadline_s": 60.0},
}
"""Sized so that both repetitions of the eight rows fit about 25 minutes of one lease: an engine
build with compilation and CUDA-graph capture takes ~30-60 s (more on a lease's first), and
generation stops at `deadline_s` (the run is marked truncated: its rates count what ran, TTFT is
over the requests that started, `started_requests` says how many); 16 runs x (~50 s + deadline)
~= 23-27 min. A workload's repetitions belong in one lease (its ratios are taken within it)."""

QUICK = {"throughput": {"requests": 8, "prompt_tokens": 512, "output_tokens": 256, "deadline_s": 20.0},
         "long_context": {"requests": 4, "prompt_tokens": 4096, "output_tokens": 128, "deadline_s": 20.0},
         "quality": {"requests": 8, "prompt_tokens": 512, "output_tokens": 32, "deadline_s": 30.0}}
"""`--quick`: each workload shrunk (a smoke run of the whole schedule in a few minutes)."""


def rep_order(rows: list[str], rep: int) -> list[str]:
    """The order of repetition `rep` (1-based): odd reps as given, even reps reversed."""
    if rep < 1:
        raise ValueError(f"repetition {rep}: repetitions count from 1")
    return list(rows) if rep % 2 else list(reversed(rows))


def schedule(rows: list[str], reps: int) -> list[tuple[int, int, str]]:
    """Every (rep, position, row) of `reps` repetitions, in run order."""
    return [(rep, pos, row) for rep in range(1, reps + 1) for pos, row in enumerate(rep_order(rows, rep))]


def new_runs(workload: str, spec: dict[str, Any], rows: list[str], meta: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "workload": workload, "spec": spec, "rows": rows, "meta": meta, "runs": []}


def load_runs(path: Path, workload: str, spec: dict[str, Any], rows: list[str]) -> dict[str, Any]:
    """A runs file to resume; it must be of the same workload, sizes and row order (else the
    alternating order and the medians would mix different benchmarks)."""
    doc = json.loads(path.read_text())
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not a runs file (format {doc.get('format')!r}, expected {FORMAT!r})")
    if doc["workload"] != workload:
        raise ValueError(f"{path}: holds workload {doc['workload']!r}, this run is {workload!r}")
    if doc["spec"] != spec:
        diff = {k: (doc["spec"].get(k), spec.get(k)) for k in set(doc["spec"]) | set(spec)
                if doc["spec"].get(k) != spec.get(k)}
        raise ValueError(f"{path}: workload sizes differ from this run's (file, now): {diff}")
    if doc["rows"] != rows:
        raise ValueError(f"{path}: row order {doc['rows']} differs from this run's {rows}: the alternating "
                         "order is defined over the file's rows (pass --rows in the file's order)")
    return doc


def pending(doc: dict[str, Any], reps: int, only: list[str] | None = None) -> list[tuple[int, int, str]]:
    """The scheduled runs the file does not hold yet (`only`: just these rows), in run order."""
    done = {(r["rep"], r["row"]) for r in doc["runs"]}
    return [(rep, pos, row) for rep, pos, row in schedule(doc["rows"], reps)
            if (rep, row) not in done and (only is None or row in only)]


def record(doc: dict[str, Any], rep: int, pos: int, row: str, result: dict[str, Any], duration_s: float,
           started: str) -> dict[str, Any]:
    run = {"rep": rep, "position": pos, "row": row, "order": rep_order(doc["rows"], rep), "started": started,
           "duration_s": round(duration_s, 1), "result": result}
    doc["runs"].append(run)
    return run


def save(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)  # a call cut off mid-write keeps the previous complete file


MEDIAN_KEYS = ("tokens_per_s", "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "peak_running",
               "mean_running", "preemptions", "prompt_nll", "prompt_top1", "scored_prompts", "wall_s", "engine_build_s",
               "generated_tokens", "finished_requests", "started_requests", "graph_replays", "compressions",
               "side_table_peak_bytes", "side_table_held_peak_blocks", "side_table_shortfall_peak_bytes")
"""Measures a row reports as the median over its runs."""
SAME_KEYS = ("kv_bytes", "pool_blocks", "block_bytes", "kv_cache_dtype", "cudagraph_mode", "async_scheduling",
             "enforce_eager")
"""Settings every run of a row shares (taken from its first successful run)."""


def _median(xs: list[Any]) -> Any:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    m = statistics.median(xs)
    if isinstance(m, float) and m.is_integer() and all(isinstance(x, int) for x in xs):
        return int(m)  # counts stay counts (the median of two equal peaks is that peak)
    return round(m, 4) if isinstance(m, float) else m


def aggregate(runs: Iterable[dict[str, Any]], rows: list[str]) -> dict[str, dict[str, Any]]:
    """The table: per row, the median of every measure over its successful runs, tokens/s of
    each run in run order (`tokens_per_s_runs`) and their spread; errors are kept per run, and a
    row with no successful run shows its last error."""
    by_row: dict[str, list[dict[str, Any]]] = {}
    # a profiled run (`bench/capacity.py --profile`) ran slower under the profiler: not the table's
    for run in sorted((r for r in runs if not r["result"].get("profiled")), key=lambda r: (r["rep"], r["position"])):
        by_row.setdefault(run["row"], []).append(run)
    table: dict[str, dict[str, Any]] = {}
    for row in [r for r in rows if r in by_row] + [r for r in by_row if r not in rows]:
        ok = [r["result"] for r in by_row[row] if "error" not in r["result"]]
        errors = [{"rep": r["rep"], "error": r["result"]["error"]} for r in by_row[row] if "error" in r["result"]]
        if not ok:
            first = by_row[row][-1]["result"]
            table[row] = {"error": first["error"], "errors": errors} | {k: first.get(k) for k in SAME_KEYS
                                                                         if k in first}
            continue
        rates = [r["tokens_per_s"] for r in ok]
        entry: dict[str, Any] = {k: ok[0].get(k) for k in SAME_KEYS}
        entry |= {k: _median([r.get(k) for r in ok]) for k in MEDIAN_KEYS}
        entry |= {"tokens_per_s_runs": rates, "tokens_per_s_min": min(rates), "tokens_per_s_max": max(rates),
                  "runs": len(ok), "reps": [r["rep"] for r in by_row[row] if "error" not in r["result"]],
                  "truncated": any(r.get("truncated") for r in ok),
                  "cuda_graphs": all(r.get("cuda_graphs") for r in ok), "errors": errors}
        parts = sorted({k for r in ok for k in r.get("step_ms") or {}})
        if parts:
            entry["step_ms"] = {k: _median([(r.get("step_ms") or {}).get(k) for r in ok]) for k in parts}
        counters = sorted({k for r in ok for k in r.get("step_counters") or {}})
        if counters:
            entry["step_counters"] = {k: _median([(r.get("step_counters") or {}).get(k) for r in ok])
                                      for k in counters}
        if "compressions_by_format" in ok[0]:
            entry["compressions_by_format"] = ok[-1]["compressions_by_format"]
        table[row] = entry
    return table


def source_digest(root: Path) -> str:
    """A digest of the code that ran (every .py and .yaml under proxima/ and bench/): the device
    gets the checkout without its git history, so the merge on the CPU side names the commit
    whose tree has this digest."""
    h = hashlib.sha256()
    for p in sorted([*root.glob("proxima/**/*.py"), *root.glob("proxima/**/*.yaml"), *root.glob("bench/*.py")]):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def document(runs_docs: list[dict[str, Any]], commit: str | None, digest: str, command: str) -> dict[str, Any]:
    """`capacity-h200.json`: every workload's table from its runs files (a workload's files are
    joined: several calls of one lease), with each file's machine, versions, date and command."""
    workloads: dict[str, dict[str, Any]] = {}
    for d in runs_docs:
        w = workloads.setdefault(d["workload"], {"spec": d["spec"], "rows": d["rows"], "runs": [], "calls": []})
        if w["spec"] != d["spec"]:
            raise ValueError(f"workload {d['workload']!r}: files with different sizes ({w['spec']} / {d['spec']})")
        w["runs"] += d["runs"]
        w["calls"] += d.get("calls") or [d["meta"]]
    out: dict[str, Any] = {}
    for name, w in workloads.items():
        meta = w["calls"][0]
        reps = max((r["rep"] for r in w["runs"]), default=0)
        out[name] = {
            "model": meta.get("model"), "weights": meta.get("weights"), "workload": w["spec"],
            "rows": w["rows"], "repetitions": reps,
            "orders": {str(rep): rep_order(w["rows"], rep) for rep in range(1, reps + 1)},
            "machine": meta.get("machine"), "versions": meta.get("versions"),
            "dates": sorted({c.get("date", "") for c in w["calls"]}),
            "commands": [c.get("command") for c in w["calls"]],
            "code": sorted({c.get("source_digest", "") for c in w["calls"]}),
            "results": aggregate(w["runs"], w["rows"]),
            "runs": w["runs"],
        }
    first = runs_docs[0]["meta"] if runs_docs else {}
    stale = sorted({c for w in out.values() for c in w["code"]} - {digest})
    return {"machine": first.get("machine"), "versions": first.get("versions"),
            "commit": commit if not stale else None,
            "commit_note": (f"code digest {digest} = commit {commit}" if not stale else
                            f"runs of code {stale} differ from this checkout's ({digest}): commit unknown"),
            "date": max((d for w in out.values() for d in w["dates"]), default=None),
            "command": command, "engine": first.get("engine"), "equal_memory": EQUAL_MEMORY,
            "workloads": out}


EQUAL_MEMORY = ("every row holds the KV bytes of the bf16 pool: vLLM's dtype rows get the blocks those bytes hold "
                "in their dtype (vLLM's own page size); Proxima's rows hold back pool blocks for their side tables "
                "(side_tables.py, always charged)")


def _cell(v: Any) -> str:
    return "-" if v is None else str(v)


def markdown_table(results: dict[str, dict[str, Any]], prompt_scores_too: bool) -> str:
    head = ["row", "KV dtype", "pool blocks", "KV MiB", "graphs, async", "tokens/s median (min-max)", "runs",
            "TPOT p50/p99 ms", "TTFT p50/p99 ms", "peak / mean running", "preempt"]
    if prompt_scores_too:
        head += ["prompt NLL", "top-1"]
    head += ["ms/step: model, attention vLLM/Proxima, compress, planning"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, t in results.items():
        if "error" in t:
            cells = [name, _cell(t.get("kv_cache_dtype")), _cell(t.get("pool_blocks")), "", "", f"error: {t['error']}"]
            lines.append("| " + " | ".join(cells + [""] * (len(head) - len(cells))) + " |")
            continue
        ms = t.get("step_ms") or {}
        split = (f"{ms.get('model_ms', 0):.1f}, {ms.get('attention_vllm_ms', 0):.1f}/"
                 f"{ms.get('attention_proxima_ms', 0):.1f}, {ms.get('compress_ms', 0):.1f}, "
                 f"{ms.get('planning_ms', 0):.1f}") if ms else "-"
        cells = [name, t["kv_cache_dtype"], t["pool_blocks"], round(t["kv_bytes"] / 2**20, 1),
                 (f"{t['cudagraph_mode']}" if t["cuda_graphs"] else "eager")
                 + (", async" if t["async_scheduling"] else ", sync"),
                 f"{t['tokens_per_s']} ({t['tokens_per_s_min']}-{t['tokens_per_s_max']})"
                 + (" (truncated)" if t["truncated"] else ""),
                 f"{t['runs']}" + (f" ({len(t['errors'])} failed)" if t["errors"] else ""),
                 f"{_cell(t['tpot_p50_ms'])}/{_cell(t['tpot_p99_ms'])}",
                 f"{_cell(t['ttft_p50_ms'])}/{_cell(t['ttft_p99_ms'])}",
                 f"{t['peak_running']} / {t['mean_running']}", t["preemptions"]]
        if prompt_scores_too:
            cells += [_cell(t["prompt_nll"]), _cell(t["prompt_top1"])]
        cells += [split]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def markdown(doc: dict[str, Any]) -> str:
    parts = [f"Commit: {doc['commit'] or 'unknown'} ({doc['commit_note']}); latest run {doc['date']}",
             f"Engine: {doc['engine']}", f"Equal memory: {doc['equal_memory']}"]
    for name, w in doc["workloads"].items():
        orders = "; ".join(f"rep {k}: {', '.join(v)}" for k, v in w["orders"].items())
        parts += [f"## {name} ({w['model']}, {w['weights']} weights)",
                  f"Machine: {w['machine']}; versions: {json.dumps(w['versions'])}; dates: {', '.join(w['dates'])}",
                  f"Workload: {json.dumps(w['workload'])}", f"One engine at a time, alternating order: {orders}",
                  "Commands: " + "; ".join(f"`{c}`" for c in w["commands"]),
                  markdown_table(w["results"], bool(w["workload"].get("score_prompts")))]
    return "\n\n".join(parts) + "\n"
