"""Where a step's time goes, measured cheaply: what bounds a benchmark row.

With `PROXIMA_TIME_SPLIT=1` the worker times its parts of every step: the model forward
(`forward_s`: from the plan's execution to the report, i.e. the whole forward pass), the
compression batch (`compress_s`), vLLM's attention kernel (`attention_vllm_s`) and Proxima's
split path for compressed rows (`attention_proxima_s`) summed over layers, the importance
observation (`importance_s`) and the host-side row planning of the first layer (`row_plan_s`).
The scheduler adds its own planning and commit (`plan_s`, `commit_s`, host timers, always on).

On CUDA a part is a pair of CUDA events on the current stream (its GPU time, not the launch
time: under async scheduling the host runs ahead); a pair is read only once its end event has
completed (`Event.query()`, no synchronization), so a step's numbers arrive a step or two later
and the last steps of a run may be missing. On CPU a part is a host timer (execution is
synchronous there). Off (the default) every call is a no-op.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

TIME_SPLIT_ENV = "PROXIMA_TIME_SPLIT"


def _capturing(device: Any) -> bool:
    """A CUDA graph is being captured on the current stream: an event recorded now would become
    a node of the graph, and querying it later fails (`cudaErrorInvalidValue`, which killed the
    engine on the H100 with the one-pass decode). Parts inside a graph are not timed: its replay
    runs no Python, so the enclosing `forward_s` holds them."""
    if device is None or getattr(device, "type", None) != "cuda":
        return False
    import torch

    return bool(torch.cuda.is_current_stream_capturing())


class StepTimes:
    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = os.environ.get(TIME_SPLIT_ENV) == "1" if enabled is None else enabled
        self.done: dict[str, float] = {}
        self._pending: list[tuple[str, Any, Any]] = []
        self._open: dict[str, tuple[Any, float]] = {}

    def _mark(self, device: Any) -> Any:
        import torch

        if device is not None and getattr(device, "type", None) == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return None

    def begin(self, name: str, device: Any = None) -> None:
        if self.enabled and not _capturing(device):
            self._open[name] = (self._mark(device), time.perf_counter())

    def end(self, name: str, device: Any = None) -> None:
        if not self.enabled or name not in self._open:
            return
        start, t0 = self._open.pop(name)
        if start is None:
            self.done[name] = self.done.get(name, 0.0) + time.perf_counter() - t0
        else:
            self._pending.append((name, start, self._mark(device)))

    @contextmanager
    def span(self, name: str, device: Any = None) -> Iterator[None]:
        self.begin(name, device)
        try:
            yield
        finally:
            self.end(name, device)

    def take(self) -> dict[str, float]:
        """Seconds of the parts completed since the last call (and forget them)."""
        if not self.enabled:
            return {}
        still = []
        for name, start, stop in self._pending:
            if stop.query():
                self.done[name] = self.done.get(name, 0.0) + start.elapsed_time(stop) / 1000.0
            else:
                still.append((name, start, stop))
        self._pending = still
        out, self.done = self.done, {}
        return out
