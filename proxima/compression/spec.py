"""Per-format storage facts: what a compressed slot holds, in bytes, keyed by `Format`.

`proxima.formats` says what a format *means* (ratio, kept tokens); this module says how it is
*stored*: the packed element type, the packed head dim, and the metadata (scales, zero points,
counts) that lives in the side table next to vLLM's KV tensor. Pure Python, no torch, so the
policy engine and the simulator may import it for byte accounting.

Storage contract (DESIGN.md "Block formats"): a physical bf16 block of `block_size` tokens holds
exactly `fmt.pack_ratio` slots of one format; a slot's *data* bytes (keys and values) are
exactly the physical block's data bytes divided by the pack ratio. Metadata is never stored in
the block: it goes to the side table, and `meta_bytes_per_slot` reports its size so the policy
can count it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from proxima.formats import DEFAULT_GROUP_SIZE, Format

QUANT_CODE: dict[str, int] = {"bf16": 0, "fp8": 1, "int8": 2, "int4": 3, "int2": 4, "int4h": 5, "int2h": 6}
"""Integer id of each quantization, used as a `constexpr` selector by the Triton kernels."""

VALUES_PER_BYTE: dict[str, int] = {"int4": 2, "int2": 4, "int4h": 2, "int2h": 4}
"""Sub-byte formats pack along the head dim: byte j holds elements j*P .. j*P+P-1, element
j*P+i in bits [i*b, (i+1)*b) (little end first), so a kernel unpacks with one shift and a mask."""

KIVI_KEYS: dict[str, int] = {"int8": 8, "int4": 4, "int2": 2}
"""Quantizations whose *keys* are KIVI-grouped (per channel, groups of tokens, asymmetric), with
their bits. int8 is here although DESIGN.md first said "per token-head scale" for its keys: on
keys with outlier channels a per-token scale is set by the outliers and costs the other
channels their precision (attention error from the keys alone: 1.7% per token vs 0.22% per
channel on synthetic KV with outlier channels, see docs/compression.md), so int8 keys are per
channel; int8 values stay per token."""

LEAN_BITS: dict[str, int] = {"int4h": 4, "int2h": 2}
"""The lean quantizations (issue 40): one float16 scale per (token, head) for keys and values, codes
on a symmetric mid-rise grid of 2^bits levels (no zero point per row), rows rotated by
`reference.rotation(head_dim)` (a seeded randomised Hadamard matrix: it spreads outlier channels so
that one scale serves every channel). Keys first lose their block's per-channel mean, stored as
`k_zero` [1, D] float16 per slot and head (KIVI's key zero point with one group for the slot).
Dequantization rotates back and adds the mean, so every reader of dequantized KV is unchanged.
Metadata per token and head: 4 bytes of scales plus 2 x D / C of key means (C = slot tokens);
at block 64 and head_dim 64, 6 bytes against KIVI int4's 16 (G 32) or 8 (G 64)."""

FP8_E4M3_MAX = 448.0
INT8_MAX = 127.0


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclass(frozen=True)
class MetaField:
    """One metadata tensor of a slot, per KV head: `shape` excludes the slot and head axes."""

    name: str
    shape: tuple[int, ...]
    """Per (slot, head) shape in elements, e.g. (tokens,) or (key_groups, head_dim)."""
    dtype: str
    """'float32' or 'float16' (numpy/torch spelling)."""

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def bytes_per_head(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.itemsize


@dataclass(frozen=True)
class SlotSpec:
    """How one format is stored for a given block size, head dim, KV head count and group size.

    Shapes use named dims: a slot's keys are `[slot_tokens, H_kv, packed_dim]` of `data_dtype`,
    values the same.
    """

    fmt: Format
    block_size: int
    head_dim: int
    num_kv_heads: int
    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        fmt, b, d, g = self.fmt, self.block_size, self.head_dim, self.group_size
        if b <= 0 or d <= 0 or self.num_kv_heads <= 0:
            raise ValueError(
                f"block_size, head_dim and num_kv_heads must be positive, got {b}, {d}, {self.num_kv_heads}"
            )
        if b % fmt.reduction_ratio:
            raise ValueError(
                f"{fmt}: block_size must be divisible by the reduction ratio {fmt.reduction_ratio}, got {b}"
            )
        if fmt.quant in KIVI_KEYS and not _is_pow2(g):
            raise ValueError(f"{fmt}: group_size must be a power of two, got {g}")
        if fmt.quant in LEAN_BITS:
            if not _is_pow2(d):
                raise ValueError(f"{fmt}: the Hadamard rotation needs a power-of-two head_dim, got {d}")
        elif fmt.quant in VALUES_PER_BYTE:
            if not _is_pow2(g):
                raise ValueError(f"{fmt}: group_size must be a power of two, got {g}")
            if d % g:
                raise ValueError(f"{fmt}: head_dim must be a multiple of group_size={g}, got {d}")

    @property
    def slot_tokens(self) -> int:
        """Token (or centroid) capacity of one slot: block_size / reduction ratio."""
        return self.fmt.kept_tokens(self.block_size)

    @property
    def key_dtype(self) -> str:
        """torch dtype name of stored key elements (uint8 codes for KIVI-grouped keys)."""
        return "uint8" if self.fmt.quant in KIVI_KEYS else self.data_dtype

    @property
    def data_dtype(self) -> str:
        """torch dtype name of stored value elements ('bfloat16' stands for the hot cache dtype)."""
        return {
            "bf16": "bfloat16",
            "fp8": "float8_e4m3fn",
            "int8": "int8",
            "int4": "uint8",
            "int2": "uint8",
            "int4h": "uint8",
            "int2h": "uint8",
        }[self.fmt.quant]

    @property
    def packed_dim(self) -> int:
        """Elements of `data_dtype` per token and head (head_dim / values per byte)."""
        return self.head_dim // VALUES_PER_BYTE.get(self.fmt.quant, 1)

    @property
    def key_groups(self) -> int:
        """KIVI key groups along tokens in a full slot (per channel)."""
        return -(-self.slot_tokens // self.group_size)

    def meta_fields(self) -> tuple[MetaField, ...]:
        """The side-table tensors of this format (per slot and KV head)."""
        q, t = self.fmt.quant, self.slot_tokens
        fields: list[MetaField] = []
        kg = (self.key_groups, self.head_dim)
        if q == "fp8":
            fields += [MetaField("k_scale", (t,), "float32"), MetaField("v_scale", (t,), "float32")]
        elif q == "int8":
            fields += [
                MetaField("k_scale", kg, "float16"),
                MetaField("k_zero", kg, "float16"),
                MetaField("v_scale", (t,), "float32"),
            ]
        elif q in LEAN_BITS:
            fields += [
                MetaField("k_scale", (t,), "float16"),
                MetaField("k_zero", (1, self.head_dim), "float16"),
                MetaField("v_scale", (t,), "float16"),
            ]
        elif q in VALUES_PER_BYTE:
            vg = (t, self.head_dim // self.group_size)
            fields += [
                MetaField("k_scale", kg, "float16"),
                MetaField("k_zero", kg, "float16"),
                MetaField("v_scale", vg, "float16"),
                MetaField("v_zero", vg, "float16"),
            ]
        if self.fmt.attention_uses_counts:
            fields.append(MetaField("log_count", (t,), "float32"))
        return tuple(fields)

    @property
    def element_bytes(self) -> int:
        return 2 if self.fmt.quant == "bf16" else 1

    @property
    def data_bytes_per_slot(self) -> int:
        """Key plus value bytes of one slot, all KV heads; equals block bytes / pack ratio."""
        return 2 * self.slot_tokens * self.num_kv_heads * self.packed_dim * self.element_bytes

    @property
    def block_data_bytes(self) -> int:
        """Bytes of one physical bf16 block (keys and values, all KV heads) in one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * 2

    @property
    def meta_bytes_per_slot(self) -> int:
        return self.num_kv_heads * sum(f.bytes_per_head() for f in self.meta_fields())

    @property
    def bytes_per_token(self) -> float:
        """Data plus metadata bytes per *original* token of a full block, one layer."""
        return self.held_bytes_per_slot / self.block_size

    @property
    def held_bytes_per_slot(self) -> int:
        """What one compressed block really costs: its slot's data plus its side-table metadata."""
        return self.data_bytes_per_slot + self.meta_bytes_per_slot

    @property
    def bytes_ratio(self) -> float:
        """16-bit KV bytes of a full block over the bytes it is held in, metadata included (the
        ratio every table reports; `fmt.pack_ratio` is the nominal one, data only)."""
        return bytes_ratio(self.block_data_bytes, self.held_bytes_per_slot)


KV16_ELEMENT_BYTES = 2
"""The reference every ratio is measured against: keys and values in a 16-bit dtype (bf16)."""


def kv16_bytes(tokens: int, num_kv_heads: int, head_dim: int, layers: int = 1) -> int:
    """Bytes of `tokens` tokens' keys and values held uncompressed in 16 bits."""
    return 2 * tokens * num_kv_heads * head_dim * KV16_ELEMENT_BYTES * layers


def bytes_ratio(kv16: float, held: float) -> float:
    """The compression ratio Proxima reports everywhere: 16-bit KV bytes over the bytes actually
    held for them (compressed data, scales, zero points, counts; hot blocks at 16 bits). 1.0 for
    an empty store."""
    if held < 0 or kv16 < 0:
        raise ValueError(f"byte counts must be >= 0, got kv16={kv16}, held={held}")
    if held == 0:
        return 1.0 if kv16 == 0 else float("inf")
    return kv16 / held


def slot_spec(
    fmt: Format | str, *, block_size: int, head_dim: int, num_kv_heads: int, group_size: int = DEFAULT_GROUP_SIZE
) -> SlotSpec:
    """`SlotSpec` for a format given as a `Format` or its spelling."""
    f = Format.parse(fmt) if isinstance(fmt, str) else fmt
    spec = SlotSpec(f, block_size, head_dim, num_kv_heads, group_size)
    # The whole storage contract rests on this equality; check it where it is made.
    assert spec.data_bytes_per_slot * f.pack_ratio == spec.block_data_bytes, spec
    return spec


def check_group_size(
    group_size: int, head_dim: int, formats: Iterable[Format], where: str = "storage.group_size"
) -> None:
    """Raise a `ValueError` naming `where` if `group_size` cannot store one of `formats` at this
    head dim (int4 / int2 values are grouped along the head dim, so the group must divide it).
    Both integrations call it before their first compression, so a policy whose group does not fit
    the model fails at start-up with its field named, not at every compression batch."""
    if not _is_pow2(group_size):
        raise ValueError(f"{where}={group_size}: the quantization group size must be a power of two")
    grouped = [f for f in formats if f.quant in VALUES_PER_BYTE and f.quant not in LEAN_BITS]  # lean: no group
    bad = sorted({f.name for f in grouped if head_dim % group_size})
    if bad:
        raise ValueError(
            f"{where}={group_size} does not divide the model's head_dim {head_dim}: {', '.join(bad)} group values "
            f"along the head dim (use a power of two <= {head_dim}; {head_dim} = one group per token and head)"
        )
