"""Health and metrics routes of the runtime API."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxima.api.controller import Controller


def router(ctl: Controller) -> APIRouter:
    """`/healthz` and `/metrics` over `ctl` (reads only)."""
    router = APIRouter()

    @router.get("/healthz", tags=["ops"])
    def healthz() -> dict[str, Any]:
        """Liveness: the controller answers and knows its policy version."""
        return {"status": "ok", "policy_version": ctl.store.current.version}

    @router.get(
        "/metrics", tags=["ops"], response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}}
    )
    def metrics() -> Response:
        """Prometheus exposition of every `proxima_` metric (pool gauges refreshed on scrape)."""
        ctl.stats()
        return Response(generate_latest(ctl.metrics.registry), media_type=CONTENT_TYPE_LATEST)
    return router
