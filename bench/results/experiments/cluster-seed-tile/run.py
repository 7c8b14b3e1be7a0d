"""The device script of this experiment (README.md); it needs the kernel's temporary
`CLUSTER_SEED_TILE` flag, which was removed after this run, so it is kept as a record."""

import sys

import torch

sys.path.insert(0, "bench")
import kernels as K

from proxima.compression import compress_blocks, decompress_blocks
from proxima.compression import triton_ops as T

K.FORMATS = ["cluster(4)", "cluster(2)+int8"]
print("clock", K.sm_clock_mhz(), K.warm_clocks(), flush=True)
cp = K.copy_bandwidth()
print("copy", round(cp), flush=True)
k = torch.randn(1024, 64, 8, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
imp = torch.rand(1024, 64, 8, device="cuda")
for f in K.FORMATS:
    out = []
    for tile in (False, True):
        T.CLUSTER_SEED_TILE = tile  # type: ignore[attr-defined]
        out.append(decompress_blocks(compress_blocks(f, k, v, token_importance=imp, backend="triton"), backend="torch"))
    print(f, "bit-identical:", all(torch.equal(x, y) for x, y in zip(*out, strict=True)), flush=True)
for tile in (False, True, False, True):
    T.CLUSTER_SEED_TILE = tile  # type: ignore[attr-defined]
    rows = [r for r in K.compress_rows(cp, 1024) if r["op"] == "compress"]
    print("SEED_TILE", tile, [(r["format"], round(r["time_us"], 1), f"{100 * r['gbps'] / cp:.1f}%") for r in rows])
T.CLUSTER_SEED_TILE = True  # type: ignore[attr-defined]
print([(c["format"], c["ok"], c.get("objective_ratio")) for c in K.checks() if "cluster" in c["format"]], flush=True)
