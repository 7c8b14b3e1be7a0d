"""Per-request compression targets in vLLM: "store this request's prompt r times smaller".

A request asks with `SamplingParams(extra_args={"proxima_target_ratio": r})` (the OpenAI server:
`"vllm_xargs": {"proxima_target_ratio": r}`). Once its prompt is prefilled, before the forward
of its first decode step, the scheduler plans its prompt's blocks into the formats the live
policy's engine chooses on a virtual pool holding only this request, sized for r times fewer
bytes (`proxima.policy.target`, the very functions `ProximaCache.apply_policy(target_ratio=r)`
uses, so the quality harness measures what vLLM stores). Pool pressure is not needed and not
consulted; the request stays an ordinary one for it afterwards (tokens it generates later are
compressed under pressure only).

The scheduler cannot compress and undo, so its byte trials are predictions (the engine's formats,
bytes from the slot specs), and it plans the kept trial at once. Blocks the compression-time
probe refuses stay as they were with their cap, and the next round (one step later, at most
`MAX_ROUNDS` in all) plans the shortfall again: its trials know the caps (a refused block lands
on its cap and is not offered again), so the ask rises as the HF cache's does after a refusal.
What a request reached is recorded in the stats (`targets` of the summary): the bytes ratio of
its prompt's blocks as committed, also for a request that leaves before its target was done.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request

from proxima.formats import HOT, Format
from proxima.integration.vllm.scheduler.ledger import RequestEntry
from proxima.integration.vllm.scheduler.snapshot import request_blocks
from proxima.policy import target
from proxima.policy.engine import Action, EngineState
from proxima.policy.schema import Policy
from proxima.policy.snapshot import ProbeStatus

logger = logging.getLogger("proxima.vllm")

TARGET_ARG = "proxima_target_ratio"
"""The key of `SamplingParams.extra_args` (flat, so that the OpenAI server's `vllm_xargs` can set it)."""
MAX_ROUNDS = 3
"""Planning rounds that plan something, per target: the first, then up to two for blocks the
probe refused (their caps known, the shortfall is planned again)."""
MAX_TRIES = 16
"""Steps a target may be tried in at all (a round whose reservations all failed, for want of a
destination or of the backoff's quota, is tried again a step later)."""


def requested_ratio(request: Request) -> float | None:
    """The ratio `request` asked for, or None (none asked, or an invalid value: logged, ignored,
    the request is served as any other)."""
    args: Any = getattr(request.sampling_params, "extra_args", None) if request.sampling_params else None
    if not isinstance(args, dict) or TARGET_ARG not in args:
        return None
    raw = args[TARGET_ARG]
    try:
        ratio = float(raw)
    except (TypeError, ValueError):
        ratio = math.nan
    if isinstance(raw, bool) or not math.isfinite(ratio) or ratio < 1.0:
        logger.warning("proxima: request %s: extra_args[%r]=%r is not a number >= 1 (a bytes ratio, e.g. 4); "
                       "it is ignored and the request is compressed only under pool pressure",
                       request.request_id, TARGET_ARG, raw)
        return None
    return ratio


def due(entry: RequestEntry) -> bool:
    """The request has a target to plan now: its prompt is prefilled and nothing of it is in flight."""
    r = entry.request
    return entry.target is not None and not entry.in_flight and r.num_computed_tokens >= r.num_prompt_tokens


def plan(entry: RequestEntry, blocks: Sequence[KVCacheBlock], block_size: int, policy: Policy,
         state: EngineState, probe_status: ProbeStatus, held_bytes: Callable[[Format], float]) -> list[Action]:
    """This round's actions for `entry`'s target (empty: the target is met or nothing is left to do).

    Only the prompt's blocks (those at the first round) are offered; `held_bytes(fmt)` is what one
    block held in `fmt` costs, all layers, data and metadata (`held_bytes(HOT)`: a hot block)."""
    if entry.target is None:
        return []
    if not entry.target_blocks:
        entry.target_blocks = len(blocks)
    seq = request_blocks(entry, blocks[: entry.target_blocks], block_size)
    seq = replace(seq, in_prefill=False)  # (due(): the prompt is prefilled, whatever vLLM's counters say)
    n = len(seq.formats)

    def trial(ask: float) -> list[Format]:
        pool = target.pool_for_ratio(n, policy, ask)
        return target.simulate(seq, policy, pool, block_size, state, probe_status, caps=entry.caps)

    final = target.reach_ratio(entry.target, trial,
                               achieved=lambda fmts: target.held_ratio(fmts, seq.tokens, block_size, held_bytes),
                               acted=lambda fmts: fmts != list(seq.formats))
    # (predicted_damage: not read by the reservation; the engine's own figure is per decide call)
    return [Action(seq.request_id, i, old, new, 1.0 / old.pack_ratio - 1.0 / new.pack_ratio, 0.0)
            for i, (old, new) in enumerate(zip(seq.formats, final, strict=True)) if new != old]


def reached(entry: RequestEntry, block_size: int, held_bytes: Callable[[Format], float]) -> float:
    """The bytes ratio of the target's blocks (the prompt's tokens) as committed now."""
    n, prompt = entry.target_blocks, entry.request.num_prompt_tokens
    tokens = [max(0, min(block_size, prompt - i * block_size)) for i in range(n)]
    formats = [entry.compressed[i].fmt if i in entry.compressed else HOT for i in range(n)]
    return target.held_ratio(formats, tokens, block_size, held_bytes)
