"""Admission estimates: how many blocks a request will hold once the policy compressed it.

vLLM admits a request only if its whole prompt fits uncompressed. When the policy compresses
finished prompt chunks (`protect.prefilling: false`), the manager admits on these estimates
instead: the new request's compressed footprint at the end of its life, plus what the resident
requests will still grow by (`resident_growth`), must fit the free blocks. Counting only the new
prompt (as before) over-admitted: the residents' decode and remaining prompt chunks then ran the
pool dry and vLLM preempted the newest request, usually mid-prefill, to recompute it later
(CPU capacity workload, conservative: 6 preemptions in 16 requests with the pool full of int4:
five residents' end states need about 73 blocks of the 72, each 5 hot blocks and 31 in int4 at
0.31 of a block with metadata).

Costs are physical blocks including the side tables' metadata (`MetaSizes.held_block_bytes`):
the scheduler holds pool blocks back for those bytes (`side_tables.py`), so they fill the pool
as surely as the slots do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request, RequestStatus

from proxima.formats import Format
from proxima.integration.vllm.scheduler.ledger import RequestLedger
from proxima.policy.schema import Policy

BlockCost = Callable[[Format], float]
"""Physical blocks one logical block held in a format costs, metadata included (a hot block: 1)."""


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def compressed_cost(ledger: RequestLedger, policy: Policy, cost: BlockCost) -> float:
    """Physical blocks one compressed logical block will cost: the mean over the resident
    requests' committed blocks (the engine's actual mix), never below the cheapest format of
    the live policy (a policy changed live to milder formats cannot reach the old mix); before
    any compression, the cheapest format of the highest band's ladder (where the engine takes
    blocks when memory is tightest, and where an emergency compression can take them)."""
    formats = [f for band in policy.bands for f in band.ladder]
    if not formats:
        return 1.0
    held = ledger.formats()
    count = sum(held.values())
    if not count:
        return min((cost(f) for f in policy.bands[-1].ladder), default=1.0)
    return max(sum(n * cost(f) for f, n in held.items()) / count, min(cost(f) for f in formats))


def hot_blocks(tokens: int, block_size: int, policy: Policy) -> int:
    """Blocks of a `tokens`-token request the policy keeps hot: sinks, recent window, the tail."""
    b, prot = block_size, policy.protect
    return min(blocks_for(tokens, b), blocks_for(prot.sink_tokens, b) + blocks_for(prot.recent_tokens, b) + 1)


def compressed_blocks(tokens: int, block_size: int, policy: Policy, cost: float) -> float:
    """Blocks (fractional) a request of `tokens` tokens holds once the policy compressed it under
    pressure: its protected blocks stay hot, the others cost `cost` each (`compressed_cost`)."""
    n = blocks_for(tokens, block_size)
    hot = hot_blocks(tokens, block_size, policy)
    return hot + (n - hot) * cost


def compressed_footprint(tokens: int, block_size: int, policy: Policy, cost: float) -> int:
    """`compressed_blocks` in whole blocks."""
    return math.ceil(compressed_blocks(tokens, block_size, policy, cost) - 1e-9)


class OutputLengths:
    """How many tokens a request will output, learned from the requests that finished.

    A request may stop long before `max_tokens` (an end-of-sequence token, a stop string; the
    API's default `max_tokens` is the whole context), so `max_tokens` alone would reserve room no
    request uses. The estimate is the mean output of recently finished requests (exponential
    decay), never above a request's `max_tokens` nor below what it has output already; before any
    request finished, a request is expected to output as many tokens as its prompt holds."""

    DECAY = 0.8

    def __init__(self) -> None:
        self.mean: float | None = None

    def observe(self, request: Request) -> None:
        """A request left the engine: a natural end (not an abort, not a preemption) teaches."""
        if request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
            return
        x = float(request.num_output_tokens)
        self.mean = x if self.mean is None else self.DECAY * self.mean + (1 - self.DECAY) * x

    def expected(self, request: Request) -> int:
        guess = request.num_prompt_tokens if self.mean is None else math.ceil(self.mean)
        cap = request.max_tokens if request.max_tokens is not None else guess
        return max(request.num_output_tokens, min(cap, guess))


def final_tokens(request: Request, outputs: OutputLengths, max_model_len: int) -> int:
    """The tokens `request` is expected to hold when it finishes."""
    return min(request.num_prompt_tokens + outputs.expected(request), max_model_len)


def resident_growth(ledger: RequestLedger, blocks_of: Mapping[str, Sequence[KVCacheBlock]], block_size: int,
                    policy: Policy, cost: BlockCost, outputs: OutputLengths, max_model_len: int,
                    uncompressed: set[str]) -> int:
    """Blocks the resident requests will still take before they finish: for each, its expected
    end state (`compressed_blocks` at the mix's cost; uncompressed for the requests in
    `uncompressed`, e.g. the drift probe's holdout) less what it holds now (its hot blocks, and
    each committed compressed block at its format's cost). A request already past its estimate
    adds nothing (it gives nothing back either: the estimate is not a bound). Both sides are
    fractional and only the sum is rounded: a whole block per resident (rounding its end state
    up, its holdings not) kept `aggressive` at 14 residents where 16 fit. Runs at every
    scheduling step that admits: its time grows with the residents and formats, not the blocks
    (`RequestEntry.formats`; a per-block sum here made H100 engine steps about 10 ms longer,
    bench/results/experiments/admission-growth/)."""
    mix = compressed_cost(ledger, policy, cost)
    total = 0.0
    for rid, entry in ledger.items():
        tokens = final_tokens(entry.request, outputs, max_model_len)
        end = blocks_for(tokens, block_size) if rid in uncompressed else \
            compressed_blocks(tokens, block_size, policy, mix)
        held = len(blocks_of.get(rid, ())) - len(entry.compressed)  # committed blocks are vLLM's null block
        held_f = held + sum(n * cost(f) for f, n in entry.formats.items())
        total += max(0.0, end - held_f)
    return math.ceil(total - 1e-9)
