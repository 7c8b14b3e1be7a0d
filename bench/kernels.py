"""Compression kernels on the GPU: check every kernel against its torch reference, then time them.

    PYTHONPATH=. python bench/kernels.py --out DIR [--quick]

Writes DIR/kernels-h200.json and DIR/kernels-h200.md (copy them to bench/results/). Rows:

- `copy`: a 1 GiB device-to-device copy; bytes read + written per second is the roofline.
- `compress` / `decompress` per format over >= 256 MB of bf16 KV (1024 blocks of 64 tokens,
  8 KV heads, head_dim 128): bytes read + written (data and metadata) per second.
- `decode` per format and (context, batch): Proxima's split-K kernel over paged slots
  (shuffled slot table, block size 64), 32 query heads / 8 KV heads / head_dim 128, against
  `scaled_dot_product_attention` on contiguous bf16 KV (`sdpa_time_us`). Both timed as CUDA graph
  replays (median), as vLLM runs decode; bytes = KV data + metadata read.
- `quality`: attention-output relative error (the compression-time probe) on synthetic KV with
  outlier key channels (`tests/compression/synthetic.py`).

Every number comes from this run; nothing here is a test (the tests are in tests/compression).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
import traceback

import torch
import triton
import triton.testing

from proxima.compression import (
    KVSegment,
    attention_error,
    compress_block,
    compress_blocks,
    decode_attention,
    decode_attention_reference,
    decompress_blocks,
)
from proxima.compression import reference as ref
from tests.compression.synthetic import queries_for, realistic_kv

HQ, H, D, B = 32, 8, 128, 64
FORMATS = ["fp8", "int8", "int4", "int2", "sparse(4)", "cluster(4)", "sparse(2)+int4", "cluster(2)+int8"]
DECODE_FORMATS = ["bf16", "fp8", "int8", "int4", "int2", "sparse(4)", "cluster(4)", "sparse(2)+int4"]
T_START = time.time()
DEADLINE_S = 420
"""Decode shapes still to run are skipped past this many seconds, so a run always writes results
inside the device tool's 10-minute command limit."""
PARTS = ("compress", "decode", "quality")
"""What a plain run measures, in order; `--only` picks some (the compress rows take ~20 s)."""
DECODE_SHAPES = [(4096, 1), (4096, 16), (4096, 64), (32768, 1), (32768, 8), (32768, 32), (131072, 1), (131072, 8)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(b.double().norm())
    return float((a.double() - b.double()).norm()) / den if den else float((a.double() - b.double()).norm())


def nbytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def cb_bytes(cb) -> int:
    return nbytes(cb.k_data, cb.v_data, cb.k_scale, cb.k_zero, cb.v_scale, cb.v_zero, cb.log_count, cb.token_index)


def sm_clock_mhz() -> int | None:
    try:
        return int(torch.cuda.clock_rate())  # NVML's current SM clock
    except Exception:  # no NVML in this environment
        return None


def warm_clocks(seconds: float = 3.0) -> int | None:
    """Keep the SMs busy until the clocks have left the idle state; returns the SM clock then.
    An idle H200 sits at 345 MHz and the compress rows, the first timed, ran up to 1.7x slow
    while it ramped (fp8 166.6 vs 107.9 us, int8 204.2 vs 121.9 us, the same kernels a minute
    apart in one call, 2026-12-02); the copy roofline, memory-bound, did not move (4,248 GB/s both times)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    return sm_clock_mhz()


def bench_ms(fn, graph: bool = False, rep: int = 200, how: dict | None = None) -> float:
    # Triton's do_bench_cudagraph warms up and captures on a new side stream, which is not ordered
    # after the default stream: without this sync its first call can read inputs (a slot table,
    # compressed pools) that kernels on the default stream are still writing. That was the
    # "illegal address at the first capture after 32k x 32" of the 2026-12-01 sweeps; it never
    # happened under CUDA_LAUNCH_BLOCKING=1 (every launch synchronous).
    torch.cuda.synchronize()
    if graph:
        # and warm up on the default stream: the first timing of a new kernel in a process ran
        # 1.4-1.5x slow at 4k x 1 (int4 16.0 vs 11.8 us re-timed in the same process, 2026-12-02)
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        try:
            ms = float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
            if how is not None:
                how["timing"] = "graph"
            return ms
        except Exception as e:  # capture can fail on a host sync; eager timing is then the fallback
            first = (str(e).splitlines() or [""])[0]
            print(f"  cudagraph capture failed ({type(e).__name__}: {first}); timing eagerly", flush=True)
            if how is not None:
                how["timing"] = "eager (graph capture failed)"
    elif how is not None:
        how["timing"] = "eager"
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copy_bandwidth() -> float:
    src = torch.randn(256 * 1024 * 1024 // 2 * 4, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes(src) / ms / 1e6  # GB/s


# ----------------------------------------------------------------------------------------------
# correctness on the GPU


def checks() -> list[dict]:
    out = []
    torch.manual_seed(0)
    k, v = realistic_kv(32, 64, H, D, seed=1, device="cuda")
    imp = torch.rand(32, 64, H, device="cuda")
    prot = torch.zeros(32, 64, dtype=torch.bool, device="cuda")
    prot[:, :2] = True
    for fmt in FORMATS:
        a = compress_blocks(fmt, k, v, token_importance=imp, protected=prot, backend="torch")
        b = compress_blocks(fmt, k, v, token_importance=imp, protected=prot, backend="triton")
        ka, va, la = decompress_blocks(a, backend="torch")
        kb, vb, lb = decompress_blocks(b, backend="triton")
        kc, vc, _ = decompress_blocks(b, backend="torch")
        e_k, e_v = rel(kb.float(), ka.float()), rel(vb.float(), va.float())
        e_deq = max(rel(kb.float(), kc.float()), rel(vb.float(), vc.float()))
        row = {"op": "check_compress", "format": fmt, "k_rel_err": e_k, "v_rel_err": e_v, "dequant_rel_err": e_deq}
        # fp8: the GPU's fp32 -> e4m3 path and torch's differ by one e4m3 step on a few elements
        # (run 1: 1.6e-3 / 2.9e-3 relative); codes of the integer formats match exactly
        tol = 5e-3 if fmt == "fp8" else 2e-3
        ok = e_k < tol and e_v < tol and e_deq < 1e-3
        if fmt.startswith("cluster"):
            # compare the k-means objective (near-ties may flip an assignment)
            w = imp.float().clamp_min(1e-6)
            src = k
            oa = ref.kmeans_objective(src, w, ka).sum().item()
            ob = ref.kmeans_objective(src, w, kb).sum().item()
            row["objective_ratio"] = ob / oa
            ok = abs(ob / oa - 1) < 1e-2 and torch.allclose(la.exp(), lb.exp(), atol=1e-2)
        row["ok"] = bool(ok)
        out.append(row)
    # mixed-format decode attention, Triton vs reference
    s, segs = 4, []
    for i, (fmt, e) in enumerate(
        [("bf16", 8), ("int4", 8), ("fp8", 4), ("int8", 4), ("cluster(4)", 4), ("sparse(2)+int2", 4)]
    ):
        kk, vv = realistic_kv(s * e + 5, B, H, D, seed=10 + i, device="cuda")
        cb = compress_blocks(fmt, kk, vv, token_importance=torch.rand(s * e + 5, B, H, device="cuda"))
        tab = torch.randperm(s * e + 5, device="cuda")[: s * e].view(s, e).int()
        nt = torch.full((s, e), cb.slot_tokens, dtype=torch.int32, device="cuda")
        nt[0, -1] = max(1, cb.slot_tokens // 3)
        nt[1, 0] = 0
        segs.append(KVSegment(cb, tab, nt))
    for hq in (8, 24, 64):  # GQA 1, 3, 8
        q = torch.randn(s, hq, D, device="cuda", dtype=torch.bfloat16)
        r = decode_attention_reference(q, segs)
        o = decode_attention(q, segs, backend="triton")
        mass_err = max(float((a - b).abs().max()) for a, b in zip(o.block_mass, r.block_mass, strict=True))
        e_o, e_lse = rel(o.out.float(), r.out.float()), float((o.lse - r.lse).abs().max())
        out.append({
            "op": "check_decode", "format": "mixed", "gqa": hq // H, "out_rel_err": e_o,
            "lse_abs_err": e_lse, "mass_abs_err": mass_err, "ok": bool(e_o < 1e-2 and e_lse < 1e-2 and mass_err < 5e-3),
        })  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------
# throughput


def compress_rows(copy_gbps: float, n_blocks: int) -> list[dict]:
    rows = []
    k = torch.randn(n_blocks, B, H, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    imp = torch.rand(n_blocks, B, H, device="cuda")
    src = nbytes(k, v)
    for fmt in FORMATS:
        try:
            rows += _compress_one(fmt, k, v, imp, src, copy_gbps, n_blocks)
        except Exception as e:  # keep going: one broken kernel must not hide the other numbers
            traceback.print_exc()
            rows.append({"op": "compress", "format": fmt, "error": f"{type(e).__name__}: {e}"[:500]})
    return rows


def _compress_one(fmt, k, v, imp, src, copy_gbps, n_blocks) -> list[dict]:
    rows = []
    if True:
        needs_imp = "(" in fmt

        def fn(fmt=fmt, imp_=imp if needs_imp else None):
            return compress_blocks(fmt, k, v, token_importance=imp_, backend="triton")

        cb = fn()
        moved = src + (nbytes(imp) if needs_imp else 0) + cb_bytes(cb)
        rows.append(_timed_row("compress", fmt, fn, moved, copy_gbps, n_blocks))
        moved = cb_bytes(cb) - nbytes(cb.token_index) + 2 * cb.num_slots * cb.slot_tokens * H * D * 2
        decompress = lambda cb=cb: decompress_blocks(cb, backend="triton")  # noqa: E731
        rows.append(_timed_row("decompress", fmt, decompress, moved, copy_gbps, n_blocks))
        for r in rows[-2:]:
            print(
                f"  {r['op']:10s} {fmt:16s} {r['time_us']:9.1f} us {r['gbps']:7.0f} GB/s "
                f"{100 * r['gbps'] / copy_gbps:5.1f}% of copy (eager {r['eager_us']:.1f} us)",
                flush=True,
            )
        del cb
    return rows


def _timed_row(op: str, fmt: str, fn, moved: int, copy_gbps: float, n_blocks: int) -> dict:
    """One compress / decompress row: the kernels' time from a CUDA graph of the call (what the
    copy roofline is compared with), and the eager time next to it. Eager, each call's Python
    (checks, allocations, two to four launches) runs while the GPU works; when the host is the
    slower of the two the events time the host, which is how the compress rows moved by up to
    1.4x between runs with unchanged kernels (sessions 10-15). A call that syncs with the host
    cannot be captured (the token-reducing formats check their importance for NaN): its row is
    timed eagerly and says so in `timing`."""
    eager_ms = bench_ms(fn)
    how: dict = {}
    ms = bench_ms(fn, graph=True, how=how)
    return {
        "op": op, "format": fmt, "context": n_blocks * B, "batch": n_blocks, "time_us": ms * 1e3,
        "eager_us": eager_ms * 1e3, "timing": how["timing"], "gbps": moved / ms / 1e6, "copy_gbps": copy_gbps,
        "bytes": moved,
    }  # fmt: skip


def decode_rows(copy_gbps: float, shapes: list[tuple[int, int]]) -> list[dict]:
    rows = []
    for ctx, batch in shapes:
        if time.time() - T_START > DEADLINE_S:
            print(f"  skipping decode {ctx} x {batch}: past the {DEADLINE_S}s budget", flush=True)
            rows.append({"op": "decode", "format": "all", "context": ctx, "batch": batch, "error": "skipped: time"})
            continue
        # Not `e`: `except ... as e` below would delete it (Python unbinds the name after the handler).
        per_seq = ctx // B
        nblk = batch * per_seq
        k = torch.randn(nblk, B, H, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
        # SDPA on contiguous bf16 KV: [batch, H, ctx, D]
        kc = k.view(batch, per_seq, B, H, D).permute(0, 3, 1, 2, 4).reshape(batch, H, ctx, D).contiguous()
        vc = v.view(batch, per_seq, B, H, D).permute(0, 3, 1, 2, 4).reshape(batch, H, ctx, D).contiguous()
        qs = q.unsqueeze(2)

        def sdpa(qs=qs, kc=kc, vc=vc):
            return torch.nn.functional.scaled_dot_product_attention(qs, kc, vc, enable_gqa=True)

        sdpa_ms = bench_ms(sdpa, graph=True)
        del sdpa, kc, vc
        table = torch.randperm(nblk, device="cuda").view(batch, per_seq).int()
        bf16_ms = None
        for fmt in DECODE_FORMATS:
            try:
                if fmt == "bf16":
                    cb = compress_blocks("bf16", k, v, backend="triton")
                else:
                    imp = torch.rand(nblk, B, H, device="cuda") if "(" in fmt else None
                    cb = compress_blocks(fmt, k, v, token_importance=imp, backend="triton")
                    del imp
                ntok = torch.full((batch, per_seq), cb.slot_tokens, dtype=torch.int32, device="cuda")
                seg = KVSegment(cb, table, ntok)

                def fn(seg=seg, q=q):
                    return decode_attention(q, [seg], backend="triton")

                ms = bench_ms(fn, graph=True, rep=100)
                moved = cb_bytes(cb) - nbytes(cb.token_index) + nbytes(q) * 2
                if fmt == "bf16":
                    bf16_ms = ms
                rows.append({
                "op": "decode", "format": fmt, "context": ctx, "batch": batch, "time_us": ms * 1e3,
                "gbps": moved / ms / 1e6, "copy_gbps": copy_gbps, "sdpa_time_us": sdpa_ms * 1e3,
                "speedup_vs_bf16": bf16_ms / ms, "speedup_vs_sdpa": sdpa_ms / ms, "bytes": moved,
            })  # fmt: skip
                print(
                    f"  decode {ctx:6d} x {batch:2d} {fmt:16s} {ms * 1e3:9.1f} us (sdpa {sdpa_ms * 1e3:8.1f})",
                    flush=True,
                )
                del cb, seg, fn
            except Exception as e:  # keep going: one broken kernel must not hide the other numbers
                traceback.print_exc()
                rows.append(
                    {
                        "op": "decode",
                        "format": fmt,
                        "context": ctx,
                        "batch": batch,
                        "error": f"{type(e).__name__}: {e}"[:500],
                    }
                )
                bf16_ms = bf16_ms or float("nan")
        del k, v
        torch.cuda.empty_cache()
    return rows


def quality_rows() -> list[dict]:
    rows = []
    k, v = realistic_kv(4, 128, 2, 128, seed=3)
    for fmt in ["fp8", "int8", "int4", "int2", "sparse(2)", "sparse(4)", "cluster(2)", "cluster(4)", "sparse(2)+int4"]:
        errs = []
        for i in range(4):
            q = queries_for(k[i], 16, 8, seed=i)
            p = torch.softmax(
                torch.einsum("whd,thd->wht", q.float(), k[i].float().repeat_interleave(4, 1)) / math.sqrt(128), -1
            )
            imp = p.sum(0).view(2, 4, 128).sum(1).T.contiguous()  # observation-window mass per token
            errs.append(attention_error(q, k[i], v[i], compress_block(fmt, k[i], v[i], token_importance=imp)))
        rows.append({"op": "quality", "format": fmt, "attn_rel_err": sum(errs) / len(errs)})
    return rows


# ----------------------------------------------------------------------------------------------


ISSUE_SHAPES = [(32768, 8), (32768, 32), (131072, 8)]
"""The shapes issue 15's decode targets are stated at (context, batch)."""


