"""The runtime tuning HTTP API: a thin FastAPI layer over `Controller`.

Reads are open; every mutating call needs `Authorization: Bearer <token>` (see `auth.py`),
checked before the body is read. Errors are JSON `{"error": ..., "problems": [{"field",
"message", ...}]}` with a 4xx status, so a client can point at the offending field; the OpenAPI
document lists every status each route returns. Request bodies are capped at the live policy's
`api.max_body_bytes` before anything reads them, then read by `proxima.policy.reader` (size,
UTF-8, nesting, alias expansion and duplicate keys bounded or refused) like a policy file.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from proxima import __version__
from proxima.api.auth import SAFE_METHODS, BearerAuthMiddleware, TokenSource
from proxima.api.controller import Controller, VersionConflict, changes_json, policy_summary
from proxima.api.limits import BodyLimitMiddleware
from proxima.policy.loader import PolicyError, clean_loc, field_path
from proxima.policy.probes import ProbeResult
from proxima.policy.reader import ReadError, read_json
from proxima.policy.schema import Policy
from proxima.policy.store import Change, PolicyVersion

YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")
JSON_TYPES = ("application/json", "application/merge-patch+json")


# -- request and response bodies (also what the OpenAPI document shows) ----------------------------
class _Body(BaseModel):
    # strict: `{"version": true}` is not version 1.
    model_config = ConfigDict(extra="forbid", strict=True)


class RollbackRequest(_Body):
    version: StrictInt = Field(ge=1, description="Version to re-install (as a new version).")
    comment: str = Field(default="", max_length=500)


_JSON_TYPE_NAMES = {bool: "a boolean", float: "a number", list: "an array", dict: "an object"}


class ProbeReport(_Body):
    kind: Literal["canary", "drift"] = Field(description="Which whole-model probe produced the verdict.")
    passed: bool
    values: dict[str, float] = Field(default_factory=dict, description="Named measurements (e.g. kl, top1).")
    detail: str = Field(default="", max_length=2000)


class FallbackRequest(_Body):
    level: StrictInt | str | None = Field(
        description="Ladder level to pin, by index or name; null releases the pin (automatic again)."
    )

    @field_validator("level", mode="before")
    @classmethod
    def _index_name_or_null(cls, v: object) -> object:
        # One message at `level` instead of one per union member (level.int, level.str, ...).
        if v is None or isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)):
            return v
        got = _JSON_TYPE_NAMES.get(type(v), type(v).__name__)
        raise ValueError(f"must be a level index (integer), a level name (string) or null, not {got}")


class PolicyDocument(BaseModel):
    version: int
    source: str
    created_at: float
    comment: str
    policy: Policy


class ChangeOut(BaseModel):
    path: str
    old: Any
    new: Any


class WriteResult(BaseModel):
    """What a successful write returns: the new version and the field-level diff."""

    version: int
    source: str
    created_at: float
    comment: str
    changes: list[ChangeOut]


class ProblemOut(BaseModel):
    field: str = Field(description="Field path, e.g. bands[0].exit ('' for the whole body).")
    message: str
    line: int | None = Field(default=None, description="1-based line in a YAML body, when known.")
    column: int | None = None


class ErrorBody(BaseModel):
    error: str
    problems: list[ProblemOut]
    live_version: int | None = Field(default=None, description="The live policy version (412, invalid policy).")


_ERROR_DESCRIPTIONS = {
    400: "The body cannot be read: not UTF-8, not JSON/YAML, nested too deeply, an alias expanding too far; "
    "or a malformed If-Match",
    401: "No or malformed Authorization header (sent before the body is read)",
    403: "Wrong token, or no token configured on the server",
    404: "No such policy version in history",
    412: "If-Match is not the live policy version",
    413: "Body over api.max_body_bytes, or policy text over the reader's size limit",
    415: "Unsupported Content-Type",
    422: "Invalid policy or request, with field paths; the live policy is unchanged",
}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorBody, "description": _ERROR_DESCRIPTIONS[code]} for code in codes}


WRITE_ERRORS = (400, 401, 403, 413, 415, 422)


def _json_request_body(model: type[BaseModel]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


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


_VERSION_TAG = re.compile(r"[0-9]{1,18}")


def _if_match(request: Request) -> int | None:
    """The version precondition of `If-Match: "<version>"` (optimistic concurrency), if sent."""
    raw = request.headers.get("if-match")
    if raw is None or raw.strip() == "*":
        return None
    tag = raw.strip().removeprefix("W/").strip('"')
    if not _VERSION_TAG.fullmatch(tag):
        raise ApiError(
            400,
            'If-Match must be a policy version as returned in ETag, e.g. "7"',
            [{"field": "If-Match", "message": f"not a version: {raw[:40]!r}"}],
        )
    return int(tag)


def read_status(kind: str) -> int:
    """HTTP status for text that could not be read: 413 for size, 422 for a duplicate key (a
    problem with one field, like an unknown key), 400 for the rest (the body is not readable)."""
    return {"too_large": 413, "duplicate_key": 422, "invalid": 422}.get(kind, 400)


def _read_error(exc: ReadError, what: str) -> ApiError:
    problem = {"field": exc.path, "message": exc.message, "line": exc.line, "column": exc.column}
    return ApiError(read_status(exc.kind), f"{what} cannot be used: {exc.message}", [problem])


def _content_type(request: Request, default: str = "") -> str:
    return request.headers.get("content-type", default).split(";")[0].strip().lower()


async def _json_object(request: Request, what: str) -> dict[str, Any]:
    ctype = _content_type(request, "application/json")
    if ctype not in JSON_TYPES:
        raise ApiError(415, f"{what} must be sent as one of {', '.join(JSON_TYPES)}; got {ctype[:80]!r}")
    try:
        data = read_json(await request.body())
    except ReadError as exc:
        raise _read_error(exc, what) from None
    if not isinstance(data, dict):
        raise ApiError(422, f"{what} must be a JSON object", [{"field": "", "message": "expected an object"}])
    return data


def _reject_unknown_query(request: Request) -> None:
    """Every route's query parameters are a closed set: `?verison=3` is an error, not the live policy."""
    route = request.scope.get("route")
    known = {p.alias for p in route.dependant.query_params} if isinstance(route, APIRoute) else set()
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        expected = ", ".join(sorted(known)) or "none"
        raise ApiError(
            422,
            f"unknown query parameter {unknown[0][:80]!r}",
            [{"field": n[:80], "message": f"unknown query parameter (expected: {expected})"} for n in unknown[:20]],
        )


