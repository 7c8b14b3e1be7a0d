"""The step file (`bench/results/step-h200.{json,md}`): where a Proxima row's step goes, from the
equal-bytes benchmark's runs (`capacity_runs.document`).

Per policy row (`rows.<policy>`, from the throughput workload; every workload under
`by_workload`): compression and attention time per step (CUDA events of `PROXIMA_TIME_SPLIT=1`,
`worker/timing.py`, medians over the row's runs), the model step, the planning, CUDA-graph
replays (vLLM's own `cudagraph_metrics`, counted by the benchmark's stat logger for every row),
and the structure counters the step issues add to Proxima's stats file (`launches_per_step`,
`memcpys_per_step`, `syncs_per_step`: medians over the worker's sampled steps, measured in the
engine by `worker/step_counter.py`; `compressions_per_block`, `attention_launches_per_layer`). A
value the row's stats file does not hold is null, with the reason under `missing`; a value it
holds has none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.kv_budget import VLLM_KV_DTYPES

UNSAMPLED = ("no sampled step in this row's stats file: the worker measures one compressing step in 64 (the "
             "second, then every 64th; worker/step_counter.py, with PROXIMA_TIME_SPLIT=1), so a row with fewer "
             "compressing steps, or a stats file older than the counter, has none")
COUNTER_REASONS = {
    "launches_per_step": UNSAMPLED + " (CUDA kernel launches of Proxima's part of a step, torch profiler)",
    "memcpys_per_step": UNSAMPLED + " (CUDA memcpys and memsets of Proxima's part of a step, torch profiler)",
    "syncs_per_step": UNSAMPLED + " (host syncs of Proxima's part of a step, torch.cuda.set_sync_debug_mode)",
    "compressions_per_block": "this row's stats file predates the scheduler's `compressions_per_block` (commits "
                              "over first compressions, scheduler/stats.py)",
    "attention_launches_per_layer": "Proxima's stats file has no attention launch counter (issue 38's CPU test "
                                    "counts them under TRITON_INTERPRET)",
}
PREFERRED = "throughput"


def policy_rows(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each Proxima row of one workload's table (vLLM's own rows have no step split)."""
    out: dict[str, dict[str, Any]] = {}
    for row, t in results.items():
        if row in VLLM_KV_DTYPES:
            continue
        if "error" in t:
            out[row] = {"error": t["error"]}
            continue
        ms = t.get("step_ms") or {}
        counters = t.get("step_counters") or {}
        missing: dict[str, str] = {}

        def part(*keys: str, why: str, ms: dict = ms, missing: dict = missing) -> float | None:
            vals = [ms[k] for k in keys if ms.get(k) is not None]
            if not vals:
                missing[keys[0]] = why
                return None
            return round(sum(vals), 3)

        no_split = "no step split in this row's runs (PROXIMA_TIME_SPLIT=1 and the stats file are set by the bench)"
        entry: dict[str, Any] = {
            "compress_ms_per_step": part("compress_ms", why=no_split),
            "attention_ms_per_step": part("attention_vllm_ms", "attention_proxima_ms", why=no_split),
            "attention_proxima_ms_per_step": part("attention_proxima_ms", why=no_split),
            "model_ms_per_step": part("model_ms", why=no_split),
            "planning_ms_per_step": part("planning_ms", why=no_split),
            "graph_replays": t.get("graph_replays"),
            "cudagraph_mode": t.get("cudagraph_mode"),
            "tokens_per_s": t.get("tokens_per_s"),
            "compressions": t.get("compressions"),
        }
        if entry["graph_replays"] is None:
            missing["graph_replays"] = "vLLM reported no cudagraph_stats in this row's runs"
        for name, why in COUNTER_REASONS.items():
            entry[name] = counters.get(name)
            if entry[name] is None:  # (the reason is for an absent value only)
                missing[name] = why
        entry["counted_steps"] = counters.get("counted_steps")
        entry["missing"] = missing
        out[row] = entry
    return out


def step_document(capacity: dict[str, Any]) -> dict[str, Any]:
    workloads = capacity["workloads"]
    by_workload = {name: policy_rows(w["results"]) for name, w in workloads.items()}
    main = PREFERRED if PREFERRED in by_workload else next(iter(by_workload), None)
    return {"source": "bench/capacity.py --mode equal-bytes (medians over each row's runs)",
            "commit": capacity.get("commit"), "date": capacity.get("date"), "machine": capacity.get("machine"),
            "versions": capacity.get("versions"), "workload": main,
            "rows": by_workload.get(main, {}) if main else {}, "by_workload": by_workload}


def _cell(v: Any) -> str:
    return "-" if v is None else str(v)


def step_markdown(doc: dict[str, Any]) -> str:
    cols = ("compress_ms_per_step", "attention_ms_per_step", "attention_proxima_ms_per_step", "model_ms_per_step",
            "planning_ms_per_step", "graph_replays", "launches_per_step", "memcpys_per_step", "syncs_per_step",
            "counted_steps", "compressions_per_block",
            "attention_launches_per_layer")
    parts = [f"Step split of Proxima's rows (commit {doc['commit'] or 'unknown'}, {doc['date']}, "
             f"{doc['machine']}); null values: the reason is under `missing` in the JSON."]
    for name, rows in doc["by_workload"].items():
        lines = ["| row | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
        for row, e in rows.items():
            cells = [f"error: {e['error']}"] + [""] * (len(cols) - 1) if "error" in e else [_cell(e[c]) for c in cols]
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
        parts += [f"## {name}", "\n".join(lines)]
    return "\n\n".join(parts) + "\n"


def write_step_file(capacity: dict[str, Any], out: Path) -> dict[str, Any]:
    doc = step_document(capacity)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    out.with_suffix(".md").write_text(step_markdown(doc))
    return doc
