"""A request's per-token importance on the worker: the observed attention mass, averaged over steps.

Pure tensor math on the host's copies (the worker store keeps one [tokens, H_kv] tensor per
request and calls these). Kept apart from the store so the averaging rule is stated once.
"""

from __future__ import annotations

import torch

from proxima.observation import fold_heads


def fold_observation(old: torch.Tensor | None, mass: torch.Tensor, *, reset: bool, decay: float) -> torch.Tensor:
    """The request's token importance after one observation.

    mass: float32 [tokens, H_kv], the attention mass each token got from the observed queries
    (NaN where the token could not be seen: compressed blocks keep their last value). `reset` (a
    prefill chunk's observation window) replaces the history of the tokens it saw; decode steps
    update the moving average (`decay` x old + (1 - decay) x mass), and a token seen for the first
    time starts at its first mass."""
    n = mass.shape[0]
    seen = ~torch.isnan(mass)
    if old is None:
        return torch.where(seen, mass, torch.zeros_like(mass))
    kept = torch.zeros_like(mass)
    m = min(n, old.shape[0])
    kept[:m] = old[:m]
    if reset:  # unseen tokens (chunks compressed earlier in the prefill) keep their last value
        return torch.where(seen, mass, kept)
    upd = torch.full_like(mass, float("nan"))
    upd[:m] = decay * old[:m] + (1 - decay) * mass[:m]
    upd[m:] = mass[m:]
    return torch.where(seen, upd, kept)


def block_mass(importance: torch.Tensor, seen: torch.Tensor, block_size: int, aggregate: str) -> list[float]:
    """One number per block for the scheduler: the block's mass (summed over its tokens), folded
    over heads as the policy says (`observation.fold_heads`); blocks with no token seen (`seen`
    [tokens] bool) this step are NaN (the scheduler keeps theirs)."""
    n, b = importance.shape[0], block_size
    nb = -(-n // b)
    pad = torch.zeros(nb * b, importance.shape[1])
    pad[:n] = importance
    per_block = fold_heads(pad.view(nb, b, -1).sum(1), aggregate, 1)
    vis = torch.zeros(nb * b, dtype=torch.bool)
    vis[:n] = seen
    per_block[~vis.view(nb, b).any(1)] = float("nan")
    return list(per_block.tolist())


__all__ = ["block_mass", "fold_observation"]
