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
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from proxima import __version__
from proxima.api.auth import SAFE_METHODS, BearerAuthMiddleware, TokenSource
from proxima.api.bodies import errors
from proxima.api.controller import Controller, VersionConflict
from proxima.api.handling import ApiError, allowed_methods, error_response, read_status, reject_unknown_query
from proxima.api.limits import BodyLimitMiddleware
from proxima.api.routes import engine, ops, policy
from proxima.policy.loader import PolicyError, clean_loc, field_path


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
        dependencies=[Depends(reject_unknown_query)],
        responses=errors(422),  # every route: an unknown or invalid query parameter
        title="Proxima runtime tuning API",
        version=__version__,
        description="Change the live KV-compression policy, watch what it does, and steer its fallback.",
    )
    # Starlette runs the middleware added last first: authentication, then the body limit.
    app.add_middleware(BodyLimitMiddleware, limit=lambda: ctl.store.policy.api.max_body_bytes)
    app.add_middleware(BearerAuthMiddleware, source=token_source, routes=app.router.routes)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        resp = error_response(exc.status, exc.error, exc.problems)
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        return resp

    @app.exception_handler(PolicyError)
    async def _policy_error(_: Request, exc: PolicyError) -> JSONResponse:
        problems = [{"field": p.field, "message": p.message, "line": p.line, "column": p.column} for p in exc.problems]
        status = read_status(exc.reason)
        what = "invalid policy" if status == 422 else "policy text cannot be read"
        return error_response(
            status,
            f"{what}; the live policy is unchanged",
            problems,
            live_version=ctl.store.current.version,
        )

    @app.exception_handler(VersionConflict)
    async def _conflict(_: Request, exc: VersionConflict) -> JSONResponse:
        return error_response(412, str(exc), live_version=exc.live)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            {"field": field_path(clean_loc([p for p in e["loc"] if p not in ("body", "query", "header")])),
             "message": e["msg"]}
            for e in exc.errors()
        ]
        return error_response(422, "invalid request", problems)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Routing errors (unknown path 404, wrong method 405) in the same shape as every other error.
        resp = error_response(exc.status_code, str(exc.detail))
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        if exc.status_code == 405:
            # Starlette names only the first route matching the path; a path has one route per method.
            resp.headers["Allow"] = ", ".join(allowed_methods(app, request))
        return resp

    # One router per group of endpoints; the order is the OpenAPI document's.
    app.include_router(ops.router(ctl))
    app.include_router(policy.router(ctl, mutating))
    app.include_router(engine.router(ctl, mutating))

    # The invariant BearerAuthMiddleware relies on: every handler of an unsafe method is declared
    # `mutating`, so it is checked, and the OpenAPI document shows the bearer scheme on exactly
    # those operations.
    for route in app.routes:
        if isinstance(route, APIRoute):
            documented = any(d.dependency is bearer for d in route.dependencies)
            assert documented == bool(route.methods - SAFE_METHODS), f"{route.path}: declare it with `mutating`"
    return app
