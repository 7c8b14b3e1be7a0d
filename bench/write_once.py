"""Compressions per compressed block in the simulator, with the engine's settled price as it is
and as it was before it counted this step's need and the queue's demand (issue 37 item 4).

Two workloads: the 8B throughput workload's shape (bench/capacity_runs.py: 16 requests of 2,048 +
1,024 tokens at once, a pool of two full requests) and `proxima simulate`'s default (128 requests,
Poisson arrivals, a pool of 2,048 blocks). "before" is the same `decide` with the price given
neither the need nor `queued_blocks`. Capacity is the simulator's resident requests (peak, mean)
and steps to finish.

    PYTHONPATH=$PWD python bench/write_once.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_info, write_results
from proxima.policy import engine
from proxima.policy.loader import load_policy
from proxima.simulator.sim import PoolConfig, Simulator
from proxima.simulator.workload import RequestSpec, WorkloadConfig, synthetic

POLICIES = ("conservative", "balanced", "aggressive")
KEYS = ("compressions_per_block", "peak_resident_requests", "mean_resident_requests", "steps", "predicted_damage")


def workloads() -> dict[str, tuple[PoolConfig, list[RequestSpec]]]:
    return {
        "throughput": (
            PoolConfig(total_blocks=2 * 3072 // 16, block_size=16),
            [RequestSpec(f"r{i}", 0, 2048, 1024) for i in range(16)],
        ),
        "default": (PoolConfig(), synthetic(WorkloadConfig(), 0)),
    }


def run(before: bool) -> dict[str, dict[str, dict[str, object]]]:
    price = engine.settled_price

    def present_savings_only(snap, policy, ladder, floor, need=0.0):  # type: ignore[no-untyped-def]
        return price(dataclasses.replace(snap, queued_blocks=0), policy, ladder, floor, 0.0)

    engine.settled_price = present_savings_only if before else price  # type: ignore[assignment]
    try:
        out: dict[str, dict[str, dict[str, object]]] = {}
        for name, (pool, wl) in workloads().items():
            out[name] = {}
            for pol in POLICIES:
                s = Simulator(pool, load_policy(pol), 0).run(wl).summary()
                out[name][pol] = {k: s[k] for k in KEYS}
        return out
    finally:
        engine.settled_price = price  # type: ignore[assignment]


def main() -> None:
    rows = {"before": run(True), "now": run(False)}
    lines = [
        "# Compressions per compressed block in the simulator (issue 37 item 4)",
        "",
        "`PYTHONPATH=$PWD python bench/write_once.py`",
        "",
        "| workload | policy | compressions/block before -> now | peak resident | mean resident | steps "
        "| predicted damage |",
        "|---|---|---|---|---|---|---|",
    ]
    for wl in rows["now"]:
        for pol in POLICIES:
            b, n = rows["before"][wl][pol], rows["now"][wl][pol]
            lines.append(
                f"| {wl} | {pol} | {b['compressions_per_block']} -> {n['compressions_per_block']} | "
                f"{b['peak_resident_requests']} -> {n['peak_resident_requests']} | "
                f"{b['mean_resident_requests']} -> {n['mean_resident_requests']} | "
                f"{b['steps']} -> {n['steps']} | {b['predicted_damage']} -> {n['predicted_damage']} |"
            )
    info = machine_info()
    lines += ["", f"Machine: {info.get('cpu', '?')}, commit {info.get('git_commit', '?')}, {info['date']}", ""]
    md = "\n".join(lines)
    print(md)
    write_results(
        "write-once-sim", {"command": "PYTHONPATH=$PWD python bench/write_once.py", "machine": info, "rows": rows}, md
    )


if __name__ == "__main__":
    main()
