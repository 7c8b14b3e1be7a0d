"""Lean formats (issue 40): bytes held with metadata and attention error, against KIVI int4 / int2.

    nice -n 10 .venv/bin/python bench/lean.py [--contexts 2] [--context-len 1024] [--no-model]

Rows: KIVI int4 / int2 at groups 32 and head_dim (the largest valid group), and the lean int4h /
int2h (one float16 scale per token and head, keys rotated by the seeded Hadamard matrix). For each:

- bytes per token and KV head, data plus metadata (`SlotSpec`), and the byte ratio of a full
  block, at SmolLM2's shape (block 64, head_dim 64, 3 KV heads) and the 8B's (block 128, 128, 8);
- the compression-time probe (`attention_errors`: relative L2 error of the attention output over
  the block alone) on the synthetic outlier KV of tests/compression (4 outlier channels at 12x)
  and on SmolLM2's real KV: Wikipedia contexts prefilled through `ProximaCache`, every block but the
  first compressed into each format, all 30 layers, the window's real queries.

Writes bench/results/experiments/lean-formats/lean.{json,md}.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import kv_sample_args, machine_info  # noqa: E402
from proxima.compression import attention_errors, compress_blocks, slot_spec  # noqa: E402
from tests.compression.synthetic import queries_for, realistic_kv  # noqa: E402

OUT = ROOT / "bench" / "results" / "experiments" / "lean-formats"
ROWS: tuple[tuple[str, int | None], ...] = (
    ("int4", 32), ("int4", 0), ("int4h", None), ("int2", 32), ("int2", 0), ("int2h", None),
)  # fmt: skip
"""(format, group): 0 = head_dim (KIVI's largest valid group), None = no group (lean)."""
SHAPES = ((64, 64, 3), (128, 128, 8))


def _group(g: int | None, d: int) -> int:
    return d if g == 0 else (g or 32)


def _label(fmt: str, g: int | None, d: int) -> str:
    return fmt if g is None else f"{fmt} (G {_group(g, d)})"


def byte_rows() -> list[dict]:
    rows = []
    for block, d, h in SHAPES:
        for fmt, g in ROWS:
            s = slot_spec(fmt, block_size=block, head_dim=d, num_kv_heads=h, group_size=_group(g, d))
            rows.append({
                "shape": f"{block} / {d} / {h}", "format": _label(fmt, g, d),
                "bytes_per_token_head": s.held_bytes_per_slot / (block * h),
                "meta_bytes_per_token_head": s.meta_bytes_per_slot / (block * h), "bytes_ratio": s.bytes_ratio,
            })  # fmt: skip
    return rows


def synthetic_rows(blocks: int, seeds: int) -> list[dict]:
    rows = []
    for block, d, h in SHAPES:
        h = min(h, 3)
        for fmt, g in ROWS:
            errs: list[float] = []
            for seed in range(seeds):
                k, v = realistic_kv(blocks, block, h, d, seed=100 + seed)
                qs = torch.stack([queries_for(k[i], 32, 3 * h, seed=200 + seed * blocks + i) for i in range(blocks)])
                cb = compress_blocks(fmt, k, v, group_size=_group(g, d), backend="torch")
                errs += attention_errors(qs, k, v, cb).tolist()
            rows.append({"kv": "synthetic", "shape": f"{block} / {d} / {h}", "format": _label(fmt, g, d),
                         "n": len(errs), "mean": statistics.fmean(errs), "median": statistics.median(errs),
                         "max": max(errs)})  # fmt: skip
    return rows


def smollm2_rows(contexts: int, context_len: int, block_size: int = 64) -> list[dict]:
    from proxima.formats import Format
    from proxima.integration.hf import ProximaCache, enable
    from proxima.models import load
    from proxima.quality.datasets import text_samples

    model, tok = load()
    enable(model)
    d = model.config.hidden_size // model.config.num_attention_heads
    errs: dict[str, list[float]] = {}
    for s in text_samples(tok, context_len, contexts, seed=7):
        cache = ProximaCache(block_size=block_size, record_probes=True)
        with torch.no_grad():
            model(torch.tensor([s.context_ids], device=model.device), past_key_values=cache)
        n = cache.proxima_layers[0].n_blocks
        for fmt, g in ROWS:
            c = copy.deepcopy(cache)
            c.group_size = _group(g, d)
            c.compress_blocks(list(range(1, n)), Format.parse(fmt))
            errs.setdefault(_label(fmt, g, d), []).extend(r.error for r in c.probe_log)
        print(f"[lean] SmolLM2 context {s.name}: {n} blocks", flush=True)
    return [{"kv": "smollm2", "shape": f"{block_size} / {d} / 3", "format": name, "n": len(e),
             "mean": statistics.fmean(e), "median": statistics.median(e), "max": max(e)}
            for name, e in errs.items()]  # fmt: skip


def markdown(meta: dict, by: list[dict], probes: list[dict]) -> str:
    out = ["# Lean formats: bytes held and attention error", "", f"`{meta['command']}`", ""]
    out += [f"- {k}: {v}" for k, v in meta.items() if k != "command"]
    out += ["", "## Bytes per token and KV head (data + metadata)", ""]
    out += ["| block / head_dim / KV heads | format | bytes | metadata | byte ratio |", "|---|---|---:|---:|---:|"]
    out += [f"| {r['shape']} | {r['format']} | {r['bytes_per_token_head']:.2f} | {r['meta_bytes_per_token_head']:.2f} "
            f"| {r['bytes_ratio']:.2f} |" for r in by]  # fmt: skip
    out += ["", "## Probe error (relative L2 of the attention output over the block)", ""]
    out += ["| KV | block / head_dim / heads | format | n | mean | median | max |", "|---|---|---|---:|---:|---:|---:|"]
    out += [f"| {r['kv']} | {r['shape']} | {r['format']} | {r['n']} | {r['mean']:.4f} | {r['median']:.4f} "
            f"| {r['max']:.4f} |" for r in probes]  # fmt: skip
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = kv_sample_args(__doc__, OUT, contexts=2).parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.time()
    by, probes = byte_rows(), synthetic_rows(args.blocks, args.seeds)
    probes += [] if args.no_model else smollm2_rows(args.contexts, args.context_len)
    info = machine_info()
    meta = {
        "command": "python bench/lean.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        **{k: v for k, v in info.items() if k in ("date", "platform", "cpu", "torch", "transformers", "git_commit")},
        "seconds": round(time.time() - t0, 1),
        "synthetic": f"realistic_kv: {args.seeds} seeds x {args.blocks} blocks, 32 queries each (queries_for)",
        "smollm2": f"{args.contexts} Wikipedia context(s) x {args.context_len} tokens, block 64, every block but "
        "the first, all 30 layers",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lean.json").write_text(json.dumps({"meta": meta, "bytes": by, "probes": probes}, indent=2) + "\n")
    md = markdown(meta, by, probes)
    (args.out / "lean.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
