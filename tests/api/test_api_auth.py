"""Auth: reads are open; mutations need the bearer token; no token configured refuses mutations."""

from __future__ import annotations

import pytest
from api_helpers import AUTH, TOKEN, FakeClock, make_server
from fastapi.testclient import TestClient

from proxima.api.auth import AuthError, TokenSource, check_bearer

MUTATIONS = [
    ("PUT", "/v1/policy", {"name": "x", "enabled": False}),
    ("PATCH", "/v1/policy", {"description": "x"}),
    ("POST", "/v1/policy/rollback", {"version": 1}),
    ("POST", "/v1/fallback", {"level": 1}),
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
