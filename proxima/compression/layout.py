"""Views of vLLM's per-layer KV tensor: hot paged blocks, and compressed slots inside blocks.

vLLM 0.32 gives each attention layer one tensor of logical shape [num_blocks, H, B, 2 * D]
(per block, KV head and token: key then value channels), in a physical order chosen by the
backend's KV-cache layout:

- CPU_ATTN (`KVLayout.CPU_ATTN`, physical LBHNC = identity): the backend reinterprets each
  (block, head) page as [2 * B, D]: keys of all B tokens, then values of all B tokens. Careful:
  *inside* each half the order is the kernel's, by ISA (on x86 without AMX the keys are stored
  channel-major, [D, B]); `hot_store` here assumes token-major halves, so the vLLM integration
  reads CPU pages through `proxima.integration.vllm.worker.page_layout.PageLayout` (probed from vLLM).
- FlashAttention / Triton on CUDA (`KVLayout.FLASH_ATTN`): the backend reads keys as
  `kv.transpose(1, 2)[..., :D]` and values as `[..., D:]`, strides whatever the layout gives.

Both are *block-contiguous* (the block is the outermost physical axis), which is what lets a
physical block be reinterpreted as `pack_ratio` compressed slots: slot j of block b owns bytes
[j * S, (j + 1) * S) of the block's bytes, S = block bytes / pack ratio; inside a slot, the
first half holds keys [C, H, P] and the second half values, in `SlotSpec.data_dtype`. Metadata
lives in a `SideTable` indexed by the same slot id (block * ratio + j). The layout inside a slot
is Proxima's own in both layouts, since only Proxima's kernels read compressed slots.
"""

from __future__ import annotations

from enum import Enum

import torch

from proxima.compression.blocks import CompressedBlocks
from proxima.compression.spec import LEAN_BITS, SlotSpec
from proxima.formats import HOT

_TORCH_DTYPE = {
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "float16": torch.float16,
    "float32": torch.float32,
}


class KVLayout(str, Enum):  # noqa: UP042 - (str, Enum) keeps str() and format() output as callers see it today
    CPU_ATTN = "cpu_attn"
    FLASH_ATTN = "flash_attn"


