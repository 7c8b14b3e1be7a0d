"""What one `WorkerStore.apply` dispatches, per (source, target) format group, at two layer counts.

For each policy, every transition its ladders make (bf16 -> the first rung, each rung -> the next
it can be recompressed into) is one group. On synthetic caches laid out as vLLM 0.32 lays them
out (one backing allocation, layer views at a fixed stride), blocks are first brought into each
group's source format (not counted), then one `apply` per group runs under `OpCounter`
(`bench/op_counter.py`): torch ops dispatched, Triton/numba launches, would-be GPU syncs. The
product's code runs, nothing is copied. Issue 37's targets: the same count at both layer counts,
<= 64 ops + launches and <= 4 device kernels per group (probe off), no would-be sync. On CUDA the
profiler's kernel count ("CUDA kernels") also holds the uploads' copies (memcpy HtoD).

    PYTHONPATH=$PWD .venv/bin/python bench/step_ops.py --name step-ops-cpu  # CPU, torch reference
    TRITON_INTERPRET=1 PYTHONPATH=$PWD .venv/bin/python bench/step_ops.py --kernels triton \
        --name step-ops-cpu-triton                                           # CPU, the Triton kernels
    PYTHONPATH=$PWD python bench/step_ops.py --device cuda --layers 32 --heads 8 --block-size 32 \
        --head-dim 128 --name step-ops-h200                                  # the 8B shape, on a GPU

On CUDA it also times each group's apply (CUDA events), counts the kernels the torch profiler
sees, and runs the apply under `torch.cuda.set_sync_debug_mode("error")` (a sync raises).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from bench.common import machine_info, write_results
from bench.op_counter import Counts, OpCounter
from proxima.formats import HOT, Format, recompressible
from proxima.integration.vllm.plan import ActionId, CompressAction, ProximaPlan
from proxima.integration.vllm.worker.store import WorkerStore
from proxima.placement import BlockId, SlotIndex
from proxima.policy.loader import load_policy
from proxima.policy.schema import Policy

POLICIES = ("conservative", "balanced", "aggressive")


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    block_size: int
    head_dim: int
    blocks: int = 64


def stacked_caches(shape: Shape, device: str, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Per-layer `[N, H, B, 2D]` caches as views of one allocation, layer-outermost (vLLM 0.32's
    `allocate_kv_cache`), named as vLLM names attention layers."""
    s = shape
    gen = torch.Generator().manual_seed(0)
    buf = torch.randn(s.layers, s.blocks, s.heads, s.block_size, 2 * s.head_dim, generator=gen).to(dtype)
    buf = buf.to(device)
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(s.layers)}


def transitions(policy: Policy, direct: bool = False) -> list[tuple[Format, Format]]:
    """(source, target) of every step the policy's ladders take, first compressions first.
    `direct`: also a hot block straight to every rung, as the planner writes a cold block once,
    on the rung it would end on (on the CPU capacity workload most of aggressive's blocks go
    bf16 -> cluster(8)+int4 in one step)."""
    out: list[tuple[Format, Format]] = []
    for band in policy.bands:
        ladder = band.ladder
        firsts = ladder if direct else ladder[:1]
        steps = [(HOT, f) for f in firsts] + [(a, b) for a, b in itertools.pairwise(ladder) if recompressible(a, b)]
        for t in steps:
            if t not in out:
                out.append(t)
    return out


def accepting_probe(policy: Policy) -> Policy:
    """`policy` with its compression probe on but a bound no block exceeds: every block is measured
    once in its chosen format and accepted, so a group's work does not depend on random data's
    verdicts (a refusal measures milder formats too)."""
    probe = policy.probes.compression.model_copy(update={"max_error": {}, "default_max_error": 1e9})
    return policy.model_copy(update={"probes": policy.probes.model_copy(update={"compression": probe})})


