"""`proxima serve` with the runtime API: vLLM's server as a child process, the canary runner beside it.

The runner needs a client of the server (it submits canary requests through `/v1/completions`),
so it cannot live inside vLLM's processes; it runs in a thread of the `proxima serve` process,
which stays vLLM's parent: SIGINT/SIGTERM are passed on to vLLM's server, whose exit status
becomes ours. Without the API there is no runner and `proxima serve` execs vLLM as before.

Canaries are low priority when vLLM schedules by priority: `proxima serve` asks for
`--scheduling-policy priority` unless the command line chose a policy (user requests keep
priority 0, so among themselves they are served by arrival, as with vLLM's default `fcfs`).
Under `fcfs` the canaries are only rate-limited: one round of `canary_runner.PROMPTS`
single-token requests in flight at a time, one live round per `probes.canary.interval_s`.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

logger = logging.getLogger("proxima.canary")
READY_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class ServerArgs:
    """What the runner needs from `vllm serve`'s command line."""

    url: str
    api_key: str | None
    priority_scheduling: bool


def _option(args: Sequence[str], name: str) -> str | None:
    """The value of `--name V` or `--name=V` (the last one wins, as in argparse)."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def server_args(args: Sequence[str], environ: dict[str, str]) -> ServerArgs:
    host = _option(args, "--host") or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"  # listening everywhere: reach it on loopback
    port = _option(args, "--port") or "8000"
    key = _option(args, "--api-key") or environ.get("VLLM_API_KEY") or None
    return ServerArgs(f"http://{host}:{port}", key, _option(args, "--scheduling-policy") == "priority")


def with_priority_scheduling(args: list[str]) -> list[str]:
    """`args` asking vLLM to schedule by priority, unless they choose a scheduling policy."""
    return args if _option(args, "--scheduling-policy") is not None else [*args, "--scheduling-policy", "priority"]


def _wait_healthy(url: str, child: subprocess.Popen[bytes], stop: threading.Event) -> bool:
    import httpx

    deadline = time.monotonic() + READY_TIMEOUT_S
    while not stop.is_set() and child.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        stop.wait(1.0)
    return False


def _canary_thread(srv: ServerArgs, api_url: str, token: str | None, child: subprocess.Popen[bytes],
                   stop: threading.Event) -> None:
    from proxima.integration.vllm.serve.canary_runner import (
        CANARY_PRIORITY,
        CanaryRunner,
        HttpTransport,
        RuntimeApi,
        canary_prompts,
    )

    try:
        prompts = canary_prompts()
    except (OSError, ValueError) as exc:
        logger.warning("proxima: no canary runner: %s", exc)
        return
    if not _wait_healthy(srv.url, child, stop):
        return
    transport = HttpTransport(srv.url, srv.api_key, priority=CANARY_PRIORITY if srv.priority_scheduling else 0)
    runner = CanaryRunner(prompts, transport, RuntimeApi(api_url, token))
    how = "low priority" if srv.priority_scheduling else "rate-limited (vLLM schedules fcfs)"
    logger.warning("proxima: canary runner on %s (%d prompts, %s)", srv.url, len(prompts), how)
    try:
        runner.run(stop.is_set)
    finally:
        transport.close()


def supervise(argv: list[str], env: dict[str, str], vllm_args: Sequence[str], api_url: str,
              token: str | None) -> int:
    """Run vLLM's server (`argv`) as a child with the canary runner beside it; its exit status."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    srv = server_args(vllm_args, env)
    child = subprocess.Popen(argv, env=env)
    stop = threading.Event()

    def forward(signum: int, frame: FrameType | None) -> None:
        stop.set()
        if child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    thread = threading.Thread(target=_canary_thread, args=(srv, api_url, token, child, stop),
                              name="proxima-canary", daemon=True)
    thread.start()
    code = child.wait()
    stop.set()
    thread.join(5.0)
    return code if code >= 0 else 128 - code  # killed by signal N: the shell's 128 + N


__all__ = ["ServerArgs", "server_args", "supervise", "with_priority_scheduling"]
