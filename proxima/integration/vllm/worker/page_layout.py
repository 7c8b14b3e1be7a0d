"""Where vLLM's attention kernels keep each key and value element inside a block.

vLLM's CPU cache tensor is `[num_blocks, H, B, 2D]`, one *page* of `2 * B * D` elements per
(block, head). The page's inner order belongs to the kernel and depends on its ISA: on x86
without AMX ("vec", "vec16") keys are stored channel-major (`[D, B]`, so a channel of all B
tokens is contiguous) and values token-major (`[B, D]`). Proxima reads tokens out of pages
(compression, importance) and writes tokens into the scratch pages the kernel reads, so it must
use the kernel's order. Rather than hard-code one ISA's order, `probe_layout` asks vLLM's own
`cpu_attn_reshape_and_cache` to store known values and reads back where each element went.

Proxima computes in the *canonical* order `[B, D]` for both halves (keys first); `PageLayout`
converts between the two.

vLLM's CUDA cache (TRITON_ATTN, FlashAttention) has the same `[num_blocks, H, B, 2D]` logical
shape but another page order: per token, the content axis holds its key then its value
(`triton_attn.py` reads `kv_cache.split(head_size, dim=-1)`), see `token_interleaved_layout`.
Which order a worker's pages have is decided by the attention implementation that reads them
(`worker.SlotReader.page_layout`), never by the device alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property

import torch

logger = logging.getLogger("proxima.vllm")


@dataclass(frozen=True)
class PageLayout:
    block_size: int
    head_dim: int
    key_pos: torch.Tensor
    """long [B * D]: page position (in [0, 2BD)) of key element (t, c), listed at t * D + c."""
    value_pos: torch.Tensor

    @cached_property
    def is_canonical(self) -> bool:
        """Computed once: `to_kernel` asks at every layer of every step."""
        n = self.block_size * self.head_dim
        return bool(torch.equal(self.key_pos, torch.arange(n)) and torch.equal(self.value_pos, torch.arange(n, 2 * n)))

    @cached_property
    def page_pos(self) -> torch.Tensor:
        """long [2BD]: page position of each canonical element (keys then values)."""
        return torch.cat([self.key_pos, self.value_pos]).contiguous()

    def pages(self, kv: torch.Tensor) -> torch.Tensor:
        """[N, H, 2BD] view of a `[N, H, B, 2D]` cache (or scratch)."""
        return kv.view(kv.shape[0], kv.shape[1], -1)

    def read_blocks(self, kv: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of whole blocks in canonical order: [N, B, H, D] each."""
        return self.split_pages(self.pages(kv).index_select(0, blocks))

    @cached_property
    def _on_device(self) -> dict[torch.device, tuple[torch.Tensor, torch.Tensor]]:
        return {}

    def positions(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`key_pos`, `value_pos` on `device`, copied once (`WorkerStore.register` calls it before
        serving): indexing a GPU page with the host tensors would copy them in every step, a sync."""
        got = self._on_device.get(device)
        if got is None:
            got = self._on_device[device] = (self.key_pos.to(device), self.value_pos.to(device))
        return got

    def split_pages(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of pages [N, H, 2BD] (gathered whole) in canonical order: [N, B, H, D] each."""
        n, h = p.shape[:2]
        b, d = self.block_size, self.head_dim
        key_pos, value_pos = self.positions(p.device)
        k = p[:, :, key_pos].view(n, h, b, d).transpose(1, 2)
        v = p[:, :, value_pos].view(n, h, b, d).transpose(1, 2)
        return k, v

    def read_keys(self, kv: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Keys of blocks (any index shape S) in canonical order: [*S, H, B, D]."""
        p = self.pages(kv)[blocks]  # [*S, H, 2BD]
        return p[..., self.key_pos].view(*p.shape[:-1], self.block_size, self.head_dim)

    def read_tokens(self, kv: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """Tokens at flat positions (block * B + t): [T, H, 2, D] (key, value), canonical."""
        b, d = self.block_size, self.head_dim
        blk, tok = flat // b, flat % b
        kp = self.key_pos.view(b, d)[tok]  # [T, D]
        vp = self.value_pos.view(b, d)[tok]
        p = self.pages(kv)
        k = p[blk.view(-1, 1, 1), torch.arange(p.shape[1]).view(1, -1, 1), kp.view(len(tok), 1, d)]
        v = p[blk.view(-1, 1, 1), torch.arange(p.shape[1]).view(1, -1, 1), vp.view(len(tok), 1, d)]
        return torch.stack([k, v], 2)  # [T, H, 2, D]

    def to_kernel(self, scratch: torch.Tensor, blocks: torch.Tensor) -> None:
        """Reorder `blocks` of `scratch`, written in canonical order, into the kernel's order (in place)."""
        if self.is_canonical or not len(blocks):
            return
        p = self.pages(scratch)
        kernels = numba_kernels() if p.device.type == "cpu" and p.element_size() == 2 and p.is_contiguous() else None
        if kernels is not None:
            pages = p.view(torch.int16).numpy().view("uint16")
            kernels.permute_pages(pages, blocks.numpy(), self.page_pos.numpy())
            return
        canon = p.index_select(0, blocks)  # [N, H, 2BD] canonical
        n = self.block_size * self.head_dim
        out = torch.empty_like(canon)
        out[:, :, self.key_pos] = canon[:, :, :n]
        out[:, :, self.value_pos] = canon[:, :, n:]
        p.index_copy_(0, blocks, out)


def numba_kernels():  # type: ignore[no-untyped-def]
    """The fused numba kernels module, or None without numba (torch then does the work)."""
    try:
        from proxima.integration.vllm.worker import cpu_kernels as cpu_dequant
    except ImportError:
        return None
    return cpu_dequant


def token_interleaved_layout(block_size: int, head_dim: int) -> PageLayout:
    """vLLM's CUDA page order: token t's row of 2D elements is its key, then its value.

    The same order `proxima.compression.layout.hot_store(..., KVLayout.FLASH_ATTN)` reads (the
    decode path, checked against vLLM's own kernel on an H200 by the read-sources diagnostic).
    Compressing CUDA pages in the canonical order instead mixed keys and values: prompt NLL 7.6
    against 3.2 under the conservative policy (H200, real SmolLM2 weights, 2026-12-01)."""
    t = torch.arange(block_size).view(-1, 1) * (2 * head_dim)
    c = torch.arange(head_dim).view(1, -1)
    key_pos = (t + c).flatten()
    return PageLayout(block_size, head_dim, key_pos, key_pos + head_dim)


def canonical_layout(block_size: int, head_dim: int) -> PageLayout:
    n = block_size * head_dim
    return PageLayout(block_size, head_dim, torch.arange(n), torch.arange(n, 2 * n))


def probe_layout(block_size: int, head_dim: int, dtype: torch.dtype, isa: str | None = None) -> PageLayout:
    """Store known values with vLLM's CPU cache writer and find where each element lands.

    Two probes per page (16-bit floats hold small integers exactly): token ids t + 1 (keys) and
    -(t + 1) (values), then channel ids c + 1 / -(c + 1).
    """
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    b, d = block_size, head_dim
    if max(b, d) >= 256:
        raise ValueError(f"layout probe needs block size and head dim < 256, got B={b}, D={d}")
    isa = isa or _get_attn_isa(dtype, b, d)
    seen: list[torch.Tensor] = []
    for ids in (torch.arange(b).view(b, 1).expand(b, d), torch.arange(d).view(1, d).expand(b, d)):
        kv = torch.zeros(1, 1, b, 2 * d, dtype=dtype)
        kc, vc = kv.view(1, 1, 2 * b, d).chunk(2, dim=2)
        k = (ids + 1).to(dtype).view(b, 1, d).contiguous()
        ops.cpu_attn_reshape_and_cache(k, -k, kc, vc, torch.arange(b), isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
        seen.append(kv.view(-1).float())
    tok, chan = seen
    key_pos = torch.full((b * d,), -1, dtype=torch.long)
    value_pos = torch.full((b * d,), -1, dtype=torch.long)
    for sign, pos in ((1, key_pos), (-1, value_pos)):
        where = (tok * sign > 0).nonzero().flatten()
        t = (tok[where] * sign).long() - 1
        c = (chan[where] * sign).long() - 1
        pos[t * d + c] = where
    if (key_pos < 0).any() or (value_pos < 0).any():
        raise RuntimeError(f"vLLM's CPU cache layout (isa {isa}) is not a permutation of each page; "
                           "Proxima cannot read compressed blocks with it")
    layout = PageLayout(b, d, key_pos, value_pos)
    kind = "canonical" if layout.is_canonical else "keys channel-major" if _keys_transposed(layout) else "permuted"
    logger.info("proxima: CPU attention page layout for isa %s: %s", isa, kind)
    return layout


def _keys_transposed(layout: PageLayout) -> bool:
    b, d = layout.block_size, layout.head_dim
    return bool(torch.equal(layout.key_pos.view(b, d), (torch.arange(d) * b).view(1, d) + torch.arange(b).view(b, 1)))
