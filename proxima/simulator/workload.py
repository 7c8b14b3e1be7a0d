"""Workloads for the simulator: a seeded synthetic generator, or a JSONL trace.

A trace line is one request: `{"arrival": 0, "prompt_tokens": 1500, "output_tokens": 256}`
(`arrival` is an engine step; `id` is optional).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    arrival: int
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class WorkloadConfig:
    """The default is memory-bound: the pool holds about 18 full requests of the 128 offered."""

    num_requests: int = 128
    prompt_min: int = 1024
    prompt_max: int = 2048
    output_min: int = 128
    output_max: int = 384
    arrival_rate: float = 4.0
    """Mean requests arriving per engine step (Poisson); 0 means all arrive at step 0."""


def synthetic(cfg: WorkloadConfig, seed: int) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(cfg.prompt_min, cfg.prompt_max + 1, cfg.num_requests)
    outputs = rng.integers(cfg.output_min, cfg.output_max + 1, cfg.num_requests)
    if cfg.arrival_rate > 0:
        arrivals = np.cumsum(rng.exponential(1.0 / cfg.arrival_rate, cfg.num_requests)).astype(int)
    else:
        arrivals = np.zeros(cfg.num_requests, dtype=int)
    return [
        RequestSpec(f"req-{i}", int(a), int(p), int(o))
        for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs, strict=True))
    ]


class TraceError(ValueError):
    pass


def load_trace(path: str | Path) -> list[RequestSpec]:
    """Read a JSONL trace; errors name the file, line and field."""
    out: list[RequestSpec] = []
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise TraceError(f"{p}: cannot read trace: {exc.strerror}") from None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{p}:{n}:{exc.colno}: invalid JSON: {exc.msg}") from None
        if not isinstance(row, dict):
            raise TraceError(f"{p}:{n}: each line must be a JSON object")
        for key, lo in (("prompt_tokens", 1), ("output_tokens", 1), ("arrival", 0)):
            value = row.get(key, 0 if key == "arrival" else None)
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise TraceError(f"{p}:{n}: field {key!r} must be an integer >= {lo}, got {value!r}")
        unknown = set(row) - {"id", "arrival", "prompt_tokens", "output_tokens"}
        if unknown:
            raise TraceError(f"{p}:{n}: unknown field(s) {sorted(unknown)}")
        out.append(
            RequestSpec(
                str(row.get("id", f"req-{n}")), row.get("arrival", 0), row["prompt_tokens"], row["output_tokens"]
            )
        )
    if not out:
        raise TraceError(f"{p}: trace holds no requests")
    return out
