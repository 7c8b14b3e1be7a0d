"""Bearer-token authentication for mutating API calls.

Where the token comes from is fixed when the server starts (`api.token_file` if set, else the
environment variable named by `api.token_env`), so a policy PATCH cannot redirect it. A token
file is re-read on every check, so rotating the secret needs no restart. With no token
configured the server still answers reads but refuses every mutation: an open write API on a
serving engine is never the default.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from proxima.policy.schema import Api


class AuthError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class TokenSource:
    """Reads the expected token; returns None when none is configured."""

    file: Path | None
    env: str
    environ: Callable[[str], str | None] = os.environ.get

    @classmethod
    def from_settings(cls, api: Api) -> TokenSource:
        return cls(Path(api.token_file) if api.token_file else None, api.token_env)

    def describe(self) -> str:
        return f"file {self.file}" if self.file else f"environment variable {self.env}"

    def read(self) -> str | None:
        if self.file is not None:
            try:
                token = self.file.read_text(encoding="utf-8").strip()
            except OSError:
                return None
        else:
            token = (self.environ(self.env) or "").strip()
        return token or None


def check_bearer(header: str | None, source: TokenSource) -> None:
    """Raise `AuthError` unless `header` is `Bearer <the configured token>`."""
    expected = source.read()
    if expected is None:
        raise AuthError(
            403,
            f"mutations are disabled: no API token is configured (set {source.describe()} and restart the server)",
        )
    if not header:
        raise AuthError(401, "missing Authorization header; send 'Authorization: Bearer <token>'")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise AuthError(401, "malformed Authorization header; expected 'Bearer <token>'")
    # Constant time, so response timing does not reveal how much of a guess was right.
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise AuthError(403, "invalid API token")
