"""The drift probe's observer on the worker side (`drift.py` says how the three parts fit): a vLLM
logits processor that records, for every request tagged by the scheduler, the log-prob of the
token vLLM sampled and the entropy of the distribution it came from, into the worker's report.

A module of its own, apart from the scheduler side (`drift.py`, which `live.py` imports), and it
finds the worker's store through vLLM's connector registry, not through `connector.py`: the
plugin (`_patches.py`) installs this class, and `connector.py` reaches `_patches` through
`live.py` and `manager.py`, so importing it here would close a circle.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proxima.integration.vllm import DRIFT_ID_ARG

if TYPE_CHECKING:
    import torch
    from vllm.v1.sample.logits_processor import BatchUpdate

    from proxima.integration.vllm.worker.store import WorkerStore

logger = logging.getLogger("proxima.vllm")
MAX_ROWS = 64
"""Rows observed per step, at most (the first by batch index; the others' tokens of that step are
not observed). Bounds the observer's memory: one `[MAX_ROWS, vocab]` float32 buffer (12.6 MB for
SmolLM2's 49k-token vocabulary, 33 MB at 128k), which vLLM's memory profile does not see."""
CHUNK_ROWS = 16
"""Rows whose log-softmax and entropy are computed at once (the temporaries are this many rows)."""


@dataclass
class _Tracked:
    req_id: str
    output: list[int]
    """vLLM's own list of the request's output tokens (appended to as tokens are sampled)."""
    pending: tuple[int, int, float] | None = None
    """(output length when stored, row in the stored log-softmax, entropy) of the last step."""


def _worker_store() -> WorkerStore | None:
    """This process's Proxima store: the KV connector vLLM runs here holds it (as
    `connector.worker_store` finds it), or None without a Proxima connector."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

    from proxima.integration.vllm.worker.store import WorkerStore

    if not has_kv_transfer_group():
        return None
    store = getattr(get_kv_transfer_group(), "store", None)
    return store if isinstance(store, WorkerStore) else None


def _logits_processor_base() -> type:
    from vllm.v1.sample.logits_processor import LogitsProcessor

    return LogitsProcessor


class DriftObserver(_logits_processor_base()):  # type: ignore[misc]
    """Records (request, sampled-token log-prob, entropy) of tagged requests; logits unchanged.

    Only the drift probe's two samples are tagged (`drift.assignment`): with the shipped 2%
    holdout, about 4% of the rows; an untagged batch costs one dictionary check per step."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, _Tracked] = {}
        self._prev: torch.Tensor | None = None  # the last step's log-softmax of the tracked rows (in `_buf`)
        self._buf: torch.Tensor | None = None
        self._store: WorkerStore | None = None
        self._broken = False

    def is_argmax_invariant(self) -> bool:
        return False  # (it changes nothing, but vLLM skips argmax-invariant processors for greedy batches)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        from vllm.v1.sample.logits_processor.builtin import process_dict_updates

        def new_state(params: Any, prompt: list[int] | None, output: list[int]) -> _Tracked | None:
            rid = (getattr(params, "extra_args", None) or {}).get(DRIFT_ID_ARG)
            return None if rid is None else _Tracked(str(rid), output)

        process_dict_updates(self.rows, batch_update, new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows or self._broken:
            return logits
        t0 = time.perf_counter()
        try:
            self._observe(logits)
        except Exception as exc:  # an observer must never fail a request: stop observing
            self._broken = True
            logger.error("proxima: drift observer disabled after an error: %s: %s", type(exc).__name__, exc)
        if self._store is not None:
            self._store.report.drift_seconds += time.perf_counter() - t0
        return logits

    def _observe(self, logits: torch.Tensor) -> None:
        import torch

        store = self._store
        if store is None:
            store = self._store = _worker_store()
            if store is None:
                self._broken = True  # no Proxima connector in this process: nothing to report to
                return
        rows = sorted(i for i in self.rows if i < logits.shape[0])[:MAX_ROWS]
        # The token sampled from the stored distribution is the newest output token, if exactly one came.
        done = [(t, t.pending) for i in rows if (t := self.rows[i]).pending is not None
                and len(t.output) == t.pending[0] + 1 and t.output[-1] >= 0]
        if done and self._prev is not None:
            at = torch.tensor([p[1] for _, p in done], device=self._prev.device)
            tok = torch.tensor([t.output[-1] for t, _ in done], device=self._prev.device)
            lps = self._prev[at, tok].tolist()
            store.report.drift.extend((t.req_id, p[0], lp, p[2]) for (t, p), lp in zip(done, lps, strict=True))
        for i in self.rows:
            self.rows[i].pending = None
        if not rows:
            self._prev = None
            return
        # Read above, overwritten here: one buffer serves both steps.
        buf = self._buf
        if buf is None or buf.shape[1] != logits.shape[1] or buf.device != logits.device:
            buf = self._buf = torch.empty(MAX_ROWS, logits.shape[1], dtype=torch.float32, device=logits.device)
        idx = torch.tensor(rows, device=logits.device)
        ent = []
        for s in range(0, len(rows), CHUNK_ROWS):
            part = buf[s:s + CHUNK_ROWS][: len(rows) - s]
            part.copy_(logits.index_select(0, idx[s:s + CHUNK_ROWS]))
            part.sub_(torch.logsumexp(part, dim=-1, keepdim=True))  # the log-softmax, in place
            ent += (-(part.exp() * part).nansum(dim=-1)).tolist()
        self._prev = buf
        for k, i in enumerate(rows):
            t = self.rows[i]
            t.pending = (len(t.output), k, ent[k])

def is_observer(proc: Any) -> bool:
    """Whether an entry of vLLM's `logits_processors` is the observer: the class, or its
    qualified name as a string."""
    return proc is DriftObserver or proc in {f"{DriftObserver.__module__}.{DriftObserver.__qualname__}",
                                             f"{DriftObserver.__module__}:{DriftObserver.__qualname__}"}


def configured(vllm_config: Any) -> bool:
    """Whether an engine of this configuration runs the observer."""
    procs = getattr(getattr(vllm_config, "model_config", None), "logits_processors", None) or []
    return any(is_observer(p) for p in procs)


__all__ = ["CHUNK_ROWS", "MAX_ROWS", "DriftObserver", "configured", "is_observer"]
