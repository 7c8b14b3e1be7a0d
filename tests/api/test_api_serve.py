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
            str(ROOT / "proxima" / "policies" / "balanced.yaml"),
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


def test_serve_watch_reports_bad_files_and_takes_the_next_valid_edit(tmp_path: Path) -> None:
    """`api serve --watch` as a real process: a non-UTF-8 file, then a deeply nested one, then a fix."""
    policy = tmp_path / "live.yaml"
    text = (ROOT / "proxima" / "policies" / "balanced.yaml").read_text()
    policy.write_text(text)
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from proxima.cli import main; main()", "api", "serve", "--simulate", "--watch",
         "--port", str(port), "--policy", str(policy)],
        cwd=ROOT,
        env={**os.environ, "PROXIMA_API_TOKEN": "tok"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"

    def wait_for(what: str, condition) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 60
        while True:
            try:
                if condition():
                    return
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)

    def refusals() -> list[dict]:
        alerts = httpx.get(f"{base}/v1/alerts", timeout=5).json()["alerts"]
        return [a for a in alerts if a["kind"] == "policy_reload_refused"]

    try:
        wait_for("the server", lambda: httpx.get(f"{base}/healthz", timeout=1).status_code == 200)
        policy.write_bytes(text.replace("name: balanced", "name: caf\u00e9").encode("latin-1"))
        wait_for("the first alert", lambda: len(refusals()) == 1)
        assert "not UTF-8: byte 0xe9 at line 5" in refusals()[0]["message"]
        policy.write_text("bands: " + "[" * 500 + "]" * 500 + "\n")
        wait_for("the second alert", lambda: len(refusals()) == 2)
        assert "nested more than 32 levels deep" in refusals()[1]["message"]
        assert httpx.get(f"{base}/v1/policy").json()["version"] == 1
        policy.write_text(text.replace("max_blocks_per_step: 1024", "max_blocks_per_step: 64"))
        wait_for("the valid edit", lambda: httpx.get(f"{base}/v1/policy", timeout=5).json()["version"] == 2)
        assert httpx.get(f"{base}/v1/policy").json()["policy"]["budget"]["max_blocks_per_step"] == 64
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert f"policy file refused, the live policy stays at version 1:\n{policy}:5:" in out
    assert "ALERT policy_reload_refused [warning]" in out
    assert "Traceback" not in out
