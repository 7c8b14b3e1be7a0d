"""Quantization group size: bytes held and attention error per (format, group), issue 18.

    nice -n 5 .venv/bin/python bench/groups.py [--contexts 1] [--context-len 1024]

For int8 / int4 / int2 and group sizes 32 / 64 / 128 / head_dim (keys grouped per channel along
tokens, values per token along channels; `SlotSpec.group_size`):

- bytes per token per KV head, data plus metadata (`SlotSpec.bytes_per_token`), and the byte
  ratio of a full block, at SmolLM2's geometry (block 64, head_dim 64) and at block 128 / head_dim
  128 (vLLM's CPU block size, the common head_dim);
- the compression-time probe (`proxima.compression.attention_errors`: relative L2 error of the
  attention output over the block alone) on the synthetic outlier KV of tests/compression
  (`realistic_kv`, 4 outlier channels at 12x, queries from `queries_for`), and on SmolLM2's real
  KV: a Wikipedia context prefilled through `ProximaCache`, every block but the first compressed
  into each (format, group) with the window's real queries (the probe records the damage model
  is fitted on).

A group that does not fit the geometry (int4 / int2 values need head_dim % group == 0) is
reported as invalid, with SlotSpec's error. Writes bench/results/experiments/groups/groups.{json,md}.
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
from proxima.formats import Format  # noqa: E402
from tests.compression.synthetic import queries_for, realistic_kv  # noqa: E402

OUT = ROOT / "bench" / "results" / "experiments" / "groups"
QUANTS = ("int8", "int4", "int2")
GROUPS = (32, 64, 128)
"""Plus head_dim, which at head_dim 64 / 128 is one of these already."""
PROBE_BOUNDS = {"int8": 0.05, "int4": 0.25, "int2": 0.35}
"""The shipped compression-probe bounds (proxima/policies/balanced.yaml `probes.compression.max_error`)."""
TEST_BOUNDS = {"int8": 0.01, "int4": 0.08, "int2": 0.4}
"""The synthetic-KV bounds tests/compression/test_attention.py asserts at group 32."""


def groups_for(head_dim: int) -> list[int]:
    return sorted({*GROUPS, head_dim})


def byte_rows() -> list[dict]:
    rows = []
    for block, d in ((64, 64), (128, 128)):
        for q in QUANTS:
            for g in groups_for(d):
                row: dict = {"block_size": block, "head_dim": d, "format": q, "group_size": g}
                try:
                    s = slot_spec(q, block_size=block, head_dim=d, num_kv_heads=1, group_size=g)
                except ValueError as e:
                    row["invalid"] = str(e)
                else:
                    row |= {
                        "bytes_per_token_head": s.bytes_per_token,
                        "data_bytes_per_token_head": s.data_bytes_per_slot / block,
                        "meta_bytes_per_token_head": s.meta_bytes_per_slot / block,
                        "bytes_ratio": s.bytes_ratio,
                    }
                rows.append(row)
    return rows


def synthetic_rows(blocks: int, seeds: int) -> list[dict]:
    """Probe error on the synthetic outlier KV, per (geometry, format, group): mean and max over
    `seeds` x `blocks` blocks (each seed its own KV and queries)."""
    rows = []
    for block, h, d in ((64, 3, 64), (128, 2, 128)):
        for q in QUANTS:
            for g in groups_for(d):
                errs: list[float] = []
                for seed in range(seeds):
                    k, v = realistic_kv(blocks, block, h, d, seed=100 + seed)
                    qs = torch.stack(
                        [queries_for(k[i], 32, 3 * h, seed=200 + seed * blocks + i) for i in range(blocks)]
                    )
                    try:
                        cb = compress_blocks(q, k, v, group_size=g, backend="torch")
                    except ValueError as e:
                        errs = []
                        err_text = str(e)
                        break
                    errs += attention_errors(qs, k, v, cb).tolist()
                row: dict = {
                    "kv": "synthetic",
                    "block_size": block,
                    "heads": h,
                    "head_dim": d,
                    "format": q,
                    "group_size": g,
                }
                if errs:
                    row |= {"n": len(errs), "mean": statistics.fmean(errs), "max": max(errs)}
                else:
                    row["invalid"] = err_text
                rows.append(row)
    return rows


def smollm2_rows(contexts: int, context_len: int, block_size: int = 64) -> list[dict]:
    """Probe error on SmolLM2's real KV: the probe records of `ProximaCache.compress_blocks`."""
    from proxima.formats import Format
    from proxima.integration.hf import ProximaCache, enable
    from proxima.models import load
    from proxima.quality.datasets import text_samples
    from proxima.quality.probe_records import ProbeLog, probe_records

    model, tok = load()
    enable(model)
    d = model.config.hidden_size // model.config.num_attention_heads
    errs: dict[tuple[str, int], list[float]] = {}
    invalid: dict[tuple[str, int], str] = {}
    for s in text_samples(tok, context_len, contexts, seed=7):
        cache = ProximaCache(block_size=block_size, probe_hook=ProbeLog())
        with torch.no_grad():
            model(torch.tensor([s.context_ids], device=model.device), past_key_values=cache)
        n = cache.proxima_layers[0].n_blocks
        for q in QUANTS:
            for g in groups_for(d):
                c = copy.deepcopy(cache)
                c.group_size = g
                try:
                    c.compress_blocks(list(range(1, n)), Format.parse(q))
                except ValueError as e:
                    invalid[(q, g)] = str(e)
                    continue
                errs.setdefault((q, g), []).extend(r.error for r in probe_records(c))
        print(f"[groups] SmolLM2 context {s.name}: {n} blocks", flush=True)
    rows = []
    for q in QUANTS:
        for g in groups_for(d):
            row: dict = {"kv": "smollm2", "block_size": block_size, "head_dim": d, "format": q, "group_size": g}
            e = errs.get((q, g))
            if e:
                row |= {"n": len(e), "mean": statistics.fmean(e), "median": statistics.median(e), "max": max(e)}
            else:
                row["invalid"] = invalid.get((q, g), "not measured")
            rows.append(row)
    return rows


