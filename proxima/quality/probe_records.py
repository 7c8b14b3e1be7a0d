"""The damage model's samples: one record per block compressed in one layer, with the features
the model learns from and the probe error measured there (`proxima.quality.damage`).

`ProbeLog` is a probe hook (`proxima.integration.hf.hooks.ProbeHook`): attached to a
`ProximaCache` (`probe_hook=`), it is called for every layer of every compression, every layer
then measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from proxima.formats import Format
from proxima.integration.hf.cache import ProximaCache


@dataclass
class ProbeRecord:
    """One block compressed in one layer: the features and error the damage model learns from."""

    layer: int
    block: int
    fmt: str
    importance: float
    """Attention mass the observation window gives the block in this layer (max over heads)."""
    key_norm_spread: float
    """Std / mean of the block's key norms (mean over heads)."""
    error: float
    """Relative error of the observation window's attention output over the block."""


class ProbeLog:
    """The records of one cache's compressions, in order (see the module docstring)."""

    def __init__(self) -> None:
        self.records: list[ProbeRecord] = []

    def fork(self) -> ProbeLog:
        out = ProbeLog()
        out.records = list(self.records)
        return out

    def __call__(self, layer_idx: int, blocks: list[int], fmt: Format, k: torch.Tensor,
                 token_importance: torch.Tensor | None, errors: torch.Tensor, batch: int) -> None:
        norms = k.float().norm(dim=-1)  # [N, bs, H]
        spread = (norms.std(1) / norms.mean(1).clamp_min(1e-12)).mean(1).view(-1, batch).mean(1)
        timp = token_importance
        mass = timp.sum(1).amax(1).view(-1, batch).amax(1) if timp is not None else torch.zeros(len(blocks))
        # One device-to-host copy per tensor (a float() per element would synchronise a GPU each time).
        masses, spreads, errs = mass.tolist(), spread.tolist(), errors.tolist()
        for j, blk in enumerate(blocks):
            self.records.append(ProbeRecord(layer_idx, blk, fmt.name, masses[j], spreads[j], errs[j]))


def probe_records(cache: ProximaCache) -> list[ProbeRecord]:
    """The records of `cache`'s `ProbeLog` (empty without one)."""
    hook = cache.probe_hook
    return list(hook.records) if isinstance(hook, ProbeLog) else []


__all__ = ["ProbeLog", "ProbeRecord", "probe_records"]
