"""Shared fixtures: a simulated engine behind the API, a fake clock and a known token."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from proxima.api.auth import TokenSource
from proxima.api.server import SimulatedServer, simulated
from proxima.policy.loader import load_policy

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@dataclass
class FakeClock:
    now: float = 1_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_server(clock: FakeClock, token: str | None = TOKEN) -> SimulatedServer:
    env = {"PROXIMA_API_TOKEN": token} if token else {}
    return simulated(
        load_policy(CONFIGS / "balanced.yaml"),
        source=str(CONFIGS / "balanced.yaml"),
        clock=clock,
        tokens=TokenSource(None, "PROXIMA_API_TOKEN", environ=env.get),
        registry=CollectorRegistry(),
    )


@pytest.fixture
def server(clock: FakeClock) -> SimulatedServer:
    srv = make_server(clock)
    yield srv
    srv.controller.stop()


@pytest.fixture
def client(server: SimulatedServer) -> TestClient:
    with TestClient(server.app) as c:
        yield c
