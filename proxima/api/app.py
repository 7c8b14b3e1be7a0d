"""The runtime tuning HTTP API: a thin FastAPI layer over `Controller`.

Reads are open; every mutating call needs `Authorization: Bearer <token>` (see `auth.py`).
Errors are JSON `{"error": ..., "problems": [{"field", "message", ...}]}` with a 4xx status, so
a client can point at the offending field. Request bodies are capped at the live policy's
`api.max_body_bytes` before anything parses them.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import AsyncIterator
from typing import Annotated, Any

import yaml
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from proxima import __version__
from proxima.api.auth import AuthError, TokenSource, check_bearer
from proxima.api.controller import Controller, VersionConflict, changes_json, policy_summary
from proxima.api.limits import BodyLimitMiddleware
from proxima.policy.loader import PolicyError, clean_loc, field_path
from proxima.policy.schema import Policy
from proxima.policy.store import Change, PolicyVersion

YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")
JSON_TYPES = ("application/json", "application/merge-patch+json")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RollbackRequest(_Body):
    version: int = Field(ge=1, description="Version to re-install (as a new version).")
    comment: str = Field(default="", max_length=500)


class FallbackRequest(_Body):
    level: int | str | None = Field(
        description="Ladder level to pin, by index or name; null releases the pin (automatic again)."
    )


class PolicyDocument(BaseModel):
    version: int
    source: str
    created_at: float
    comment: str
    policy: Policy


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        error: str,
        problems: list[dict[str, Any]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(error)
        self.status, self.error, self.problems, self.headers = status, error, problems or [], headers


def _error(status: int, error: str, problems: list[dict[str, Any]] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": error, "problems": problems or [], **extra}, status_code=status)


def _write_response(version: PolicyVersion, changes: list[Change]) -> JSONResponse:
    body = {**policy_summary(version), "changes": changes_json(changes)}
    return JSONResponse(body, headers={"ETag": f'"{version.version}"'})


def _if_match(request: Request) -> int | None:
    """The version precondition of `If-Match: "<version>"` (optimistic concurrency), if sent."""
    raw = request.headers.get("if-match")
    if raw is None or raw.strip() == "*":
        return None
    tag = raw.strip().removeprefix("W/").strip('"')
    if not tag.isdigit():
        raise ApiError(
            400,
            'If-Match must be a policy version as returned in ETag, e.g. "7"',
            [{"field": "If-Match", "message": f"not a version: {raw!r}"}],
        )
    return int(tag)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _non_finite(data: Any, path: str = "") -> str | None:
    """The path of the first NaN or infinite number in `data`, if any.

    pydantic accepts them for float fields, but such a policy could not be written back as JSON
    (every later GET would fail), so the API refuses them up front.
    """
    if isinstance(data, float) and not math.isfinite(data):
        return path
    if isinstance(data, dict):
        items: Any = data.items()
    elif isinstance(data, list):
        items = enumerate(data)
    else:
        return None
    for key, value in items:
        sub = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else str(key))
        found = _non_finite(value, sub)
        if found is not None:
            return found
    return None


def _require_finite(data: Any, what: str) -> None:
    where = _non_finite(data)
    if where is not None:
        raise ApiError(
            422, f"{what} contains a NaN or infinite number", [{"field": where, "message": "must be a finite number"}]
        )


async def _json_object(request: Request, what: str) -> dict[str, Any]:
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype not in JSON_TYPES:
        raise ApiError(415, f"{what} must be sent as one of {', '.join(JSON_TYPES)}; got {ctype!r}")
    try:
        data = json.loads(await request.body(), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise ApiError(400, f"{what} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(422, f"{what} must be a JSON object", [{"field": "", "message": "expected an object"}])
    _require_finite(data, what)
    return data


def create_app(controller: Controller, tokens: TokenSource | None = None) -> FastAPI:
    """Build the API over `controller`. `tokens` defaults to the live policy's `api` settings."""
    ctl = controller
    token_source = tokens or TokenSource.from_settings(ctl.store.policy.api)
    bearer = HTTPBearer(auto_error=False, description="The API token (PROXIMA_API_TOKEN or api.token_file).")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # The webhook thread lives as long as the server; the engine itself is started elsewhere.
        ctl.start()
        try:
            yield
        finally:
            ctl.stop()

    app = FastAPI(
        lifespan=lifespan,
        title="Proxima runtime tuning API",
        version=__version__,
        description="Change the live KV-compression policy, watch what it does, and steer its fallback.",
    )
    app.add_middleware(BodyLimitMiddleware, limit=lambda: ctl.store.policy.api.max_body_bytes)

    def require_token(request: Request, _: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:  # noqa: B008
        # HTTPBearer only documents the scheme in OpenAPI; the check (and its 401/403 split) is ours.
        check_bearer(request.headers.get("authorization"), token_source)

    mutating = [Depends(require_token)]

    @app.exception_handler(AuthError)
    async def _auth_error(_: Request, exc: AuthError) -> JSONResponse:
        resp = _error(exc.status, exc.message)
        if exc.status == 401:
            resp.headers["WWW-Authenticate"] = 'Bearer realm="proxima"'
        return resp

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        resp = _error(exc.status, exc.error, exc.problems)
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        return resp

    @app.exception_handler(PolicyError)
    async def _policy_error(_: Request, exc: PolicyError) -> JSONResponse:
        problems = [{"field": p.field, "message": p.message, "line": p.line, "column": p.column} for p in exc.problems]
        return _error(
            422, "invalid policy; the live policy is unchanged", problems, live_version=ctl.store.current.version
        )

    @app.exception_handler(VersionConflict)
    async def _conflict(_: Request, exc: VersionConflict) -> JSONResponse:
        return _error(412, str(exc), live_version=exc.live)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            {"field": field_path(clean_loc([p for p in e["loc"] if p != "body"])), "message": e["msg"]}
            for e in exc.errors()
        ]
        return _error(422, "invalid request", problems)

    # -- health and metrics ------------------------------------------------------------------------
    @app.get("/healthz", tags=["ops"])
    def healthz() -> dict[str, Any]:
        """Liveness: the controller answers and knows its policy version."""
        return {"status": "ok", "policy_version": ctl.store.current.version}

    @app.get("/metrics", tags=["ops"], response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    def metrics() -> Response:
        """Prometheus exposition of every `proxima_` metric (pool gauges refreshed on scrape)."""
        ctl.stats()
        return Response(generate_latest(ctl.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- policy ------------------------------------------------------------------------------------
    @app.get("/v1/policy", tags=["policy"], response_model=PolicyDocument)
    def get_policy(
        version: Annotated[int | None, Query(ge=1, description="An older version from history.")] = None,
    ) -> JSONResponse:
        """The live policy (or a version from history), with its version; ETag carries the version."""
        pv = ctl.store.current
        if version is not None:
            pv = next((v for v in ctl.store.history() if v.version == version), None)  # type: ignore[assignment]
            if pv is None:
                raise ApiError(
                    404, f"no policy version {version} in history", [{"field": "version", "message": "unknown version"}]
                )
        body = {**policy_summary(pv), "policy": pv.policy.model_dump(mode="json")}
        return JSONResponse(body, headers={"ETag": f'"{pv.version}"'})

    policy_body = {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/Policy"}},
                "application/yaml": {"schema": {"type": "string"}},
            },
        }
    }

    @app.put("/v1/policy", tags=["policy"], dependencies=mutating, openapi_extra=policy_body)
    async def put_policy(request: Request, comment: Annotated[str, Query(max_length=500)] = "") -> JSONResponse:
        """Replace the whole policy (JSON or YAML). Validated, then swapped atomically; returns the diff."""
        expected = _if_match(request)
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype in YAML_TYPES:
            try:
                text = (await request.body()).decode("utf-8")
            except UnicodeDecodeError:
                raise ApiError(400, "policy YAML must be UTF-8") from None
            # Broken YAML is left to the store's parser, which reports it with line and column.
            with contextlib.suppress(yaml.YAMLError):
                _require_finite(yaml.safe_load(text), "the policy")
            version, changes = ctl.put_policy(None, "api:PUT", comment, expected, text=text)
        else:
            data = await _json_object(request, "the policy")
            version, changes = ctl.put_policy(data, "api:PUT", comment, expected)
        return _write_response(version, changes)

    patch_body = {
        "requestBody": {
            "required": True,
            "content": {
                "application/merge-patch+json": {"schema": {"type": "object"}},
                "application/json": {"schema": {"type": "object"}},
            },
        }
    }

    @app.patch("/v1/policy", tags=["policy"], dependencies=mutating, openapi_extra=patch_body)
    async def patch_policy(request: Request, comment: Annotated[str, Query(max_length=500)] = "") -> JSONResponse:
        """Change single knobs with a JSON merge patch (RFC 7386), e.g. {"budget": {"max_blocks_per_step": 64}}."""
        expected = _if_match(request)
        patch = await _json_object(request, "the merge patch")
        version, changes = ctl.patch_policy(patch, "api:PATCH", comment, expected)
        return _write_response(version, changes)

    @app.post("/v1/policy/rollback", tags=["policy"], dependencies=mutating)
    def rollback(body: RollbackRequest) -> JSONResponse:
        """Re-install an earlier version as a new version (versions only ever increase)."""
        try:
            version, changes = ctl.rollback(body.version, body.comment)
        except KeyError as exc:
            raise ApiError(404, str(exc.args[0]), [{"field": "version", "message": "unknown version"}]) from None
        return _write_response(version, changes)

    @app.get("/v1/policy/history", tags=["policy"])
    def history() -> dict[str, Any]:
        """Every kept version (newest last), without the policies themselves."""
        return {"live": ctl.store.current.version, "versions": [policy_summary(v) for v in ctl.store.history()]}

    # -- engine state ------------------------------------------------------------------------------
    @app.get("/v1/stats", tags=["engine"])
    def stats() -> dict[str, Any]:
        """Pressure, blocks per format, bytes saved, effective compression and fragmentation."""
        s = ctl.stats()
        version, level = ctl.policy_for_step()
        return {**s.to_json(), "policy_version": version.version, "fallback_level": level}

    @app.get("/v1/probes", tags=["engine"])
    def probes() -> dict[str, Any]:
        """The last verdict and pass/fail counts of each probe, and the fallback ladder state."""
        return ctl.probes()

    @app.get("/v1/alerts", tags=["engine"])
    def alerts(
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        since_id: Annotated[int, Query(ge=0, description="Only alerts with a larger id.")] = 0,
    ) -> dict[str, Any]:
        """Recent alerts, oldest first."""
        return {"alerts": [a.to_json() for a in ctl.alerts.recent(limit, since_id)]}

    @app.get("/v1/fallback", tags=["engine"])
    def get_fallback() -> dict[str, Any]:
        """The fallback ladder: effective level, automatic level, pin, counters, cooldown."""
        return ctl.fallback_state()

    @app.post("/v1/fallback", tags=["engine"], dependencies=mutating)
    def set_fallback(body: FallbackRequest) -> dict[str, Any]:
        """Pin the ladder at a level (index or name), or release it with {"level": null}."""
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

    return app
