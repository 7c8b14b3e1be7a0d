"""Fallback end to end, on a fake clock: an injected canary regression steps the ladder down, fires an
alert and moves the metric; once quality is back and the cooldown is over, the ladder steps back up."""

from __future__ import annotations

from api_helpers import AUTH, FakeClock
from fastapi.testclient import TestClient

from proxima.api.server import SimulatedServer

INTERVAL = 10.0
COOLDOWN = 60.0


def _metric(server: SimulatedServer, name: str, **labels: str) -> float:
    value = server.controller.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def _run(server: SimulatedServer, clock: FakeClock, probes: int) -> None:
    """Let `probes` canary intervals pass, stepping the engine a few times in each."""
    for _ in range(probes):
        clock.advance(INTERVAL)
        for _ in range(3):
            server.driver.tick()


def test_regression_steps_down_alerts_and_recovers(
    client: TestClient, server: SimulatedServer, clock: FakeClock
) -> None:
    r = client.patch(
        "/v1/policy",
        headers=AUTH,
        json={
            "probes": {"canary": {"enabled": True, "interval_s": INTERVAL, "max_kl": 0.05, "min_top1": 0.9}},
            "fallback": {"failures_to_step_down": 2, "passes_to_step_up": 3, "cooldown_s": COOLDOWN},
        },
    )
    assert r.status_code == 200, r.text

    _run(server, clock, 4)  # healthy
    probes = client.get("/v1/probes").json()
    assert probes["probes"]["canary"]["passes"] >= 4 and probes["probes"]["canary"]["failures"] == 0
    assert probes["fallback"]["level"] == 0
    assert client.get("/v1/alerts").json()["alerts"] == []

    server.quality.inject(3.0)  # the regression
    _run(server, clock, 2)
    state = client.get("/v1/fallback").json()
    assert state["level"] == 1 and state["level_name"] == "quantize-only"
    stepped_at = clock.now
    assert state["cooldown_until"] == stepped_at + COOLDOWN
    alerts = client.get("/v1/alerts").json()["alerts"]
    assert [a["kind"] for a in alerts] == ["fallback_step_down"]
    assert alerts[0]["severity"] == "critical"
    assert alerts[0]["details"]["probe"]["kind"] == "canary"
    assert alerts[0]["details"]["probe"]["values"]["kl"] > 0.05
    assert _metric(server, "proxima_fallback_level") == 1
    assert _metric(server, "proxima_alerts_fired_total", kind="fallback_step_down", severity="critical") == 1
    assert _metric(server, "proxima_probe_runs_total", probe="canary", result="fail") == 2
    assert _metric(server, "proxima_probe_value", probe="canary", stat="kl") > 0.05
    # The engine runs under the restricted level from its next step on.
    server.driver.tick()
    assert server.backend.sim.state.fallback_level == 1
    assert "proxima_fallback_level 1.0" in client.get("/metrics").text

    server.quality.inject(0.0)  # quality is back
    _run(server, clock, 3)  # three passes, but still inside the cooldown: hold
    assert clock.now < stepped_at + COOLDOWN
    assert client.get("/v1/fallback").json()["level"] == 1

    while clock.now < stepped_at + COOLDOWN:
        _run(server, clock, 1)
    state = client.get("/v1/fallback").json()
    assert state["level"] == 0
    kinds = [a["kind"] for a in client.get("/v1/alerts").json()["alerts"]]
    assert kinds == ["fallback_step_down", "fallback_step_up"]
    assert _metric(server, "proxima_fallback_level") == 0
    assert _metric(server, "proxima_fallback_transitions_total", kind="step_up") == 1
    server.driver.tick()
    assert server.backend.sim.state.fallback_level == 0


def test_sustained_regression_walks_down_to_off(client: TestClient, server: SimulatedServer, clock: FakeClock) -> None:
    client.patch(
        "/v1/policy",
        headers=AUTH,
        json={
            "probes": {"canary": {"enabled": True, "interval_s": INTERVAL}},
            "fallback": {"failures_to_step_down": 1, "cooldown_s": COOLDOWN},
        },
    )
    server.quality.inject(5.0)
    _run(server, clock, 6)
    state = client.get("/v1/fallback").json()
    assert state["level_name"] == "off" and state["level"] == len(state["levels"]) - 1
    # At "off" no new compression is decided.
    before = _metric(server, "proxima_engine_steps_total")
    decided = sum(server.backend.sim.result.decisions_by_format.values())
    for _ in range(20):
        server.driver.tick()
    assert sum(server.backend.sim.result.decisions_by_format.values()) == decided
    assert _metric(server, "proxima_engine_steps_total") == before + 20


def test_forced_level_holds_against_probes(client: TestClient, server: SimulatedServer, clock: FakeClock) -> None:
    client.patch(
        "/v1/policy",
        headers=AUTH,
        json={
            "probes": {"canary": {"enabled": True, "interval_s": INTERVAL}},
            "fallback": {"failures_to_step_down": 1},
        },
    )
    client.post("/v1/fallback", json={"level": 0}, headers=AUTH)
    server.quality.inject(5.0)
    _run(server, clock, 3)
    state = client.get("/v1/fallback").json()
    assert state["level"] == 0 and state["forced"] == 0


def test_policy_swap_with_fewer_levels_rebases_ladder(client: TestClient, server: SimulatedServer) -> None:
    client.post("/v1/fallback", json={"level": 3}, headers=AUTH)
    r = client.patch(
        "/v1/policy",
        headers=AUTH,
        json={"fallback": {"levels": [{"name": "full"}, {"name": "off", "max_pack_ratio": 1}]}},
    )
    assert r.status_code == 200
    state = client.get("/v1/fallback").json()
    assert state["level"] == 1 and state["level_name"] == "off"
    server.driver.tick()
    assert server.backend.sim.state.fallback_level == 1


def test_drift_regression_steps_down(client: TestClient, server: SimulatedServer) -> None:
    from proxima.api.sim_backend import DRIFT_EVERY_STEPS

    client.patch(
        "/v1/policy",
        headers=AUTH,
        json={
            "probes": {"drift": {"enabled": True, "window": 100, "p_value": 0.01}},
            "fallback": {"failures_to_step_down": 2},
        },
    )
    for _ in range(DRIFT_EVERY_STEPS * 2):
        server.driver.tick()
    assert client.get("/v1/probes").json()["probes"]["drift"]["passes"] >= 1
    server.quality.inject(2.0)
    for _ in range(DRIFT_EVERY_STEPS * 2):
        server.driver.tick()
    probes = client.get("/v1/probes").json()
    assert probes["probes"]["drift"]["last"]["passed"] is False
    assert probes["probes"]["drift"]["last"]["values"]["p_logprob"] < 0.005
    assert probes["fallback"]["level"] == 1
    assert client.get("/v1/alerts").json()["alerts"][-1]["details"]["probe"]["kind"] == "drift"
