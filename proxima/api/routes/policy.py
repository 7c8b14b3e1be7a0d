"""Policy routes of the runtime API: read, replace, patch, roll back, history."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse

from proxima.api.bodies import (
    WRITE_ERRORS,
    YAML_TYPES,
    PolicyDocument,
    RollbackRequest,
    WriteResult,
    errors,
    json_request_body,
)
from proxima.api.controller import Controller, policy_summary
from proxima.api.handling import ApiError, content_type, if_match, json_object, request_model, write_response


def router(ctl: Controller, mutating: list[Depends]) -> APIRouter:
    """The `/v1/policy` routes over `ctl`; writes carry `mutating` (the bearer scheme)."""
    router = APIRouter()

    @router.get("/v1/policy", tags=["policy"], response_model=PolicyDocument, responses=errors(404))
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
    write_responses = errors(*WRITE_ERRORS, 412)

    @router.put(
        "/v1/policy",
        tags=["policy"],
        dependencies=mutating,
        openapi_extra=policy_body,
        response_model=WriteResult,
        responses=write_responses,
    )
    async def put_policy(request: Request, comment: Annotated[str, Query(max_length=500)] = "") -> JSONResponse:
        """Replace the whole policy (JSON or YAML). Validated, then swapped atomically; returns the diff."""
        expected = if_match(request)
        if content_type(request) in YAML_TYPES:
            # Read (within the reader's limits) and validated by the store, with line and column.
            version, changes = ctl.put_policy(None, "api:PUT", comment, expected, text=await request.body())
        else:
            data = await json_object(request, "the policy")
            version, changes = ctl.put_policy(data, "api:PUT", comment, expected)
        return write_response(version, changes)

    patch_body = {
        "requestBody": {
            "required": True,
            "content": {
                "application/merge-patch+json": {"schema": {"type": "object"}},
                "application/json": {"schema": {"type": "object"}},
            },
        }
    }

    @router.patch(
        "/v1/policy",
        tags=["policy"],
        dependencies=mutating,
        openapi_extra=patch_body,
        response_model=WriteResult,
        responses=write_responses,
    )
    async def patch_policy(request: Request, comment: Annotated[str, Query(max_length=500)] = "") -> JSONResponse:
        """Change single knobs with a JSON merge patch (RFC 7386), e.g. {"budget": {"max_blocks_per_step": 64}}."""
        expected = if_match(request)
        patch = await json_object(request, "the merge patch")
        version, changes = ctl.patch_policy(patch, "api:PATCH", comment, expected)
        return write_response(version, changes)

    @router.post(
        "/v1/policy/rollback",
        tags=["policy"],
        dependencies=mutating,
        openapi_extra=json_request_body(RollbackRequest),
        response_model=WriteResult,
        responses=errors(*WRITE_ERRORS, 404),
    )
    async def rollback(request: Request) -> JSONResponse:
        """Re-install an earlier version as a new version (versions only ever increase)."""
        body: RollbackRequest = await request_model(request, RollbackRequest)
        try:
            version, changes = ctl.rollback(body.version, body.comment)
        except KeyError as exc:
            raise ApiError(404, str(exc.args[0]), [{"field": "version", "message": "unknown version"}]) from None
        return write_response(version, changes)

    @router.get("/v1/policy/history", tags=["policy"])
    def history() -> dict[str, Any]:
        """Every kept version (newest last), without the policies themselves."""
        return {"live": ctl.store.current.version, "versions": [policy_summary(v) for v in ctl.store.history()]}
    return router
