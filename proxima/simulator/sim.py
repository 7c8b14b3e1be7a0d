"""A step-level simulation of a paged KV pool under a policy, against vanilla (no compression).

The model follows vLLM's scheduler closely enough to compare policies: requests arrive, wait
FIFO, are admitted when their prompt fits (prefill in one step), then decode one token per step;
each block of `block_size` tokens takes one physical block. When a decode step would need a block
that does not exist, the most recently admitted request is preempted (its blocks freed, it goes
back to the head of the queue and re-prefills later), as vLLM's recompute preemption does.

With a policy, the real decision engine runs every step on a snapshot of the pool (waiting
demand counts as pending blocks), and its actions are placed by the placement model the vLLM KV
manager uses (`proxima.placement`): per-request destinations, no in-place compression (a
compression needs a destination block; its source is freed once the copy is written, here at
once, in vLLM one step later), and admission keeps `DEST_RESERVE_BLOCKS` free while anything is
resident. The placement invariants are asserted after every step.

Block importance is synthetic and seeded: heavy-tailed (a few blocks take most attention) with
the sink block always important, and identical between the vanilla and the policy run.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from proxima.formats import HOT, Format
from proxima.placement import DEST_RESERVE_BLOCKS, BlockId, CounterPool, SlotIndex, SlotPacker, check_pool
from proxima.policy.engine import Decision, EngineState, decide
from proxima.policy.schema import Policy
from proxima.policy.snapshot import Snapshot, pool_pressure
from proxima.simulator.workload import RequestSpec


@dataclass(frozen=True)
class PoolConfig:
    total_blocks: int = 2048
    block_size: int = 16
    max_running: int = 256
    """vLLM's max_num_seqs."""
    max_steps: int = 200_000


@dataclass
class _Req:
    spec: RequestSpec
    index: int
    generated: int = 0
    admitted_at: int = -1
    prefill_step: int = -1
    importance: np.ndarray = field(default_factory=lambda: np.zeros(0))
    fmt_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int16))
    n_blocks: int = 0
    preemptions: int = 0
    hot: list[BlockId | None] = field(default_factory=list)
    """Physical block of each logical block; None once compressed (vLLM's null block)."""
    slots: dict[int, tuple[BlockId, SlotIndex]] = field(default_factory=dict)
    """Logical block -> its compressed slot (destination block, slot)."""

    @property
    def tokens(self) -> int:
        return self.spec.prompt_tokens + self.generated


@dataclass
class RunResult:
    label: str
    steps: int = 0
    peak_resident_requests: int = 0
    mean_resident_requests: float = 0.0
    preemptions: int = 0
    finished: int = 0
    decisions_by_format: dict[str, int] = field(default_factory=dict)
    compressions_skipped: int = 0
    compressions: int = 0
    """Compressions written (first ones and recompressions alike)."""
    blocks_compressed: int = 0
    """Distinct (request, block) pairs compressed at least once."""
    predicted_damage: float = 0.0
    peak_fragmentation_blocks: float = 0.0
    timeline_pressure: list[float] = field(default_factory=list)
    timeline_resident: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        return {
            "steps": self.steps,
            "peak_resident_requests": self.peak_resident_requests,
            "mean_resident_requests": round(self.mean_resident_requests, 3),
            "preemptions": self.preemptions,
            "finished": self.finished,
            "decisions_by_format": dict(sorted(self.decisions_by_format.items())),
            "compressions_skipped": self.compressions_skipped,
            "compressions": self.compressions,
            "compressions_per_block": round(self.compressions / max(1, self.blocks_compressed), 3),
            "predicted_damage": round(self.predicted_damage, 6),
            "peak_fragmentation_blocks": round(self.peak_fragmentation_blocks, 3),
        }


class SimulationError(RuntimeError):
    pass


class PoolExhausted(RuntimeError):
    """No free physical block for a request's next block: the scheduler must preempt."""


