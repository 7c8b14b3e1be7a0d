"""Diagnostics of the attention split (never on in production).

`PROXIMA_DEBUG=check-values`: the worker's compressions check importance and counts for NaN
(`checks_values`; each check reads back to the host, so a GPU step has none by default).

`PROXIMA_DEBUG=read-sources`: compressed rows read their freed *source* blocks through Proxima's
split path instead of their compressed slots (valid only while those blocks are not reused, i.e.
with a pool much larger than the workload). That isolates the row split, the tables and the
kernels' plumbing from the formats' loss: outputs must then equal vanilla vLLM's to within bf16
rounding.

On CUDA the backend also compares, in every layer, the split path's output of those rows with
what vLLM's own kernel computed for them in the same full batch, and keeps the worst relative
error per layer; with `PROXIMA_DEBUG_FILE` set, the worker writes them there (JSON) every step.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

DEBUG_ENV = "PROXIMA_DEBUG"
DEBUG_FILE_ENV = "PROXIMA_DEBUG_FILE"


def _debug_modes() -> list[str]:
    return os.environ.get(DEBUG_ENV, "").split(",")


def reads_sources() -> bool:
    return "read-sources" in _debug_modes()


def checks_values() -> bool:
    """`PROXIMA_DEBUG=check-values` (comma-separated with other modes): the worker's compression
    checks its inputs for NaN, a read back to the host in every step (a GPU sync), so off by default."""
    return "check-values" in _debug_modes()


@dataclass
class SplitErrors:
    """Worst relative error of the split path against vLLM's kernel, per layer (read-sources)."""

    per_layer: dict[str, float] = field(default_factory=dict)
    rows_checked: int = 0

    def add(self, layer: str, rel_err: float, rows: int) -> None:
        self.per_layer[layer] = max(self.per_layer.get(layer, 0.0), rel_err)
        self.rows_checked += rows

    def dump(self) -> None:
        path = os.environ.get(DEBUG_FILE_ENV)
        if not path or not self.per_layer:
            return
        tmp = f"{path}.{os.getpid()}.tmp"  # every rank of a tensor-parallel engine writes here (last wins)
        with open(tmp, "w") as f:
            json.dump({"max_rel_err_per_layer": self.per_layer, "rows_checked": self.rows_checked,
                       "max_rel_err": max(self.per_layer.values())}, f)
        os.replace(tmp, path)