def _check_kv(kv: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    if kv.dim() != 4 or kv.shape[1] != num_kv_heads or kv.shape[3] != 2 * head_dim:
        raise ValueError(
            f"kv_cache must be [num_blocks, H={num_kv_heads}, B, 2*D={2 * head_dim}], got {tuple(kv.shape)}"
        )
    return int(kv.shape[0]), int(kv.shape[2])


def hot_store(kv_cache: torch.Tensor, layout: KVLayout, *, num_kv_heads: int, head_dim: int) -> CompressedBlocks:
    """The hot (bf16) blocks as a `CompressedBlocks` pool: k_data, v_data [num_blocks, B, H, D]
    are strided views (no copy) onto `kv_cache`, slot id = physical block id."""
    nb, b = _check_kv(kv_cache, num_kv_heads, head_dim)
    if layout == KVLayout.CPU_ATTN:
        if not kv_cache.is_contiguous():
            raise ValueError("CPU_ATTN kv_cache must be contiguous (physical layout LBHNC)")
        pages = kv_cache.view(nb, num_kv_heads, 2 * b, head_dim)
        k = pages[:, :, :b].permute(0, 2, 1, 3)
        v = pages[:, :, b:].permute(0, 2, 1, 3)
    elif layout == KVLayout.FLASH_ATTN:
        kvt = kv_cache.transpose(1, 2)  # [nb, B, H, 2D]
        k, v = kvt[..., :head_dim], kvt[..., head_dim:]
    else:
        raise ValueError(f"layout must be one of {[x.value for x in KVLayout]}, got {layout!r}")
    return CompressedBlocks(HOT, k, v, head_dim=head_dim, dtype=kv_cache.dtype)


def block_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """uint8 [num_blocks, bytes per block] view of a block-contiguous KV tensor (any layout)."""
    nb = kv_cache.shape[0]
    strides = kv_cache.stride()
    order = sorted(range(kv_cache.dim()), key=lambda i: -strides[i])  # stable: ties keep logical order
    phys = kv_cache.permute(*order)
    if order[0] != 0 or not phys.is_contiguous():
        raise ValueError(
            f"kv_cache must be block-contiguous (block axis outermost, dense); strides {kv_cache.stride()}"
        )
    return phys.reshape(nb, -1).view(torch.uint8)


class SideTable:
    """Metadata of every slot of one format in one layer: tensors [num_slots, ...] keyed by name.

    Exists because compressed slots must fill their physical block's bytes exactly: scales, zero
    points and counts cannot live in the block, so they live here, at the same slot id.
    """

    def __init__(self, spec: SlotSpec, num_slots: int, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.tensors: dict[str, torch.Tensor] = {}
        for f in spec.meta_fields():
            shape = (num_slots, f.shape[0], spec.num_kv_heads, *f.shape[1:])
            self.tensors[f.name] = torch.zeros(shape, dtype=_TORCH_DTYPE[f.dtype], device=device)

    def get(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)


def slot_pool(
    kv_cache: torch.Tensor, spec: SlotSpec, side: SideTable | None = None, *, dtype: torch.dtype | None = None
) -> CompressedBlocks:
    """Every physical block of `kv_cache` seen as `spec.fmt.pack_ratio` slots of `spec.fmt`.

    Returns a `CompressedBlocks` whose k_data / v_data [num_blocks * ratio, C, H, P] alias the
    KV tensor's bytes and whose metadata tensors are `side`'s. Slot id = block * ratio + j.
    """
    if kv_cache.element_size() != 2:
        raise ValueError(f"slot pools need a 16-bit KV cache (bf16/fp16), got {kv_cache.dtype}")
    u8 = block_bytes(kv_cache)
    nb, bb = u8.shape
    if bb != spec.block_data_bytes:
        raise ValueError(
            f"{spec.fmt}: a block of this kv_cache has {bb} bytes, the spec expects {spec.block_data_bytes} "
            f"(B={spec.block_size}, H={spec.num_kv_heads}, D={spec.head_dim}, 16-bit cache)"
        )
    r = spec.fmt.pack_ratio
    slots = u8.view(nb * r, bb // r)
    half = bb // r // 2
    shape = (nb * r, spec.slot_tokens, spec.num_kv_heads, spec.packed_dim)
    k = slots[:, :half].view(_TORCH_DTYPE.get(spec.key_dtype, kv_cache.dtype)).view(shape)
    v = slots[:, half:].view(_TORCH_DTYPE.get(spec.data_dtype, kv_cache.dtype)).view(shape)
    side = side if side is not None else SideTable(spec, nb * r, kv_cache.device)
    return CompressedBlocks(
        spec.fmt,
        k,
        v,
        head_dim=spec.head_dim,
        dtype=dtype or kv_cache.dtype,
        group_size=spec.group_size,
        k_scale=side.get("k_scale"),
        k_zero=side.get("k_zero"),
        v_scale=side.get("v_scale"),
        v_zero=side.get("v_zero"),
        log_count=side.get("log_count"),
    )


def write_slots(pool: CompressedBlocks, slot_ids: torch.Tensor, cb: CompressedBlocks) -> None:
    """Store compressed block i of `cb` into slot `slot_ids[i]` of `pool` (data and metadata).

    `cb` may hold fewer tokens than a slot (a partial block): the rest of the slot is left as it
    was, and the caller records `cb.slot_tokens` as the entry's valid token count.
    """
    if cb.fmt != pool.fmt:
        raise ValueError(f"pool holds {pool.fmt}, got blocks of {cb.fmt}")
    if slot_ids.shape != (cb.num_slots,):
        raise ValueError(f"slot_ids must be [{cb.num_slots}], got {tuple(slot_ids.shape)}")
    c = cb.slot_tokens
    if c > pool.slot_tokens:
        raise ValueError(f"{cb.fmt}: {c} tokens do not fit a slot of {pool.slot_tokens}")
    ids = slot_ids.to(pool.k_data.device, torch.long)
    pool.k_data[ids, :c] = cb.k_data.to(pool.k_data.dtype)
    pool.v_data[ids, :c] = cb.v_data.to(pool.v_data.dtype)
    for name in ("k_scale", "k_zero", "v_scale", "v_zero", "log_count"):
        src, dst = getattr(cb, name), getattr(pool, name)
        if (src is None) != (dst is None):
            raise ValueError(f"{cb.fmt}: metadata {name} present in one of pool / blocks only")
        if src is not None:
            dst[ids, : src.shape[1]] = src.to(dst.dtype)


def read_slots(pool: CompressedBlocks, slot_ids: torch.Tensor, tokens: int) -> CompressedBlocks:
    """Copy of the slots `slot_ids`, trimmed to `tokens` valid tokens (inverse of write_slots)."""
    sub = pool.select(slot_ids.to(pool.k_data.device, torch.long))
    g = -(-tokens // pool.group_size)

    def trim(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
        return None if t is None else t[:, :n].contiguous()

    sub.k_data, sub.v_data = sub.k_data[:, :tokens].contiguous(), sub.v_data[:, :tokens].contiguous()
    per_token_keys = pool.fmt.quant == "fp8" or pool.fmt.quant in LEAN_BITS  # else per key group
    sub.k_scale = trim(sub.k_scale, tokens if per_token_keys else g)
    sub.k_zero = trim(sub.k_zero, g)
    sub.v_scale, sub.v_zero = trim(sub.v_scale, tokens), trim(sub.v_zero, tokens)
    sub.log_count = trim(sub.log_count, tokens)
    return sub
