"""Fault injection, for tests and benchmarks only: make the worker's compression batches fail.

Two switches, both read by the worker process:

* `PROXIMA_FAULT_INJECT`, fixed at startup: `compress` (every batch fails) or `compress@N`
  (every Nth batch fails); either may end in `,rank=R`: only tensor-parallel rank R fails
  (the other ranks write the same batches, which the scheduler must then undo everywhere);
* `PROXIMA_FAULT_FILE`, a path: the file holds the same spelling and is re-read once per engine
  step, before the step's compressions (missing or empty: no fault). Writing it switches faults
  on and off while the engine runs, which is how `bench/soak.py` and the backoff test inject
  bursts. When it is set it replaces `PROXIMA_FAULT_INJECT`.

A fault raises `InjectedFault` inside the executor's transaction, exactly where a kernel error
would: the batch's blocks stay uncompressed and no request notices. Never set these in
production.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger("proxima.vllm")
FAULT_ENV = "PROXIMA_FAULT_INJECT"
FAULT_FILE_ENV = "PROXIMA_FAULT_FILE"
MAX_FAULT_FILE_BYTES = 256
"""A fault spelling is a few bytes; more is not a fault file (read no further)."""


class InjectedFault(RuntimeError):
    """Raised by the executor when a fault is switched on (tests and benchmarks only)."""


def parse_fault(text: str, source: str) -> int | None:
    """Every how many batches one fails (1: all of them), or None for no fault (`,rank=R` ignored:
    `parse_rank`)."""
    spelling = text.strip()
    if not spelling:
        return None
    name, at, every = spelling.partition(",")[0].partition("@")
    parse_rank(spelling, source)
    if name == "compress" and not at:
        return 1
    if name == "compress" and every.isdigit() and int(every) >= 1:
        return int(every)
    raise ValueError(f"{source}: unknown fault {spelling[:40]!r}; expected 'compress' or 'compress@N' with N >= 1")


def parse_rank(text: str, source: str) -> int | None:
    """The one tensor-parallel rank a fault hits (`...,rank=R`), or None: every rank."""
    _, comma, tail = text.strip().partition(",")
    if not comma:
        return None
    key, _, value = tail.partition("=")
    if key.strip() != "rank" or not value.strip().isdigit():
        raise ValueError(f"{source}: unknown fault option {tail[:40]!r}; expected 'rank=R' with R >= 0")
    return int(value)


class FaultInjector:
    """The worker's fault switch: `refresh()` once per step, `check()` before each batch."""

    def __init__(self, environ: Mapping[str, str] = os.environ, rank: int = 0) -> None:
        self._environ = environ
        self.rank = rank
        """This worker's tensor-parallel rank (a `,rank=R` fault hits rank R only)."""
        self.every: int | None = None
        self.spelling = ""
        self.batches = 0
        """Batches seen while a fault was on (the `@N` count runs over these)."""
        self.injected = 0
        self._bad: str | None = None

    def refresh(self) -> None:
        """Read the switch for this step (the file, when one is named; else the variable)."""
        path = self._environ.get(FAULT_FILE_ENV)
        if path:
            try:
                with open(path, "rb") as f:
                    raw = f.read(MAX_FAULT_FILE_BYTES)
            except FileNotFoundError:
                raw = b""
            text, source = raw.decode("utf-8", "replace"), f"{FAULT_FILE_ENV}={Path(path)}"
        else:
            text, source = self._environ.get(FAULT_ENV, ""), FAULT_ENV
        if text == self.spelling:
            return
        try:
            every = parse_fault(text, source)
        except ValueError as e:
            if path:  # a benchmark's typo must not stop the engine: say so once, inject nothing
                if text != self._bad:
                    logger.error("proxima: %s; no fault injected", e)
                    self._bad = text
                self.every, self.spelling = None, text
                return
            raise
        only = parse_rank(text, source)
        self.every = every if only is None or only == self.rank else None
        self.spelling = text

    def check(self) -> None:
        """Raise `InjectedFault` if the fault hits this batch."""
        if self.every is None:
            return
        self.batches += 1
        if self.batches % self.every == 0:
            self.injected += 1
            raise InjectedFault(f"injected fault {self.spelling.strip()!r}")


__all__ = ["FAULT_ENV", "FAULT_FILE_ENV", "FaultInjector", "InjectedFault", "parse_fault"]
