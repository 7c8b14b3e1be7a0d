"""The live drift probe (`probes.drift_test`) inside vLLM: do the tokens of requests that read
compressed blocks look less sure than those of an uncompressed holdout?

Three parts, in the three places that can see what each needs:

* **Two random samples** (scheduler, `manager.py`): with `probes.drift.enabled`, a request is in
  the *holdout* with probability `holdout_fraction`, and in the *compressible sample* with the
  same probability (one hash of its id, `assignment`); the KV manager never compresses a holdout
  request, and treats a compressible-sample request as any other. Only these two samples are
  tagged for the observer (`tag`: the id in `SamplingParams.extra_args`, which vLLM hands to
  logits processors with the request's parameters, and to nothing else): the other requests cost
  the observer nothing.
* **Observer** (worker, `drift_observer.DriftObserver`): a vLLM logits processor (the supported
  extension point that sees each step's logits; vLLM 0.32's scheduler receives sampled-token
  log-probs only for requests that asked for them, and no entropy at all). For every tagged row it
  keeps the step's log-softmax; at the next step the token vLLM sampled from it is the row's
  newest output token, whose log-prob and the distribution's entropy go into the worker's report
  (`ProximaReport.drift`). It never changes the logits. Installed by the plugin in every engine
  Proxima's connector runs in (`_patches.install`; vLLM builds logits processors once, at
  start-up, and refuses custom ones with speculative decoding: there the drift probe is refused).
* **Windows** (scheduler, `DriftWindows`, driven by `live.LiveControl`): a token counts when, at
  its step, the engine held committed compressed blocks (of any request: the report arrives two
  engine steps after that step's forward, see `LiveControl`), for the side its request was drawn
  into; each compressible-sample token also records whether its request read compressed blocks
  then. With `probes.drift.window` finished requests on each side, `drift_test` gives one verdict
  for the ladder over per-request means (tokens of one request are correlated: requests are the
  units), each compressible request paired with a holdout one and both averaged over the output
  positions they share (`DriftWindows.verdict`), judged by a paired signed-rank test
  (`bench/drift_false_alarms.py` measures its false alarms on recorded runs).

Why both sides are random samples (an intention-to-treat comparison): the requests the engine
happens to compress are not a random sample of the traffic (it compresses the requests resident
when the pool is full: a stretch of the run, and with it of the text), so comparing only those
with the holdout tests which requests were chosen as much as what compression did to them. Both
samples drawn by the id's hash are alike but for compression, so under a good policy the test's
false-alarm rate is its nominal one whatever the traffic; the tokens of compressible requests not
compressed at the time dilute an effect (the verdict reports `compressed_share`), they cannot fake
one. `bench/fallback.py` splits the compressed requests' tokens into those before and after their
first compressed one (`drift_selection`); with 4-token requests per-request mean entropies spread
by 1.0-1.3 nats, so a window of 10 requests a side moves by about 0.5 nats between windows.
"""

from __future__ import annotations

import logging
import zlib
from collections import deque
from collections.abc import Container, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from proxima.integration.vllm import DRIFT_ID_ARG
from proxima.policy.probes import DriftSample, ProbeResult, drift_test
from proxima.policy.schema import DriftProbe

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("proxima.vllm")
Side = Literal["compressible", "holdout"]
HISTORY_TOKENS = 64
"""Tokens of each finished request kept in `DriftWindows.history` (its first positions)."""
CLOSE_AFTER = 4
"""Commits a request stays open after it left the engine: its last tokens' samples arrive with the
reports of the two steps after its last forward (the observer resolves a token one step later and
reports it with the next step's report)."""


def assignment(req_id: str, cfg: DriftProbe) -> Side | None:
    """The sample a request is drawn into, or None (not observed). Deterministic in the id (vLLM's
    ids end in a random part): `holdout_fraction` of the requests each way (at most 0.5 each)."""
    if not cfg.enabled:
        return None
    share = round(cfg.holdout_fraction * 10_000)
    h = zlib.crc32(req_id.encode()) % 10_000
    return "holdout" if h < share else "compressible" if h < 2 * share else None


def is_holdout(req_id: str, cfg: DriftProbe) -> bool:
    return assignment(req_id, cfg) == "holdout"


def tag(request: Request) -> None:
    """Ask the observer for this request's token log-probs (before the worker first sees it)."""
    sp = request.sampling_params
    if sp is not None:
        sp.extra_args = {**(sp.extra_args or {}), DRIFT_ID_ARG: request.request_id}


# -- scheduler side (the worker side is `drift_observer.py`) --------------------------------------


Token = tuple[float, float, bool]
"""(log-prob, entropy, whether its request read compressed blocks at its step)."""


