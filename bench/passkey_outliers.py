"""Where a passkey's digits rank by `reference.outlier_scores` inside their block (issue 40 item 2).

    PYTHONPATH=$PWD nice -n 10 .venv/bin/python bench/passkey_outliers.py [--depths 0.5,0.7,0.9]

Prefills each 1,024-token passkey context of the quality suite (`proxima.quality.datasets`) into a
`ProximaCache(block_size=64)` and prints, per layer and KV head, the best (lowest) rank among the
key's digit tokens in the block holding its first occurrence (0 = the block's largest outlier):
what `protect.merged_tokens: k` with `merged_by: outlier` would pin is the ranks below k.
Writes bench/results/experiments/protected-tokens/passkey-outliers.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from proxima.compression import reference as ref
from proxima.integration.hf import ProximaCache, enable
from proxima.models import load
from proxima.quality import datasets

OUT = Path(__file__).resolve().parent / "results" / "experiments" / "protected-tokens" / "passkey-outliers.json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depths", default="0.5,0.7,0.9")
    ap.add_argument("--length", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load("smollm2")
    enable(model)
    rows = []
    for depth in [float(x) for x in args.depths.split(",")]:
        s = datasets.needle_samples(tok, args.length, [depth])[0]
        ids = s.context_ids
        starts = [i for i in range(len(ids) - 5) if tok.decode(ids[i:i + 5]).replace(" ", "") == s.answer]
        digits = [p + j for p in starts for j in range(5)]
        cache = ProximaCache(block_size=64)
        with torch.no_grad():
            model(torch.tensor([ids]), past_key_values=cache)
        blk = digits[0] // 64
        in_blk = [p - blk * 64 for p in digits if p // 64 == blk]
        best = []
        for layer in cache.proxima_layers:
            wk, _, _ = layer.materialize()  # [B, H, T, D]
            k = wk[0, :, blk * 64:(blk + 1) * 64].transpose(0, 1).unsqueeze(0)  # [1, 64, H, D]
            rank = ref.outlier_scores(k, None)[0].argsort(0, descending=True).argsort(0)  # [64, H]
            best.append(rank[in_blk].min(0).values.tolist())
        rows.append({"depth": depth, "block": blk, "digit_positions": digits, "best_digit_rank": best})
        print(f"depth {depth}: digits at {digits}, block {blk}; best digit rank per layer (KV heads):")
        for li, b in enumerate(best):
            print(f"  layer {li:2d}: {b}")
    meta = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": platform.machine(), "torch": torch.__version__, "length": args.length}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
