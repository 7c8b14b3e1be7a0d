"""The vocabulary of compressed KV block formats, as plain data.

One place defines what a format *is* (its name, how it reduces tokens, how it quantizes, what it
packs to), so that the policy language, the decision engine, the simulator, the kernels and the
vLLM integration all agree. This module imports no torch and no vLLM: the policy engine must stay
pure, and the kernels attach their implementations to these names elsewhere
(`proxima.compression`).

Spelling (what a policy file writes):

    bf16                  hot, uncompressed (pack ratio 1)
    fp8 | int8            quantized, 2x
    int4                  KIVI-style 4-bit, 4x
    int2                  KIVI-style 2-bit, 8x
    int4h | int2h         lean 4-bit / 2-bit: one fp16 scale per token and head, keys rotated by a
                          seeded randomised Hadamard transform first (the "h"), 3.76x / 7.11x held
    sparse(R)             keep 1/R of a block's tokens (the most important), Rx
    cluster(R)            STAR-KV: merge a block's tokens into 1/R weighted centroids, Rx
    sparse(R)+int8        a token reduction followed by a quantization: ratios multiply

`R` is a *ratio*, not a token count, so a policy means the same thing whatever vLLM's block
size is; `Format.kept_tokens(block_size)` turns it into a count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

Quant = Literal["bf16", "fp8", "int8", "int4", "int2", "int4h", "int2h"]
Reduction = Literal["sparse", "cluster"]

QUANT_BITS: dict[str, int] = {"bf16": 16, "fp8": 8, "int8": 8, "int4": 4, "int2": 2, "int4h": 4, "int2h": 2}
"""Bits per stored element; the hot cache is 16-bit, so the quantization pack ratio is 16/bits."""

MAX_REDUCTION_RATIO = 64

_PATTERN = re.compile(
    r"""^\s*
    (?:(?P<red>sparse|cluster)\s*\(\s*(?P<ratio>\d+)\s*\))?     # optional token reduction
    \s*(?P<plus>\+)?\s*
    (?P<quant>bf16|fp8|int8|int4h|int2h|int4|int2)?                     # optional quantization
    \s*$""",
    re.VERBOSE,
)


class FormatError(ValueError):
    """A format string that does not name a valid format."""


@dataclass(frozen=True, order=True)
class Format:
    """A compressed block format: an optional token reduction, then a quantization.

    Frozen and hashable so it can key dictionaries (damage tables, per-format counters).
    """

    reduction: Reduction | None = None
    reduction_ratio: int = 1
    quant: Quant = "bf16"

    def __post_init__(self) -> None:
        if self.quant not in QUANT_BITS:
            raise FormatError(f"unknown quantization {self.quant!r}; valid: {sorted(QUANT_BITS)}")
        if self.reduction is None and self.reduction_ratio != 1:
            raise FormatError("reduction_ratio must be 1 when there is no reduction")
        if self.reduction is not None and not (2 <= self.reduction_ratio <= MAX_REDUCTION_RATIO):
            raise FormatError(
                f"{self.reduction}(R) needs 2 <= R <= {MAX_REDUCTION_RATIO}, got R={self.reduction_ratio}"
            )

    @classmethod
    def parse(cls, text: str) -> Format:
        """Parse `int4`, `sparse(4)`, `cluster(2)+int8` ... (see the module docstring)."""
        if not isinstance(text, str):
            raise FormatError(f"a format is a string such as 'int4' or 'sparse(4)', got {text!r}")
        m = _PATTERN.match(text)
        if m is None or (m["red"] is None and m["quant"] is None):
            raise FormatError(
                f"unknown format {text!r}; valid: bf16, fp8, int8, int4, int2, int4h, int2h, sparse(R), "
                "cluster(R), or a reduction then a quantization such as 'sparse(2)+int8'"
            )
        if m["plus"] and (m["red"] is None or m["quant"] is None):
            raise FormatError(f"format {text!r}: '+' joins a reduction and a quantization")
        if m["red"] is not None and m["quant"] is not None and not m["plus"]:
            raise FormatError(f"format {text!r}: write a composition as 'sparse(2)+int8'")
        quant: Quant = m["quant"] or "bf16"  # type: ignore[assignment]
        if m["red"] is None:
            return cls(quant=quant)
        return cls(reduction=m["red"], reduction_ratio=int(m["ratio"]), quant=quant)  # type: ignore[arg-type]

    @property
    def name(self) -> str:
        """Canonical spelling; `Format.parse(f.name) == f`."""
        if self.reduction is None:
            return self.quant
        base = f"{self.reduction}({self.reduction_ratio})"
        return base if self.quant == "bf16" else f"{base}+{self.quant}"

    def __str__(self) -> str:
        return self.name

    @property
    def is_hot(self) -> bool:
        return self.reduction is None and self.quant == "bf16"

    @property
    def quant_ratio(self) -> int:
        return 16 // QUANT_BITS[self.quant]

    @property
    def pack_ratio(self) -> int:
        """How many compressed slots of this format fit in one physical (bf16) block."""
        return self.reduction_ratio * self.quant_ratio

    def kept_count(self, tokens: int) -> int:
        """Tokens (or centroids) kept from `tokens` tokens of one block: ceil(tokens / R) after a
        reduction, all of them otherwise. The one kept-token rule: a partial block rounds up (a
        block's last token is never reduced away), and a full block is the case `tokens == B`."""
        if tokens < 0:
            raise FormatError(f"{self.name}: a block holds a non-negative number of tokens, got {tokens}")
        return -(-tokens // self.reduction_ratio)

    def kept_tokens(self, block_size: int) -> int:
        """Tokens (or centroids) a full block keeps (`kept_count(block_size)`): the rows of one
        compressed slot. `pack_ratio` slots share one physical block, so a reduction must divide
        the block size: a full block's count is exact, never rounded."""
        if block_size % self.reduction_ratio:
            raise FormatError(f"{self.name}: block size {block_size} is not divisible by ratio {self.reduction_ratio}")
        return self.kept_count(block_size)

    @property
    def attention_uses_counts(self) -> bool:
        """Clustered slots add log(count) to each centroid's logit."""
        return self.reduction == "cluster"


def recompressible(src: Format, dst: Format) -> bool:
    """Whether a block stored as `src` can be compressed further into `dst` from what it holds
    (the engine, both integrations and the kernels ask this one function).

    Always towards a higher pack ratio. A quantized-only block: into anything (from its
    dequantised data; its loss is kept). A token-reduced block keeps a reduction of at least its
    ratio: cluster(R) -> cluster(R' >= R) merges centroids (counts add, so a centroid still stands
    for the original tokens it holds), sparse(R) -> sparse(R' >= R) drops more of the kept tokens,
    sparse(R) -> cluster(R' >= R) merges them. A centroid can be neither sparsified (its count
    would be lost) nor stored without a reduction.
    """
    if dst.pack_ratio <= src.pack_ratio:
        return False
    if src.reduction is None:
        return True
    if dst.reduction is None or dst.reduction_ratio < src.reduction_ratio:
        return False
    return not (src.reduction == "cluster" and dst.reduction == "sparse")


HOT = Format()

DEFAULT_GROUP_SIZE = 32
"""KIVI group size: keys are grouped along tokens per channel, values along channels per token.
The default of a policy's `storage.group_size`; defined here (pure Python) so that the policy
language and the storage layer (`proxima.compression.spec`) share one constant."""
QUANTS: tuple[str, ...] = get_args(Quant)


def parse_format(text: str) -> Format:
    return Format.parse(text)
