"""Auth: reads are open; mutations need the bearer token, checked before the body; no token
configured refuses mutations; a configured but blank token stops the server at startup."""

from __future__ import annotations

from pathlib import Path

import pytest
from api_helpers import AUTH, CONFIGS, TOKEN, FakeClock, make_server
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

import proxima.api.server as api_server
from proxima.api.auth import AuthError, TokenConfigError, TokenSource, check_bearer
from proxima.api.server import simulated
from proxima.cli import app
from proxima.policy.loader import load_policy

MUTATIONS = [
    ("PUT", "/v1/policy", {"name": "x", "enabled": False}),
    ("PATCH", "/v1/policy", {"description": "x"}),
    ("POST", "/v1/policy/rollback", {"version": 1}),
    ("POST", "/v1/fallback", {"level": 1}),
    ("POST", "/v1/probes", {"kind": "canary", "passed": True}),
]


@pytest.mark.parametrize(("method", "path", "body"), MUTATIONS)
def test_missing_wrong_right_token(client: TestClient, method: str, path: str, body: dict) -> None:
    r = client.request(method, path, json=body)
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert "Authorization" in r.json()["error"]
    assert client.request(method, path, json=body, headers={"Authorization": "Bearer nope"}).status_code == 403
    assert client.request(method, path, json=body, headers={"Authorization": TOKEN}).status_code == 401
    assert client.request(method, path, json=body, headers=AUTH).status_code == 200


def test_reads_need_no_token(client: TestClient) -> None:
    for path in (
        "/v1/policy",
        "/v1/policy/history",
        "/v1/stats",
        "/v1/probes",
        "/v1/alerts",
        "/v1/fallback",
        "/metrics",
        "/healthz",
    ):
        assert client.get(path).status_code == 200, path


def test_no_token_configured_refuses_mutations(clock: FakeClock) -> None:
    srv = make_server(clock, token=None)
    with TestClient(srv.app) as c:
        r = c.patch("/v1/policy", json={"description": "x"}, headers=AUTH)
        assert r.status_code == 403
        assert "no API token is configured" in r.json()["error"]
        assert "PROXIMA_API_TOKEN" in r.json()["error"]
        assert c.get("/v1/policy").json()["version"] == 1


def test_token_file_wins_and_rotates(tmp_path) -> None:
    f = tmp_path / "token"
    f.write_text("one\n")
    src = TokenSource(f, "UNUSED", environ={"UNUSED": "env"}.get)
    check_bearer("Bearer one", src)
    with pytest.raises(AuthError) as e:
        check_bearer("Bearer env", src)
    assert e.value.status == 403
    f.write_text("two")
    check_bearer("Bearer two", src)
    f.unlink()
    with pytest.raises(AuthError) as e:
        check_bearer("Bearer two", src)
    assert e.value.status == 403 and "no API token" in e.value.message


def test_empty_token_counts_as_unset() -> None:
    with pytest.raises(AuthError) as e:
        check_bearer("Bearer ", TokenSource(None, "T", environ={"T": "  "}.get))
    assert e.value.status == 403


BROKEN_BODIES = {
    "not-json": b"{not json",
    "not-utf8": b'{"x": "\xff"}',
    "deep": b"[" * 5000 + b"]" * 5000,
    "over-the-body-limit": b"x" * 100_000,
}


@pytest.mark.parametrize("body", sorted(BROKEN_BODIES))
@pytest.mark.parametrize(("method", "path"), [(m, p) for m, p, _ in MUTATIONS])
def test_auth_is_checked_before_the_body(client: TestClient, method: str, path: str, body: str) -> None:
    """401 / 403 whatever the body: an unauthenticated client cannot make the server read it."""
    headers = {"Content-Type": "application/json"}
    r = client.request(method, path, content=BROKEN_BODIES[body], headers=headers)
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"].startswith("Bearer") and "Authorization" in r.json()["error"]
    r = client.request(method, path, content=BROKEN_BODIES[body], headers={**headers, "Authorization": "Bearer no"})
    assert r.status_code == 403 and r.json()["error"] == "invalid API token"
    # With the token, the same body reaches the reader (and is refused there, with a 4xx).
    r = client.request(method, path, content=BROKEN_BODIES[body], headers={**headers, **AUTH})
    assert r.status_code in (400, 413, 422), r.text
    assert client.get("/v1/policy").json()["version"] == 1


