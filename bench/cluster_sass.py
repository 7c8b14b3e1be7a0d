"""Static profile of the k-means kernel for the H200 (sm_90), made on a CPU machine.

    PYTHONPATH=/tmp/triton-3.6:. python bench/cluster_sass.py [--out bench/results]

Compiles `triton_ops._cluster_kernel` ahead of time for sm_90 as `compress_blocks` launches it
on bf16 blocks of 64 tokens, 128 channels, 4 Lloyd steps: cluster(4) (16 centroids) and
cluster(2) (32), at the shipped register cap and without one, and reports registers, stack
(spills), shared memory and the SASS instructions of its two loops: the farthest-point seeding
(one iteration per centroid) and the Lloyd steps (one per step). Set-up of Triton 3.6 (the
device's) as in bench/decode_sass.py. The compiler's view, not timings: those come from
`bench/kernels.py` on the H200.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret (before triton is imported)

from decode_sass import compile_sm90, loop_bodies, opcode, write_results
from triton.compiler import ASTSource

from proxima.compression import blocks, triton_ops

T, D = 64, 128
POINTERS = {
    "k_ptr": "*bf16", "v_ptr": "*bf16", "w_ptr": "*fp32", "imp_ptr": "*fp32", "prot_ptr": "*fp32",
    "ko_ptr": "*bf16", "vo_ptr": "*bf16", "lc_ptr": "*fp32", "cnt_ptr": "*fp32",
}  # fmt: skip


SYNC_OPS = ("BAR", "SHFL", "LDS", "STS")
"""Opcodes counted per loop: barriers, warp shuffles and shared-memory loads / stores (the
cross-thread reductions and layout conversions)."""


def profile(centroids: int, maxnreg: int | None) -> dict:
    kern = triton_ops._cluster_kernel
    consts = {
        "ITERS": blocks.DEFAULT_CLUSTER_ITERS, "HAS_PROT": False, "COUNTS": False, "D": D, "BLOCK_T": T, "BLOCK_D": D,
        "BLOCK_C": max(16, centroids), "EXACT16": True, "BF16": triton_ops.CLUSTER_BF16, "PRECISION": "tf32",
        "HW_CVT": True,
    }  # fmt: skip
    sig = {n: POINTERS.get(n) or ("constexpr" if n in consts else "i32") for n in kern.arg_names}
    # the launch specializes pointers and integer arguments that are multiples of 16 (T, C here)
    div16 = set(POINTERS) | {n for n, val in (("T", T), ("C", centroids)) if val % 16 == 0}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kern.arg_names) if n in div16}
    src = ASTSource(
        fn=kern, signature=sig, constexprs={(kern.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs
    )
    opts = {"num_warps": triton_ops.CLUSTER_WARPS} | ({"maxnreg": maxnreg} if maxnreg else {})
    res, sass = compile_sm90(src, opts)
    bodies = loop_bodies(sass)
    # the kernel has exactly two loops, seeding then Lloyd; another one would shift the columns
    assert len(bodies) == 2, f"expected the seeding and the Lloyd loop, found {len(bodies)} loops"
    seed, lloyd = (len(b) for b in bodies)
    ops = [collections.Counter(opcode(x) for x in b) for b in bodies]
    iters = blocks.DEFAULT_CLUSTER_ITERS
    return {
        "centroids": centroids, "maxnreg": maxnreg, "warps": triton_ops.CLUSTER_WARPS,
        **res,
        "seed_loop_instrs": seed, "lloyd_loop_instrs": lloyd, "lloyd_steps": iters,
        "seed_sync": {k: ops[0][k] for k in SYNC_OPS}, "lloyd_sync": {k: ops[1][k] for k in SYNC_OPS},
        "seed_share": seed * centroids / max(1, seed * centroids + lloyd * iters),
    }  # fmt: skip


def markdown(meta: dict, rows: list[dict]) -> str:
    out = [
        "# k-means kernel, static profile for sm_90 (compiled on a CPU machine)", "",
        f"Triton {meta['triton']}, {meta['date']}. Command: `{meta['command']}`", "",
        f"bf16 blocks of {T} tokens x {D} channels, {triton_ops.CLUSTER_WARPS} warps. Loop bodies per warp; "
        "`seeding share` = seeding instructions x centroids over that plus Lloyd instructions x steps. "
        "The compiler's view, not timings.", "",
        "Static counts: a loop's instructions include both sides of its branches. `BAR / SHFL / LDS / STS`: "
        "barriers, shuffles, shared-memory loads and stores in one iteration.", "",
        "| centroids | maxnreg | regs | stack | smem | seeding loop | its BAR / SHFL / LDS / STS | Lloyd loop "
        "| its BAR / SHFL / LDS / STS | Lloyd steps | seeding share |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        out.append(
            f"| {r['centroids']} | {r['maxnreg']} | {r['regs']} | {r['stack']} | {r['smem']} | {r['seed_loop_instrs']} "
            f"| {' / '.join(str(v) for v in r['seed_sync'].values())} | {r['lloyd_loop_instrs']} "
            f"| {' / '.join(str(v) for v in r['lloyd_sync'].values())} | {r['lloyd_steps']} "
            f"| {100 * r['seed_share']:.0f}% |"
        )
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write cluster-sass.{json,md} here")
    args = ap.parse_args()
    rows = []
    for c in (T // 4, T // 2):
        for cap in dict.fromkeys((triton_ops.CLUSTER_MAX_REGISTERS, None, 128)):
            r = profile(c, cap)
            rows.append(r)
            print(
                f"C={c} maxnreg={cap}: regs {r['regs']} stack {r['stack']} smem {r['smem']} seeding loop "
                f"{r['seed_loop_instrs']} x {c}, Lloyd loop {r['lloyd_loop_instrs']} x {r['lloyd_steps']}",
                flush=True,
            )
    command = "PYTHONPATH=/tmp/triton-3.6:. python bench/cluster_sass.py " + " ".join(sys.argv[1:])
    write_results(args.out, "cluster-sass", command, rows, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
