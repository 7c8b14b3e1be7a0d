"""Concurrent writers: every PATCH lands, versions strictly increase, nothing is lost."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from api_helpers import AUTH
from fastapi.testclient import TestClient

from proxima.api.server import SimulatedServer

# Distinct knobs, so a lost update (a write based on a stale read) would show as a missing value.
KNOBS = [
    ({"protect": {"sink_tokens": 16}}, ("protect", "sink_tokens"), 16),
    ({"protect": {"recent_tokens": 48}}, ("protect", "recent_tokens"), 48),
    ({"budget": {"max_blocks_per_step": 99}}, ("budget", "max_blocks_per_step"), 99),
    ({"importance": {"observation_window": 7}}, ("importance", "observation_window"), 7),
    ({"importance": {"ema_decay": 0.5}}, ("importance", "ema_decay"), 0.5),
    ({"importance": {"aggregate": "mean"}}, ("importance", "aggregate"), "mean"),
    ({"fallback": {"cooldown_s": 3.0}}, ("fallback", "cooldown_s"), 3.0),
    ({"fallback": {"passes_to_step_up": 9}}, ("fallback", "passes_to_step_up"), 9),
    ({"probes": {"canary": {"max_kl": 0.2}}}, ("probes", "canary", "max_kl"), 0.2),
    ({"probes": {"drift": {"window": 50}}}, ("probes", "drift", "window"), 50),
    ({"description": "concurrent"}, ("description",), "concurrent"),
    ({"alerts": {"log": False}}, ("alerts", "log"), False),
]


def test_concurrent_patches_are_serialized(client: TestClient, server: SimulatedServer) -> None:
    def send(patch: dict) -> int:
        r = client.patch("/v1/policy", json=patch, headers=AUTH)
        assert r.status_code == 200, r.text
        return r.json()["version"]

    patches = [k[0] for k in KNOBS] * 3
    with ThreadPoolExecutor(max_workers=8) as pool:
        # The engine keeps stepping meanwhile, reading the store on every step.
        ticks = pool.submit(lambda: [server.driver.tick() for _ in range(30)])
        versions = list(pool.map(send, patches))
        ticks.result()
    assert sorted(versions) == list(range(2, 2 + len(patches)))  # unique, no gaps
    live = client.get("/v1/policy").json()
    assert live["version"] == 1 + len(patches)
    for _, path, value in KNOBS:
        node = live["policy"]
        for key in path:
            node = node[key]
        assert node == value, path
    hist = [v["version"] for v in client.get("/v1/policy/history").json()["versions"]]
    assert hist == sorted(hist) and len(set(hist)) == len(hist)


def test_if_match_lets_exactly_one_racer_win(client: TestClient) -> None:
    def send(i: int) -> int:
        return client.patch(
            "/v1/policy", json={"description": f"w{i}"}, headers={**AUTH, "If-Match": '"1"'}
        ).status_code

    with ThreadPoolExecutor(max_workers=6) as pool:
        codes = list(pool.map(send, range(12)))
    assert codes.count(200) == 1 and codes.count(412) == 11


def test_every_change_is_logged_with_version_and_diff(client: TestClient, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="proxima.api.changes"):
        client.patch(
            "/v1/policy", json={"budget": {"max_blocks_per_step": 12}}, headers=AUTH, params={"comment": "tighter"}
        )
    (rec,) = [r for r in caplog.records if r.name == "proxima.api.changes"]
    msg = rec.getMessage()
    assert "v1 -> v2" in msg and "api:PATCH" in msg and "(tighter)" in msg
    assert "budget.max_blocks_per_step: 1024 -> 12" in msg
