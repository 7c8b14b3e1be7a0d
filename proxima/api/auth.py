"""Bearer-token authentication for mutating API calls.

Where the token comes from is fixed when the server starts (`api.token_file` if set, else the
environment variable named by `api.token_env`), so a policy PATCH cannot redirect it. A token
file is re-read on every check, so rotating the secret needs no restart. With no token
configured the server still answers reads but refuses every mutation: an open write API on a
serving engine is never the default. A token source that is configured but unusable (an empty
or blank variable, a missing, unreadable or blank file) stops the server at startup
(`TokenSource.check_at_startup`): the operator meant to set a token.

The check runs in `BearerAuthMiddleware`, before the body-size limit and before any body is
read, so an unauthenticated write gets 401 whatever its body holds.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from starlette.routing import BaseRoute, Match

from proxima.api.limits import ASGIApp, Receive, Scope, Send
from proxima.policy.schema import Api

MAX_TOKEN_BYTES = 4096
"""A token file is read up to this size (a token is a short secret; /dev/zero must not hang a check)."""


class TokenConfigError(ValueError):
    """The configured token source is unusable; raised at startup."""


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

    def _read_file(self) -> str:
        """The token file's text; raises OSError or UnicodeDecodeError."""
        assert self.file is not None
        with open(self.file, "rb") as f:
            raw = f.read(MAX_TOKEN_BYTES + 1)
        if len(raw) > MAX_TOKEN_BYTES:
            raise OSError(f"larger than {MAX_TOKEN_BYTES} bytes")
        return raw.decode("utf-8")

    def read(self) -> str | None:
        if self.file is not None:
            try:
                token = self._read_file().strip()
            except (OSError, UnicodeDecodeError):
                return None
        else:
            token = (self.environ(self.env) or "").strip()
        return token or None

    def check_at_startup(self) -> None:
        """Raise `TokenConfigError` when a token source is configured but gives no usable token.

        An unset variable (and no token file) is allowed: the server then refuses every change.
        """
        if self.file is not None:
            try:
                text = self._read_file()
            except OSError as exc:
                raise TokenConfigError(
                    f"api.token_file {self.file} cannot be read ({exc.strerror or exc}); "
                    "write the API token into it, or remove api.token_file"
                ) from None
            except UnicodeDecodeError:
                raise TokenConfigError(f"api.token_file {self.file} is not UTF-8 text") from None
            if not text.strip():
                raise TokenConfigError(
                    f"api.token_file {self.file} is empty or only whitespace; write the API token into it"
                )
            return
        value = self.environ(self.env)
        if value is not None and not value.strip():
            raise TokenConfigError(
                f"{self.env} is set but empty or only whitespace; set it to the API token "
                "(e.g. $(openssl rand -hex 16)), or unset it to serve read-only"
            )


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


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
"""The safe methods of RFC 9110: they change nothing, and need no token."""


class BearerAuthMiddleware:
    """Checks the bearer token of every request that reaches a write handler, before its body is read.

    A request whose method is not safe is checked when the app's router would hand it to a
    handler (the route matches the way the router matches, root_path included); any other
    request reaches no handler that changes state (the router answers 404 or 405). The app
    declares every handler of an unsafe method as mutating (`create_app` asserts it). Plain
    ASGI, added outside the body-size limit, so an unauthenticated client can make the server
    neither buffer nor parse a body.
    """

    def __init__(self, app: ASGIApp, source: TokenSource, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.source = source
        self.routes = routes
        """The app's routes (the router's own list: routes declared later are seen too)."""

    def _reaches_a_handler(self, scope: Scope) -> bool:
        return any(route.matches(scope)[0] == Match.FULL for route in self.routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in SAFE_METHODS and self._reaches_a_handler(scope):
            header = None
            for name, value in scope.get("headers", []):
                if name == b"authorization":
                    header = value.decode("latin-1")
                    break
            try:
                check_bearer(header, self.source)
            except AuthError as exc:
                await _send_error(send, exc)
                return
        await self.app(scope, receive, send)


async def _send_error(send: Send, exc: AuthError) -> None:
    body = json.dumps({"error": exc.message, "problems": []}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if exc.status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="proxima"'))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
