"""CPU time of one layer's scratch fill (`proxima.integration.vllm.attention.cpu_scratch.fill_scratch`).

The CPU attention backend refills the scratch for every layer of every decode step, so this
number times the layer count is added to each step. Setup: 16 requests of 48 blocks (SmolLM2
geometry: 32 tokens, 3 KV heads, 64 dims), 44 blocks of each compressed to one format. Measured:
the torch reference path, the fused numba path (`cpu_dequant.py`), a plain copy of the same
blocks (the floor), and the one-off compression of the blocks.
Usage: python bench/scratch_fill.py [--formats int4 int8 ...] [--repeat 5] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import torch
from common import machine_info, write_results  # bench/ is on sys.path when run as a script

from proxima.formats import Format
from proxima.integration.vllm.attention.cpu_scratch import (
    ScratchPlan,
    ScratchRow,
    fill_scratch,
    plan_scratch,
    store_reader,
)
from proxima.integration.vllm.plan import CompressAction, ProximaPlan
from proxima.integration.vllm.worker.store import WorkerStore

H, B, D = 3, 32, 64
REQUESTS, BLOCKS = 16, 48
LAYER = "model.layers.0.attn"
FORMATS = ["int4", "int8", "cluster(2)+int4", "sparse(4)+int4", "fp8"]


def _timed(fn: Callable[[], Any], repeat: int) -> float:
    """Best-of-`repeat` milliseconds of `fn` after one warm-up call (numba compiles or loads its
    cache there). The best, not the mean: on a shared machine the mean measures the neighbours."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1000


def _setup(fmt: Format) -> tuple[WorkerStore, torch.Tensor, ScratchPlan, float]:
    """A store with every request's middle blocks compressed to `fmt`; returns the compress time too."""
    torch.manual_seed(0)
    nb = REQUESTS * BLOCKS + REQUESTS * BLOCKS // fmt.pack_ratio + 8
    kv = torch.randn(nb, H, B, 2 * D).bfloat16()
    st = WorkerStore()
    st.register({LAYER: kv})
    acts: list[CompressAction] = []
    rows: list[tuple[str, list[int]]] = []
    nxt, dnext, d = 1, REQUESTS * BLOCKS + 1, 0
    for r in range(REQUESTS):
        blocks = list(range(nxt, nxt + BLOCKS))
        nxt += BLOCKS
        for j in range(2, BLOCKS - 2):
            slot = len(acts) % fmt.pack_ratio
            if slot == 0:
                d, dnext = dnext, dnext + 1
            acts.append(CompressAction(len(acts), f"r{r}", j, blocks[j], d, slot, fmt))
        rows.append((f"r{r}", blocks))
    t = time.perf_counter()
    st.apply(ProximaPlan(actions=acts))
    compress_s = time.perf_counter() - t
    plan = plan_scratch([ScratchRow(b, BLOCKS * B - 5, st.remap[rid]) for rid, b in rows], B)
    return st, kv, plan, compress_s


def measure(name: str, repeat: int) -> dict[str, Any]:
    st, kv, plan, compress_s = _setup(Format.parse(name))
    scratch = torch.empty(plan.num_blocks, H, 2 * B, D, dtype=torch.bfloat16)

    def read(f: Format, d: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return st.read_with_counts(LAYER, f, d, s)

    raw = store_reader(st, LAYER)
    src = torch.arange(1, REQUESTS * BLOCKS)
    return {
        "format": name,
        "compressed_blocks": int(sum(len(g.dst) for g in plan.groups)),
        "torch_ms": _timed(lambda: fill_scratch(plan, kv, read, scratch), repeat),
        "fused_ms": _timed(lambda: fill_scratch(plan, kv, read, scratch, raw=raw), repeat),
        "plain_copy_ms": _timed(lambda: kv.index_select(0, src), repeat),
        "compress_ms": compress_s * 1000,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=FORMATS)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch and numba threads (0: their defaults)")
    a = ap.parse_args()
    if a.threads:
        import numba  # type: ignore[import-untyped]

        torch.set_num_threads(a.threads)
        numba.set_num_threads(a.threads)
    results = [measure(f, a.repeat) for f in a.formats]
    head = ("format", "torch ms", "fused ms", "copy ms", "speedup", "vs copy", "compress ms")
    print(f"{head[0]:<18}" + "".join(f"{x:>10}" for x in head[1:4]) + "".join(f"{x:>9}" for x in head[4:6])
          + f"{head[6]:>13}")
    for r in results:
        print(f"{r['format']:<18}{r['torch_ms']:>10.1f}{r['fused_ms']:>10.1f}{r['plain_copy_ms']:>10.1f}"
              f"{r['torch_ms'] / r['fused_ms']:>8.1f}x{r['fused_ms'] / r['plain_copy_ms']:>8.2f}x"
              f"{r['compress_ms']:>13.0f}")
    info = machine_info()
    info["numba"] = version("numba")
    info["torch_threads"] = torch.get_num_threads()
    info["load_average"] = os.getloadavg()
    setup = {"requests": REQUESTS, "blocks_per_request": BLOCKS, "block_size": B, "kv_heads": H, "head_dim": D,
             "repeat": a.repeat,
             "note": "best-of-repeat milliseconds per layer; compress_ms: one layer, once per block"}
    path = write_results("scratch-fill-cpu", {"machine": info, "setup": setup, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
