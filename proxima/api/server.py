"""Assembling and running the API: over the simulator now, over the live engine later.

`simulated(policy)` builds the controller, the simulated engine and the app in one call (the CLI
and the tests use it). `serve()` runs any app with uvicorn in the foreground until interrupted;
`serve_in_thread()` is what the vLLM integration will call inside the engine process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from proxima.api.app import create_app
from proxima.api.auth import TokenSource
from proxima.api.controller import Controller
from proxima.api.metrics import Metrics
from proxima.api.sim_backend import SimDriver, SimulatedBackend, SimulatedQuality
from proxima.policy.schema import Policy
from proxima.policy.store import PolicyStore


@dataclass
class SimulatedServer:
    controller: Controller
    backend: SimulatedBackend
    quality: SimulatedQuality
    driver: SimDriver
    app: FastAPI


def simulated(
    policy: Policy,
    source: str = "initial",
    clock: Callable[[], float] = time.time,
    tokens: TokenSource | None = None,
    registry: CollectorRegistry | None = None,
    seed: int = 0,
) -> SimulatedServer:
    """Everything `proxima api serve --simulate` runs, unstarted (call `driver.start()` to step)."""
    store = PolicyStore(policy, source=source, clock=clock)
    backend = SimulatedBackend(policy, seed=seed)
    controller = Controller(store, backend, Metrics(registry), clock=clock)
    quality = SimulatedQuality(seed=seed)
    driver = SimDriver(controller, backend, quality)
    return SimulatedServer(controller, backend, quality, driver, create_app(controller, tokens))


def serve(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    """Run in the foreground until interrupted (Ctrl-C / SIGTERM)."""
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def serve_in_thread(app: FastAPI, host: str, port: int) -> tuple[uvicorn.Server, threading.Thread]:
    """Run the API on a daemon thread (inside an engine process). Stop with `server.should_exit = True`."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="proxima-api", daemon=True)
    thread.start()
    return server, thread
