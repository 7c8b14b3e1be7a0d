"""`KVSegment`: one compressed format's part of every sequence's context (the input of attention).

In a module of its own because both attention paths read it: the torch path (`attention.py`)
and the Triton kernels (`triton_attention.py`), which `attention.py` calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from proxima.compression.blocks import CompressedBlocks


@dataclass
class KVSegment:
    """One format's part of every sequence's context.

    `store` holds the slots (dim 0 = slot id); `slot_table[s, e]` is the slot of sequence s's
    e-th entry and `slot_tokens[s, e]` how many of its tokens (or centroids) are valid; entries
    with 0 tokens are padding (their slot id is ignored). Entry order does not matter to
    attention (no positions: keys are cached after RoPE).
    """

    store: CompressedBlocks
    slot_table: torch.Tensor
    """[S, E] int32 slot ids."""
    slot_tokens: torch.Tensor
    """[S, E] int32 valid tokens per entry (0 = padding)."""

    def __post_init__(self) -> None:
        if self.slot_table.dim() != 2 or self.slot_tokens.shape != self.slot_table.shape:
            raise ValueError(
                f"slot_table and slot_tokens must both be [S, E], got {tuple(self.slot_table.shape)} "
                f"and {tuple(self.slot_tokens.shape)}"
            )
        cap = self.store.slot_tokens
        # Checked only for CPU tables: on the GPU it would cost a device sync per layer and step
        # (the CUDA backend builds a segment per layer). Nothing unsafe follows from a larger
        # count there: kernel and reference read tokens 0 .. C-1 of a slot and no further.
        on_host = not self.slot_tokens.is_cuda
        if on_host and self.slot_tokens.numel() and int(self.slot_tokens.max()) > cap:
            raise ValueError(f"slot_tokens may not exceed the slot capacity {cap}, got {int(self.slot_tokens.max())}")
