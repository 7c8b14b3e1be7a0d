"""Per-layer decode attention on a GPU (issue 38): the one-pass kernel vs vLLM's TRITON_ATTN kernel
and Proxima's split path, nothing compressed and a mixed batch, at the 8B shape.

Rows (each timed as CUDA-graph replays, median of `--iters`, and launches per call counted with
torch.profiler on one eager call):

* `vllm`: vLLM's `unified_attention` over every row, the whole context in bf16 pages;
* `one_pass`: `mixed_decode` from the device block table (nothing compressed / `--fraction` of
  every row's oldest blocks in `--format`);
* `one_pass, unsplit`: the same with every row's context in one program (`splits=1`: the kernel
  before the split; `one_pass` splits as `auto_splits` decides, its count in the JSON);
* `one_pass, without the lean reader` (nothing compressed, and formats other than int4h / int2h):
  the kernel compiled without `mixed_decode_lean.py` (`lean=False`), what carrying the lean
  formats' state costs every other format (the backend always compiles it in);
* `one_pass, observed layer` (mixed only): the same with the block log-sum-exp and the device
  importance update (`update_block_importance`), the observed layer's two launches;
* `[tiles]` / `[kernel]` (`--readers tiles kernel`): the compressed blocks read inside the kernel
  (`mixed_slots._slot_tile`) or by a kernel of their own first (`mixed_comp.py`; `--comp-warps`,
  `--comp-stages`: its num_warps / num_stages);
* `split` (mixed only): what the backend ran before: vLLM's kernel on every row, then
  `paged_attention` over the compressed rows (eager: it plans on the host).

    python bench/one_pass_decode.py [--batch 64 --context 4096 --formats int4 int4h --fractions 0.5]

`--formats` takes any format the one-pass kernel reads (`mixed_decode_pools.READS_QUANTS`: fp8,
int8, int4, int2 and the lean int4h / int2h, alone or under cluster(R) / sparse(R)).

Writes bench/results/one-pass-decode-<gpu>.{json,md} (command, commit, machine, versions, date).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _graph_ms(fn, iters: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _eager_ms(fn, iters: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _launches(fn) -> int:  # type: ignore[no-untyped-def]
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--formats", nargs="+", default=["int4"], help="formats of the compressed blocks")
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.5, 1.0],
                    help="share of each row's blocks compressed (1.0: all but the last)")
    ap.add_argument("--splits", nargs="*", type=int, default=[],
                    help="extra variants: these splits (0: auto) x --tiles x --warps")
    ap.add_argument("--tiles", nargs="*", type=int, default=[], help="extra variants: --splits x these tile_blocks")
    ap.add_argument("--warps", nargs="*", type=int, default=[4], help="extra variants: num_warps")
    ap.add_argument("--comp-tiles", nargs="*", type=int, default=[],
                    help="extra rows per compressed case: these comp_tile (blocks of a compressed tile)")
    ap.add_argument("--readers", nargs="+", default=["tiles"], choices=["tiles", "kernel"],
                    help="compressed_reader of every one_pass row: 'tiles' (inside the kernel), 'kernel' (a kernel "
                         "of their own, mixed_comp.py); with several, each row once per reader")
    ap.add_argument("--comp-warps", nargs="*", type=int, default=[],
                    help="extra rows per compressed case with the 'kernel' reader: these comp_warps")
    ap.add_argument("--comp-stages", nargs="*", type=int, default=[],
                    help="extra rows per compressed case with the 'kernel' reader: these comp_stages")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/one_pass_decode.py needs a CUDA GPU")
    try:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    except ImportError:  # a GPU machine without vLLM: the one-pass rows alone (no `vllm`, no split row)
        unified_attention = None

    from proxima.compression.blocks import CompressedBlocks, compress_blocks
    from proxima.compression.layer_stack import LayerStack
    from proxima.compression.layout import KVLayout, hot_store
    from proxima.compression.mixed_decode import auto_splits, mixed_decode, pool_descriptors, update_block_importance
    from proxima.compression.paged import PagedPlan, PagedRow, paged_attention, plan_rows
    from proxima.compression.spec import LEAN_BITS, SlotSpec
    from proxima.formats import DEFAULT_GROUP_SIZE, Format
    from proxima.integration.vllm.worker.block_table import DeviceBlockTable

    dev = torch.device("cuda")
    bsz, ctx, hq, h, d, bs = a.batch, a.context, a.heads, a.kv_heads, a.head_dim, a.block
    nblk = -(-ctx // bs)
    n_phys = 2 * bsz * nblk + 1  # vLLM's pages, then room for every row's blocks in any format
    torch.manual_seed(0)
    kv = torch.randn(n_phys, h, bs, 2 * d, device=dev, dtype=torch.bfloat16)
    tables = (1 + torch.arange(bsz * nblk, device=dev, dtype=torch.int32)).view(bsz, nblk)
    seq_lens = torch.full((bsz,), ctx, device=dev, dtype=torch.int32)
    qsl = torch.arange(bsz + 1, device=dev, dtype=torch.int32)
    slots = (tables[:, -1].long() * bs + (ctx - 1) % bs)
    q = torch.randn(bsz, hq, d, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    scale = d**-0.5
    hot = hot_store(kv, KVLayout.FLASH_ATTN, num_kv_heads=h, head_dim=d)
    kvt = kv.transpose(1, 2)
    key_cache, value_cache = kvt.split(d, dim=-1)
    descale = torch.ones(1, device=dev).expand(bsz, h)
    seg_out = torch.empty(bsz, hq, 16, d, device=dev, dtype=torch.float32)
    seg_m = torch.empty(bsz, hq, 16, device=dev, dtype=torch.float32)
    seg_s = torch.empty_like(seg_m)

    def vllm() -> None:
        unified_attention(q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=qsl, max_seqlen_q=1,
                          seqused_k=seq_lens, max_seqlen_k=ctx, softmax_scale=scale, causal=True,
                          window_size=(-1, -1), block_table=tables, softcap=0, q_descale=None,
                          k_descale=descale, v_descale=descale, seq_threshold_3D=8, num_par_softmax_segments=16,
                          softmax_segm_output=seg_out, softmax_segm_max=seg_m, softmax_segm_expsum=seg_s)

    table = DeviceBlockTable(bsz, nblk, n_phys, dev, kv_heads=h, max_batch=bsz)
    key_blocks = {int(b): f"r{i}" for i, b in enumerate(tables[:, -1].tolist())}
    table.update([], [], key_blocks)
    empty_desc = pool_descriptors({}, bs, dev)

    reader = a.readers[0]  # rows with nothing compressed: no compressed block, so the same work with either reader

    def one_pass(desc: torch.Tensor, splits: int | None = None, tb: int | None = None, nw: int | None = None,
                 lean: bool = True, ct: int | None = None, rd: str | None = None, cw: int | None = None,
                 cs: int | None = None) -> None:
        mixed_decode(q, out, kv, tables, seq_lens, qsl, slots, table.owner, table.entries, desc, sm_scale=scale,
                     splits=splits, tile_blocks=tb, num_warps=nw, key_group=DEFAULT_GROUP_SIZE, lean=lean,
                     comp_tile=ct, compressed_reader=rd or reader, comp_warps=cw, comp_stages=cs)

    def timed(name: str, case: str, fn, graph: bool = True) -> dict:  # type: ignore[no-untyped-def]
        row = {"row": name, "case": case, "ms": (_graph_ms if graph else _eager_ms)(fn, a.iters),
               "launches": _launches(fn)}
        print(f"{name:40s} {case:32s} {row['ms']:8.3f} ms  {row['launches']} launches", flush=True)
        return row

    variants = [("one_pass", None, None, None), ("one_pass, unsplit", 1, None, None)]
    variants += [(f"one_pass, splits={sp or 'auto'} tile_blocks={tb} warps={nw}", sp or None, tb, nw)
                 for sp in a.splits for tb in a.tiles for nw in a.warps]
    rows = [timed("vllm", "nothing compressed", vllm)] if unified_attention is not None else []
    rows += [timed(name, "nothing compressed", lambda sp=sp, tb=tb, nw=nw: one_pass(empty_desc, sp, tb, nw))
             for name, sp, tb, nw in variants]
    no_lean = "one_pass, without the lean reader"
    rows.append(timed(no_lean, "nothing compressed", lambda: one_pass(empty_desc, lean=False)))

    def mixed_case(fmt: Format, fraction: float) -> tuple[torch.Tensor, CompressedBlocks, dict]:
        """Every row's oldest blocks (never its last, which takes this step's token) in `fmt`,
        written by the product's kernels into the worker's slot pool over the same cache."""
        ncomp = min(int(nblk * fraction), nblk - 1)
        spec = SlotSpec(fmt, bs, d, h)
        stack = LayerStack({"layer": kv})
        slot_pool = stack.pool(fmt, spec)
        placed, remaps = [], []
        sid0 = (bsz * nblk + 1) * fmt.pack_ratio
        for r in range(bsz):
            src = tables[r, :ncomp].long()
            k, v = hot.k_data[src], hot.v_data[src]
            imp = torch.ones(ncomp, bs, h, device=dev) if fmt.reduction is not None else None
            cb = compress_blocks(fmt, k, v, token_importance=imp)
            stack.write(slot_pool, (0,), sid0 + r * ncomp + torch.arange(ncomp, device=dev), cb)
            rm = {}
            for j in range(ncomp):
                sid = int(sid0 + r * ncomp + j)
                rm[j] = (fmt, sid // fmt.pack_ratio, sid % fmt.pack_ratio)
                placed.append((f"r{r}", j, rm[j]))
            remaps.append(rm)
        table.update(placed, [], key_blocks)
        pool = slot_pool.at(0).blocks(cb.k_data.dtype, cb.v_data.dtype, kv.dtype)
        return pool_descriptors({table.code_of(fmt): pool}, bs, dev), pool, {"remaps": remaps, "ncomp": ncomp}

    ent, lse = table.observe_scratch(hq)
    first = True
    for fmt_name in a.formats:
        fmt = Format.parse(fmt_name)
        for fraction in a.fractions:
            desc, pool, info = mixed_case(fmt, fraction)
            case = f"{info['ncomp']}/{nblk} blocks {fmt}"
            for rd in a.readers:
                tag = f" [{rd}]" if len(a.readers) > 1 else ""
                rows += [timed(name + tag, case, lambda sp=sp, tb=tb, nw=nw, desc=desc, rd=rd: one_pass(desc, sp, tb,
                                                                                                        nw, rd=rd))
                         for name, sp, tb, nw in variants]
                if fmt.quant not in LEAN_BITS:  # (a lean code needs the reader)
                    rows.append(timed(no_lean + tag, case, lambda desc=desc, rd=rd: one_pass(desc, lean=False, rd=rd)))
            rows += [timed(f"one_pass, comp_tile={ct}", case, lambda desc=desc, ct=ct: one_pass(desc, ct=ct,
                                                                                                 rd="tiles"))
                     for ct in a.comp_tiles]
            rows += [timed(f"one_pass [kernel], comp_warps={cw}", case,
                           lambda desc=desc, cw=cw: one_pass(desc, rd="kernel", cw=cw)) for cw in a.comp_warps]
            rows += [timed(f"one_pass [kernel], comp_stages={cs}", case,
                           lambda desc=desc, cs=cs: one_pass(desc, rd="kernel", cs=cs)) for cs in a.comp_stages]
            if first:  # the observed layer and the old split path, once
                first = False

                def observed(desc: torch.Tensor = desc, rd: str = a.readers[-1]) -> None:
                    mixed_decode(q, out, kv, tables, seq_lens, qsl, slots, table.owner, table.entries, desc,
                                 sm_scale=scale, entry_lse=ent[:bsz], lse=lse[:bsz], key_group=DEFAULT_GROUP_SIZE,
                                 compressed_reader=rd)
                    update_block_importance(ent[:bsz], lse[:bsz], seq_lens, qsl, slots, table.owner,
                                            table.entries, table.imp_owner, table.importance, decay=0.9,
                                            aggregate="max", block_size=bs)

                plan = plan_rows([PagedRow(tables[r].tolist(), ctx, 1, info["remaps"][r]) for r in range(bsz)],
                                 bs).to(dev)

                def split(plan: PagedPlan = plan, pool: CompressedBlocks = pool, fmt: Format = fmt) -> None:
                    vllm()
                    paged_attention(q, plan, hot, {fmt: pool}, sm_scale=scale)

                rows.append(timed(f"one_pass, observed layer [{a.readers[-1]}]", case, observed))
                if unified_attention is not None:
                    rows.append(timed("split (eager)", case, split, graph=False))
            table.update([(f"r{r}", j, None) for r in range(bsz) for j in range(info["ncomp"])], [], key_blocks)
    gpu = torch.cuda.get_device_name().replace(" ", "-").lower()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    import triton

    try:
        import vllm as _vllm

        vllm_version = _vllm.__version__
    except ImportError:
        vllm_version = None

    meta = {"command": " ".join(sys.argv), "commit": commit.strip(), "machine": f"{gpu} {platform.node()}",
            "versions": {"torch": torch.__version__, "triton": triton.__version__, "vllm": vllm_version},
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "shape": {"batch": bsz, "context": ctx, "heads": hq, "kv_heads": h, "head_dim": d, "block": bs},
            "auto_splits": auto_splits(bsz, h, tables.shape[1], dev)}
    lines = ["| row | case | ms per layer (graph replay; split: eager) | launches |", "|---|---|---|---|"]
    lines += [f"| {r['row']} | {r['case']} | {r['ms']:.3f} | {r['launches']} |" for r in rows]
    print("\n".join(lines))
    res = ROOT / "bench" / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / f"one-pass-decode-{gpu}{a.tag}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    (res / f"one-pass-decode-{gpu}{a.tag}.md").write_text(f"{json.dumps(meta, indent=1)}\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
