"""Acceptance: `proxima api serve --simulate` as a real process answers over HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_simulate_end_to_end() -> None:
    port = _free_port()
    env = {**os.environ, "PROXIMA_API_TOKEN": "tok"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from proxima.cli import main; main()",
            "api",
            "serve",
            "--simulate",
            "--port",
            str(port),
            "--policy",
            str(ROOT / "configs" / "balanced.yaml"),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        assert httpx.patch(f"{base}/v1/policy", json={"description": "x"}).status_code == 401
        auth = {"Authorization": "Bearer tok"}
        r = httpx.patch(f"{base}/v1/policy", json={"budget": {"max_blocks_per_step": 0}}, headers=auth)
        assert r.status_code == 422 and r.json()["problems"][0]["field"] == "budget.max_blocks_per_step"
        assert httpx.get(f"{base}/v1/policy").json()["version"] == 1
        assert (
            httpx.patch(f"{base}/v1/policy", json={"budget": {"max_blocks_per_step": 64}}, headers=auth).status_code
            == 200
        )
        metrics = httpx.get(f"{base}/metrics").text
        assert "proxima_pool_pressure_ratio" in metrics and "proxima_policy_version 2.0" in metrics
        time.sleep(0.3)  # the engine thread keeps stepping
        assert httpx.get(f"{base}/v1/stats").json()["step"] > 0
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert "policy v1 -> v2" in out and "budget.max_blocks_per_step: 1024 -> 64" in out
