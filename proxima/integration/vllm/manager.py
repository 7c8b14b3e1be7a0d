"""Scheduler side: the KV manager that owns each request's compressed blocks and their memory.

`ProximaKVCacheManager` subclasses vLLM's `KVCacheManager`. vLLM constructs its manager inside
`Scheduler.__init__` with no config option, then hands it to the connector
(`bind_kv_cache_manager`); `install()` switches that instance's class to ours and adds our
state, so all of vLLM's own state stays where vLLM put it.

Physical accounting (the invariant `check_accounting` asserts): every non-null block is either
in vLLM's free queue or owned: referenced by some request's `req_to_blocks` or held as a
Proxima destination block. A compressed source is replaced by the null block and freed only
after the worker reported that its compressed copy was written (two-phase commit).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request

from proxima.compression.spec import SlotSpec
from proxima.formats import HOT, Format
from proxima.integration.vllm.plan import NO_READER, CompressAction, ProximaPlan, ProximaReport
from proxima.policy.backoff import FormatBackoff
from proxima.policy.engine import EngineState, decide
from proxima.policy.schema import Policy
from proxima.policy.snapshot import RequestBlocks, Snapshot

logger = logging.getLogger("proxima.vllm")
DEST_RESERVE_BLOCKS = 2
"""Free blocks that admitting a new request may not take (destinations for compression)."""
CHECK_ENV = "PROXIMA_CHECK_ACCOUNTING"
"""`1`: assert the physical accounting invariant at every step (tests)."""


def supported_formats(policy: Policy) -> set[Format]:
    """Formats the vLLM data path stores: every format of the ladders (quantized, sparse, cluster)."""
    fmts: set[Format] = set()
    for band in policy.bands:
        fmts.update(band.ladder)
    return fmts


def recompressible(policy: Policy, fmt: Format) -> bool:
    """A block can be recompressed (e.g. int8 -> int4) only if no layer dropped or merged its tokens."""
    if fmt.reduction is not None:
        return False
    return all(ov.substitute.get(fmt.name, fmt).reduction is None for ov in policy.layer_overrides)


UNMEASURED_IMPORTANCE = 1.0
"""Importance of a block the worker has not observed yet: all of its head's attention mass, so the
engine compresses measured blocks first (measured masses are fractions of 1)."""


def _importance(measured: list[float], n: int) -> list[float]:
    out = [UNMEASURED_IMPORTANCE] * n
    for i, x in enumerate(measured[:n]):
        if not math.isnan(x):
            out[i] = x
    return out


@dataclass
class _Dest:
    """A physical block holding up to `fmt.pack_ratio` compressed slots of one request."""

    block: KVCacheBlock
    fmt: Format
    next_slot: int = 0
    live: int = 0
    """Slots holding a committed or in-flight compressed block."""


@dataclass
class _ReqState:
    request: Request
    compressed: dict[int, tuple[Format, int, int]] = field(default_factory=dict)
    """Logical block index -> (format, destination block id, slot), committed."""
    in_flight: dict[int, CompressAction] = field(default_factory=dict)
    dests: dict[int, _Dest] = field(default_factory=dict)
    open: dict[Format, _Dest] = field(default_factory=dict)
    importance: list[float] = field(default_factory=list)
    """Attention mass of each logical block, as the worker last observed it (NaN: never)."""


@dataclass
class ProximaStats:
    steps: int = 0
    planned: int = 0
    committed: int = 0
    failed: int = 0
    emergencies: int = 0
    peak_running: int = 0
    running_sum: int = 0
    side_bytes_peak: int = 0
    preemptions: int = 0
    freed_blocks: int = 0
    importance_updates: int = 0
    """Requests whose block importance the worker reported (summed over steps)."""
    planned_in_prefill: int = 0
    """Compressions planned for requests whose prompt was still being prefilled (chunked prefill)."""
    committed_in_prefill: int = 0
    """... and of those, committed (the rest of the prompt then attended to them)."""
    committed_by_format: dict[str, int] = field(default_factory=dict)
    pool_at_peak: dict[str, float] = field(default_factory=dict)
    """Where the pool went at the (first) step of peak residency: hot blocks, destination
    blocks and their filled fraction, free blocks (what bounds the next resident request)."""
    errors: list[str] = field(default_factory=list)


class ProximaKVCacheManager(KVCacheManager):
    """vLLM's KV manager plus Proxima's per-request compressed-block bookkeeping."""

    # Set by install(); declared for type checkers.
    px_policy: Policy
    px_state: EngineState
    px_reqs: dict[str, _ReqState]
    px_pending: dict[int, CompressAction]
    px_dropped: list[str]
    px_scrub: list[int]
    """Destination blocks released since the last plan: they hold packed bytes (NaN as bf16)
    and go back to vLLM, whose CPU kernel reads whole blocks. The worker zeroes them first."""
    px_stats: ProximaStats
    px_formats: set[Format]
    px_ids: itertools.count
    px_check: bool
    _px_sent: set[int]
    """Action ids already sent to the worker (not sent again while in flight)."""
    px_meta_cache: dict[Format, int]
    px_on_change: Callable[[], None] | None
    px_emergency: bool
    px_waiting_need: int
    """Blocks the largest waiting request needed this step (counted as pressure)."""
    """An emergency compression is in flight: admit no new request until it commits."""
    """Called after a request's blocks were freed (the connector dumps its counters)."""
    px_effective: Policy
    """The policy with ladders restricted to the formats this data path stores."""
    px_disabled: str | None
    """Why compression stopped for good in this engine (the worker cannot read compressed blocks)."""
    px_prefill_actions: set[int]
    """Action ids planned while their request was in prefill (counted when they commit)."""
    px_backoff: FormatBackoff
    """Formats whose batches failed are left out of planning for a growing number of steps."""

    def px_set_policy(self, policy: Policy) -> None:
        """Adopt a (validated) policy; takes effect at the next planning step. Blocks already
        compressed keep their format, in-flight actions still commit."""
        self.px_policy = policy
        self.px_formats = supported_formats(policy)
        self.px_effective = policy.model_copy(update={"bands": [
            b.model_copy(update={"ladder": [f for f in b.ladder if f in self.px_formats]}) for b in policy.bands
        ]})
        dropped = {f.name for band in policy.bands for f in band.ladder} - {f.name for f in self.px_formats}
        if dropped:
            logger.warning("proxima: formats %s are not stored by the vLLM path yet and are skipped", sorted(dropped))

    # --- vLLM hooks -------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, *args, **kwargs) -> KVCacheBlocks | None:  # type: ignore[override]
        if request.request_id not in self.px_reqs and not self.px_policy.is_off and not self.px_disabled:
            if kwargs.get("full_sequence_must_fit") and not self.px_policy.protect.prefilling:
                # vLLM admits a request only if its whole prompt fits uncompressed. When the policy
                # compresses finished chunks during prefill, the prompt never needs that: admit it
                # if its *compressed* footprint fits (and let the first chunk's allocation decide).
                # Prefix-cache hits hold shared blocks already (never compressed, no new block).
                kwargs["full_sequence_must_fit"] = False
                hit = kwargs.get("num_new_computed_tokens", 0) + request.num_computed_tokens
                full = self.compressed_footprint(max(0, min(request.num_tokens, self.max_model_len) - hit))
                full += getattr(self, "watermark_blocks", 0)  # vLLM's own headroom (0 by default)
                if self.px_reqs and self.block_pool.get_num_free_blocks() - full < DEST_RESERVE_BLOCKS:
                    self.px_waiting_need = max(self.px_waiting_need, full + DEST_RESERVE_BLOCKS)
                    return None
            if self.px_emergency and self.px_pending:
                # Blocks an emergency compression frees belong to the running requests that
                # needed them: admitting new requests meanwhile would starve those.
                return None
            # Admission keeps a small reserve free: a compression needs a fresh destination
            # block, and a pool filled to the last block could never compress its way out.
            need = -(-(num_new_tokens + kwargs.get("num_lookahead_tokens", 0)) // self.block_size) + 1
            if self.px_reqs and self.block_pool.get_num_free_blocks() - need < DEST_RESERVE_BLOCKS:
                # (with nothing resident the reserve is moot: never block a lone request)
                self.px_waiting_need = max(self.px_waiting_need, need + DEST_RESERVE_BLOCKS)
                return None
        out = super().allocate_slots(request, num_new_tokens, *args, **kwargs)
        if out is None and request.request_id not in self.px_reqs:
            # A waiting request that does not fit: its demand counts as pressure (pending blocks).
            need = -(-num_new_tokens // self.block_size) + 1 + DEST_RESERVE_BLOCKS
            self.px_waiting_need = max(self.px_waiting_need, need)
            return None
        if out is not None:
            if request.request_id not in self.px_reqs:
                self.px_reqs[request.request_id] = _ReqState(request)
            return out
        # The allocation would fail: vLLM would now preempt. Plan an emergency compression;
        # has_pending_block_frees() then tells the scheduler to wait one step instead.
        need = -(-num_new_tokens // self.block_size) + 1
        if not self.px_pending and self._plan(pending_blocks=need):
            self.px_stats.emergencies += 1
            self.px_emergency = True
        return None

    def free(self, request: Request) -> None:
        if request.request_id in self.px_reqs and not request.is_finished():
            self.px_stats.preemptions += 1
        self._release_request(request.request_id)
        super().free(request)
        if self.px_on_change is not None:
            self.px_on_change()

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        dests = self._release_request(request.request_id, free_now=False)
        return super().pop_blocks_for_free(request) + dests

    # --- Proxima ------------------------------------------------------------------------------

    def compressed_footprint(self, tokens: int) -> int:
        """Blocks a request of `tokens` tokens holds once the policy compressed it under pressure:
        its protected blocks (sinks, recent window, hot tail) stay hot, the others compress as the
        resident requests' blocks did (`achieved_pack_ratio`); before any compression, as the
        first format of the highest band's ladder (what the engine picks first when memory is
        tightest)."""
        b, prot = self.block_size, self.px_policy.protect
        n = -(-tokens // b)
        hot = min(n, -(-prot.sink_tokens // b) + -(-prot.recent_tokens // b) + 1)
        ladder = self.px_effective.bands[-1].ladder if self.px_effective.bands else []
        ratio = self.achieved_pack_ratio()
        if ratio is None:
            ratio = ladder[0].pack_ratio if ladder else 1
        else:  # (a policy changed live to milder formats: no more than it can reach now)
            ratio = min(ratio, max((f.pack_ratio for b in self.px_effective.bands for f in b.ladder), default=1))
        return hot + math.ceil((n - hot) / ratio - 1e-9)

    def achieved_pack_ratio(self) -> float | None:
        """Compressed blocks per physical block they take, over the resident requests' committed
        blocks (None before any): the engine's actual mix of formats under this workload."""
        count, space = 0, 0.0
        for st in self.px_reqs.values():
            for fmt, _, _ in st.compressed.values():
                count += 1
                space += 1.0 / fmt.pack_ratio
        return count / space if count else None

    @property
    def block_size(self) -> int:
        return self._stm.block_size

    @property
    def _stm(self):  # type: ignore[no-untyped-def]
        return self.coordinator.single_type_managers[0]

    def has_pending(self) -> bool:
        return bool(self.px_pending)

    def _release_request(self, req_id: str, *, free_now: bool = True) -> list[KVCacheBlock]:
        st = self.px_reqs.pop(req_id, None)
        if st is None:
            return []
        for aid in list(st.in_flight.values()):
            self.px_pending.pop(aid.action_id, None)
        self.px_dropped.append(req_id)
        blocks = [d.block for d in st.dests.values()]
        self._give_back(blocks, free_now=free_now)
        return blocks

    def _give_back(self, dests: list[KVCacheBlock], *, free_now: bool = True) -> None:
        """The one way destination blocks return to vLLM: listed for the worker to zero first
        (`ProximaPlan.scrub`), then freed (now, or by vLLM's deferred-free path)."""
        self.px_scrub.extend(b.block_id for b in dests)
        if free_now and dests:
            self.block_pool.free_blocks(dests)

    def _reserve_slot(self, st: _ReqState, fmt: Format) -> tuple[_Dest, int] | None:
        dest = st.open.get(fmt)
        if dest is None or dest.next_slot >= fmt.pack_ratio:
            if self.block_pool.get_num_free_blocks() < 1:
                return None
            block = self.block_pool.get_new_blocks(1)[0]
            dest = _Dest(block, fmt)
            st.dests[block.block_id] = dest
            st.open[fmt] = dest
        slot = dest.next_slot
        dest.next_slot += 1
        dest.live += 1
        return dest, slot

    def _unreserve(self, st: _ReqState, dst: int) -> None:
        dest = st.dests[dst]
        dest.live -= 1
        if dest.live == 0 and (dest.next_slot >= dest.fmt.pack_ratio or dest.next_slot == 0):
            del st.dests[dst]
            if st.open.get(dest.fmt) is dest:
                del st.open[dest.fmt]
            self._give_back([dest.block])

    def snapshot(self, pending_blocks: int = 0, finishing: AbstractSet[str] = frozenset()
                 ) -> tuple[Snapshot, list[_ReqState]]:
        """The pool and every resident request's blocks for the policy engine; requests in
        `finishing` are left out (none of their blocks is eligible)."""
        b = self.block_size
        reqs: list[RequestBlocks] = []
        states: list[_ReqState] = []
        req_to_blocks = self._stm.req_to_blocks
        for rid, st in self.px_reqs.items():
            blocks = req_to_blocks.get(rid)
            if not blocks or rid in finishing:
                continue
            r = st.request
            computed = r.num_computed_tokens
            n = len(blocks)
            tokens = [max(0, min(b, computed - i * b)) for i in range(n)]
            formats = [st.compressed[i][0] if i in st.compressed else HOT for i in range(n)]
            shared = [
                (i in st.in_flight) or (i not in st.compressed and blocks[i].ref_cnt > 1) for i in range(n)
            ]
            reqs.append(
                RequestBlocks(
                    request_id=rid,
                    importance=_importance(st.importance, n),
                    formats=formats,
                    tokens=tokens,
                    shared=shared,
                    in_prefill=computed < r.num_prompt_tokens,
                )
            )
            states.append(st)
        snap = Snapshot.build(
            total_blocks=self.block_pool.num_gpu_blocks - 1,
            free_blocks=self.block_pool.get_num_free_blocks(),
            block_size=b,
            requests=reqs,
            pending_blocks=pending_blocks,
        )
        return snap, states

    def _plan(self, pending_blocks: int = 0, finishing: AbstractSet[str] = frozenset()) -> int:
        """Run the policy engine and reserve destinations for its actions; returns actions planned."""
        if self.px_policy.is_off or self.px_disabled:
            return 0
        snap, _ = self.snapshot(pending_blocks, finishing)
        decision = decide(snap, self.px_backoff.restrict(self.px_effective, self.px_stats.steps), self.px_state)
        self.px_state = decision.state
        planned = 0
        blocks_of = self._stm.req_to_blocks
        quota = self.px_backoff.quota(self.px_stats.steps)  # after failures: small probe batches
        for act in decision.actions:
            fmt = act.to_format
            if fmt not in self.px_formats or not quota.take(fmt.name):
                continue  # (px_formats: filtered out of the ladders by install(); kept as a guard)
            st = self.px_reqs[act.request_id]
            src = blocks_of[act.request_id][act.block_index]
            prev = st.compressed.get(act.block_index)
            if prev is None and (src.is_null or src.ref_cnt != 1):
                continue
            if prev is not None and (
                    prev[0].pack_ratio >= fmt.pack_ratio or not recompressible(self.px_policy, prev[0])):
                continue
            if self.px_check:
                self._check_protected(st, act.block_index)
            res = self._reserve_slot(st, fmt)
            if res is None:
                break
            dest, slot = res
            if prev is None:
                ca = CompressAction(next(self.px_ids), act.request_id, act.block_index, src.block_id,
                                    dest.block.block_id, slot, fmt.name)
            else:
                ca = CompressAction(next(self.px_ids), act.request_id, act.block_index, -1,
                                    dest.block.block_id, slot, fmt.name, prev[0].name, prev[1], prev[2])
            st.in_flight[act.block_index] = ca
            self.px_pending[ca.action_id] = ca
            planned += 1
            if st.request.num_computed_tokens < st.request.num_prompt_tokens:
                self.px_stats.planned_in_prefill += 1
                self.px_prefill_actions.add(ca.action_id)
        self.px_stats.planned += planned
        return planned

    def _check_protected(self, st: _ReqState, index: int) -> None:
        """DESIGN.md invariants, re-checked on every action (tests): never the hot tail, never a
        protected window, never a block not fully computed, nor one of a request still in prefill
        unless the policy allows it (`protect.prefilling: false`)."""
        b, prot = self.block_size, self.px_policy.protect
        r = st.request
        n = len(self._stm.req_to_blocks[r.request_id])
        ok = (
            index < n - 1
            and index * b >= prot.sink_tokens
            and (index + 1) * b <= r.num_computed_tokens - prot.recent_tokens
            and (r.num_computed_tokens >= r.num_prompt_tokens or not prot.prefilling)
        )
        if not ok:
            raise AssertionError(
                f"proxima would compress block {index} of {r.request_id} ({n} blocks, "
                f"{r.num_computed_tokens} computed, protect={prot}): this indicates a bug in the engine's eligibility"
            )

    def build_plan(self, scheduled_req_ids: Iterable[str]) -> ProximaPlan:
        """Called at the end of each `schedule()`: this step's actions for the worker."""
        self.px_stats.steps += 1
        if len(self.px_reqs) > self.px_stats.peak_running or not self.px_stats.pool_at_peak:
            self.px_stats.pool_at_peak = self.pool_usage()
        self.px_stats.peak_running = max(self.px_stats.peak_running, len(self.px_reqs))
        self.px_stats.running_sum += len(self.px_reqs)
        self.px_stats.side_bytes_peak = max(self.px_stats.side_bytes_peak, self.side_table_bytes())
        if self.px_check:
            self.check_accounting()
        scheduled_req_ids = list(scheduled_req_ids)
        if not self.px_pending:
            self._plan(pending_blocks=min(self.px_waiting_need, self.block_pool.num_gpu_blocks - 1),
                       finishing=self._finishing(scheduled_req_ids))
        self.px_waiting_need = 0
        plan = ProximaPlan(
            actions=[a for a in self.px_pending.values() if a.action_id not in self._px_sent],
            dropped=self.px_dropped,
            scrub=self.px_scrub,
        )
        self._px_sent.update(a.action_id for a in plan.actions)
        self.px_dropped = []
        self.px_scrub = []
        b = self.block_size
        blocks_of = self._stm.req_to_blocks
        for rid in scheduled_req_ids:
            st = self.px_reqs.get(rid)
            if st is None or (self.px_policy.is_off and not st.compressed and not st.in_flight):
                continue  # (a policy switched off live leaves compressed blocks to read)
            blocks = blocks_of[rid]
            key = blocks[st.request.num_computed_tokens // b]
            plan.key_blocks[key.block_id] = rid
        return plan

    def _finishing(self, scheduled_req_ids: Iterable[str]) -> set[str]:
        """Scheduled requests that decode their last token this step (`max_tokens`; a stop string
        or EOS cannot be foreseen). vLLM frees a request that finished in a step before it applies
        the step's connector report, so compressing their blocks would be wasted work. (A request
        recomputing after preemption is not decoding: `num_computed_tokens` is behind.)"""
        out = set()
        for rid in scheduled_req_ids:
            st = self.px_reqs.get(rid)
            r = st.request if st is not None else None
            if r is not None and r.num_computed_tokens == r.num_tokens - 1 and r.num_output_tokens + 1 >= r.max_tokens:
                out.add(rid)
        return out

    def apply_report(self, report: ProximaReport) -> None:
        """Second phase: commit successful compressions (free sources), undo failed ones; and
        take the worker's observed block importance."""
        fmt = {aid: ca.fmt for aid, ca in self.px_pending.items()}  # before the commits below pop them
        for ev in self.px_backoff.observe(self.px_stats.steps, [fmt[a] for a in report.ok if a in fmt],
                                          [fmt[a] for a in report.failed if a in fmt], (report.errors or [""])[-1],
                                          {f.name for f in self.px_formats}):
            logger.warning("proxima: %s", ev.message)  # one line per pause: growing intervals, not every step
        for rid, imp in report.importance.items():
            st = self.px_reqs.get(rid)
            if st is not None:
                self.px_stats.importance_updates += 1
                # A block the worker could not see this step (compressed) keeps its last value.
                old = st.importance
                st.importance = [old[i] if math.isnan(x) and i < len(old) else x for i, x in enumerate(imp)]
        blocks_of = self._stm.req_to_blocks
        null = self.block_pool.null_block
        to_free: list[KVCacheBlock] = []
        for aid in report.ok:
            ca = self.px_pending.pop(aid, None)
            self._px_sent.discard(aid)
            if ca is None:
                continue  # its request was freed meanwhile; its blocks went with it
            st = self.px_reqs[ca.req_id]
            st.in_flight.pop(ca.index, None)
            st.compressed[ca.index] = (Format.parse(ca.fmt), ca.dst, ca.slot)
            self.px_stats.committed += 1
            if aid in self.px_prefill_actions:
                self.px_stats.committed_in_prefill += 1
            self.px_stats.committed_by_format[ca.fmt] = self.px_stats.committed_by_format.get(ca.fmt, 0) + 1
            if ca.from_fmt != HOT.name:  # recompression: release the old slot
                self._unreserve(st, ca.from_dst)
                continue
            blocks = blocks_of[ca.req_id]
            src = blocks[ca.index]
            assert src.block_id == ca.src, (
                f"request {ca.req_id} block {ca.index} moved from {ca.src} to {src.block_id} while being "
                "compressed: this indicates a bug in Proxima's manager"
            )
            blocks[ca.index] = null
            to_free.append(src)
        self.px_prefill_actions.difference_update(report.ok)
        self.px_prefill_actions.difference_update(report.failed)
        failed = [self.px_pending.pop(aid, None) for aid in report.failed]
        self.px_stats.failed += len(report.failed)
        self._px_sent.difference_update(report.failed)
        # Latest slots first, so that an open destination can take its failed slots back.
        for ca in sorted((c for c in failed if c is not None), key=lambda c: (c.dst, -c.slot)):
            st = self.px_reqs[ca.req_id]
            st.in_flight.pop(ca.index, None)
            dest = st.dests[ca.dst]
            if st.open.get(dest.fmt) is dest and dest.next_slot - 1 == ca.slot:
                dest.next_slot -= 1
            self._unreserve(st, ca.dst)
        if NO_READER in report.errors and not self.px_disabled:
            self.px_disabled = NO_READER
            logger.error("proxima: %s", NO_READER)
        if report.errors:
            self.px_stats.errors[:] = (self.px_stats.errors + report.errors)[-5:]  # bounded over any run
        if not self.px_pending:
            self.px_emergency = False
        if to_free:
            self.block_pool.free_blocks(to_free)
            self.px_stats.freed_blocks += len(to_free)

    def pool_usage(self) -> dict[str, float]:
        """Blocks held hot (shared prefix blocks once), in destinations (and the fraction of their
        slots holding a live compressed block: the rest is packing headroom), and free."""
        null = self.block_pool.null_block
        blocks_of = self._stm.req_to_blocks
        hot = {b.block_id for rid in self.px_reqs for b in blocks_of.get(rid, ()) if b is not null}
        dests = [d for st in self.px_reqs.values() for d in st.dests.values()]
        slots = sum(d.fmt.pack_ratio for d in dests)
        return {"resident": len(self.px_reqs), "hot": len(hot), "dest": len(dests),
                "dest_fill": round(sum(d.live for d in dests) / slots, 3) if slots else 0.0,
                "free": self.block_pool.get_num_free_blocks()}

    def side_table_bytes(self) -> int:
        """Metadata bytes (scales, zero points) of the live compressed slots, all layers.

        They live outside vLLM's KV pool, so an honest capacity comparison adds them to it.
        """
        total = 0
        for st in self.px_reqs.values():
            for fmt, _, _ in st.compressed.values():
                total += self._meta_per_slot(fmt)
        return total

    def _meta_per_slot(self, fmt: Format) -> int:
        cached = self.px_meta_cache.get(fmt)
        if cached is None:
            spec = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec
            layers = len(self.kv_cache_config.kv_cache_groups[0].layer_names)
            ss = SlotSpec(fmt, spec.block_size, spec.head_size, spec.num_kv_heads)  # type: ignore[attr-defined]
            cached = self.px_meta_cache[fmt] = ss.meta_bytes_per_slot * layers
        return cached

    def owned_blocks(self) -> set[int]:
        owned: set[int] = set()
        for blocks in self._stm.req_to_blocks.values():
            owned.update(b.block_id for b in blocks if not b.is_null)
        for st in self.px_reqs.values():
            owned.update(st.dests)
        return owned

    def check_accounting(self) -> None:
        """free + owned == total, and no block both free and owned (no leak, no double free)."""
        pool = self.block_pool
        total = pool.num_gpu_blocks - 1
        owned = self.owned_blocks()
        free_ids = {b.block_id for b in pool.blocks if b.ref_cnt == 0 and not b.is_null}
        both = owned & free_ids
        if both or len(owned) + pool.get_num_free_blocks() != total or len(free_ids) != pool.get_num_free_blocks():
            raise AssertionError(
                f"proxima accounting broken: owned={len(owned)} free={pool.get_num_free_blocks()} "
                f"(ref_cnt==0: {len(free_ids)}) total={total}, owned and free: {sorted(both)[:10]}"
            )

    def summary(self) -> dict[str, object]:
        s = self.px_stats
        nslots = sum(len(st.compressed) for st in self.px_reqs.values())
        ndest = sum(len(st.dests) for st in self.px_reqs.values())
        return {
            "steps": s.steps, "planned": s.planned, "committed": s.committed, "failed": s.failed,
            "emergencies": s.emergencies, "freed_blocks": s.freed_blocks,
            "importance_updates": s.importance_updates, "planned_in_prefill": s.planned_in_prefill,
            "committed_in_prefill": s.committed_in_prefill, "disabled": self.px_disabled,
            "committed_by_format": dict(s.committed_by_format),
            "peak_resident": s.peak_running, "pool_at_peak": dict(s.pool_at_peak),
            "mean_resident": s.running_sum / max(1, s.steps), "preemptions": s.preemptions,
            "resident_now": len(self.px_reqs),
            "side_table_peak_bytes": s.side_bytes_peak,
            "block_bytes": self.kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
            * len(self.kv_cache_config.kv_cache_groups[0].layer_names),
            "compressed_slots_now": nslots, "dest_blocks_now": ndest,
            "free_blocks": self.block_pool.get_num_free_blocks(), "total_blocks": self.block_pool.num_gpu_blocks - 1,
            "errors": s.errors[-3:], "backoff": self.px_backoff.summary(s.steps),
        }


def install(manager: KVCacheManager, policy: Policy) -> ProximaKVCacheManager | None:
    """Turn vLLM's manager instance into a `ProximaKVCacheManager` (None if unsupported)."""
    if len(manager.coordinator.single_type_managers) != 1:
        logger.warning("proxima: %d KV cache groups (hybrid model); Proxima supports one and stays inactive",
                       len(manager.coordinator.single_type_managers))
        return None
    manager.__class__ = ProximaKVCacheManager
    m: ProximaKVCacheManager = manager  # type: ignore[assignment]
    m.px_state = EngineState()
    m.px_reqs = {}
    m.px_pending = {}
    m.px_dropped = []
    m.px_scrub = []
    m.px_stats = ProximaStats()
    m.px_set_policy(policy)
    m.px_ids = itertools.count()
    m.px_meta_cache = {}
    m.px_on_change = None
    m.px_emergency = False
    m.px_waiting_need = 0
    m.px_disabled = None
    m.px_prefill_actions = set()
    m.px_backoff = FormatBackoff()
    m.px_check = os.environ.get(CHECK_ENV) == "1"  # type: ignore[attr-defined]
    m._px_sent = set()
    return m
