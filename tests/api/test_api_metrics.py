"""Metrics: names follow the conventions, and the pool gauges agree with /v1/stats."""

from __future__ import annotations

import re

import pytest
from api_helpers import AUTH
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from proxima.api.server import SimulatedServer

REQUIRED = {
    "proxima_pool_pressure_ratio",
    "proxima_pool_blocks",
    "proxima_pool_saved_bytes",
    "proxima_pool_effective_compression_factor",
    "proxima_pool_nominal_compression_factor",
    "proxima_pool_metadata_bytes",
    "proxima_pool_fragmentation_blocks",
    "proxima_engine_decisions",
    "proxima_engine_compression_errors",
    "proxima_engine_compression_kernel_seconds",
    "proxima_probe_runs",
    "proxima_probe_value",
    "proxima_fallback_level",
    "proxima_alerts_fired",
    "proxima_policy_version",
}


def test_metric_names_and_conventions(client: TestClient, server: SimulatedServer) -> None:
    for _ in range(100):
        server.driver.tick()
    text = client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) >= REQUIRED
    for name, fam in families.items():
        assert re.fullmatch(r"proxima_[a-z]+_[a-z0-9_]+", name) or name == "proxima_policy_version", name
        assert fam.documentation, name
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), name
        if name.endswith("_ratio"):
            assert all(0.0 <= s.value <= 1.0 for s in fam.samples), name


def test_pool_gauges_match_stats(client: TestClient, server: SimulatedServer) -> None:
    for _ in range(120):
        server.driver.tick()
    stats = client.get("/v1/stats").json()
    reg = server.controller.metrics.registry
    assert reg.get_sample_value("proxima_pool_saved_bytes") == stats["saved_bytes"]
    assert reg.get_sample_value("proxima_pool_metadata_bytes") == stats["meta_bytes"]
    assert reg.get_sample_value("proxima_pool_effective_compression_factor") == pytest.approx(
        stats["effective_compression"], rel=1e-5
    )
    assert reg.get_sample_value("proxima_pool_nominal_compression_factor") == pytest.approx(
        stats["nominal_compression"], rel=1e-5
    )
    for fmt, n in stats["blocks_by_format"].items():
        assert reg.get_sample_value("proxima_pool_blocks", {"format": fmt}) == n
    decided = server.backend.sim.result.decisions_by_format
    for fmt, n in decided.items():
        assert reg.get_sample_value("proxima_engine_decisions_total", {"action": "compress", "format": fmt}) == n


def test_policy_version_and_changes(client: TestClient, server: SimulatedServer) -> None:
    client.patch("/v1/policy", json={"description": "x"}, headers=AUTH)
    client.post("/v1/policy/rollback", json={"version": 1}, headers=AUTH)
    reg = server.controller.metrics.registry
    assert reg.get_sample_value("proxima_policy_version") == 3
    assert reg.get_sample_value("proxima_policy_changes_total", {"origin": "api"}) == 1
    assert reg.get_sample_value("proxima_policy_changes_total", {"origin": "rollback"}) == 1


def test_stale_format_gauge_drops_to_zero(server: SimulatedServer) -> None:
    from proxima.api.backend import BackendStats

    m = server.controller.metrics
    base = dict(
        pressure=0.5, total_blocks=10, free_blocks=5, owned_blocks=5, block_bytes=1, fragmentation_blocks=0.0, step=1
    )
    m.set_stats(BackendStats(blocks_by_format={"bf16": 3, "int4": 8}, **base))
    m.set_stats(BackendStats(blocks_by_format={"bf16": 5}, **base))
    assert m.registry.get_sample_value("proxima_pool_blocks", {"format": "int4"}) == 0
