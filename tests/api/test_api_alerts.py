"""Alert sinks: the webhook delivers with timeout and retry, and never blocks the engine."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import ClassVar

from api_helpers import AUTH
from fastapi.testclient import TestClient

from proxima.api.alerts import AlertLog, WebhookSink
from proxima.api.server import SimulatedServer
from proxima.policy.schema import Alerts, Webhook


def test_webhook_retries_then_reports_failure() -> None:
    calls: list[tuple[str, float]] = []
    failures = []

    def post(url: str, body: dict, timeout: float) -> None:
        calls.append((url, timeout))
        raise ConnectionError("endpoint down")

    cfg = Webhook(url="http://hooks.invalid/x", timeout_s=0.5, retries=2)
    sink = WebhookSink(lambda: cfg, post=post, on_failure=lambda a, e: failures.append((a, e)), sleep=lambda s: None)
    alerts = AlertLog(lambda: Alerts(log=False, webhook=cfg), webhook=sink)
    sink.start()
    alerts.fire(1.0, "test", "warning", "hello")
    sink.join()
    sink.stop()
    assert calls == [("http://hooks.invalid/x", 0.5)] * 3
    assert len(failures) == 1 and isinstance(failures[0][1], ConnectionError)


def test_slow_webhook_never_blocks_fire_and_drops_when_full() -> None:
    release = threading.Event()
    dropped = []

    def post(url: str, body: dict, timeout: float) -> None:
        release.wait(5.0)

    cfg = Webhook(url="http://hooks.invalid/x", retries=0)
    sink = WebhookSink(lambda: cfg, post=post, on_drop=dropped.append, max_queue=3)
    alerts = AlertLog(lambda: Alerts(log=False, webhook=cfg), webhook=sink)
    sink.start()
    t0 = time.perf_counter()
    for i in range(10):
        alerts.fire(float(i), "test", "info", f"alert {i}")
    assert time.perf_counter() - t0 < 0.5
    assert len(alerts.recent()) == 10  # the in-memory log keeps everything regardless
    assert len(dropped) >= 6  # one in flight, three queued, the rest dropped
    release.set()
    sink.join()
    sink.stop()


def test_no_webhook_configured_queues_nothing() -> None:
    sink = WebhookSink(lambda: None, post=lambda *a: (_ for _ in ()).throw(AssertionError("posted")))
    sink.submit(AlertLog(lambda: Alerts(log=False)).fire(0.0, "x", "info", "m"))
    sink.start()
    sink.join()
    sink.stop()


class _Hook(BaseHTTPRequestHandler):
    received: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        _Hook.received.append(json.loads(self.rfile.read(length)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_webhook_set_by_patch_receives_fallback_alert(client: TestClient, server: SimulatedServer) -> None:
    httpd = HTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_port}/hook"
        assert (
            client.patch(
                "/v1/policy", json={"alerts": {"webhook": {"url": url, "timeout_s": 2}}}, headers=AUTH
            ).status_code
            == 200
        )
        client.post("/v1/fallback", json={"level": 1}, headers=AUTH)
        server.controller.webhook.join()
        assert _Hook.received and _Hook.received[-1]["kind"] == "fallback_forced"
        assert _Hook.received[-1]["source"] == "proxima"
        assert server.controller.webhook.delivered == 1
    finally:
        httpd.shutdown()


def test_alerts_pagination(client: TestClient) -> None:
    for level in (1, 2, None):
        client.post("/v1/fallback", json={"level": level}, headers=AUTH)
    all_alerts = client.get("/v1/alerts").json()["alerts"]
    assert [a["id"] for a in all_alerts] == [1, 2, 3]
    assert [a["id"] for a in client.get("/v1/alerts", params={"since_id": 1}).json()["alerts"]] == [2, 3]
    assert [a["id"] for a in client.get("/v1/alerts", params={"limit": 1}).json()["alerts"]] == [3]
