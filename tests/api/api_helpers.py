"""Helpers shared by the API tests.

A uniquely named module: several test folders have a conftest.py, so `from conftest import ...`
would be ambiguous in a full run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from proxima.api.auth import TokenSource
from proxima.api.server import SimulatedServer, simulated
from proxima.policy.loader import load_policy

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CONFIGS = Path(__file__).resolve().parents[2] / "proxima" / "policies"


@dataclass
class FakeClock:
    now: float = 1_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_server(clock: FakeClock, token: str | None = TOKEN, environ: dict[str, str] | None = None) -> SimulatedServer:
    """The balanced policy over the simulator, with its own registry and a known token."""
    env = {"PROXIMA_API_TOKEN": token} if token else dict(environ or {})
    return simulated(
        load_policy(CONFIGS / "balanced.yaml"),
        source=str(CONFIGS / "balanced.yaml"),
        clock=clock,
        tokens=TokenSource(None, "PROXIMA_API_TOKEN", environ=env.get),
        registry=CollectorRegistry(),
    )
