"""Scheduler side: the KV manager that owns each request's compressed blocks and their memory.

`ProximaKVCacheManager` subclasses vLLM's `KVCacheManager`. vLLM constructs its manager inside
`Scheduler.__init__` with no config option, then hands it to the connector
(`bind_kv_cache_manager`); `install()` switches that instance's class to ours (patch 2 of
`_patches`' list; vLLM's version was checked by `plugin.register`) and attaches one `ProximaState` (`self.px`).

This module keeps vLLM's hooks (`allocate_slots`, `free`, `pop_blocks_for_free`), planning
(`build_plan`) and the commit (`apply_report`). What it knows per request is in the ledger
(`ledger.py`), where compressed blocks live in the placement model (`proxima.placement`, over
vLLM's block pool: `blocks.py`), what the policy engine sees in `snapshot.py`, admission estimates
in `admission.py`, counters in `stats.py`, pool usage and the accounting check in `pool_usage.py`,
compressions between plan and report in `in_flight.py`, the quality probes' requests in
`probe_state.py`, the rest of Proxima's per-engine state (releasing a request) in `state.py`.

Physical accounting (the invariants of `proxima.placement.model`, asserted by
`check_accounting`): every non-null block is either in vLLM's free queue or owned: referenced by
some request's `req_to_blocks` or held as a Proxima destination block. A compressed source is
replaced by the null block and freed only after the worker reported that its compressed copy was
written (two-phase commit).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from collections.abc import Set as AbstractSet

from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.request import Request

from proxima.integration.vllm.plan import (
    DISABLING_ERRORS,
    NO_BLOCK,
    ActionId,
    CompressAction,
    ProximaPlan,
    ProximaReport,
)
from proxima.integration.vllm.scheduler import admission, canary, drift, pool_usage, targets
from proxima.integration.vllm.scheduler.ledger import CompressedSlot, RequestEntry, expected_remap
from proxima.integration.vllm.scheduler.snapshot import build_snapshot, check_protected, finishing_requests
from proxima.integration.vllm.scheduler.state import ProximaState
from proxima.integration.vllm.scheduler.stats import summary
from proxima.placement import DEST_RESERVE_BLOCKS, BlockId, SlotIndex
from proxima.policy.backoff import Quota
from proxima.policy.engine import Action, decide
from proxima.policy.schema import Policy

logger = logging.getLogger("proxima.vllm")
CHECK_ENV = "PROXIMA_CHECK_ACCOUNTING"
"""`1`: assert the physical accounting invariant at every step (tests)."""


class ProximaKVCacheManager(KVCacheManager):
    """vLLM's KV manager plus Proxima's per-request compressed-block bookkeeping."""

    px: ProximaState
    """Set by install(); declared for type checkers."""

    def set_policy(self, policy: Policy, version: int | None = None) -> None:
        """Adopt a (validated) policy from the next planning step on (`ProximaState.adopt`)."""
        self.px.adopt(policy, version)

    # --- vLLM hooks -------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        px, rid = self.px, request.request_id
        # A drift holdout request is never compressed (`drift.py`): it is admitted as vLLM would.
        # Without the observer there is no drift probe, so no request is held out for it.
        sample = drift.assignment(rid, px.policy.probes.drift) \
            if px.probes.drift_observer and not canary.is_special(rid) else None
        holdout = sample == "holdout"
        if rid not in px.ledger and not px.policy.is_off and not px.disabled:
            if full_sequence_must_fit and not px.policy.protect.prefilling and not holdout:
                # vLLM admits a request only if its whole prompt fits uncompressed. When the policy
                # compresses finished chunks during prefill, the prompt never needs that: admit it
                # if its *compressed* footprint fits (and let the first chunk's allocation decide).
                # Prefix-cache hits hold shared blocks already (never compressed, no new block).
                # The request's expected end state (prompt and output) must fit beside what the
                # residents will still grow by (`admission.py`).
                full_sequence_must_fit = False
                hit = num_new_computed_tokens + request.num_computed_tokens
                end = admission.final_tokens(request, px.outputs, self.max_model_len)
                full = self.compressed_footprint(max(0, end - hit)) + self.resident_growth()
                full += getattr(self, "watermark_blocks", 0)  # vLLM's own headroom (0 by default)
                if not self._admits(full):
                    return None
            if px.emergency and px.in_flight:
                # Blocks an emergency compression frees belong to the running requests that
                # needed them: admitting new requests meanwhile would starve those.
                return None
            # Admission keeps a small reserve free: a compression needs a fresh destination
            # block, and a pool filled to the last block could never compress its way out.
            if not self._admits(admission.blocks_for(num_new_tokens + num_lookahead_tokens, self.block_size) + 1):
                return None
        out = super().allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
            num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens, full_sequence_must_fit,
            reserved_blocks, has_scheduled_reqs, skip_zeroing_group_ids)
        need = admission.blocks_for(num_new_tokens, self.block_size) + 1
        if out is None and rid not in px.ledger:
            # A waiting request that does not fit: its demand counts as pressure (pending blocks).
            px.waiting_need = max(px.waiting_need, need + DEST_RESERVE_BLOCKS)
            return None
        if out is not None:
            if rid not in px.ledger:
                entry = px.ledger[rid] = RequestEntry(request)
                if not canary.is_special(rid) and not holdout:
                    entry.target = targets.requested_ratio(request)
                    if entry.target is not None:
                        px.targets.add(rid)
                px.probes.admitted(rid, request.num_prompt_tokens, holdout=holdout)
                if sample is not None:  # one of the drift probe's two samples: observed
                    drift.tag(request)  # (in this step's scheduler output: before the worker sees it)
            return out
        # The allocation would fail: vLLM would now preempt. Plan an emergency compression;
        # has_pending_block_frees() then tells the scheduler to wait one step instead.
        if not px.in_flight and self._plan(pending_blocks=need):
            px.stats.emergencies += 1
            px.emergency = True
        return None

    def _admits(self, need: int) -> bool:
        """A new request of `need` blocks leaves `DEST_RESERVE_BLOCKS` free (with nothing resident
        the reserve is moot: never block a lone request); else its demand counts as pressure."""
        if self.px.ledger and self.block_pool.get_num_free_blocks() - need < DEST_RESERVE_BLOCKS:
            self.px.waiting_need = max(self.px.waiting_need, need + DEST_RESERVE_BLOCKS)
            return False
        return True

    def free(self, request: Request) -> None:
        if request.request_id in self.px.ledger and not request.is_finished():
            self.px.stats.preemptions += 1
        self.px.outputs.observe(request)
        self._drop_target(request.request_id)
        self.px.release(request.request_id)
        super().free(request)
        # The request's side-table bytes are gone: their held blocks go back now, not at the next
        # plan (an idle engine plans no more, and its pool must show nothing held).
        self._settle_side_tables()
        if self.px.on_change is not None:
            self.px.on_change()

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        self._drop_target(request.request_id)
        dests = self.px.release(request.request_id, free_now=False)
        blocks = super().pop_blocks_for_free(request) + self.px.blocks.blocks(dests)
        self._settle_side_tables()  # (as in `free`)
        return blocks

    # --- Proxima ------------------------------------------------------------------------------

    def compressed_footprint(self, tokens: int) -> int:
        """Blocks `tokens` tokens of a request hold once compressed (`admission.compressed_footprint`)."""
        px = self.px
        cost = admission.compressed_cost(px.ledger, px.policy, px.meta.block_cost)
        return admission.compressed_footprint(tokens, self.block_size, px.policy, cost)

    def resident_growth(self) -> int:
        """Blocks the resident requests will still take (`admission.resident_growth`)."""
        px = self.px
        return admission.resident_growth(px.ledger, self._stm.req_to_blocks, self.block_size, px.policy,
                                         px.meta.block_cost, px.outputs, self.max_model_len, px.probes.holdout)

    @property
    def block_size(self) -> int:
        return self._stm.block_size

    @property
    def _stm(self) -> SingleTypeKVCacheManager:
        return self.coordinator.single_type_managers[0]

    def has_pending(self) -> bool:
        return bool(self.px.in_flight)

    def _plan(self, pending_blocks: int = 0, finishing: AbstractSet[str] = frozenset(),
              quota: Quota | None = None) -> int:
        """Run the policy engine and reserve destinations for its actions; returns actions planned.
        `quota`: this step's allowance per format (shared by everything a step plans)."""
        px = self.px
        if px.policy.is_off or px.disabled:
            return 0
        # Canaries and their references are not the pressure's to compress (`canary.py`), nor is
        # the drift probe's holdout (`drift.py`).
        special = (canary.special_requests(px.ledger) if px.probes.canaries else set()) | px.probes.holdout
        restricted = px.backoff.restrict(px.policy, px.stats.steps)
        total = pool_usage.total_blocks(self.block_pool)
        # (no queue asks the pool for more than it holds at the harshest format: the sum stops there)
        held = int(total * max((f.pack_ratio for f in px.formats), default=1))
        queued = px.queue.blocks(self.block_size, len(px.ledger), held, head_counted=px.waiting_need > 0) \
            if px.queue is not None else 0
        px.stats.queued_blocks_peak = max(px.stats.queued_blocks_peak, queued)
        snap = build_snapshot(px.ledger, self._stm.req_to_blocks, self.block_pool, self.block_size,
                              pending_blocks, set(finishing) | special, px.probes.status, queued_blocks=queued)
        decision = decide(snap, restricted, px.engine)
        px.engine = decision.state
        actions = decision.actions
        if special:
            actions += canary.forced_actions(px.ledger, self._stm.req_to_blocks, self.block_pool, self.block_size,
                                             restricted, px.engine, finishing)
        return self._reserve(actions, quota or px.backoff.quota(px.stats.steps))

    def _reserve(self, actions: Iterable[Action], quota: Quota) -> int:
        """Reserve destinations for the engine's `actions` (in order; a block the probe capped
        takes its cap) and put them in flight; returns actions planned."""
        px = self.px
        planned = 0
        blocks_of = self._stm.req_to_blocks
        for act in actions:
            fmt = act.to_format
            if fmt not in px.formats or not quota.take(fmt.name):
                continue  # (px.formats: the live ladders' formats, which the engine picks from; a guard)
            entry = px.ledger[act.request_id]
            cap = entry.caps.get(act.block_index)
            if cap is not None and cap.pack_ratio < fmt.pack_ratio:
                # The probe measured this block over the bound in a harsher format: the milder one it accepted.
                levels = px.policy.fallback.levels
                level = levels[min(px.engine.fallback_level, len(levels) - 1)]
                if cap not in px.formats or not level.permits(cap) or not quota.take(cap.name):
                    continue
                fmt = cap
            if act.block_index in entry.in_flight:
                continue  # (one action per block at a time: `InFlight`'s invariant)
            src = blocks_of[act.request_id][act.block_index]
            prev = entry.compressed.get(act.block_index)
            if prev is None and (src.is_null or src.ref_cnt != 1):
                continue
            if prev is not None and not px.policy.can_recompress(prev.fmt, fmt):
                continue
            if px.check:
                protect = px.policy.protect  # (a live canary's prefill is not protected: `canary.forced_actions`)
                if canary.is_canary(act.request_id):
                    protect = protect.model_copy(update={"prefilling": False})
                check_protected(entry, act.block_index, len(blocks_of[act.request_id]), self.block_size, protect)
            res = px.packer.reserve(act.request_id, fmt)
            if res is None:
                break
            dst, slot = res
            if prev is None:
                ca = CompressAction(px.in_flight.next_id(), act.request_id, act.block_index, BlockId(src.block_id),
                                    dst, slot, fmt)
            else:
                ca = CompressAction(px.in_flight.next_id(), act.request_id, act.block_index, NO_BLOCK,
                                    dst, slot, fmt, prev.fmt, prev.block, prev.slot)
            in_prefill = entry.request.num_computed_tokens < entry.request.num_prompt_tokens
            px.in_flight.plan(ca, in_prefill=in_prefill)
            planned += 1
            px.stats.planned_in_prefill += in_prefill
        px.stats.planned += planned
        return planned

    def _plan_targets(self, finishing: AbstractSet[str], quota: Quota) -> None:
        """Plan the requests whose target is due (`targets.py`): every step, pending or not, and
        before the pressure's planning, so that a prompt is stored at its ratio before its first
        decode step's forward. A target ends when a round finds nothing more to do, after
        `MAX_ROUNDS` rounds that planned something, or after `MAX_TRIES` steps."""
        px = self.px
        if px.policy.is_off or px.disabled or not px.targets:
            return
        restricted = None
        blocks_of = self._stm.req_to_blocks
        for rid in list(px.targets):
            entry = px.ledger.get(rid)
            if entry is None or entry.target is None:
                px.targets.discard(rid)
                continue
            if rid in finishing or not targets.due(entry):
                continue
            if entry.target_rounds >= targets.MAX_ROUNDS or entry.target_tries >= targets.MAX_TRIES:
                self._target_done(entry)
                continue
            entry.target_tries += 1
            restricted = restricted or px.backoff.restrict(px.policy, px.stats.steps)
            actions = targets.plan(entry, blocks_of[rid], self.block_size, restricted, px.engine,
                                   px.probes.status, self.px.meta.held_block_bytes)
            if not actions:
                self._target_done(entry)
            elif self._reserve(actions, quota):
                entry.target_rounds += 1
            # (nothing reserved: no destination or no quota this step; tried again next step)

    def _drop_target(self, req_id: str) -> None:
        """A request leaving with its target still open: record what it reached so far."""
        entry = self.px.ledger.get(req_id)
        if entry is not None and entry.target is not None:
            self._target_done(entry)

    def _target_done(self, entry: RequestEntry) -> None:
        """Record what the target reached and stop planning it."""
        px = self.px
        if entry.target_blocks:
            px.stats.record_target(entry.request.request_id, entry.target or 0.0,
                                   targets.reached(entry, self.block_size, self.px.meta.held_block_bytes))
        entry.target = None
        px.targets.discard(entry.request.request_id)

    def build_plan(self, scheduled_req_ids: Iterable[str]) -> ProximaPlan:
        """Called at the end of each `schedule()`: this step's actions for the worker."""
        px = self.px
        t0 = time.perf_counter()
        side = self._settle_side_tables()
        px.stats.record_step(len(px.ledger), self.pool_usage, side)
        if px.check:
            self.check_accounting()
        scheduled_req_ids = list(scheduled_req_ids)
        finishing = finishing_requests(px.ledger, scheduled_req_ids)
        quota = px.backoff.quota(px.stats.steps)
        idle = not px.in_flight  # (the pressure plans only when nothing is in flight: decided before targets)
        self._plan_targets(finishing, quota)
        if idle:
            self._plan(pending_blocks=min(px.waiting_need, pool_usage.total_blocks(self.block_pool)),
                       finishing=finishing, quota=quota)
        px.waiting_need = 0
        out = px.in_flight.send()
        plan = ProximaPlan(
            actions=out.actions,
            dropped=out.dropped,
            scrub=list(px.blocks.take_scrub()),
            revoked=out.revoked,
            check_remap=expected_remap(px.ledger) if px.check else None,
        )
        plan.policy_version = px.policy_version
        if px.worker_version != px.policy_version:  # the worker applies it before this plan's work
            plan.policy, px.worker_version = px.policy, px.policy_version
        px.charge.settle(self.side_table_bytes())  # with this step's reservations in flight
        b = self.block_size
        blocks_of = self._stm.req_to_blocks
        for rid in scheduled_req_ids:
            entry = px.ledger.get(rid)
            if entry is None or (px.policy.is_off and not entry.compressed and not entry.in_flight):
                continue  # (a policy switched off live leaves compressed blocks to read)
            key = blocks_of[rid][entry.request.num_computed_tokens // b]
            plan.key_blocks[key.block_id] = rid
        px.stats.add_time("plan_s", time.perf_counter() - t0)
        return plan

    def apply_report(self, report: ProximaReport) -> None:
        """Second phase: commit successful compressions (free sources), undo failed ones; and
        take the worker's observed block importance."""
        px = self.px
        t0 = time.perf_counter()
        for name, seconds in report.timings.items():
            px.stats.add_time(name, seconds)
        px.stats.record_counts(report.step_counts)
        # (the backoff keys formats by name: its events become log lines and metric labels)
        fmt = {a.action_id: a.fmt.name for a in px.in_flight}  # before the commits below take them
        try:
            events = px.backoff.observe(px.stats.steps, [fmt[a] for a in report.ok if a in fmt],
                                        [fmt[a] for a in report.failed if a in fmt], (report.errors or [""])[-1],
                                        {f.name for f in px.formats})
        except Exception:  # the backoff only advises the planner: its bookkeeping never stops the engine
            logger.exception("proxima: the format backoff failed to take a report; formats keep their state")
            events = []
        for ev in events:
            logger.warning("proxima: %s", ev.message)  # one line per pause: growing intervals, not every step
        for rid, imp in report.importance.items():
            entry = px.ledger.get(rid)
            if entry is not None:
                px.stats.importance_updates += 1
                entry.observe(imp)
        to_free = [src for aid in report.ok if (src := self._commit(aid)) is not None]
        # The probe's verdicts are read while their actions are in flight; then every failure leaves
        # at once, latest slot first (`InFlight.fail`), so an open destination takes its slots back.
        for aid, milder in report.rejected.items():  # the probe refused: the block is as it was
            ca = px.in_flight.get(aid)
            if ca is not None and aid not in report.failed and milder != ca.fmt:
                # (its own format: not measured yet, planned again later; `HOT`: no format is within the bound)
                px.ledger[ca.req_id].caps[ca.index] = milder
        for ca in px.in_flight.fail([*report.failed, *report.rejected]):
            # (revoked by the next plan: under tensor parallelism another rank may have written it)
            px.packer.release(ca.req_id, ca.dst, SlotIndex(ca.slot), undo=True)
        px.stats.rejected += len(report.rejected)
        px.stats.failed += len(report.failed)
        if not px.disabled and (why := next((e for e in DISABLING_ERRORS if e in report.errors), None)):
            px.disabled = why
            logger.error("proxima: %s", why)
        if report.errors:
            px.stats.errors[:] = (px.stats.errors + report.errors)[-5:]  # bounded over any run
        if not px.in_flight:
            px.emergency = False
        if to_free:
            self.block_pool.free_blocks(to_free)
            px.stats.freed_blocks += len(to_free)
        self._settle_side_tables()  # the freed sources pay for the new slots' metadata first
        px.stats.add_time("commit_s", time.perf_counter() - t0)

    def _commit(self, aid: ActionId) -> KVCacheBlock | None:
        """The worker wrote `aid`: its block now lives in its slot. Returns the source block to
        free (None: a recompression, whose old slot is released here, or its request was freed)."""
        px = self.px
        done = px.in_flight.commit(aid)
        if done is None:
            return None  # its request was freed meanwhile; its blocks went with it
        ca = done.action
        px.ledger[ca.req_id].commit(ca.index, CompressedSlot(ca.fmt, ca.dst, ca.slot))
        px.stats.record_commit(ca.fmt, in_prefill=done.in_prefill, first=ca.from_fmt.is_hot)
        if not ca.from_fmt.is_hot:  # recompression: release the old slot
            px.packer.release(ca.req_id, ca.from_dst, ca.from_slot)
            return None
        blocks = self._stm.req_to_blocks[ca.req_id]
        src = blocks[ca.index]
        assert src.block_id == ca.src, (
            f"request {ca.req_id} block {ca.index} moved from {ca.src} to {src.block_id} while being "
            "compressed: this indicates a bug in Proxima's manager"
        )
        blocks[ca.index] = self.block_pool.null_block
        return src

    def side_table_bytes(self) -> int:
        """Side-table bytes of the committed slots plus the in-flight ones (the worker writes
        their metadata before the report arrives)."""
        px = self.px
        return px.meta.side_table_bytes(px.ledger) + sum(px.meta.per_slot(ca.fmt)
                                                         for ca in px.in_flight)

    def _settle_side_tables(self) -> int:
        """Hold back the pool blocks the side tables fill (`side_tables.py`); returns their bytes."""
        side = self.side_table_bytes()
        self.px.charge.settle(side)
        return side

    # --- views (pool_usage.py, stats.py) ---------------------------------------------------------

    def pool_usage(self) -> dict[str, float]:
        px = self.px
        return pool_usage.pool_usage(px.ledger, px.packer, self._stm.req_to_blocks, self.block_pool,
                                     len(px.charge.held))

    def blocks_by_format(self) -> dict[str, int]:
        return pool_usage.blocks_by_format(self.px.ledger, self._stm.req_to_blocks)

    def check_accounting(self) -> None:
        """The in-flight ledger's invariant (`InFlight.check`) and the placement invariants over
        vLLM's pool (`pool_usage.check_accounting`)."""
        px = self.px
        px.in_flight.check()  # (first: a ledger out of step with it would fail the slots' check, less clearly)
        pool_usage.check_accounting(px.ledger, px.packer, self._stm.req_to_blocks, self.block_pool, px.charge.ids())

    def summary(self) -> dict[str, object]:
        px = self.px
        out = summary(px.stats, px.ledger, px.packer, self.block_pool, px.meta, px.disabled, px.charge)
        out["backoff"] = px.backoff.summary(px.stats.steps)
        # What admission expects a request to output (None: no request finished yet).
        out["expected_output_tokens"] = None if px.outputs.mean is None else round(px.outputs.mean, 1)
        return out


def install(manager: KVCacheManager, policy: Policy, ranks: int = 1) -> ProximaKVCacheManager | None:
    """Turn vLLM's manager instance into a `ProximaKVCacheManager` (None if unsupported); `ranks`:
    the engine's tensor-parallel workers (`ranks.py`)."""
    if len(manager.coordinator.single_type_managers) != 1:
        logger.warning("proxima: %d KV cache groups (hybrid model); Proxima supports one and stays inactive",
                       len(manager.coordinator.single_type_managers))
        return None
    # Patch 2 (see _patches): a subclass that adds no __init__ state of vLLM's, so swapping the
    # live instance's class keeps every attribute where vLLM put it.
    if not isinstance(manager, KVCacheManager):
        raise TypeError(f"ProximaKVCacheManager extends KVCacheManager, vLLM built a {type(manager).__name__}")
    manager.__class__ = ProximaKVCacheManager
    m: ProximaKVCacheManager = manager  # type: ignore[assignment]
    m.px = ProximaState.create(policy, m.block_pool, m.kv_cache_config, check=os.environ.get(CHECK_ENV) == "1",
                                ranks=ranks)
    return m