def decode_targets(times: dict[tuple[int, int], dict[str, float]]) -> list[dict]:
    """Issue 15's decode targets from {(context, batch): {format or "sdpa": time_us}}; a target
    whose shapes were not measured is reported as such, not as met."""
    out = []

    def add(name: str, vals: list[float], ok) -> None:  # type: ignore[no-untyped-def]
        if not vals:
            out.append({"target": name, "value": None, "met": False, "note": "not measured"})
        else:
            out.append({"target": name, "value": vals, "met": bool(all(ok(v) for v in vals))})

    big = [times[s] for s in ISSUE_SHAPES if s in times]
    hot = [t for (ctx, b), t in times.items() if b >= 8 and "bf16" in t and "sdpa" in t]
    add("Proxima bf16 / SDPA bf16, batch >= 8 (<= 1.10)", [t["bf16"] / t["sdpa"] for t in hot], lambda v: v <= 1.10)
    add("int4 speed vs Proxima bf16 (>= 2.2x)", [t["bf16"] / t["int4"] for t in big], lambda v: v >= 2.2)
    add("int4 speed vs SDPA bf16 (>= 1.8x)", [t["sdpa"] / t["int4"] for t in big], lambda v: v >= 1.8)
    for fmt in ("int8", "fp8"):
        add(f"{fmt} speed vs Proxima bf16 (>= 1.5x)", [t["bf16"] / t[fmt] for t in big], lambda v: v >= 1.5)
    add("int2 speed vs Proxima bf16 (>= 3x)", [t["bf16"] / t["int2"] for t in big], lambda v: v >= 3.0)
    small = times.get((4096, 1), {})
    add(
        "every format at 4k x 1 vs Proxima bf16 (>= 0.9x)",
        [small["bf16"] / small[f] for f in ("fp8", "int8", "int4", "int2") if f in small and "bf16" in small],
        lambda v: v >= 0.9,
    )
    return out


