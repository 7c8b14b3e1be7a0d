"""Fixtures: a simulated engine behind the API, on a fake clock, with a known token."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from api_helpers import FakeClock, make_server
from fastapi.testclient import TestClient

from proxima.api.server import SimulatedServer


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def server(clock: FakeClock) -> Iterator[SimulatedServer]:
    srv = make_server(clock)
    yield srv
    srv.controller.stop()


@pytest.fixture
def client(server: SimulatedServer) -> Iterator[TestClient]:
    with TestClient(server.app) as c:
        yield c
