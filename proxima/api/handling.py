"""Request handling shared by the runtime API's routers: the JSON error shape (`ApiError`), body
reading (JSON read like a policy file, `proxima.policy.reader`), `If-Match` and the closed set of
query parameters."""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.routing import Match, Route

from proxima.api.bodies import JSON_TYPES
from proxima.api.controller import changes_json, policy_summary
from proxima.policy.loader import clean_loc, field_path
from proxima.policy.reader import ReadError, read_json
from proxima.policy.store import Change, PolicyVersion


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


def error_response(status: int, error: str, problems: list[dict[str, Any]] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": error, "problems": problems or [], **extra}, status_code=status)


def write_response(version: PolicyVersion, changes: list[Change]) -> JSONResponse:
    body = {**policy_summary(version), "changes": changes_json(changes)}
    return JSONResponse(body, headers={"ETag": f'"{version.version}"'})


_VERSION_TAG = re.compile(r"[0-9]{1,18}")


def if_match(request: Request) -> int | None:
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


def read_error(exc: ReadError, what: str) -> ApiError:
    problem = {"field": exc.path, "message": exc.message, "line": exc.line, "column": exc.column}
    return ApiError(read_status(exc.kind), f"{what} cannot be used: {exc.message}", [problem])


def content_type(request: Request, default: str = "") -> str:
    return request.headers.get("content-type", default).split(";")[0].strip().lower()


async def json_object(request: Request, what: str) -> dict[str, Any]:
    ctype = content_type(request, "application/json")
    if ctype not in JSON_TYPES:
        raise ApiError(415, f"{what} must be sent as one of {', '.join(JSON_TYPES)}; got {ctype[:80]!r}")
    try:
        data = read_json(await request.body())
    except ReadError as exc:
        raise read_error(exc, what) from None
    if not isinstance(data, dict):
        raise ApiError(422, f"{what} must be a JSON object", [{"field": "", "message": "expected an object"}])
    return data


def reject_unknown_query(request: Request) -> None:
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


def validation_problems(exc: ValidationError) -> list[dict[str, Any]]:
    return [
        {"field": field_path(clean_loc(e["loc"])), "message": e["msg"].removeprefix("Value error, ")}
        for e in exc.errors(include_url=False)
    ]


async def request_model(request: Request, model: type[BaseModel]) -> Any:
    """A JSON body read like a policy, then validated as `model` (errors: 4xx with field paths)."""
    data = await json_object(request, "the request body")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ApiError(422, "invalid request", validation_problems(exc)) from None


def allowed_methods(app: FastAPI, request: Request) -> list[str]:
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})  # path match, whatever the method
        if match != Match.NONE and isinstance(route, APIRoute | Route):
            methods |= route.methods or set()
    return sorted(methods)


