"""Alerts: a bounded in-memory log (for `GET /v1/alerts`), the log sink and a webhook sink.

The webhook is the only sink that does network I/O, so it runs on its own daemon thread behind a
bounded queue: `fire()` never blocks the engine, a slow or dead endpoint only delays the queue,
and when the queue is full new alerts are dropped (and counted) rather than held in memory.
The webhook settings are read from the live policy at delivery time, so a PATCH that sets or
clears `alerts.webhook` takes effect for the next alert.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

from proxima.policy.schema import Alerts, Webhook

log = logging.getLogger("proxima.alerts")

Severity = Literal["info", "warning", "critical"]

# POST(url, json body, timeout seconds); raises on failure. Injected by tests.
PostFn = Callable[[str, dict[str, Any], float], None]


@dataclass(frozen=True)
class Alert:
    id: int
    at: float
    """Unix time (from the controller's clock)."""
    kind: str
    """e.g. 'fallback_step_down', 'fallback_step_up', 'fallback_forced', 'probe_failed'."""
    severity: Severity
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _httpx_post(url: str, body: dict[str, Any], timeout: float) -> None:
    resp = httpx.post(url, json=body, timeout=timeout)
    resp.raise_for_status()


class WebhookSink:
    """Delivers alerts to `alerts.webhook` from a background thread, with timeout and retries."""

    def __init__(
        self,
        settings: Callable[[], Webhook | None],
        post: PostFn = _httpx_post,
        on_failure: Callable[[Alert, Exception], None] | None = None,
        on_drop: Callable[[Alert], None] | None = None,
        max_queue: int = 1000,
        backoff_s: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._settings = settings
        self._post = post
        self._on_failure = on_failure
        self._on_drop = on_drop
        self._backoff_s = backoff_s
        self._sleep = sleep
        self._queue: queue.Queue[Alert | None] = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None
        self.delivered = 0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="proxima-alert-webhook", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        if self._thread is not None:
            # A full queue means the worker is stuck on a slow endpoint; it is a daemon thread.
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(None)
            self._thread.join(timeout)
            self._thread = None

    def submit(self, alert: Alert) -> None:
        """Queue an alert for delivery; never blocks."""
        if self._settings() is None:
            return
        try:
            self._queue.put_nowait(alert)
        except queue.Full:
            log.warning("alert webhook queue full; dropping alert %d (%s)", alert.id, alert.kind)
            if self._on_drop:
                self._on_drop(alert)

    def join(self) -> None:
        """Wait until every queued alert was delivered or given up on (tests)."""
        self._queue.join()

    def _run(self) -> None:
        while True:
            alert = self._queue.get()
            try:
                if alert is None:
                    return
                self._deliver(alert)
            finally:
                self._queue.task_done()

    def _deliver(self, alert: Alert) -> None:
        cfg = self._settings()
        if cfg is None:  # webhook removed after the alert was queued
            return
        body = {"source": "proxima", **alert.to_json()}
        last: Exception | None = None
        for attempt in range(cfg.retries + 1):
            if attempt:
                self._sleep(min(self._backoff_s * 2 ** (attempt - 1), 10.0))
            try:
                self._post(cfg.url, body, cfg.timeout_s)
                self.delivered += 1
                return
            except Exception as exc:  # any failure of the endpoint is retried, then reported
                last = exc
        assert last is not None
        log.warning("alert %d not delivered to %s after %d attempts: %s", alert.id, cfg.url, cfg.retries + 1, last)
        if self._on_failure:
            self._on_failure(alert, last)


class AlertLog:
    """Keeps the last `capacity` alerts and fans each new one out to the log and the webhook."""

    def __init__(
        self,
        settings: Callable[[], Alerts],
        webhook: WebhookSink | None = None,
        on_fire: Callable[[Alert], None] | None = None,
        capacity: int = 500,
    ) -> None:
        self._settings = settings
        self._webhook = webhook
        self._on_fire = on_fire
        self._items: deque[Alert] = deque(maxlen=capacity)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def fire(self, at: float, kind: str, severity: Severity, message: str, **details: Any) -> Alert:
        with self._lock:
            alert = Alert(next(self._ids), at, kind, severity, message, details)
            self._items.append(alert)
        if self._settings().log:
            level = {"info": logging.INFO, "warning": logging.WARNING, "critical": logging.ERROR}[severity]
            log.log(level, "ALERT %s [%s] %s %s", kind, severity, message, json.dumps(details, default=str))
        if self._on_fire:
            self._on_fire(alert)
        if self._webhook:
            self._webhook.submit(alert)
        return alert

    def recent(self, limit: int = 100, since_id: int = 0) -> list[Alert]:
        with self._lock:
            items = [a for a in self._items if a.id > since_id]
        return items[-limit:] if limit > 0 else []
