"""What a hostile policy costs now: time and peak memory to refuse each case of issue 12's table.

Run: .venv/bin/python bench/hostile_policies.py
Writes bench/results/hostile-policies.json and .md.

Each case is refused by the loader (`load_policy` on a file) and by `PUT /v1/policy` (the
simulator-backed app, in-process). Before the bounded reader, the 1.8 KB alias bomb blocked the
API for 88 s and the 50 MB file took 210-300 s and over 6 GiB before a MemoryError (issue 12).
Peak memory is Python allocations traced by tracemalloc during a second call (timed untraced).
"""

from __future__ import annotations

import itertools
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info, write_results
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from proxima.api.auth import TokenSource
from proxima.api.server import simulated
from proxima.policy.loader import PolicyError, load_policy

ROOT = Path(__file__).resolve().parents[1]
BALANCED = (ROOT / "proxima" / "policies" / "balanced.yaml").read_text()
AUTH = {"Authorization": "Bearer bench"}


def _bomb() -> str:
    names = "abcdefghi"
    lines = ['  a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"  {n}: &{n} [" + ", ".join([f"*{p}"] * 9) + "]" for p, n in itertools.pairwise(names)]
    return BALANCED + "\ndamage:\n  table:\n" + "\n".join(lines) + "\n"


CASES: dict[str, bytes] = {
    "alias bomb (YAML)": _bomb().encode(),
    "50 MB file": b"",  # written in chunks below
    "YAML nested 500 levels": ("bands: " + "[" * 500 + "]" * 500).encode(),
    "JSON nested 1,000 levels": ('{"bands": ' + "[" * 1000 + "]" * 1000 + "}").encode(),
    "non-UTF-8 byte": BALANCED.replace("name: balanced", "name: balanc\u00e9").encode("latin-1"),
    "duplicate key": (BALANCED + "\nenabled: false\nenabled: true\n").encode(),
    "true as an integer": BALANCED.replace("max_blocks_per_step: 1024", "max_blocks_per_step: true").encode(),
}


def _measure(fn: Any) -> tuple[float, float, str]:
    """Wall time of one call, then the peak of a second, traced call (tracing slows it several-fold)."""
    t0 = time.perf_counter()
    outcome = fn()
    seconds = time.perf_counter() - t0
    tracemalloc.start()
    try:
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return seconds, peak / 2**20, outcome


def _load(path: Path) -> str:
    try:
        load_policy(path)
    except PolicyError as exc:
        return str(exc).splitlines()[0].split(": ", 1)[1][:90]
    return "ACCEPTED"


def main() -> None:
    srv = simulated(
        load_policy(ROOT / "proxima" / "policies" / "balanced.yaml"),
        tokens=TokenSource(None, "T", environ={"T": "bench"}.get),
        registry=CollectorRegistry(),
    )
    # Raise the body limit to its maximum so the reader, not the body limit, meets the big file.
    client = TestClient(srv.app)
    assert client.patch("/v1/policy", json={"api": {"max_body_bytes": 16 << 20}}, headers=AUTH).status_code == 200
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in CASES.items():
            path = Path(tmp) / "p.yaml"
            with path.open("wb") as f:
                if name == "50 MB file":
                    for _ in range(50):
                        f.write(b"# " + b"x" * ((1 << 20) - 3) + b"\n")
                else:
                    f.write(data)
            load_s, load_mib, message = _measure(lambda path=path: _load(path))
            body = path.read_bytes()[: 16 << 20]  # what fits the API's largest body limit
            before = client.get("/v1/policy").json()["version"]
            headers = {**AUTH, "Content-Type": "application/yaml"}
            def put(body: bytes = body, headers: dict[str, str] = headers) -> str:
                return str(client.put("/v1/policy", content=body, headers=headers).status_code)

            api_s, api_mib, status = _measure(put)
            unchanged = client.get("/v1/policy").json()["version"] == before
            rows.append(
                {
                    "case": name,
                    "bytes": path.stat().st_size,
                    "loader_s": round(load_s, 4),
                    "loader_peak_mib": round(load_mib, 2),
                    "api_status": int(status),
                    "api_s": round(api_s, 4),
                    "api_peak_mib": round(api_mib, 2),
                    "live_policy_unchanged": unchanged,
                    "message": message,
                }
            )
    cmd = ".venv/bin/python bench/hostile_policies.py"
    md = [
        "# Hostile policies: cost of refusing each case",
        "",
        f"Command: `{cmd}`. Machine: {machine_info().get('cpu', '?')}, {machine_info().get('cpu_count')} CPUs "
        f"(shared). Date: {machine_info()['date']}.",
        "API: `PUT /v1/policy` (YAML body; `api.max_body_bytes` raised to 16 MiB, so the 50 MB case sends its",
        "first 16 MiB and meets the reader's 256 KiB limit). Times: one untraced call; peak: Python",
        "allocations (tracemalloc) during a second call. The API's peak includes the 16 MiB body it buffered.",
        "",
        "| case | bytes | loader s | loader peak MiB | API status | API s | API peak MiB | live unchanged | message |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['case']} | {r['bytes']} | {r['loader_s']:.4f} | {r['loader_peak_mib']:.2f} | {r['api_status']} | "
            f"{r['api_s']:.4f} | {r['api_peak_mib']:.2f} | {r['live_policy_unchanged']} | {r['message']} |"
        )
    text = "\n".join(md) + "\n"
    print(text)
    write_results("hostile-policies", {"command": cmd, "machine": machine_info(), "rows": rows}, text)


if __name__ == "__main__":
    main()
