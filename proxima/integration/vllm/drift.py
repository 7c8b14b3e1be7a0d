"""The live drift probe (`probes.drift_test`) inside vLLM: do the tokens of requests that read
compressed blocks look less sure than those of an uncompressed holdout?

Three parts, in the three places that can see what each needs:

* **Holdout** (scheduler, `manager.py`): with `probes.drift.enabled`, a request is in the holdout
  with probability `holdout_fraction` (a hash of its id, `is_holdout`); the KV manager never
  compresses a holdout request, so its tokens are the uncompressed population. Every other
  request is tagged for the observer (`tag`: its id in `SamplingParams.extra_args`, which vLLM
  hands to logits processors with the request's parameters, and to nothing else).
* **Observer** (worker, `drift_observer.DriftObserver`): a vLLM logits processor (the supported extension point
  that sees each step's logits; vLLM 0.32's scheduler receives sampled-token log-probs only for
  requests that asked for them, and no entropy at all). For every tagged row it keeps the
  step's log-softmax; at the next step the token vLLM sampled from it is the row's newest output
  token, whose log-prob and the distribution's entropy go into the worker's report
  (`ProximaReport.drift`). It never changes the logits. Installed by the plugin when the startup
  policy enables the drift probe (`_patches.install`; vLLM builds logits processors once, at
  start-up, and refuses custom ones with speculative decoding).
* **Windows** (scheduler, `DriftWindows`, driven by `live.LiveControl`): a token counts for the
  compressed side when its request held committed compressed blocks when the token's step ran
  (the report arrives two engine steps after that step's forward: see `LiveControl`), for the
  holdout when its request is in the holdout; other tokens (a request not compressed yet) are
  not used. With `probes.drift.window` finished requests on each side, `drift_test` gives one
  verdict for the ladder over per-request means (tokens of one request are correlated), each
  compressed request paired with a holdout one and both averaged over the output positions they
  share (`DriftWindows.verdict`: the compressed side's tokens are its requests' later ones).
"""

from __future__ import annotations

import logging
import zlib
from collections import deque
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from proxima.policy.probes import DriftSample, ProbeResult, drift_test
from proxima.policy.schema import DriftProbe

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("proxima.vllm")
DRIFT_ID_ARG = "proxima_drift_id"
"""`SamplingParams.extra_args` key: the request id the observer reports the request's tokens under."""
Side = Literal["compressed", "holdout"]
CLOSE_AFTER = 4
"""Commits a request stays open after it left the engine: its last tokens' samples arrive with the
reports of the two steps after its last forward (the observer resolves a token one step later and
reports it with the next step's report)."""


def is_holdout(req_id: str, cfg: DriftProbe) -> bool:
    """Deterministic in the id (vLLM's ids end in a random part, so the share is `holdout_fraction`)."""
    return cfg.enabled and zlib.crc32(req_id.encode()) % 10_000 < round(cfg.holdout_fraction * 10_000)


def tag(request: Request) -> None:
    """Ask the observer for this request's token log-probs (before the worker first sees it)."""
    sp = request.sampling_params
    if sp is not None:
        sp.extra_args = {**(sp.extra_args or {}), DRIFT_ID_ARG: request.request_id}


# -- worker side ----------------------------------------------------------------------------------


# -- scheduler side -------------------------------------------------------------------------------


@dataclass
class DriftWindows:
    """Per-request means of each side, and the verdict once both sides have a window."""

    open: dict[tuple[str, Side], dict[int, tuple[float, float]]] = field(default_factory=dict)
    """(request, side) -> output position -> (log-prob, entropy), while it runs."""
    closed: dict[Side, list[tuple[str, dict[int, tuple[float, float]]]]] = field(
        default_factory=lambda: {"compressed": [], "holdout": []})
    """Finished requests of each side, with their tokens by output position."""
    tokens: dict[Side, int] = field(default_factory=lambda: {"compressed": 0, "holdout": 0})
    verdicts: int = 0
    history: deque[tuple[Side, str, float, float, int]] = field(default_factory=lambda: deque(maxlen=1000))
    """The last finished requests of both sides, verdicts or not (side, request, means, tokens)."""
    missing: dict[tuple[str, Side], int] = field(default_factory=dict)
    """Open requests absent from the engine, and for how many calls of `close_absent`."""

    def add(self, req_id: str, side: Side, position: int, logprob: float, entropy: float) -> None:
        self.open.setdefault((req_id, side), {})[position] = (logprob, entropy)
        self.tokens[side] += 1

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
                self.history.append((key[1], key[0], lp, ent, len(tokens)))

    def verdict(self, cfg: DriftProbe) -> ProbeResult | None:
        """One `drift_test` over the first `cfg.window` finished requests of each side (then dropped).

        Position-matched: the compressed side's tokens are the later ones of their requests (those
        after the first commit), and a request's first tokens are not distributed as its later
        ones (entropy right after a prompt is higher). So the i-th compressed request is paired
        with the i-th holdout request and both are averaged over the output positions they share
        (all of each when they share none)."""
        comp, hold = self.closed["compressed"], self.closed["holdout"]
        if len(comp) < cfg.window or len(hold) < cfg.window:
            return None
        pairs = []
        for (_, c), (_, h) in zip(comp[:cfg.window], hold[:cfg.window], strict=True):
            shared = c.keys() & h.keys()
            pairs.append((*_means(c, shared or c.keys()), *_means(h, shared or h.keys())))
        m = np.array(pairs)
        a, b = m[:, 0:2], m[:, 2:4]
        del comp[:cfg.window], hold[:cfg.window]
        self.verdicts += 1
        r = drift_test(DriftSample(a[:, 0], a[:, 1]), DriftSample(b[:, 0], b[:, 1]), cfg)
        return ProbeResult(r.kind, r.passed, {**r.values, "requests_per_side": float(cfg.window)}, r.detail)

    def progress(self) -> dict[str, Any]:
        return {"running": len(self.open), "finished_compressed": len(self.closed["compressed"]),
                "finished_holdout": len(self.closed["holdout"]), "tokens": dict(self.tokens),
                "verdicts": self.verdicts}


def _means(tokens: dict[int, tuple[float, float]], positions: Iterable[int]) -> tuple[float, float]:
    vals = np.array([tokens[p] for p in positions])
    return float(vals[:, 0].mean()), float(vals[:, 1].mean())


def classify(samples: Iterable[tuple[str, int, float, float]], holdout: Container[str], compressed: Container[str],
             windows: DriftWindows) -> None:
    """The worker's samples into their sides (see the module docstring); unusable ones dropped.
    `holdout`: the resident holdout requests (a finished one's late tokens still count: its
    window is open)."""
    for rid, pos, lp, ent in samples:
        if not (np.isfinite(lp) and np.isfinite(ent)):
            continue
        if rid in holdout or (rid, "holdout") in windows.open:
            windows.add(rid, "holdout", pos, lp, ent)
        elif rid in compressed:
            windows.add(rid, "compressed", pos, lp, ent)


__all__ = ["DRIFT_ID_ARG", "DriftWindows", "classify", "is_holdout", "tag"]