def _validation_problems(exc: ValidationError) -> list[dict[str, Any]]:
    return [
        {"field": field_path(clean_loc(e["loc"])), "message": e["msg"].removeprefix("Value error, ")}
        for e in exc.errors(include_url=False)
    ]


async def _request_model(request: Request, model: type[BaseModel]) -> Any:
    """A JSON body read like a policy, then validated as `model` (errors: 4xx with field paths)."""
    data = await _json_object(request, "the request body")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ApiError(422, "invalid request", _validation_problems(exc)) from None


def create_app(controller: Controller, tokens: TokenSource | None = None) -> FastAPI:
    """Build the API over `controller`. `tokens` defaults to the live policy's `api` settings.

    Raises `TokenConfigError` when the token source is configured but unusable (see `auth.py`).
    """
    ctl = controller
    token_source = tokens or TokenSource.from_settings(ctl.store.policy.api)
    token_source.check_at_startup()
    # Documents the scheme in OpenAPI only; BearerAuthMiddleware does the check (and its 401/403
    # split) before the body is read, for every request that reaches a write handler.
    bearer = HTTPBearer(auto_error=False, description="The API token (PROXIMA_API_TOKEN or api.token_file).")
    mutating = [Depends(bearer)]

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
        dependencies=[Depends(_reject_unknown_query)],
        responses=_errors(422),  # every route: an unknown or invalid query parameter
        title="Proxima runtime tuning API",
        version=__version__,
        description="Change the live KV-compression policy, watch what it does, and steer its fallback.",
    )
    # Starlette runs the middleware added last first: authentication, then the body limit.
    app.add_middleware(BodyLimitMiddleware, limit=lambda: ctl.store.policy.api.max_body_bytes)
    app.add_middleware(BearerAuthMiddleware, source=token_source, routes=app.router.routes)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        resp = _error(exc.status, exc.error, exc.problems)
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        return resp

    @app.exception_handler(PolicyError)
    async def _policy_error(_: Request, exc: PolicyError) -> JSONResponse:
        problems = [{"field": p.field, "message": p.message, "line": p.line, "column": p.column} for p in exc.problems]
        status = read_status(exc.reason)
        what = "invalid policy" if status == 422 else "policy text cannot be read"
        return _error(
            status,
            f"{what}; the live policy is unchanged",
            problems,
            live_version=ctl.store.current.version,
        )

    @app.exception_handler(VersionConflict)
    async def _conflict(_: Request, exc: VersionConflict) -> JSONResponse:
        return _error(412, str(exc), live_version=exc.live)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            {"field": field_path(clean_loc([p for p in e["loc"] if p not in ("body", "query", "header")])),
             "message": e["msg"]}
            for e in exc.errors()
        ]
        return _error(422, "invalid request", problems)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Routing errors (unknown path 404, wrong method 405) in the same shape as every other error.
        resp = _error(exc.status_code, str(exc.detail))
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        if exc.status_code == 405:
            # Starlette names only the first route matching the path; a path has one route per method.
            resp.headers["Allow"] = ", ".join(_allowed_methods(app, request))
        return resp

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
    @app.get("/v1/policy", tags=["policy"], response_model=PolicyDocument, responses=_errors(404))
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
    write_responses = _errors(*WRITE_ERRORS, 412)

    @app.put(
        "/v1/policy",
        tags=["policy"],
        dependencies=mutating,
        openapi_extra=policy_body,
        response_model=WriteResult,
        responses=write_responses,
    )
    async def put_policy(request: Request, comment: Annotated[str, Query(max_length=500)] = "") -> JSONResponse:
        """Replace the whole policy (JSON or YAML). Validated, then swapped atomically; returns the diff."""
        expected = _if_match(request)
        if _content_type(request) in YAML_TYPES:
            # Read (within the reader's limits) and validated by the store, with line and column.
            version, changes = ctl.put_policy(None, "api:PUT", comment, expected, text=await request.body())
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

    @app.patch(
        "/v1/policy",
        tags=["policy"],
        dependencies=mutating,
        openapi_extra=patch_body,
        response_model=WriteResult,
        responses=write_responses,
    )
    async def patch_policy(request: Request, comment: Annotated[str, Query(max_length=500)] = "") -> JSONResponse:
        """Change single knobs with a JSON merge patch (RFC 7386), e.g. {"budget": {"max_blocks_per_step": 64}}."""
        expected = _if_match(request)
        patch = await _json_object(request, "the merge patch")
        version, changes = ctl.patch_policy(patch, "api:PATCH", comment, expected)
        return _write_response(version, changes)

    @app.post(
        "/v1/policy/rollback",
        tags=["policy"],
        dependencies=mutating,
        openapi_extra=_json_request_body(RollbackRequest),
        response_model=WriteResult,
        responses=_errors(*WRITE_ERRORS, 404),
    )
    async def rollback(request: Request) -> JSONResponse:
        """Re-install an earlier version as a new version (versions only ever increase)."""
        body: RollbackRequest = await _request_model(request, RollbackRequest)
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
        """Pressure, blocks per format, bytes saved, effective compression and fragmentation; the
        fallback level, `probe_status` (what the engine's snapshot says) and each probe's last verdict."""
        s = ctl.stats()
        version, level = ctl.policy_for_step()
        return {**s.to_json(), "policy_version": version.version, "fallback_level": level,
                "probe_status": ctl.probe_status(), "probes": ctl.last_verdicts(), "probe_progress": ctl.progress()}

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

    @app.post(
        "/v1/fallback",
        tags=["engine"],
        dependencies=mutating,
        openapi_extra=_json_request_body(FallbackRequest),
        responses=_errors(*WRITE_ERRORS),
    )
    async def set_fallback(request: Request) -> dict[str, Any]:
        """Pin the ladder at a level (index or name), or release it with {"level": null}."""
        body: FallbackRequest = await _request_model(request, FallbackRequest)
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

    @app.post(
        "/v1/probes",
        tags=["engine"],
        dependencies=mutating,
        openapi_extra=_json_request_body(ProbeReport),
        responses=_errors(*WRITE_ERRORS),
    )
    async def report_probe(request: Request) -> dict[str, Any]:
        """A canary or drift verdict measured outside the engine thread (e.g. a canary runner):
        recorded and fed to the fallback ladder like the engine's own; returns the ladder state."""
        body: ProbeReport = await _request_model(request, ProbeReport)
        ctl.on_probe(ProbeResult(body.kind, body.passed, dict(body.values), body.detail))
        return ctl.fallback_state()

    # The invariant BearerAuthMiddleware relies on: every handler of an unsafe method is declared
    # `mutating`, so it is checked, and the OpenAPI document shows the bearer scheme on exactly
    # those operations.
    for route in app.routes:
        if isinstance(route, APIRoute):
            documented = any(d.dependency is bearer for d in route.dependencies)
            assert documented == bool(route.methods - SAFE_METHODS), f"{route.path}: declare it with `mutating`"
    return app


def _allowed_methods(app: FastAPI, request: Request) -> list[str]:
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})  # path match, whatever the method
        if match != Match.NONE and isinstance(route, APIRoute | Route):
            methods |= route.methods or set()
    return sorted(methods)