@pytest.mark.parametrize("blank", ["", " ", "\t\n  "])
def test_blank_token_variable_refused_at_startup(clock: FakeClock, blank: str) -> None:
    with pytest.raises(TokenConfigError, match="PROXIMA_API_TOKEN is set but empty or only whitespace"):
        make_server(clock, token=None, environ={"PROXIMA_API_TOKEN": blank})


@pytest.mark.parametrize("content", [None, b"", b"  \n\t", b"\xff\xfe"])
def test_unusable_token_file_refused_at_startup(clock: FakeClock, tmp_path, content: bytes | None) -> None:
    f = tmp_path / "token"
    if content is not None:
        f.write_bytes(content)
    with pytest.raises(TokenConfigError, match=f"api.token_file {f}"):
        TokenSource(f, "UNUSED").check_at_startup()
    # Through the policy, as `proxima api serve` and the engine build it.
    policy = load_policy(CONFIGS / "balanced.yaml")
    policy = policy.model_copy(update={"api": policy.api.model_copy(update={"token_file": str(f)})})
    with pytest.raises(TokenConfigError):
        simulated(policy, registry=CollectorRegistry())


def test_unset_token_is_allowed_at_startup(clock: FakeClock) -> None:
    # No token configured at all: the server starts read-only (every change refused with 403).
    srv = make_server(clock, token=None)
    assert srv.app is not None


def test_api_serve_refuses_a_blank_token(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the server started with a blank token")

    monkeypatch.setattr(api_server, "serve", refuse)  # a guard: it must stop before serving
    res = CliRunner().invoke(
        app, ["api", "serve", "--simulate", "--policy", str(CONFIGS / "balanced.yaml")], env={"PROXIMA_API_TOKEN": " "}
    )
    assert res.exit_code == 2, res.output
    assert "refusing to start the API: PROXIMA_API_TOKEN is set but empty or only whitespace" in res.output
    assert "Traceback" not in res.output


def test_token_file_read_is_bounded_and_never_a_500(clock: FakeClock, tmp_path) -> None:
    f = tmp_path / "token"
    f.write_text("good")
    srv = simulated(
        load_policy(CONFIGS / "balanced.yaml"), tokens=TokenSource(f, "UNUSED"), registry=CollectorRegistry()
    )
    with TestClient(srv.app) as c:
        assert c.patch("/v1/policy", json={}, headers={"Authorization": "Bearer good"}).status_code == 200
        f.write_bytes(b"\xff\xfe")  # rotated to garbage: mutations refused, not a server error
        r = c.patch("/v1/policy", json={}, headers={"Authorization": "Bearer good"})
        assert r.status_code == 403 and "no API token" in r.json()["error"]
    assert TokenSource(Path("/dev/zero"), "UNUSED").read() is None  # not read past 4 KiB


def test_auth_holds_behind_a_proxy_root_path(server) -> None:  # type: ignore[no-untyped-def]
    # The check matches routes the way the router does, so a root_path cannot route around it.
    with TestClient(server.app, root_path="/proxima") as c:
        for path in ("/v1/policy", "/proxima/v1/policy"):  # scope path without, then with, the root_path
            assert c.patch(path, json={"description": "x"}).status_code == 401
            assert c.patch(path, json={"description": path}, headers=AUTH).status_code == 200
        assert c.put("/healthz", json={}).status_code == 405  # no write handler there: no token asked
    assert server.controller.store.current.version == 3