META_FORMATS = (("fp8", 32), ("int8", 64), ("int4", 64), ("int2", 32), ("cluster(4)+int4", 64))
"""Formats whose metadata has float32 fields (fp8 / int8 per-token scales, log-counts), at the group
each is best at; the fp16 fields (KIVI scales and zeros) are rounded too in the bf16 variant."""


def _round_meta(cb, dtype: torch.dtype):
    """`cb` with every float32 metadata field (scales, log-counts) stored in `dtype` instead:
    what a leaner side table would hold (`None` keeps the payload as it is)."""
    from dataclasses import replace

    def r(t):
        return None if t is None or t.dtype != torch.float32 else t.to(dtype).float()

    fields = {n: r(getattr(cb, n)) for n in ("k_scale", "v_scale", "log_count")}
    return replace(cb, **{n: t for n, t in fields.items() if t is not None})


def _meta_bytes(fmt: str, group: int, f32_as: int) -> tuple[float, float]:
    """(bytes per token per head, byte ratio) at SmolLM2's geometry with float32 fields at `f32_as` bytes."""
    s = slot_spec(fmt, block_size=64, head_dim=64, num_kv_heads=1, group_size=group)
    meta = sum(
        (f.bytes_per_head() // f.itemsize) * (f32_as if f.dtype == "float32" else f.itemsize) for f in s.meta_fields()
    )
    held = s.data_bytes_per_slot + meta
    return held / 64, s.block_data_bytes / held


def metadata_rows(contexts: int, context_len: int, block_size: int = 64) -> list[dict]:
    """Probe error on SmolLM2's real KV with the float32 metadata fields held in fp16 / bf16
    instead (issue 18 item 4: 'metadata in the leanest form the probe accepts'). Log-counts need no
    measurement: a count is an integer <= block size, so a uint8 count is exact (bytes only)."""
    from proxima.integration.hf import ProximaCache, enable
    from proxima.models import load
    from proxima.quality.datasets import text_samples

    model, tok = load()
    enable(model)
    errs: dict[tuple[str, str], list[float]] = {}
    for s in text_samples(tok, context_len, contexts, seed=7):
        cache = ProximaCache(block_size=block_size)
        with torch.no_grad():
            model(torch.tensor([s.context_ids], device=model.device), past_key_values=cache)
        for li, layer in enumerate(cache.proxima_layers):
            q = cache.window_queries(li)
            if q is None:
                continue
            wk, wv, _ = layer.materialize()  # [1, H, T, D]
            n = layer.n_blocks
            k = wk[0, :, block_size : n * block_size].unflatten(1, (n - 1, block_size)).permute(1, 2, 0, 3)
            v = wv[0, :, block_size : n * block_size].unflatten(1, (n - 1, block_size)).permute(1, 2, 0, 3)
            k, v = k.to(torch.bfloat16).contiguous(), v.to(torch.bfloat16).contiguous()
            qs = q[0].transpose(0, 1)  # [W, Hq, D]
            for fmt, g in META_FORMATS:
                cb = compress_blocks(fmt, k, v, group_size=g, backend="torch")
                for name, dt in (("float32 (stored)", None), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
                    c = cb if dt is None else _round_meta(cb, dt)
                    errs.setdefault((fmt, name), []).extend(attention_errors(qs, k, v, c).tolist())
        print(f"[groups] metadata precision, context {s.name}", flush=True)
    rows = []
    for fmt, g in META_FORMATS:
        for name, nbytes in (("float32 (stored)", 4), ("float16", 2), ("bfloat16", 2)):
            e = errs[(fmt, name)]
            per_tok, ratio = _meta_bytes(fmt, g, nbytes)
            rows.append(
                {
                    "format": fmt,
                    "group_size": g,
                    "float32_fields_as": name,
                    "n": len(e),
                    "median": statistics.median(e),
                    "max": max(e),
                    "bytes_per_token_head": per_tok,
                    "bytes_ratio": ratio,
                }
            )
        if Format.parse(fmt).attention_uses_counts:
            per_tok, ratio = _meta_bytes(fmt, g, 2)
            spec = slot_spec(fmt, block_size=64, head_dim=64, num_kv_heads=1, group_size=g)
            lc = spec.slot_tokens  # log_count [C] per head: 2 bytes of fp16 -> 1 byte of uint8 count
            rows.append(
                {
                    "format": fmt,
                    "group_size": g,
                    "float32_fields_as": "scales float16, counts uint8 (exact)",
                    "bytes_per_token_head": per_tok - lc / 64,
                    "bytes_ratio": spec.block_data_bytes / (per_tok * 64 - lc),
                }
            )
    return rows


def markdown(meta: dict, by: list[dict], syn: list[dict], real: list[dict], metas: list[dict]) -> str:
    out = ["# Quantization group size: bytes and attention error (issue 18)", ""]
    out += [f"- {k}: {v}" for k, v in meta.items()] + [""]
    out += ["## Bytes per token per KV head (data + metadata, one layer)", ""]
    out += [
        "| block / head_dim | format | group | bytes/token/head | of which metadata | byte ratio |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in by:
        if "invalid" in r:
            out.append(f"| {r['block_size']} / {r['head_dim']} | {r['format']} | {r['group_size']} | invalid | | |")
        else:
            out.append(
                f"| {r['block_size']} / {r['head_dim']} | {r['format']} | {r['group_size']} | "
                f"{r['bytes_per_token_head']:.2f} | {r['meta_bytes_per_token_head']:.2f} | {r['bytes_ratio']:.2f} |"
            )
    out += ["", "## Probe error (relative L2 of the attention output over the block)", ""]
    out += [f"Shipped probe bounds (balanced): {PROBE_BOUNDS}; synthetic-KV test bounds: {TEST_BOUNDS}.", ""]
    out += [
        "| KV | block / head_dim | format | group | n | mean | median | max |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in syn + real:
        geo = f"{r['block_size']} / {r['head_dim']}"
        if "invalid" in r:
            out.append(f"| {r['kv']} | {geo} | {r['format']} | {r['group_size']} | invalid | | | |")
        else:
            med = f"{r['median']:.4f}" if "median" in r else "—"
            out.append(
                f"| {r['kv']} | {geo} | {r['format']} | {r['group_size']} | {r['n']} | {r['mean']:.4f} | {med} "
                f"| {r['max']:.4f} |"
            )
    if metas:
        out += ["", "## Metadata precision (SmolLM2 real KV, float32 side-table fields held narrower)", ""]
        out += [
            "| format | group | float32 fields as | n | median | max | bytes/token/head | byte ratio |",
            "|---|---:|---|---:|---:|---:|---:|---:|",
        ]
        for r in metas:
            med = f"{r['median']:.4f} | {r['max']:.4f}" if "median" in r else "(no change) | "
            n = r.get("n", "")
            out.append(
                f"| {r['format']} | {r['group_size']} | {r['float32_fields_as']} | {n} | {med} | "
                f"{r['bytes_per_token_head']:.2f} | {r['bytes_ratio']:.2f} |"
            )
    invalid = sorted({r["invalid"] for r in by + syn + real if "invalid" in r})
    if invalid:
        out += ["", "Invalid groups (the error SlotSpec / compress_blocks raise):", ""] + [f"- {e}" for e in invalid]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = kv_sample_args(__doc__, OUT, contexts=1).parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.time()
    by, syn = byte_rows(), synthetic_rows(args.blocks, args.seeds)
    real = [] if args.no_model else smollm2_rows(args.contexts, args.context_len)
    metas = [] if args.no_model else metadata_rows(args.contexts, args.context_len)
    meta = {
        "command": "python bench/groups.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        **{
            k: v
            for k, v in machine_info().items()
            if k in ("date", "platform", "cpu", "torch", "transformers", "git_commit")
        },
        "seconds": round(time.time() - t0, 1),
        "synthetic": f"realistic_kv: {args.seeds} seeds x {args.blocks} blocks, 32 queries each (queries_for)",
        "smollm2": f"{args.contexts} Wikipedia context(s) x {args.context_len} tokens, block 64, "
        "every block but the first, all 30 layers",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "groups.json").write_text(
        json.dumps(
            {"meta": meta, "bytes": by, "synthetic": syn, "smollm2": real, "metadata_precision": metas}, indent=2
        )
        + "\n"
    )
    md = markdown(meta, by, syn, real, metas)
    (args.out / "groups.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