class Simulator:
    def __init__(self, pool: PoolConfig, policy: Policy | None, seed: int = 0, label: str = "") -> None:
        self.cfg = pool
        self.policy = policy if policy is not None and not policy.is_off else None
        self.seed = seed
        self.label = label or (policy.name if policy else "vanilla")
        self.formats: list[Format] = [HOT] + (self.policy.all_formats() if self.policy else [])
        self.fmt_index = {f: i for i, f in enumerate(self.formats)}

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.cfg.block_size)

    def _importance(self, req: _Req, n: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, req.index])
        imp = rng.lognormal(mean=0.0, sigma=1.5, size=n) / 100.0
        imp[0] = 1.0  # attention sink
        return imp

    def run(self, workload: list[RequestSpec], record_timeline: bool = False) -> RunResult:
        """Run the workload to completion; check accounting at the end."""
        self.start(workload, record_timeline)
        while not self.done:
            self.step()
        return self.finish()

    # -- stepping API (the runtime API's simulated backend drives these directly) ----------------
    def start(self, workload: list[RequestSpec], record_timeline: bool = False) -> None:
        cfg = self.cfg
        for spec in workload:
            need = self._blocks_for(spec.prompt_tokens + spec.output_tokens)
            if need > cfg.total_blocks:
                raise SimulationError(
                    f"request {spec.request_id} needs {need} blocks at full length, pool has {cfg.total_blocks}"
                )
        self.result = RunResult(self.label)
        self.pool = CounterPool(cfg.total_blocks)
        self.packer = SlotPacker(self.pool)
        self._arrivals = deque(sorted(workload, key=lambda r: (r.arrival, r.request_id)))
        # Requests not yet finished; finished ones are dropped, so an endless run stays bounded.
        self._reqs = {spec.request_id: _Req(spec, i) for i, spec in enumerate(workload)}
        self._next_index = len(workload)
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.state = EngineState()
        self.step_no = 0
        self.last_decision: Decision | None = None
        self._record = record_timeline
        self._resident_sum = 0
        self._decisions: Counter[str] = Counter()

    def add_requests(self, specs: list[RequestSpec]) -> None:
        """Offer more requests to a running simulation (they arrive at their `arrival` step)."""
        for spec in specs:
            self._reqs[spec.request_id] = _Req(spec, self._next_index)
            self._next_index += 1
            self._arrivals.append(spec)

    @property
    def pending_arrivals(self) -> int:
        """Requests offered but not arrived yet."""
        return len(self._arrivals)

    @property
    def done(self) -> bool:
        return not (self._arrivals or self.waiting or self.running)

    def step(self) -> None:
        """Advance one engine step: arrivals, the engine, decodes (with preemption), admissions."""
        cfg, pool, res = self.cfg, self.pool, self.result
        step = self.step_no
        if step >= cfg.max_steps:
            raise SimulationError(f"{self.label}: not finished after {cfg.max_steps} steps")
        while self._arrivals and self._arrivals[0].arrival <= step:
            self.waiting.append(self._reqs[self._arrivals.popleft().request_id])
        running, waiting = self.running, self.waiting

        # Blocks this step's decodes need (tail blocks that are full), plus the head of the queue.
        decode_need = sum(1 for r in running if r.tokens % cfg.block_size == 0)
        admit_need = self._blocks_for(waiting[0].tokens) if waiting else 0
        if self.policy is not None:
            self.state = self._engine_step(decode_need + admit_need)

        # Decode: one token per running request (not the ones admitted this step).
        for r in list(running):
            if r.prefill_step == step or r not in running:
                continue
            if r.tokens % cfg.block_size == 0:
                while True:
                    try:
                        self._append_block(pool, r)
                        break
                    except PoolExhausted:
                        victim = max(running, key=lambda x: (x.admitted_at, x.index))
                        self._preempt(pool, victim, running, waiting, res)
                        if victim is r:
                            break
                if r not in running:
                    continue
            r.generated += 1
            if r.generated >= r.spec.output_tokens:
                self._free_request(r)
                running.remove(r)
                del self._reqs[r.spec.request_id]
                res.finished += 1

        # Admission, FIFO, whole prompt in one prefill step.
        while waiting and len(running) < cfg.max_running:
            head = waiting[0]
            need = self._blocks_for(head.tokens)
            # With a policy, admission keeps a destination reserve (as the vLLM manager does):
            # a pool filled to its last block could never compress its way out.
            reserve = DEST_RESERVE_BLOCKS if self.policy is not None and running else 0
            if need > pool.num_free() - reserve:
                break
            waiting.popleft()
            head.admitted_at = step
            head.prefill_step = step
            cap = self._blocks_for(head.spec.prompt_tokens + head.spec.output_tokens)
            head.importance = self._importance(head, cap)
            head.fmt_ids = np.zeros(cap, dtype=np.int16)
            head.n_blocks = 0
            head.hot, head.slots = [], {}
            for _ in range(need):
                self._append_block(pool, head)
            running.append(head)

        resident = len(running)
        self._resident_sum += resident
        res.peak_resident_requests = max(res.peak_resident_requests, resident)
        res.peak_fragmentation_blocks = max(res.peak_fragmentation_blocks, self.packer.fragmentation_blocks())
        self.check()
        if self._record:
            res.timeline_pressure.append(pool_pressure(pool.num_free(), 0, cfg.total_blocks))
            res.timeline_resident.append(resident)
        self.step_no += 1
        res.steps = self.step_no
        res.mean_resident_requests = self._resident_sum / self.step_no
        res.decisions_by_format = dict(self._decisions)

    def finish(self) -> RunResult:
        self.check()
        if self.pool.num_free() != self.cfg.total_blocks:
            raise SimulationError(f"{self.label}: {self.cfg.total_blocks - self.pool.num_free()} blocks leaked")
        return self.result

    def check(self) -> None:
        """The placement invariants (`proxima.placement.model`), over the simulated requests."""
        self.packer.check({r.spec.request_id: r.slots.values() for r in self.running})
        hot = [b for r in self.running for b in r.hot if b is not None]
        check_pool(self.cfg.total_blocks, self.pool.free_ids(), self.pool.num_free(), hot, self.packer)

    def blocks_by_format(self) -> dict[str, int]:
        """Logical blocks currently resident, by format name."""
        counts: Counter[str] = Counter()
        for r in self.running:
            for fid in r.fmt_ids[: r.n_blocks]:
                counts[self.formats[int(fid)].name] += 1
        return dict(counts)

    def _append_block(self, pool: CounterPool, r: _Req) -> None:
        if pool.num_free() == 0:
            raise PoolExhausted("no free physical KV block")
        r.hot.append(pool.take())
        r.fmt_ids[r.n_blocks] = 0
        r.n_blocks += 1

    def _free_request(self, r: _Req) -> None:
        """A finished or preempted request: its hot blocks and its destinations go back."""
        self.pool.free([b for b in r.hot if b is not None])
        self.packer.release_request(r.spec.request_id)
        r.hot, r.slots = [], {}

    def _preempt(
        self, pool: CounterPool, victim: _Req, running: list[_Req], waiting: deque[_Req], res: RunResult
    ) -> None:
        self._free_request(victim)
        running.remove(victim)
        victim.n_blocks = 0
        victim.preemptions += 1
        res.preemptions += 1
        waiting.appendleft(victim)

    def _snapshot(self, pool: CounterPool, running: list[_Req], step: int, pending: int, queued: int = 0) -> Snapshot:
        cfg = self.cfg
        rs = [r for r in running if r.n_blocks > 0]
        counts = np.array([r.n_blocks for r in rs], dtype=np.int32)
        n = int(counts.sum())
        block_request = np.repeat(np.arange(len(rs), dtype=np.int32), counts)
        block_index = (np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)).astype(np.int32)
        tokens = np.full(n, cfg.block_size, dtype=np.int32)
        ends = np.cumsum(counts) - 1
        for j, r in enumerate(rs):  # the tail block may be partly filled
            tail = r.tokens - (r.n_blocks - 1) * cfg.block_size
            tokens[ends[j]] = min(tail, cfg.block_size)
        return Snapshot(
            total_blocks=cfg.total_blocks,
            free_blocks=pool.num_free(),
            block_size=cfg.block_size,
            request_ids=tuple(r.spec.request_id for r in rs),
            formats=tuple(self.formats),
            block_request=block_request,
            block_index=block_index,
            block_importance=np.concatenate([r.importance[: r.n_blocks] for r in rs]) if rs else np.zeros(0),
            block_format=np.concatenate([r.fmt_ids[: r.n_blocks] for r in rs]) if rs else np.zeros(0, np.int16),
            block_tokens=tokens,
            block_age=np.concatenate([r.n_blocks - np.arange(r.n_blocks) for r in rs]) if rs else np.zeros(0, np.int64),
            block_shared=np.zeros(n, dtype=bool),
            request_tokens=np.array([r.tokens for r in rs], dtype=np.int64),
            request_blocks=counts,
            request_prefill=np.array([r.prefill_step == step for r in rs], dtype=bool),
            pending_blocks=pending,
            queued_blocks=queued,
        )

    def set_policy(self, policy: Policy | None) -> None:
        """Swap the live policy between steps (formats it introduces join the format table)."""
        self.policy = policy if policy is not None and not policy.is_off else None
        for f in self.policy.all_formats() if self.policy else []:
            if f not in self.fmt_index:
                self.fmt_index[f] = len(self.formats)
                self.formats.append(f)

    def _engine_step(self, pending: int) -> EngineState:
        assert self.policy is not None
        # The queue behind its head (whose prompt is in `pending`): the demand still to come.
        queued = sum(self._blocks_for(r.tokens) for r in itertools.islice(self.waiting, 1, None))
        snap = self._snapshot(self.pool, self.running, self.step_no, pending, queued)
        decision = decide(snap, self.policy, self.state)
        self.last_decision = decision
        by_id = {r.spec.request_id: r for r in self.running}
        for action, dmg in zip(decision.actions, decision.damage, strict=True):
            r = by_id[action.request_id]
            i, fmt = action.block_index, action.to_format
            prev = self.formats[int(r.fmt_ids[i])]
            if not prev.is_hot and not self.policy.can_recompress(prev, fmt):
                continue  # the vLLM manager skips these too
            got = self.packer.reserve(action.request_id, fmt)
            if got is None:
                self.result.compressions_skipped += 1
                continue
            # The copy is written: the source goes back (vLLM frees it when the worker reports).
            if prev.is_hot:
                src = r.hot[i]
                assert src is not None, f"{action.request_id} block {i} is hot without a physical block"
                r.hot[i] = None
                self.pool.free([src])
            else:
                self.packer.release(action.request_id, *r.slots[i])
            r.slots[i] = got
            r.fmt_ids[i] = self.fmt_index[fmt]
            self._decisions[action.to_format.name] += 1
            self.result.compressions += 1
            self.result.blocks_compressed += prev.is_hot  # a block is hot until its first compression
            self.result.predicted_damage += float(dmg)
        return decision.state
