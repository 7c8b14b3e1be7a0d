"""GPU timing of one decode step of `paged_attention`, the CUDA backend's compute core.

Same batch twice: every block hot, then every other block (the tail excepted) compressed to one
format, so the number shows what reading compressed slots next to vLLM's pages costs or saves.
Usage: python bench/paged_decode.py [--requests 32 --tokens 8192 --fmt int4 ...] [--config SPEC ...]
    [--out FILE]

`--config FMT[:key=value...]` replaces a format's decode launch config (`parse_decode_spec`);
`--out` writes the rows as JSON with the command, GPU, versions and date.

Timing: the SMs are kept busy for 3 s first (an idle H200 sits at 345 MHz), then CUDA-graph
medians (`kernels.bench_ms`, eager `do_bench` if capture fails): eager timing without the warm-up
moved the same case by up to 1.5x between repeats (2026-12-04, docs/compression.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton

from proxima.compression import KVLayout, LayerStack, compress_blocks, hot_store, slot_spec
from proxima.compression import triton_attention as ta
from proxima.compression.paged import PagedRow, paged_attention, plan_rows
from proxima.formats import Format

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import bench_ms, warm_clocks  # bench/kernels.py: one timing method for every bench

B, H, HQ, D = 16, 8, 32, 128


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--fmt", nargs="+", default=["int4"])
    ap.add_argument("--config", nargs="*", default=[], metavar="SPEC", help="FMT[:key=value...] decode config")
    ap.add_argument("--out", help="write the rows here (JSON)")
    a = ap.parse_args()
    for spec in a.config:
        f, cfg = ta.parse_decode_spec(spec)
        ta.DECODE_CONFIGS[f] = cfg
    clock = warm_clocks()
    rows = [row for f in a.fmt for row in time_one(Format.parse(f), a.requests, a.tokens)]
    if a.out:
        meta = {
            "command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "sm_clock_mhz_after_warmup": clock,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "decode_configs": {
                k: [v.tokens, v.num_warps, v.num_stages, v.variant] for k, v in ta.DECODE_CONFIGS.items()
            },
        }  # fmt: skip
        with open(a.out, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)


def time_one(fmt: Format, r: int, tokens: int) -> list[dict]:
    nb = tokens // B
    kv = torch.randn(1 + 2 * r * nb, H, B, 2 * D, device="cuda").bfloat16()
    hot = hot_store(kv, KVLayout.FLASH_ATTN, num_kv_heads=H, head_dim=D)
    stack = LayerStack({"layer": kv})  # the worker's slot pool (one layer): the bytes it writes
    sp = stack.pool(fmt, slot_spec(fmt, block_size=B, head_dim=D, num_kv_heads=H))
    q = torch.randn(r, HQ, D, device="cuda").bfloat16()
    plain = [PagedRow(range(1 + i * nb, 1 + (i + 1) * nb), tokens) for i in range(r)]
    comp_rows, srcs, slots = [], [], []
    next_slot = (1 + r * nb) * fmt.pack_ratio  # destinations: the second half of the pool
    for row in plain:
        placements = {}
        for j in range(0, nb - 1, 2):
            placements[j] = (fmt, next_slot // fmt.pack_ratio, next_slot % fmt.pack_ratio)
            srcs.append(row.block_ids[j])
            slots.append(next_slot)
            next_slot += 1
        comp_rows.append(PagedRow(row.block_ids, tokens, 1, placements))
    src = kv[torch.tensor(srcs, device="cuda")].transpose(1, 2)  # [N, B, H, 2D]
    cb = compress_blocks(fmt, src[..., :D].contiguous(), src[..., D:].contiguous())
    stack.write(sp, (0,), torch.tensor(slots, device="cuda"), cb)
    pool = sp.at(0).blocks(cb.k_data.dtype, cb.v_data.dtype, kv.dtype)
    out = []
    for name, rows in (("all hot", plain), (f"half {fmt}", comp_rows)):
        plan = plan_rows(rows, B).to("cuda")
        torch.cuda.synchronize()
        ms = bench_ms(lambda plan=plan: paged_attention(q, plan, hot, {fmt: pool}), graph=True)
        print(f"{name:>12}: {r} requests x {tokens} tokens, H={H} Hq={HQ} D={D} B={B}: {ms * 1e3:.0f} us", flush=True)
        out.append({"case": name, "format": str(fmt), "requests": r, "tokens": tokens, "time_us": ms * 1e3})
    out[1]["vs_all_hot"] = out[1]["time_us"] / out[0]["time_us"]
    return out


if __name__ == "__main__":
    main()