def compress_targets(rows: list[dict]) -> list[dict]:
    out = []
    for op, fmt in (("compress", "fp8"), ("compress", "int8"), ("compress", "int4"), ("decompress", "int4")):
        r = [x for x in rows if x["op"] == op and x["format"] == fmt and "gbps" in x]
        frac = r[0]["gbps"] / r[0]["copy_gbps"] if r else None
        out.append({"target": f"{op} {fmt} >= 60% of copy", "value": frac, "met": frac is not None and frac >= 0.6})
    for fmt in ("cluster(4)", "cluster(2)+int8"):
        r = [x for x in rows if x["op"] == "compress" and x["format"] == fmt and "gbps" in x]
        frac = r[0]["gbps"] / r[0]["copy_gbps"] if r else None
        out.append(
            {"target": f"compress {fmt} >= 15% of copy", "value": frac, "met": frac is not None and frac >= 0.15}
        )
    return out


def bytes_per_token_head() -> list[dict]:
    """Stored bytes per token per KV head (keys + values + metadata) at the bench's shapes."""
    from proxima.compression import slot_spec

    rows = []
    for fmt in ["bf16", "fp8", "int8", "int4", "int2", "sparse(4)", "cluster(4)", "sparse(2)+int4"]:
        sp = slot_spec(fmt, block_size=B, head_dim=D, num_kv_heads=H)
        total = sp.bytes_per_token / H
        rows.append(
            {"format": fmt, "bytes": total, "meta_bytes": sp.meta_bytes_per_slot / B / H, "vs_bf16": 4 * D / total}
        )
    return rows


