"""GPU timing of one decode step of `paged_attention`, the CUDA backend's compute core.

Same batch twice: every block hot, then every other block (the tail excepted) compressed to one
format, so the number shows what reading compressed slots next to vLLM's pages costs or saves.
Usage: python bench/paged_decode.py [--requests 32 --tokens 8192 --fmt int4]
"""

from __future__ import annotations

import argparse

import torch
import triton

from proxima.compression import KVLayout, compress_blocks, hot_store, slot_pool, slot_spec, write_slots
from proxima.compression.paged import PagedRow, paged_attention, plan_rows
from proxima.formats import Format

B, H, HQ, D = 16, 8, 32, 128


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--fmt", default="int4")
    a = ap.parse_args()
    fmt, r, nb = Format.parse(a.fmt), a.requests, a.tokens // B
    kv = torch.randn(1 + 2 * r * nb, H, B, 2 * D, device="cuda").bfloat16()
    hot = hot_store(kv, KVLayout.FLASH_ATTN, num_kv_heads=H, head_dim=D)
    pool = slot_pool(kv, slot_spec(fmt, block_size=B, head_dim=D, num_kv_heads=H))
    q = torch.randn(r, HQ, D, device="cuda").bfloat16()
    plain = [PagedRow(range(1 + i * nb, 1 + (i + 1) * nb), a.tokens) for i in range(r)]
    comp_rows, srcs, slots = [], [], []
    next_slot = (1 + r * nb) * fmt.pack_ratio  # destinations: the second half of the pool
    for row in plain:
        placements = {}
        for j in range(0, nb - 1, 2):
            placements[j] = (fmt, next_slot // fmt.pack_ratio, next_slot % fmt.pack_ratio)
            srcs.append(row.block_ids[j])
            slots.append(next_slot)
            next_slot += 1
        comp_rows.append(PagedRow(row.block_ids, a.tokens, 1, placements))
    src = kv[torch.tensor(srcs, device="cuda")].transpose(1, 2)  # [N, B, H, 2D]
    cb = compress_blocks(fmt, src[..., :D].contiguous(), src[..., D:].contiguous())
    write_slots(pool, torch.tensor(slots, device="cuda"), cb)
    for name, rows in (("all hot", plain), (f"half {fmt}", comp_rows)):
        plan = plan_rows(rows, B).to("cuda")
        ms = triton.testing.do_bench(lambda plan=plan: paged_attention(q, plan, hot, {fmt: pool}))
        print(f"{name:>12}: {r} requests x {a.tokens} tokens, H={H} Hq={HQ} D={D} B={B}: {ms * 1e3:.0f} us")


if __name__ == "__main__":
    main()
