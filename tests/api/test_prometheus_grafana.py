"""Monitoring as operators run it: a real Prometheus (Debian's `prometheus` package, installed by
scripts/bootstrap.sh) scrapes `proxima api serve --simulate`'s /metrics, and every query of the
Grafana dashboard (configs/grafana/*.json) returns data from it.

The simulator alone never fails a probe or moves the fallback ladder, so the test does what an
operator's tooling would through the API: posts a failing canary and drift verdict (their values
and fail counts), pins and releases a fallback level (the level's changes, alerts), and the policy
sends alerts to a webhook that refuses connections (webhook failures). Nothing here is skipped:
without a prometheus binary the test fails and says how to install it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
JOB = "proxima-sim"
TOKEN = "prom-test"
SCRAPE_S = 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, what: str, proc: subprocess.Popen[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode}:\n{proc.stdout.read() if proc.stdout else ''}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{what} did not answer {url} within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def dashboard_queries() -> list[tuple[str, str]]:
    """(dashboard file and panel title, PromQL) of every target in configs/grafana/*.json."""
    out = []
    for path in sorted((ROOT / "configs" / "grafana").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                out.append((f"{path.name}: {panel.get('title', '?')}", target["expr"]))
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The simulated API and a Prometheus scraping it; yields their base URLs (Prometheus, API)."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise AssertionError("no `prometheus` on PATH: run `bash scripts/bootstrap.sh` (installs Debian's "
                             "prometheus package) or `apt-get install -y prometheus`")
    tmp = tmp_path_factory.mktemp("prometheus")
    api_port, prom_port, dead_port = _free_port(), _free_port(), _free_port()
    policy = yaml.safe_load((ROOT / "proxima" / "policies" / "balanced.yaml").read_text())
    # Alerts go to a port nothing listens on: each delivery fails (proxima_alerts_webhook_failures_total).
    policy["alerts"] = {"log": True, "webhook": {"url": f"http://127.0.0.1:{dead_port}/alerts", "timeout_s": 0.5,
                                                 "retries": 0}}
    policy_file = tmp / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(policy, sort_keys=False))
    env = {**os.environ, "PROXIMA_API_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    api = subprocess.Popen([sys.executable, "-c", "from proxima.cli import main; main()", "api", "serve",
                            "--simulate", "--port", str(api_port), "--policy", str(policy_file)],
                           cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": [f"127.0.0.1:{api_port}"]}]}],
    }))
    prom = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait(f"http://127.0.0.1:{api_port}/healthz", "proxima api serve --simulate", api)
        _wait(f"http://127.0.0.1:{prom_port}/-/ready", "prometheus", prom)
        yield f"http://127.0.0.1:{prom_port}", f"http://127.0.0.1:{api_port}"
    finally:
        _stop(api)
        _stop(prom)


def _query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return list(body["data"]["result"])


def test_every_dashboard_query_returns_data_from_a_real_prometheus(stack: tuple[str, str]) -> None:
    prom, api = stack
    auth = {"Authorization": f"Bearer {TOKEN}"}
    queries = dashboard_queries()
    assert len(queries) >= 10, queries
    # Before the operator's actions: Prometheus scrapes the API (the target is up).
    deadline = time.monotonic() + 30
    while not _query(prom, f'up{{job="{JOB}"}} == 1'):
        assert time.monotonic() < deadline, "prometheus never scraped the API"
        time.sleep(SCRAPE_S)
    time.sleep(3 * SCRAPE_S)  # a few samples of the level before it changes
    with httpx.Client(base_url=api, headers=auth, timeout=10) as c:
        for kind, values in (("canary", {"kl": 0.4, "top1": 0.7}), ("drift", {"p_logprob": 1e-5, "p_entropy": 0.3})):
            r = c.post("/v1/probes", json={"kind": kind, "passed": False, "values": values, "detail": "test"})
            assert r.status_code < 300, r.text
        r = c.post("/v1/fallback", json={"level": 1})
        assert r.status_code < 300, r.text
        time.sleep(3 * SCRAPE_S)
        r = c.post("/v1/fallback", json={"level": None})
        assert r.status_code < 300, r.text
    # rate()/increase() need two samples after the change; changes() sees both moves.
    time.sleep(4 * SCRAPE_S)
    # The simulator sets the pool gauges once its pool has filled, which a loaded host reaches later:
    # poll (bounded) instead of trusting a fixed sleep, so the test asks "data eventually", not "data by t".
    deadline = time.monotonic() + 90
    while True:
        empty = [f"{where}: {expr}" for where, expr in queries if not _query(prom, expr.replace("$job", JOB))]
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(SCRAPE_S)
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