@dataclass
class DriftWindows:
    """Per-request means of each side, and the verdict once both sides have a window."""

    open: dict[tuple[str, Side], dict[int, Token]] = field(default_factory=dict)
    """(request, side) -> output position -> token, while it runs."""
    closed: dict[Side, list[tuple[str, dict[int, Token]]]] = field(
        default_factory=lambda: {"compressible": [], "holdout": []})
    """Finished requests of each side, with their tokens by output position."""
    tokens: dict[Side, int] = field(default_factory=lambda: {"compressible": 0, "holdout": 0})
    compressed_tokens: int = 0
    """Of the compressible side's tokens, those whose request read compressed blocks."""
    verdicts: int = 0
    history: deque[tuple[Side, str, float, float, int, list[tuple[int, float, float, bool]]]] = field(
        default_factory=lambda: deque(maxlen=1000))
    """The last finished requests of both sides, verdicts or not: (side, request, means, tokens,
    its first `HISTORY_TOKENS` tokens as (position, log-prob, entropy, compressed))."""
    missing: dict[tuple[str, Side], int] = field(default_factory=dict)
    """Open requests absent from the engine, and for how many calls of `close_absent`."""

    def add(self, req_id: str, side: Side, position: int, logprob: float, entropy: float,
            compressed: bool = False) -> None:
        self.open.setdefault((req_id, side), {})[position] = (logprob, entropy, compressed)
        self.tokens[side] += 1
        self.compressed_tokens += compressed

    def close_absent(self, resident: Container[str], grace: int = CLOSE_AFTER) -> None:
        """Requests out of the engine for `grace` calls: their means join their side. (Not at once:
        a request's last tokens are reported after it finished, `CLOSE_AFTER`.)"""
        for key in list(self.open):
            if key[0] in resident:
                self.missing.pop(key, None)
                continue
            self.missing[key] = self.missing.get(key, 0) + 1
            if self.missing[key] >= grace:
                del self.missing[key]
                tokens = self.open.pop(key)
                self.closed[key[1]].append((key[0], tokens))
                lp, ent = _means(tokens, tokens.keys())
                first = [(p, *tokens[p]) for p in sorted(tokens)[:HISTORY_TOKENS]]
                self.history.append((key[1], key[0], lp, ent, len(tokens), first))

    def verdict(self, cfg: DriftProbe) -> ProbeResult | None:
        """One `drift_test` over the first `cfg.window` finished requests of each side (then dropped).

        Position-matched: a request's first tokens are not distributed as its later ones (entropy
        right after a prompt is higher), and a side's requests need not have the same positions
        (a token counts only at steps when the engine held compressed blocks). So the i-th
        compressible request is paired with the i-th holdout request and both are averaged over
        the output positions they share (all of each when they share none)."""
        comp, hold = self.closed["compressible"], self.closed["holdout"]
        if len(comp) < cfg.window or len(hold) < cfg.window:
            return None
        pairs, used, used_compressed = [], 0, 0
        for (_, c), (_, h) in zip(comp[:cfg.window], hold[:cfg.window], strict=True):
            shared = c.keys() & h.keys()
            at = shared or c.keys()
            pairs.append((*_means(c, at), *_means(h, shared or h.keys())))
            used += len(at)
            used_compressed += sum(c[p][2] for p in at)
        m = np.array(pairs)
        a, b = m[:, 0:2], m[:, 2:4]
        del comp[:cfg.window], hold[:cfg.window]
        self.verdicts += 1
        # Paired: both values of a pair are means over the same positions (signed-rank test).
        r = drift_test(DriftSample(a[:, 0], a[:, 1]), DriftSample(b[:, 0], b[:, 1]), cfg, paired=True)
        return ProbeResult(r.kind, r.passed, {**r.values, "requests_per_side": float(cfg.window),
                                              "compressed_share": used_compressed / max(1, used)}, r.detail)

    def progress(self) -> dict[str, Any]:
        return {"running": len(self.open), "finished_compressible": len(self.closed["compressible"]),
                "finished_holdout": len(self.closed["holdout"]), "tokens": dict(self.tokens),
                "compressed_tokens": self.compressed_tokens, "verdicts": self.verdicts}


def _means(tokens: dict[int, Token], positions: Iterable[int]) -> tuple[float, float]:
    vals = np.array([tokens[p][:2] for p in positions])
    return float(vals[:, 0].mean()), float(vals[:, 1].mean())


def classify(samples: Iterable[tuple[str, int, float, float]], holdout: Container[str], compressed: AbstractSet[str],
             windows: DriftWindows) -> None:
    """The worker's samples (of the two tagged samples only) into their sides; unusable ones dropped.

    `holdout`: the resident holdout requests (a finished one's late tokens still count: its window
    is open); every other sampled request is of the compressible sample. `compressed`: the user
    requests that held committed compressed blocks at the samples' step. A step when no request
    held any gives no token to either side (the same rule for both: nothing to compare there)."""
    if not compressed:
        return
    for rid, pos, lp, ent in samples:
        if not (np.isfinite(lp) and np.isfinite(ent)):
            continue
        if rid in holdout or (rid, "holdout") in windows.open:
            windows.add(rid, "holdout", pos, lp, ent)
        else:
            windows.add(rid, "compressible", pos, lp, ent, rid in compressed)


__all__ = ["HISTORY_TOKENS", "DriftWindows", "Side", "assignment", "classify", "is_holdout", "tag"]