class _Slots:
    """Hands out destination slots: blocks of one format hold `pack_ratio` slots each."""

    def __init__(self, first_free: int, limit: int) -> None:
        self.next_block, self.limit = first_free, limit
        self.open: dict[Format, tuple[int, int]] = {}

    def take(self, fmt: Format) -> tuple[int, int]:
        blk, used = self.open.get(fmt, (-1, fmt.pack_ratio))
        if used == fmt.pack_ratio:
            if self.next_block >= self.limit:
                raise ValueError("step_ops: too few blocks for the plan; raise --blocks")
            blk, used = self.next_block, 0
            self.next_block += 1
        self.open[fmt] = (blk, used + 1)
        return blk, used


class Workload:
    """A store over stacked caches and, per group, one plan of `per_group` actions ready to apply."""

    def __init__(self, policy: Policy, shape: Shape, device: str, per_group: int,
                 kernels: Literal["torch", "triton"] = "torch", direct: bool = False) -> None:
        self.store = WorkerStore()
        self.store.cpu_kernels = kernels  # (CUDA always runs the Triton kernels)
        self.caches = stacked_caches(shape, device)
        self.store.register(self.caches, policy)
        self.store.adopt(policy, 1)
        # The engine's warm-up (`attention/triton.py` `warm_up` -> `slot_pool_of`) allocates every
        # stored format's pool before the first step: a step's count does not include it.
        for stored in self.store.stored_formats():
            self.store.slot_pool(stored)
        self.groups = transitions(policy, direct)
        n_src = len(self.groups) * per_group
        self.slots = _Slots(first_free=n_src, limit=shape.blocks)
        self._aid = 0
        q_gen = torch.Generator().manual_seed(1)
        setup: list[CompressAction] = []
        self.plans: list[ProximaPlan] = []
        for g, (src, dst) in enumerate(self.groups):
            acts = []
            for j in range(per_group):
                rid, block = f"g{g}-{j}", g * per_group + j
                window = policy.importance.observation_window
                queries = torch.randn(window, shape.heads, shape.head_dim, generator=q_gen)
                self.store.recent_queries.add(rid, queries.to(device), shape.head_dim ** -0.5)
                if src.is_hot:
                    acts.append(self._action(rid, dst, src=block))
                    continue
                first = self._action(rid, src, src=block)
                setup.append(first)
                acts.append(self._action(rid, dst, from_=first))
            self.plans.append(ProximaPlan(actions=acts))
        self._apply_all(setup)
        self._setup_remap = copy.deepcopy(self.store.remap)

    def reset(self) -> None:
        """Point every block back where the setup left it, so a group's plan can be applied again
        (after an apply, a recompressed block's current format is its target)."""
        self.store.remap = copy.deepcopy(self._setup_remap)
        self.store.replaced = {}

    def apply(self, g: int) -> None:
        """One uncounted apply of group g (warm-up: Triton compiles and autotunes on first use)."""
        self.reset()
        self.store.apply(self.plans[g])
        self._settle()
        self.store.take_report()

    def _settle(self) -> None:
        """Wait for the device (outside any count): the compression probe's verdicts are read when
        their errors have arrived (`WorkerStore.settle_probes` never waits), so on a GPU a report
        taken at once can miss them, and they would land in the next group's report."""
        if next(iter(self.caches.values())).is_cuda:
            torch.cuda.synchronize()

    def _action(self, rid: str, fmt: Format, src: int = -1, from_: CompressAction | None = None) -> CompressAction:
        blk, slot = self.slots.take(fmt)
        self._aid += 1
        if from_ is None:
            return CompressAction(ActionId(self._aid), rid, 0, src=BlockId(src), dst=BlockId(blk),
                                  slot=SlotIndex(slot), fmt=fmt)
        return CompressAction(ActionId(self._aid), rid, 0, src=BlockId(-1), dst=BlockId(blk), slot=SlotIndex(slot),
                              fmt=fmt, from_fmt=from_.fmt, from_dst=from_.dst, from_slot=from_.slot)

    def _apply_all(self, actions: list[CompressAction]) -> None:
        self.store.apply(ProximaPlan(actions=actions))
        self._settle()
        rep = self.store.take_report()
        if actions and (rep is None or rep.failed or len(rep.ok) != len(actions)):
            raise RuntimeError(f"step_ops: the setup compressions did not all commit: {rep}")

    def apply_counted(self, g: int) -> Counts:
        self.reset()
        with OpCounter() as c:
            self.store.apply(self.plans[g])
        self._settle()
        rep = self.store.take_report()
        if rep is None or rep.failed or len(rep.ok) + len(rep.rejected) != len(self.plans[g].actions):
            raise RuntimeError(f"step_ops: group {g} did not run as planned: {rep}")
        return c.counts


