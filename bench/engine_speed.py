"""How long `decide()` takes at 1k, 10k and 100k blocks (target: < 1 ms at 10k).

Run: .venv/bin/python bench/engine_speed.py
Writes bench/results/engine-speed.json and .md.

The snapshot is a realistic pressure situation: requests of 100 blocks, a mix of hot and already
compressed blocks, heavy-tailed importance, the pool at 95% with allocations waiting, so the
engine has real work (a full ranking and a budget-limited choice), not an early exit.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info, write_results

from proxima.formats import HOT, Format
from proxima.policy.engine import EngineState, decide
from proxima.policy.loader import load_policy
from proxima.policy.snapshot import Snapshot

ROOT = Path(__file__).resolve().parents[1]


def make_snapshot(n_blocks: int, seed: int = 0, block_size: int = 16, per_request: int = 100) -> Snapshot:
    rng = np.random.default_rng(seed)
    n_req = max(1, n_blocks // per_request)
    counts = np.full(n_req, per_request, dtype=np.int32)
    n = int(counts.sum())
    formats = (HOT, Format.parse("int8"), Format.parse("int4"))
    fmt = rng.choice(3, size=n, p=[0.6, 0.25, 0.15]).astype(np.int16)
    tokens = np.full(n, block_size, dtype=np.int32)
    ends = np.cumsum(counts) - 1
    tokens[ends] = rng.integers(1, block_size + 1, n_req)
    total = int(n / 0.95)
    return Snapshot(
        total_blocks=total,
        free_blocks=total - n,
        block_size=block_size,
        request_ids=tuple(f"r{i}" for i in range(n_req)),
        formats=formats,
        block_request=np.repeat(np.arange(n_req, dtype=np.int32), counts),
        block_index=np.tile(np.arange(per_request, dtype=np.int32), n_req),
        block_importance=rng.lognormal(0, 1.5, n) / 100,
        block_format=fmt,
        block_tokens=tokens,
        block_age=np.tile(np.arange(per_request, 0, -1), n_req).astype(np.int64),
        block_shared=rng.random(n) < 0.02,
        request_tokens=counts.astype(np.int64) * block_size - (block_size - tokens[ends]),
        request_blocks=counts,
        request_prefill=rng.random(n_req) < 0.05,
        pending_blocks=int(0.05 * total),
    )


def time_decide(snap: Snapshot, policy_name: str, repeats: int) -> tuple[float, float, int]:
    policy = load_policy(ROOT / "proxima" / "policies" / f"{policy_name}.yaml")
    state = EngineState()
    decide(snap, policy, state)  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        d = decide(snap, policy, state)
        times.append(time.perf_counter() - t0)
    arr = np.array(times) * 1e3
    return float(np.median(arr)), float(np.percentile(arr, 90)), len(d)


def main() -> None:
    rows = []
    for n in (1_000, 10_000, 100_000):
        snap = make_snapshot(n)
        for policy in ("conservative", "balanced", "aggressive"):
            repeats = 200 if n <= 10_000 else 30
            med, p90, actions = time_decide(snap, policy, repeats)
            rows.append(
                {"blocks": n, "policy": policy, "median_ms": round(med, 4), "p90_ms": round(p90, 4), "actions": actions}
            )
            print(f"{n:>7} blocks  {policy:<12}  median {med:8.3f} ms  p90 {p90:8.3f} ms  actions {actions}")
    at_10k = max(r["median_ms"] for r in rows if r["blocks"] == 10_000)
    verdict = "met" if at_10k < 1.0 else "NOT met"
    print(f"target: < 1 ms at 10k blocks: worst median {at_10k:.3f} ms -> {verdict}")
    md = [
        "# decide() speed",
        "",
        f"Machine: {machine_info().get('cpu', '?')}; command: `.venv/bin/python bench/engine_speed.py`",
        "",
        "| blocks | policy | median ms | p90 ms | actions |",
        "|---:|---|---:|---:|---:|",
    ]
    md += [f"| {r['blocks']} | {r['policy']} | {r['median_ms']} | {r['p90_ms']} | {r['actions']} |" for r in rows]
    md += ["", f"Target < 1 ms at 10k blocks: worst median {at_10k:.3f} ms, **{verdict}**.", ""]
    path = write_results(
        "engine-speed", {"machine": machine_info(), "target_ms_at_10k": 1.0, "rows": rows}, "\n".join(md)
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