def targets(rows: list[dict]) -> list[dict]:
    times: dict[tuple[int, int], dict[str, float]] = {}
    for r in rows:
        if r["op"] == "decode" and "time_us" in r:
            t = times.setdefault((r["context"], r["batch"]), {"sdpa": r["sdpa_time_us"]})
            t[r["format"]] = r["time_us"]
    qual = {r["format"]: r["attn_rel_err"] for r in rows if r["op"] == "quality"}
    tg = compress_targets(rows) + decode_targets(times)
    for fmt, bound in (("int8", 0.01), ("fp8", 0.04), ("int4", 0.08)):
        tg.append(
            {
                "target": f"attention error {fmt} <= {bound:.0%}",
                "value": qual.get(fmt),
                "met": qual.get(fmt, 1) <= bound,
            }
        )
    return tg


def _fmt_value(v) -> str:  # type: ignore[no-untyped-def]
    if v is None:
        return "not measured"
    if isinstance(v, list):
        return " / ".join(f"{x:.2f}" for x in v)
    return f"{v:.3g}"


def markdown(meta: dict, rows: list[dict], tg: list[dict]) -> str:
    lines = [f"# Proxima compression kernels on {meta['gpu']}", ""]
    lines += [
        f"torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; "
        f"copy bandwidth {meta['copy_gbps']:.0f} GB/s (read + write).",
        "",
    ]
    if (clk := meta.get("sm_clock_mhz")) and clk.get("after_warmup") is not None:  # None: no NVML
        lines += [f"SM clock {clk['before_warmup']} MHz before the warm-up, {clk['after_warmup']} MHz after.", ""]
    lines += ["## Targets", "", "| target | value | met |", "|---|---|---|"]
    lines += [f"| {x['target']} | {_fmt_value(x['value'])} | {'yes' if x['met'] else 'no'} |" for x in tg]
    lines += [
        "",
        "## Checks against the torch reference (GPU)",
        "",
        "| op | format | errors | ok |",
        "|---|---|---|---|",
    ]
    for r in meta["checks"]:
        errs = ", ".join(
            f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
            for k, v in r.items()
            if k not in ("op", "format", "ok", "gqa")
        )
        lines.append(
            f"| {r['op']} | {r['format']}{' gqa ' + str(r['gqa']) if 'gqa' in r else ''} | {errs} | {r['ok']} |"
        )
    lines += ["", "## Compress / decompress (1024 blocks x 64 tokens x 8 heads x 128, bf16 = 256 MiB)", ""]
    lines += [
        "time_us: the call's kernels, timed as a CUDA graph where `timing` says graph (the % of copy); "
        "a call that syncs with the host (the token-reducing formats' NaN check of their importance) "
        "cannot be captured and is timed eagerly. eager_us: the same call timed eagerly, Python and "
        "launches included. Decompressing sparse(R) / cluster(R) stored at bf16 returns the stored "
        "rows (a view and a clone of the counts), hence their % of copy above 100.",
        "",
        "| op | format | time_us | GB/s | % of copy | eager_us | timing |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['op']} | {r['format']} | error: {r['error'][:200]} | | | | |")
        elif r["op"] in ("compress", "decompress"):
            eager = f"{r['eager_us']:.1f}" if "eager_us" in r else ""
            lines.append(
                f"| {r['op']} | {r['format']} | {r['time_us']:.1f} | {r['gbps']:.0f} "
                f"| {100 * r['gbps'] / r['copy_gbps']:.0f}% | {eager} | {r.get('timing', '')} |"
            )
    lines += ["", "## Decode attention (32 q heads, 8 KV heads, D 128, block 64; CUDA-graph medians)", ""]
    lines += [
        "| context | batch | format | time_us | GB/s | sdpa_time_us | vs bf16 | vs SDPA |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["op"] == "decode" and "error" not in r:
            lines.append(
                f"| {r['context']} | {r['batch']} | {r['format']} | {r['time_us']:.1f} | {r['gbps']:.0f} | "
                f"{r['sdpa_time_us']:.1f} | {r['speedup_vs_bf16']:.2f}x | {r['speedup_vs_sdpa']:.2f}x |"
            )
    lines += [
        "",
        "## Attention-output error (probe, synthetic KV with outlier key channels)",
        "",
        "| format | rel. error |",
        "|---|---|",
    ]
    lines += [f"| {r['format']} | {r['attn_rel_err']:.4f} |" for r in rows if r["op"] == "quality"]
    return "\n".join(lines) + "\n"  # fmt: skip


SWEEP_SPECS = [
    "bf16", "bf16:warps=2", "bf16:stages=3",
    "fp8", "fp8:warps=4:maxnreg=128", "fp8:scale_values=0",
    "int8", "int8:unpack_asm=1", "int8:warps=4:unpack_asm=1",
    "int4", "int4:stages=2", "int4:warps=4:stages=2:maxnreg=128",
    "int2", "int2:stages=3", "int2:warps=4:maxnreg=128",
]  # fmt: skip
"""What a plain --sweep times (`parse_decode_spec` specs; maxnreg=0: no register cap): each shipped
config, its closest alternatives and the previous shipped one (4 warps). Tried before and slower at
32k x 8: 8 warps everywhere, 128 tokens but for fp8 / int8 / int2 (2026-12-01), int4 words unpacked
by PTX into a join (removed), the value planes joined into one dot, maxnreg 96 for int4
(2026-12-02); 1 warp, and 2 warps under a register cap (spills; 2026-12-04)."""
SWEEP_FORMATS = ["bf16", "fp8", "int8", "int4", "int2"]


def _decode_case(ctx: int, batch: int, fmt: str, seed: int = 0):  # type: ignore[no-untyped-def]
    """q, a shuffled paged segment of `fmt` and the bytes decode must read; plus bf16 contiguous KV."""
    torch.manual_seed(seed)
    per_seq = ctx // B
    nblk = batch * per_seq
    k = torch.randn(nblk, B, H, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    imp = torch.rand(nblk, B, H, device="cuda") if "(" in fmt else None
    cb = compress_blocks(fmt, k, v, token_importance=imp, backend="triton")
    table = torch.randperm(nblk, device="cuda").view(batch, per_seq).int()
    ntok = torch.full((batch, per_seq), cb.slot_tokens, dtype=torch.int32, device="cuda")
    moved = cb_bytes(cb) - nbytes(cb.token_index) + nbytes(q) * 2
    return q, KVSegment(cb, table, ntok), moved, (k, v)


def _small_check(fmt: str) -> float:
    """Max over out / lse / mass of the error of a 3-sequence decode with a partial and a padding
    entry against the torch reference (fresh data every call)."""
    s, e = 3, 7
    kk, vv = realistic_kv(s * e + 2, B, H, D, seed=int(time.time() * 1e3) % 10_000, device="cuda")
    cb = compress_blocks(fmt, kk, vv, token_importance=torch.rand(s * e + 2, B, H, device="cuda"))
    tab = torch.randperm(s * e + 2, device="cuda")[: s * e].view(s, e).int()
    nt = torch.full((s, e), cb.slot_tokens, dtype=torch.int32, device="cuda")
    nt[0, -1] = max(1, cb.slot_tokens // 3)
    nt[1, 2] = 0
    seg = KVSegment(cb, tab, nt)
    q = torch.randn(s, HQ, D, device="cuda", dtype=torch.bfloat16)
    r = decode_attention_reference(q, [seg])
    o = decode_attention(q, [seg], backend="triton")
    mass = float((o.block_mass[0] - r.block_mass[0]).abs().max())
    return max(rel(o.out.float(), r.out.float()), float((o.lse - r.lse).abs().max()) / 10, mass)


def _sweep_specs(specs: list[str] | None) -> list[tuple]:
    """(format, config) pairs to time: the given `FMT[:key=value...]` specs, or SWEEP_SPECS."""
    from proxima.compression import triton_attention as ta

    return [ta.parse_decode_spec(x) for x in specs or SWEEP_SPECS]


def sweep(out_dir: str, shapes_only: bool = False, specs: list[str] | None = None) -> None:
    """Time every config of `_sweep_specs` at 32k x 8, keep the best per format, then time the
    best configs at the issue's shapes against SDPA (`shapes_only`: the shipped DECODE_CONFIGS at
    the shapes). Writes sweep.json after every format and shape, so a run stopped by a fault (a
    CUDA error kills the process's context) keeps what it measured."""
    from proxima.compression import triton_attention as ta

    res: dict = {"configs": [], "shapes": [], "best": {}}

    def save() -> None:
        with open(os.path.join(out_dir, "sweep.json"), "w") as f:
            json.dump(res, f, indent=1)

    todo = [] if shapes_only else _sweep_specs(specs)
    res["specs"] = [f"{f}:{c}" for f, c in todo]
    for fmt in dict.fromkeys(f for f, _ in todo):
        shipped = ta.DECODE_CONFIGS[fmt]
        q, seg, moved, _ = _decode_case(32768, 8, fmt)
        best = None
        for cfg in [c for f, c in todo if f == fmt]:
            ta.DECODE_CONFIGS[fmt] = cfg
            row = {
                "format": fmt, "tokens": cfg.tokens, "warps": cfg.num_warps, "stages": cfg.num_stages,
                "variant": cfg.variant,
            }  # fmt: skip
            try:
                row["check_err"] = _small_check(fmt)
                ms = bench_ms(lambda q=q, seg=seg: decode_attention(q, [seg], backend="triton"), graph=True, rep=100)
                row.update(time_us=ms * 1e3, gbps=moved / ms / 1e6)
                key = ta._launch_key(seg, q, cfg)
                row.update(ta.KERNEL_INFO.get(key, {}))
                row["splits"] = ta.plan_splits(q, seg, None)
                if row["check_err"] < 2e-2 and (best is None or ms < best[0]):
                    best = (ms, cfg)
            except Exception as e:  # keep going: one config that fails to compile must not stop the sweep
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            res["configs"].append(row)
            print(f"  sweep {row}", flush=True)
        ta.DECODE_CONFIGS[fmt] = shipped if best is None else best[1]  # no config passed: keep the shipped one
        if best is not None:
            b = best[1]
            res["best"][fmt] = [b.tokens, b.num_warps, b.num_stages, b.variant, best[0] * 1e3]
        del q, seg
        torch.cuda.empty_cache()
        save()
    for ctx, batch in [(4096, 1), (32768, 8), (32768, 32), (131072, 8)]:
        q, seg, moved, (k, v) = _decode_case(ctx, batch, "bf16")
        per_seq = ctx // B
        kc = k.view(batch, per_seq, B, H, D).permute(0, 3, 1, 2, 4).reshape(batch, H, ctx, D).contiguous()
        vc = v.view(batch, per_seq, B, H, D).permute(0, 3, 1, 2, 4).reshape(batch, H, ctx, D).contiguous()
        qs = q.unsqueeze(2)
        sdpa_ms = bench_ms(
            lambda qs=qs, kc=kc, vc=vc: torch.nn.functional.scaled_dot_product_attention(qs, kc, vc, enable_gqa=True),
            graph=True,
        )
        del kc, vc, k, v
        row = {"context": ctx, "batch": batch, "sdpa_us": sdpa_ms * 1e3}
        for fmt in SWEEP_FORMATS:
            q, seg, moved, _ = _decode_case(ctx, batch, fmt)
            ms = bench_ms(lambda q=q, seg=seg: decode_attention(q, [seg], backend="triton"), graph=True)
            row[fmt] = ms * 1e3
            row[fmt + "_gbps"] = moved / ms / 1e6
            del q, seg
            torch.cuda.empty_cache()
        res["shapes"].append(row)
        print(f"  shape {row}", flush=True)
        save()


def profile_one(spec: str) -> None:
    """Five decode launches of one format (`FMT[:key=value...]`, see `parse_decode_spec`) at 32k x 8,
    for `ncu --launch-skip 2 --launch-count 1`."""
    from proxima.compression import triton_attention as ta

    fmt, cfg = ta.parse_decode_spec(spec)
    ta.DECODE_CONFIGS[fmt] = cfg
    q, seg, _, _ = _decode_case(32768, 8, fmt)
    for _ in range(5):
        decode_attention(q, [seg], backend="triton")
    torch.cuda.synchronize()


def fp8_diag() -> dict:
    """fp8 codes: the Triton quantizer against torch's, with the scale divided the old way (by a
    Python float, which CUDA turns into a reciprocal multiply) and the new way (true division)."""
    out = {}
    from proxima.compression import triton_ops

    k, _ = realistic_kv(256, 64, H, D, seed=5, device="cuda")
    tri = triton_ops.quantize(k, "fp8", 32, is_key=True)[0]
    xf = k.float()
    amax = xf.abs().amax(-1)
    for name, scale in (("python_float", amax / 448.0), ("true_div", ref._true_div(amax, 448.0))):
        y = xf * (1.0 / scale).unsqueeze(-1)
        codes = y.to(torch.float8_e4m3fn)
        out[name] = float((codes.view(torch.uint8) != tri.view(torch.uint8)).float().mean())
    out["scale_ulps_differ"] = float((amax / 448.0 != ref._true_div(amax, 448.0)).float().mean())
    return out


NCU_METRICS = [
    "Duration",
    "DRAM Throughput",
    "Compute (SM) Throughput",
    "Issue Slots Busy",
    "Registers Per Thread",
    "Theoretical Occupancy",
    "Achieved Occupancy",
    "Active Warps Per Scheduler",
    "Eligible Warps Per Scheduler",
    "Warp Cycles Per Issued Instruction",
    "Executed Instructions",
    "Grid Size",
    "L2 Hit Rate",
]


def _ncu_summary(text: str) -> dict:
    """The NCU_METRICS lines and the shared-memory bank-conflict notes of an `ncu --set full` report."""
    import re

    out: dict = {}
    for name in NCU_METRICS:
        m = re.search(r"^\s+" + re.escape(name) + r"\s+(\S+)?\s+([\d,.]+)\s*$", text, re.M)
        if m:
            out[name] = float(m.group(2).replace(",", ""))
    for kind in ("load", "store"):
        m = re.search(r"causes on average a ([\d.]+) - way bank\s+conflict across all (\d+) shared " + kind, text)
        if m:
            out[f"shared {kind} bank conflict ways"] = float(m.group(1))
    return out


def render_run(run_dir: str, out_dir: str, previous: str | None) -> None:
    """kernels-h200.{json,md} from a device run's files: sweep.json and sweep.log (`--sweep`),
    ncu_<fmt>.txt (`ncu --set full ... --profile <fmt>`), pytest.log, env.txt and, if the run's
    commands differ from the usual ones, commands.txt (one per line, notes too). Rows that run
    did not measure (compress, decompress, quality) are carried from `previous` (an earlier
    kernels-h200.json) with its date, labelled as such."""
    import ast

    def read(name: str) -> str:
        path = os.path.join(run_dir, name)
        if not os.path.exists(path):
            return ""
        with open(path) as f:
            return f.read()

    sw = json.loads(read("sweep.json"))
    env = read("env.txt").strip().splitlines()
    diag_line = [x for x in read("sweep.log").splitlines() if x.startswith("fp8 diag ")]
    times = {
        (r["context"], r["batch"]): {k: v for k, v in r.items() if k in SWEEP_FORMATS} | {"sdpa": r["sdpa_us"]}
        for r in sw["shapes"]
    }
    prev = None
    if previous:
        with open(previous) as f:
            prev = json.load(f)
    # a run's own JSON has "rows"; a rendered kernels-h200.json carries them on as "previous_rows"
    prev_all = (prev.get("rows") or prev.get("previous_rows", [])) if prev else []
    prev_rows = [r for r in prev_all if r["op"] in ("copy", "compress", "decompress", "quality")]
    meta = {
        "gpu": env[1].split(",")[0] if len(env) > 1 else "?",
        "driver": env[1].split(",")[-1].strip() if len(env) > 1 else "?",
        "torch_triton": env[2] if len(env) > 2 else "?",
        "date": datetime.datetime.fromtimestamp(
            os.path.getmtime(os.path.join(run_dir, "sweep.json")), datetime.UTC
        ).isoformat(timespec="seconds"),
        "commands": read("commands.txt").strip().splitlines()
        or [
            "PYTHONPATH=. python3 bench/kernels.py --sweep --out $OUT",
            "ncu --clock-control none --set full -k regex:_decode_kernel --launch-skip 2 --launch-count 1 "
            "python3 bench/kernels.py --profile {int4,bf16,fp8}",
            "python3 -m pytest -q tests/compression/test_quant.py -k 'triton_matches_reference and fp8'",
            f"python bench/kernels.py --render RUN_DIR --previous OLD_JSON --out {out_dir}",
        ],
        "shape": {"q_heads": HQ, "kv_heads": H, "head_dim": D, "block_size": B},
        "note": "decode rows from the --sweep run; copy / compress / decompress / quality rows from the run of "
        + (prev["meta"].get("date", "?") if prev else "nobody (no --previous)"),
        "previous_run": prev["meta"] if prev else None,
    }
    result = {
        "meta": meta,
        "targets": compress_targets(prev_rows) + decode_targets(times),
        "decode": sw["shapes"],
        "decode_config_sweep": sw["configs"],
        "decode_best_config": sw["best"],
        "ncu": {f: _ncu_summary(read(f"ncu_{f}.txt")) for f in ("bf16", "fp8", "int4") if read(f"ncu_{f}.txt")},
        "fp8_diag": ast.literal_eval(diag_line[0][len("fp8 diag ") :]) if diag_line else None,
        "gpu_pytest": read("pytest.log").strip().splitlines()[-1:],
        "bytes_per_token_head": bytes_per_token_head(),
        "previous_rows": prev_rows,
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "kernels-h200.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, "kernels-h200.md"), "w") as f:
        f.write(render_markdown(result))


def render_markdown(r: dict) -> str:
    m = r["meta"]
    lines = [f"# Proxima decode kernels on the {m['gpu']}", ""]
    lines += [f"{m['torch_triton']} (torch, triton), driver {m['driver']}, {m['date']}.", "", m["note"] + ".", ""]
    lines += ["Commands:", ""] + [f"    {c}" for c in m["commands"]] + [""]
    lines += ["## Issue 15 targets", "", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {x['target']} | {_fmt_value(x['value'])} | {'yes' if x['met'] else 'no'} |" for x in r["targets"]]
    lines += ["", "Decode values are at 32k x 8 / 32k x 32 / 128k x 8 (4k x 1 row: fp8 / int8 / int4 / int2).", ""]
    lines += [
        "## Decode attention (32 q heads, 8 KV heads, D 128, block 64, shuffled slots; CUDA-graph medians, us)",
        "",
    ]
    lines += ["| context x batch | SDPA bf16 | Proxima bf16 | fp8 | int8 | int4 | int2 | bf16 GB/s | int4 GB/s |"]
    lines += ["|---|---|---|---|---|---|---|---|---|"]
    for d in r["decode"]:
        lines.append(
            f"| {d['context'] // 1024}k x {d['batch']} | {d['sdpa_us']:.1f} | {d['bf16']:.1f} | {d['fp8']:.1f} | "
            f"{d['int8']:.1f} | {d['int4']:.1f} | {d['int2']:.1f} | {d['bf16_gbps']:.0f} | {d['int4_gbps']:.0f} |"
        )
    lines += ["", "## Launch configurations at 32k x 8 (tokens per iteration, warps, stages)", ""]
    lines += ["| format | tokens | warps | stages | variant | us | GB/s | regs | spills | progs/SM | splits | err |"]
    lines += ["|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in r["decode_config_sweep"]:
        if "time_us" in c:
            lines.append(
                f"| {c['format']} | {c['tokens']} | {c['warps']} | {c['stages']} | {c.get('variant', False)} | "
                f"{c['time_us']:.1f} | "
                f"{c['gbps']:.0f} | {c.get('regs', '')} | {c.get('spills', '')} | {c.get('occupancy', '')} | "
                f"{c['splits']} | {c['check_err']:.1e} |"
            )
    lines += [
        "",
        "## Nsight Compute (one launch at 32k x 8; the launch configs are in the commands)",
        "",
    ]
    keys = [k for k in NCU_METRICS if any(k in v for v in r["ncu"].values())]
    keys += ["shared load bank conflict ways", "shared store bank conflict ways"]
    lines += ["| metric | " + " | ".join(r["ncu"]) + " |", "|---|" + "---|" * len(r["ncu"])]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(f"{v.get(k, '')}" for v in r["ncu"].values()) + " |")
    lines += ["", "## Bytes per token per KV head (keys + values + metadata, D 128, block 64, group 32)", ""]
    lines += ["| format | bytes | of which metadata | bf16 / format |", "|---|---|---|---|"]
    lines += [
        f"| {b['format']} | {b['bytes']:.1f} | {b['meta_bytes']:.1f} | {b['vs_bf16']:.2f}x |"
        for b in r["bytes_per_token_head"]
    ]
    if r["fp8_diag"]:
        d = r["fp8_diag"]
        lines += ["", "## fp8 codes, Triton vs torch on the GPU (fraction of codes that differ)", ""]
        lines += [
            f"- reference scale `amax / 448.0` (CUDA: times the reciprocal): {d['python_float']:.2e}",
            f"- reference scale by true division (`reference._true_div`): {d['true_div']:.2e} (the sign of zero; "
            "fixed since, see docs/compression.md)",
            f"- rows whose scale differs by an ulp between the two: {d['scale_ulps_differ']:.0%}",
        ]
    if r["gpu_pytest"]:
        lines += ["", f"GPU pytest: {r['gpu_pytest'][0]}"]
    if r["previous_rows"]:
        lines += ["", f"## Compress / decompress, from the previous run ({m['previous_run']['date']})", ""]
        lines += ["| op | format | time_us | GB/s | % of copy |", "|---|---|---|---|---|"]
        for x in r["previous_rows"]:
            if x["op"] in ("compress", "decompress") and "gbps" in x:
                lines.append(
                    f"| {x['op']} | {x['format']} | {x['time_us']:.1f} | {x['gbps']:.0f} | "
                    f"{100 * x['gbps'] / x['copy_gbps']:.0f}% |"
                )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--quick", action="store_true", help="small shapes only (smoke run)")
    ap.add_argument("--sweep", action="store_true", help="time decode launch configs; write sweep.json")
    ap.add_argument("--shapes-only", action="store_true", help="with --sweep: the shipped configs at the shapes only")
    ap.add_argument("--profile", metavar="SPEC", help="run five decodes of FMT[:key=value...] at 32k x 8 (for ncu)")
    ap.add_argument("--configs", nargs="+", metavar="SPEC", help="with --sweep: these FMT[:key=value...] configs")
    ap.add_argument("--render", metavar="RUN_DIR", help="write kernels-h200.{json,md} from a --sweep run's files")
    ap.add_argument("--previous", help="with --render: an earlier kernels-h200.json for the rows not re-measured")
    ap.add_argument(
        "--only",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="parts to run (the GPU checks and the copy roofline always run); e.g. --only compress",
    )
    args = ap.parse_args()
    if args.render:
        render_run(args.render, args.out, args.previous)
        return 0
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.profile:
        profile_one(args.profile)
        return 0
    if args.sweep:
        os.makedirs(args.out, exist_ok=True)
        print("fp8 diag", fp8_diag(), flush=True)
        print(f"SM clock {sm_clock_mhz()} MHz, after the warm-up {warm_clocks()} MHz", flush=True)
        sweep(args.out, shapes_only=args.shapes_only, specs=args.configs)
        return 0
    t0 = time.time()
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "shape": {"q_heads": HQ, "kv_heads": H, "head_dim": D, "block_size": B},
    }
    print("checks ...", flush=True)
    try:
        meta["checks"] = checks()
    except Exception as e:
        traceback.print_exc()
        meta["checks"] = [{"op": "checks", "format": "-", "ok": False, "error": f"{type(e).__name__}: {e}"[:500]}]
    for r in meta["checks"]:
        print(f"  {r['op']} {r['format']} ok={r['ok']}", flush=True)
    meta["sm_clock_mhz"] = {"before_warmup": sm_clock_mhz(), "after_warmup": warm_clocks()}
    meta["copy_gbps"] = copy_bandwidth()
    print(f"copy {meta['copy_gbps']:.0f} GB/s  ({time.time() - t0:.0f}s)", flush=True)
    rows = [
        {
            "op": "copy",
            "format": "bf16",
            "context": 0,
            "batch": 0,
            "time_us": 0.0,
            "gbps": meta["copy_gbps"],
            "copy_gbps": meta["copy_gbps"],
        }
    ]
    meta["parts"] = args.only
    if "compress" in args.only:
        rows += compress_rows(meta["copy_gbps"], 64 if args.quick else 1024)
        print(f"compress done ({time.time() - t0:.0f}s)", flush=True)
    if "decode" in args.only:
        rows += decode_rows(meta["copy_gbps"], [(4096, 1), (32768, 2)] if args.quick else DECODE_SHAPES)
        print(f"decode done ({time.time() - t0:.0f}s)", flush=True)
    if "quality" in args.only:
        rows += quality_rows()
    try:
        tg = targets([r for r in rows if "error" not in r])
    except Exception as e:
        traceback.print_exc()
        tg = [{"target": "evaluation failed", "value": float("nan"), "met": False, "error": str(e)}]
    meta["elapsed_s"] = time.time() - t0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kernels-h200.json"), "w") as f:
        json.dump({"meta": meta, "targets": tg, "rows": rows}, f, indent=1)
    md = markdown(meta, rows, tg)
    with open(os.path.join(args.out, "kernels-h200.md"), "w") as f:
        f.write(md)
    print(md)
    return 0 if all(r["ok"] for r in meta["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