def cuda_extras(work: Workload, g: int) -> dict[str, Any]:
    """Time, kernels seen by the profiler, and the sync check of one more apply of group g."""
    from torch.profiler import ProfilerActivity, profile

    plan = work.plans[g]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    work.reset()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    work.store.apply(plan)
    end.record()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    work.store.take_report()
    work.reset()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        work.store.apply(plan)
        torch.cuda.synchronize()
    work.store.take_report()
    kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    sync_error = ""
    work.reset()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        work.store.apply(plan)
    except RuntimeError as e:
        sync_error = str(e).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()  # (the probe's verdicts of this apply belong to its own report)
    rep = work.store.take_report()
    if rep is not None and rep.errors and not sync_error:
        sync_error = rep.errors[-1]  # apply catches kernel errors and reports them
    return {"cuda_ms": start.elapsed_time(end), "wall_ms": wall_ms, "cuda_kernels": kernels, "sync_error": sync_error}


def without_probe(policy: Policy) -> Policy:
    """`policy` with its compression probe off (the compression's own work alone)."""
    probe = policy.probes.compression.model_copy(update={"enabled": False})
    return policy.model_copy(update={"probes": policy.probes.model_copy(update={"compression": probe})})


def measure(policy_name: str, shape: Shape, device: str, per_group: int, probe: bool = True,
            kernels: Literal["torch", "triton"] = "torch", direct: bool = False) -> list[dict[str, Any]]:
    policy = load_policy(policy_name)
    work = Workload(accepting_probe(policy) if probe else without_probe(policy), shape, device, per_group, kernels,
                    direct)
    rows = []
    for g, (src, dst) in enumerate(work.groups):
        if device == "cuda":
            work.apply(g)  # compile and autotune outside the count
        counts = work.apply_counted(g)
        row: dict[str, Any] = {
            "policy": policy_name, "probe": probe, "kernels": "triton" if device == "cuda" else kernels,
            "layers": shape.layers, "group": f"{src.name}->{dst.name}",
            "actions": per_group, "ops": counts.total_ops, "launches": counts.total_launches,
            "syncs": counts.total_syncs, "sync_ops": dict(counts.syncs), "uploads": counts.uploads,
            "device_kernels": counts.device_kernels,
            "kernel_ops": {**dict(counts.kernels), **dict(counts.launches)},
            "top_ops": dict(counts.ops.most_common(8)),
        }
        if device == "cuda":
            row.update(cuda_extras(work, g))
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    cuda = any("cuda_ms" in r for r in rows)
    head = ("| policy | probe | kernels | group | layers | actions | torch ops | launches | device kernels | uploads |"
            " would-be syncs |")
    head += " CUDA ms | CUDA kernels | sync check |" if cuda else ""
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        probe = "on" if r["probe"] else "off"
        line = (f"| {r['policy']} | {probe} | {r.get('kernels', 'torch')} | {r['group']} | {r['layers']} | "
                f"{r['actions']} | {r['ops']} | "
                f"{r['launches']} | {r.get('device_kernels', '-')} | {r.get('uploads', '-')} | {r['syncs']} |")
        if cuda:
            line += f" {r['cuda_ms']:.2f} | {r['cuda_kernels']} | {r['sync_error'] or 'ok'} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


