"""Canary requests: fixed prompts whose teacher-forced log-probs are compared with the engine's own
uncompressed reference (DESIGN.md, "Quality probes and fallback"; `probes.evaluate_canary`).

Two kinds of request, told apart by their id (vLLM keeps the caller's id as a prefix of its own;
its completions endpoint puts `cmpl-` in front of it, which the tests below look past):

* `proxima-canary-ref-*`: the reference. The KV manager never compresses its blocks, so its
  prompt log-probs are the model's own, uncompressed, computed by this very engine;
* `proxima-canary-*`: the live run. Its eligible blocks are compressed by the live policy at the
  current fallback level *regardless of pressure* (`forced_actions`: the top band, as if the pool
  were full), so the canary measures the damage the policy would do when it is needed most.

Both are ordinary requests of `max_tokens=1` with `prompt_logprobs=TOP_K`; the prompt is chunked,
so the later chunks attend to earlier ones compressed: the live run's blocks are compressed while
its prompt is prefilled (whatever `protect.prefilling` says). A canary is therefore informative
only when its prompt takes more than one engine step, i.e. is longer than vLLM's
`max_num_batched_tokens` (or `long_prefill_token_threshold`): vLLM 0.32 chunks prompts only
engine-wide, there is no per-request chunk size.
`canary_runner.CanaryRunner` submits them (into an engine the caller steps, or through a server's
completions endpoint: `proxima serve` starts one) at the policy's `probes.canary.interval_s`, and
posts the verdict of `evaluate` to the runtime API (`POST /v1/probes`), where it feeds the
fallback ladder.

vLLM returns only the top-k prompt log-probs, so the KL is taken over the reference's top-k tokens,
the live run's top-1 and the rest of the mass as one bin (a token outside the live run's top-k is
given the live top-k's smallest log-prob: a bound, which over-states the live run's confidence in
it). Top-1 agreement is exact (both top-1 tokens are among the bins).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

import numpy as np

from proxima.policy.probes import ProbeResult, evaluate_canary
from proxima.policy.schema import CanaryProbe

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool

    from proxima.integration.vllm.scheduler.ledger import RequestLedger
    from proxima.integration.vllm.scheduler.pool_usage import BlockLists
    from proxima.policy.engine import Action, EngineState
    from proxima.policy.schema import Policy

CANARY_PREFIX = "proxima-canary-"
REFERENCE_PREFIX = "proxima-canary-ref-"
TOP_K = 20
"""Prompt log-probs asked per position (vLLM's default `max_logprobs`)."""


COMPLETIONS_PREFIX = "cmpl-"
"""What vLLM's `/v1/completions` puts before a caller's `request_id`."""


def _bare(req_id: str) -> str:
    return req_id.removeprefix(COMPLETIONS_PREFIX)


def is_special(req_id: str) -> bool:
    """A canary or a canary's reference."""
    return _bare(req_id).startswith(CANARY_PREFIX)


def is_reference(req_id: str) -> bool:
    return _bare(req_id).startswith(REFERENCE_PREFIX)


def is_canary(req_id: str) -> bool:
    """A live canary run (not its reference)."""
    return is_special(req_id) and not is_reference(req_id)


def special_requests(req_ids: Iterable[str]) -> set[str]:
    """Canary and reference requests: the engine's pressure-driven planning leaves them alone."""
    return {rid for rid in req_ids if is_special(rid)}


def forced_actions(ledger: RequestLedger, blocks_of: BlockLists, pool: BlockPool, block_size: int,
                   policy: Policy, state: EngineState, finishing: AbstractSet[str]) -> list[Action]:
    """The live canaries' compressions: the live policy at `state.fallback_level` with the pool as
    if it were full (pending blocks = the whole pool: the top band, an unmet target)."""
    from proxima.integration.vllm.scheduler.ledger import RequestLedger
    from proxima.integration.vllm.scheduler.pool_usage import total_blocks
    from proxima.integration.vllm.scheduler.snapshot import build_snapshot
    from proxima.policy.engine import decide

    live = RequestLedger({rid: e for rid, e in ledger.items() if is_canary(rid) and rid not in finishing})
    if not live:
        return []
    snap = build_snapshot(live, blocks_of, pool, block_size, pending_blocks=total_blocks(pool))
    # A canary is a prompt and one token: its blocks are compressed between its prefill chunks
    # whatever `protect.prefilling` says, else it would finish before any block could be.
    unprotected = policy.model_copy(update={"protect": policy.protect.model_copy(update={"prefilling": False})})
    # The decision's state is dropped: a canary must not move the engine's band hysteresis.
    return decide(snap, unprotected, state).actions


def prefill_chunk_tokens(vllm_config: Any) -> int:
    """The most prompt tokens vLLM 0.32 prefills for one request in one step: the step budget
    (`--max-num-batched-tokens`), or `--long-prefill-token-threshold` when set and lower; with
    chunked prefill off, a whole prompt (`max_model_len`)."""
    sc = vllm_config.scheduler_config
    if not getattr(sc, "enable_chunked_prefill", True):
        return int(vllm_config.model_config.max_model_len)
    chunk = int(sc.max_num_batched_tokens)
    threshold = int(getattr(sc, "long_prefill_token_threshold", 0) or 0)
    return min(chunk, threshold) if threshold > 0 else chunk


def chunking_problem(prompt_tokens: int, chunk_tokens: int) -> str | None:
    """Why a live canary of `prompt_tokens` measures nothing with this chunk size, or None."""
    if prompt_tokens > chunk_tokens:
        return None
    return (f"the canary prompt ({prompt_tokens} tokens) is prefilled in one step (at most {chunk_tokens} prompt "
            f"tokens a step): none of its blocks can be compressed before its log-probs are computed, so it "
            f"measures nothing; start vLLM with --max-num-batched-tokens (or --long-prefill-token-threshold) "
            f"below {prompt_tokens}")


def _row(entry: Mapping[Any, Any] | None) -> dict[int, tuple[float, int]]:
    """vLLM's per-position dict as token -> (logprob, rank): token -> `Logprob` from an engine, or
    the JSON of the completions endpoint (token id as a string -> {"logprob": .., "rank": ..})."""
    if entry is None:
        return {}
    out = {}
    for t, lp in entry.items():
        if isinstance(lp, Mapping):
            out[int(t)] = (float(lp["logprob"]), int(lp.get("rank") or 0))
        else:
            out[int(t)] = (float(lp.logprob), int(lp.rank or 0))
    return out


def logprob_bins(reference: Sequence[Mapping[Any, Any] | None], live: Sequence[Mapping[Any, Any] | None]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt position, the reference's and the live run's log-probs over the same bins:
    the reference's top-k tokens, the live top-1 (if not among them), and the rest of the mass.
    Returns two `[T, K + 2]` arrays (unused bins are -inf in both), positions without an entry
    (the first) left out."""
    rows_ref, rows_live = [], []
    width = TOP_K + 2
    for ref_e, live_e in zip(reference, live, strict=True):
        ref, cur = _row(ref_e), _row(live_e)
        if not ref or not cur:
            continue
        ref_top = sorted(ref, key=lambda t: ref[t][0], reverse=True)[:TOP_K]
        live_top1 = max(cur, key=lambda t: cur[t][0])
        tokens = ref_top + ([live_top1] if live_top1 not in ref_top else [])
        floor_live = min(lp for lp, _ in cur.values())
        floor_ref = min(lp for lp, _ in ref.values())
        r = np.full(width, -np.inf)
        c = np.full(width, -np.inf)
        for i, t in enumerate(tokens):
            r[i] = ref[t][0] if t in ref else floor_ref
            c[i] = cur[t][0] if t in cur else floor_live
        for arr in (r, c):  # the rest of the mass, one bin
            mass = float(np.exp(arr[np.isfinite(arr)]).sum())
            arr[-1] = math.log(max(1e-12, 1.0 - mass)) if mass < 1.0 else -30.0
        rows_ref.append(r)
        rows_live.append(c)
    return np.array(rows_ref).reshape(-1, width), np.array(rows_live).reshape(-1, width)


def evaluate(references: Sequence[Sequence[Mapping[Any, Any] | None]],
             lives: Sequence[Sequence[Mapping[Any, Any] | None]], cfg: CanaryProbe) -> ProbeResult:
    """The canary verdict over every prompt (`probes.evaluate_canary` on the bins above)."""
    pairs = [logprob_bins(r, c) for r, c in zip(references, lives, strict=True)]
    # -inf bins carry no mass in either run: give them a tiny finite log-prob so KL stays finite.
    ref = [np.where(np.isfinite(r), r, -60.0) for r, _ in pairs]
    live = [np.where(np.isfinite(c), c, -60.0) for _, c in pairs]
    return evaluate_canary(ref, live, cfg)


__all__ = [
    "CANARY_PREFIX",
    "COMPLETIONS_PREFIX",
    "REFERENCE_PREFIX",
    "TOP_K",
    "chunking_problem",
    "evaluate",
    "forced_actions",
    "is_canary",
    "is_reference",
    "is_special",
    "logprob_bins",
    "prefill_chunk_tokens",
    "special_requests",
]
