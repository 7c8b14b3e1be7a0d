"""NaN from the one-pass decode kernel (interpreter) over a row with one compressed block.

    cd bench/results/experiments/one-pass-e2e && PYTHONPATH=$PWD:$(git rev-parse --show-toplevel) \
        TRITON_INTERPRET=1 python repro_nan.py

Prints (head dim, query heads, KV heads, NaN count in row 0's output): some shapes give NaN, some
not, depending on the random data: the kernel (or this harness) reads memory it should not."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import repro_mixed_decode_shapes as t
import torch

from proxima.compression.mixed_decode import mixed_decode

t.ROWS = [(5 * 32 + 7, {0: "int4"}), (40, {})]
for d, hq, h in [(32, 4, 2), (128, 4, 2), (32, 8, 2), (64, 4, 2), (128, 2, 2)]:
    t.D, t.HQ, t.H = d, hq, h
    x, dense = t._case(16)
    q = torch.randn(len(t.ROWS), t.HQ, t.D).bfloat16()
    tb = x["table"]
    out = torch.full_like(q, float("nan"))
    mixed_decode(q, out, x["kv"], x["tables"], x["seq_lens"], x["qsl"], x["slots"], tb.owner, tb.entries, x["desc"],
                 sm_scale=t.D**-0.5, splits=1)
    print(d, hq, h, out[0].isnan().sum().item(), flush=True)
