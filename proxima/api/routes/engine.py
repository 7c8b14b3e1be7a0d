"""Engine routes of the runtime API: stats, probes, alerts and the fallback ladder."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.params import Depends

from proxima.api.bodies import WRITE_ERRORS, FallbackRequest, ProbeReport, errors, json_request_body
from proxima.api.controller import Controller
from proxima.api.handling import ApiError, request_model
from proxima.policy.probes import ProbeResult


def router(ctl: Controller, mutating: list[Depends]) -> APIRouter:
    """The engine routes over `ctl`; writes carry `mutating` (the bearer scheme)."""
    router = APIRouter()

    @router.get("/v1/stats", tags=["engine"])
    def stats() -> dict[str, Any]:
        """Pressure, blocks per format, bytes saved, effective compression and fragmentation; the
        fallback level, `probe_status` (what the engine's snapshot says) and each probe's last verdict."""
        s = ctl.stats()
        version, level = ctl.policy_for_step()
        return {**s.to_json(), "policy_version": version.version, "fallback_level": level,
                "probe_status": ctl.probe_status(), "probes": ctl.last_verdicts(), "probe_progress": ctl.progress()}

    @router.get("/v1/probes", tags=["engine"])
    def probes() -> dict[str, Any]:
        """The last verdict and pass/fail counts of each probe, and the fallback ladder state."""
        return ctl.probes()

    @router.get("/v1/alerts", tags=["engine"])
    def alerts(
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        since_id: Annotated[int, Query(ge=0, description="Only alerts with a larger id.")] = 0,
    ) -> dict[str, Any]:
        """Recent alerts, oldest first."""
        return {"alerts": [a.to_json() for a in ctl.alerts.recent(limit, since_id)]}

    @router.get("/v1/fallback", tags=["engine"])
    def get_fallback() -> dict[str, Any]:
        """The fallback ladder: effective level, automatic level, pin, counters, cooldown."""
        return ctl.fallback_state()

    @router.post(
        "/v1/fallback",
        tags=["engine"],
        dependencies=mutating,
        openapi_extra=json_request_body(FallbackRequest),
        responses=errors(*WRITE_ERRORS),
    )
    async def set_fallback(request: Request) -> dict[str, Any]:
        """Pin the ladder at a level (index or name), or release it with {"level": null}."""
        body: FallbackRequest = await request_model(request, FallbackRequest)
        levels = ctl.store.policy.fallback.levels
        level = body.level
        if isinstance(level, str):
            names = [lv.name for lv in levels]
            if level not in names:
                raise ApiError(
                    422,
                    f"unknown fallback level {level!r}",
                    [{"field": "level", "message": f"expected one of {names} or 0..{len(levels) - 1}"}],
                )
            level = names.index(level)
        try:
            return ctl.force_fallback(level)
        except ValueError as exc:
            raise ApiError(422, str(exc), [{"field": "level", "message": str(exc)}]) from None

    @router.post(
        "/v1/probes",
        tags=["engine"],
        dependencies=mutating,
        openapi_extra=json_request_body(ProbeReport),
        responses=errors(*WRITE_ERRORS),
    )
    async def report_probe(request: Request) -> dict[str, Any]:
        """A canary or drift verdict measured outside the engine thread (e.g. a canary runner):
        recorded and fed to the fallback ladder like the engine's own; returns the ladder state."""
        body: ProbeReport = await request_model(request, ProbeReport)
        ctl.on_probe(ProbeResult(body.kind, body.passed, dict(body.values), body.detail))
        return ctl.fallback_state()
    return router