ROLES = {
    "aten.index_select": "gather of sources (pages or slots, all layers) / the slots' side-table fields",
    "aten.index": "gather of sources through a layer-row index / a page-order permutation (`split_pages`)",
    "aten.clone": "`.contiguous()` of a permuted gather / the source log-counts copied (`decompress_blocks`)",
    "aten.index_copy_": "scatter of codes and side-table fields into the destination slots",
    "aten.index_put_": "scatter through a layer-row index",
    "aten.zeros": "log-counts of a source that has none (`decompress_blocks`)",
    "aten.ones": "uniform token importance of unobserved blocks (host on a GPU: `importance_of`)",
    "aten.clamp_min": "importance clamp (host, `importance_of`) and the k-means weights (device)",
    "aten.repeat": "per-action importance repeated for every layer",
    "aten.exp": "counts from the source's log-counts (`_row_counts`)",
    "aten.gt": "re-merge rank score (`compress_blocks`)",
    "aten.where": "re-merge rank score (`compress_blocks`)",
    "aten.scalar_tensor": "the where's scalars (CPU only: on a GPU they are wrapped numbers)",
    "aten.stack": "the probe's observation queries",
}
"""What each kernel-launching op of a group does (the classification table's legend)."""


def breakdown(rows: list[dict[str, Any]]) -> str:
    """Device kernels by op, per group and probe setting at the first layer count (the count is
    the same at every layer count; `test_step_ops.py` asserts it), and the legend of the ops."""
    first = min(r["layers"] for r in rows)
    lines = ["| policy | probe | group | device kernels | by op (torch ops, then Triton launches) |",
             "|---|---|---|---|---|"]
    for r in rows:
        if r["layers"] != first or "kernel_ops" not in r:
            continue
        ops = ", ".join(f"{k.removeprefix('aten.')} {v}" for k, v in r["kernel_ops"].items())
        probe = "on" if r["probe"] else "off"
        lines.append(f"| {r['policy']} | {probe} | {r['group']} | {r['device_kernels']} | {ops} |")
    used = {k for r in rows for k in r.get("kernel_ops", {}) if k in ROLES}
    legend = "".join(f"- `{k.removeprefix('aten.')}`: {v}\n" for k, v in ROLES.items() if k in used)
    return "\n".join(lines) + "\n\n" + legend


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--per-group", type=int, default=2, help="actions per group")
    ap.add_argument("--probe", choices=["on", "off", "both"], default="both",
                    help="the compression-time probe: on (every block accepted), off, or a row of each")
    ap.add_argument("--kernels", choices=["torch", "triton"], default="torch",
                    help="compression kernels on CPU: the torch reference, or Triton (needs TRITON_INTERPRET=1)")
    ap.add_argument("--direct", action="store_true",
                    help="also a hot block straight to every rung (the planner's write-once path)")
    ap.add_argument("--name", default=None, help="write bench/results/NAME.{json,md}")
    args = ap.parse_args(argv)
    if args.device == "cpu" and args.kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--kernels triton on CPU runs the Triton interpreter: set TRITON_INTERPRET=1 before starting")
    rows = []
    for name in args.policies:
        for layers in args.layers:
            shape = Shape(layers, args.heads, args.block_size, args.head_dim, args.blocks)
            for probe in ([True, False] if args.probe == "both" else [args.probe == "on"]):
                rows.extend(measure(name, shape, args.device, args.per_group, probe, args.kernels, args.direct))
    md = table(rows) + "\n## Device kernels by op\n\n" + breakdown(rows)
    print(md)
    if args.name:
        payload = {"command": " ".join(sys.argv), "machine": machine_info(), "args": vars(args), "rows": rows}
        path = write_results(args.name, payload, f"# {args.name}\n\n`{payload['command']}`\n\n{md}")
        print(f"wrote {path}")
    else:
        print(json.dumps({"rows": len(rows)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
