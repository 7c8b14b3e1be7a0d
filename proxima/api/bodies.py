"""The runtime API's request and response bodies and documented error statuses (what the
OpenAPI document shows)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from proxima.policy.schema import Policy

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


ERROR_DESCRIPTIONS = {
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


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorBody, "description": ERROR_DESCRIPTIONS[code]} for code in codes}


WRITE_ERRORS = (400, 401, 403, 413, 415, 422)


def json_request_body(model: type[BaseModel]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


