"""Property-based fuzzing: whatever a client sends, the API answers as its OpenAPI document says.

Two layers: schemathesis generates requests from the OpenAPI document (every operation, valid
and invalid bodies, parameters and headers) and checks each response against the document (no
5xx, only documented statuses, content types and schemas); plain hypothesis tests throw arbitrary
JSON and bytes at the mutating endpoints (a second, independent generator).
"""

from __future__ import annotations

import schemathesis
from api_helpers import AUTH, FakeClock, make_server
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_SERVER = make_server(FakeClock())
for _ in range(20):  # some resident blocks, so /v1/stats and /metrics have content
    _SERVER.driver.tick()
_CLIENT = TestClient(_SERVER.app)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
    max_leaves=20,
)
# Keys that exist in the policy, so the fuzzer reaches deep validation instead of 'unknown key'.
policy_keys = st.sampled_from(
    [
        "bands",
        "protect",
        "budget",
        "importance",
        "layer_overrides",
        "damage",
        "probes",
        "fallback",
        "alerts",
        "api",
        "enabled",
        "name",
        "schema_version",
    ]
)
patches = st.dictionaries(policy_keys, json_values, max_size=3)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(["PUT", "PATCH"]), body=patches | json_values)
def test_policy_writes_never_5xx(method: str, body: object) -> None:
    before = _CLIENT.get("/v1/policy").json()["version"]
    r = _CLIENT.request(method, "/v1/policy", json=body, headers=AUTH)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert _CLIENT.get("/v1/policy").json()["version"] == before
        assert "error" in r.json()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/policy/rollback", "/v1/fallback"]), body=json_values)
def test_other_writes_never_5xx(path: str, body: object) -> None:
    r = _CLIENT.post(path, json=body, headers=AUTH)
    assert r.status_code < 500, r.text


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    raw=st.binary(max_size=300)
    | st.sampled_from(
        [
            b'{"fallback": {"cooldown_s": Infinity}}',
            b'{"importance": {"ema_decay": NaN}}',
            b"fallback: {cooldown_s: .inf}",
        ]
    ),
    ctype=st.sampled_from(["application/json", "application/yaml", "text/plain", "application/merge-patch+json"]),
)
def test_raw_bytes_never_5xx(raw: bytes, ctype: str) -> None:
    for method in ("PUT", "PATCH"):
        r = _CLIENT.request(method, "/v1/policy", content=raw, headers={**AUTH, "Content-Type": ctype})
        assert r.status_code < 500, r.text


# schemathesis is in the dev extra (scripts/bootstrap.sh installs it): a missing install fails here.
# The whole schema, every operation, with every check schemathesis has except one: server errors,
# status codes, content types, headers (Allow on 405 included) and bodies against the documented
# response schemas, and schema-violating requests rejected. Excluded: positive_data_acceptance
# ("a schema-valid body must be accepted"). The policy's cross-field rules (bands ordered by
# `enter`, exit <= enter, at least one band when enabled, equal pack ratios in substitutions) are
# not expressible in JSON Schema, and strict types refuse 64.0 where JSON Schema's "integer"
# allows it; such bodies get the documented 422. Bounded: about a minute on 2 cores.
schema = schemathesis.openapi.from_asgi("/openapi.json", _SERVER.app)
CHECKS_EXCLUDED = [schemathesis.checks.positive_data_acceptance]


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_openapi_conformance_with_token(case) -> None:  # type: ignore[no-untyped-def]
    case.call_and_validate(headers=AUTH, excluded_checks=CHECKS_EXCLUDED)


@schema.parametrize()
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
def test_openapi_conformance_without_token(case) -> None:  # type: ignore[no-untyped-def]
    # Every generated request without credentials: mutations must answer the documented 401.
    case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
    response = case.call_and_validate()
    # (schemathesis also sends unsupported methods to each path: those get 405 with Allow.)
    if case.method.upper() == case.operation.method.upper() and case.method.upper() in ("PUT", "PATCH", "POST"):
        assert response.status_code == 401, f"{case.method} {case.path}: {response.status_code}"
