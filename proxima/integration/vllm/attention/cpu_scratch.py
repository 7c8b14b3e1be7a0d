"""The transient bf16 KV that vLLM's CPU kernel reads for requests with compressed blocks.

Planned once per step (`plan_scratch`), filled once per layer (`fill_scratch`) into one buffer
that every layer reuses, so it costs one layer's worth of those requests' KV.

A request with compressed blocks is a decode row or, with chunked prefill and
`protect.prefilling: false`, a prefill chunk whose earlier chunks were compressed. Compressed
blocks always precede the row's queries: every query sees all of them, and RoPE is already
applied to cached keys, so the order of the tokens *before* the queries' first block does not
matter. Only causality does: vLLM's kernel puts a row's `q` queries at the last `q` positions of
its sequence, so the queries' own tokens must come last, in order. That gives a simple layout
per row:

1. block-aligned: hot blocks before the queries' first block (one block copy each), quantized
   blocks (decompressed in one batched call per format) and cluster blocks, each centroid
   repeated as many times as tokens it merged. Repetition reproduces the count-weighted softmax
   exactly (n copies of a key add n * exp(q.k)), so vLLM's unmodified kernel computes STAR-KV
   attention;
2. token-level, packed after them: the kept tokens of sparse blocks (fewer than a block each),
   then the tokens of the *tail*: every block from the one holding the first query token on,
   in order (a decode row: its last, partial block; a prefill chunk: the chunk's blocks).

Only part 2 is copied token by token: at most one block per row plus the sparse blocks' tokens
(plus a prefill chunk's own tokens).

Compressed slots are decompressed by fused numba kernels (`cpu_dequant.py`) that write bf16
straight into the scratch, when the caller gives a raw slot reader (`store_reader`), the scratch
is a CPU bf16 tensor and numba imports; otherwise by the torch reference (`Reader`) and copies.
Both give the same bits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from proxima.compression.spec import KIVI_KEYS, LEAN_BITS
from proxima.formats import Format
from proxima.integration.vllm.worker.page_layout import PageLayout, canonical_layout, numba_kernels

if TYPE_CHECKING:
    from proxima.integration.vllm.worker.store import WorkerStore

Reader = Callable[[Format, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""(format, destination blocks, slots) -> (k_hat, v_hat [N, C, H, D], log_count [N, C, H])."""


@dataclass(frozen=True)
class RawSlots:
    """Compressed slots as stored: pool views and side table of the format the layer stores."""

    fmt: Format
    k: torch.Tensor  # uint8 [S, C, H, bytes per token and head]: every slot of the pool (a view)
    v: torch.Tensor
    meta: dict[str, torch.Tensor]  # name -> [S, ...] side table
    rows: torch.Tensor  # long [N]: pool rows (dst * pack ratio + slot) of the slots to read
    group_size: int


RawReader = Callable[[Format, torch.Tensor, torch.Tensor], RawSlots]
"""(format the scheduler chose, destination blocks, slots) -> the stored slots, undecoded."""


def store_reader(store: WorkerStore, layer: str) -> RawReader:
    """A `RawReader` over one layer of a worker store (reads its pools, copies nothing)."""

    def read(fmt: Format, dst: torch.Tensor, slot: torch.Tensor) -> RawSlots:
        fmt = store.layer_format(layer, fmt)  # this layer's substitute, as `read_with_counts` does
        p = store.pool(layer, fmt)
        rows = (dst * fmt.pack_ratio + slot).to(p.k.device)
        return RawSlots(fmt, p.k, p.v, p.meta, rows, p.spec.group_size)

    return read


@dataclass(frozen=True)
class ScratchRow:
    """One request's blocks as the worker's block table has them, with its compressed ones."""

    blocks: list[int]
    """Physical block of each logical block (compressed ones: their freed source, never read)."""
    seq_len: int
    remap: dict[int, tuple[Format, int, int]]
    """Logical block index -> (format, destination block, slot)."""
    query_len: int = 1
    """The row's query tokens this step (the last `query_len` of `seq_len`)."""


@dataclass
class ScratchGroup:
    """The compressed blocks of one format, all rows together."""

    fmt: Format
    dst: torch.Tensor  # long [N]
    slot: torch.Tensor  # long [N]
    target: torch.Tensor
    """long [N]: scratch block of each (block-aligned formats) or [N, C]: flat scratch position of
    each kept token (sparse)."""


@dataclass
class ScratchPlan:
    num_blocks: int
    block_table: torch.Tensor  # int32 [R, W]: scratch blocks of each row
    seq_lens: torch.Tensor  # int32 [R]: tokens of each row in the scratch (<= its real length)
    hot_src: torch.Tensor  # long [Nh]: physical blocks copied whole
    hot_dst: torch.Tensor  # long [Nh]
    tok_src: torch.Tensor  # long [Nt]: flat cache positions (block * B + offset) copied token by token
    tok_dst: torch.Tensor  # long [Nt]: flat scratch positions
    pad: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    """long: flat scratch positions past each row's tokens in its last block. vLLM's kernel reads
    whole blocks and masks afterwards, so these must hold finite values (a NaN there poisons the
    row's softmax; vLLM zeroes fresh cache blocks for the same reason): the fill zeroes them."""
    groups: list[ScratchGroup] = field(default_factory=list)
    canonical: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    """long: scratch blocks the torch path writes in canonical order (all but the hot block
    copies), which the kernel's page layout must be applied to (`PageLayout.to_kernel`)."""
    token_blocks: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    """long: scratch blocks of the token-level parts (sparse tokens, tails): written in canonical
    order on every path. The fused kernels write block-aligned formats in the kernel's order."""


def plan_scratch(rows: list[ScratchRow], block_size: int) -> ScratchPlan:
    b = block_size
    L = torch.long
    hot_src: list[int] = []
    hot_dst: list[int] = []
    tok_src: list[torch.Tensor] = []
    tok_dst: list[torch.Tensor] = []
    groups: dict[Format, tuple[list[int], list[int], list[int] | list[torch.Tensor]]] = {}
    tables: list[list[int]] = []
    seq_lens: list[int] = []
    token_blocks: list[int] = []
    pad: list[torch.Tensor] = []
    base = 0  # first scratch block of the current row
    for row in rows:
        nb = -(-row.seq_len // b)
        first_q = (row.seq_len - row.query_len) // b  # the block holding the first query token
        aligned = 0
        sparse: list[tuple[Format, int, int]] = []
        for j in range(first_q):
            hit = row.remap.get(j)
            if hit is None:
                hot_src.append(row.blocks[j])
                hot_dst.append(base + aligned)
            elif hit[0].reduction == "sparse":
                sparse.append(hit)
                continue
            else:
                g = groups.setdefault(hit[0], ([], [], []))
                g[0].append(hit[1])
                g[1].append(hit[2])
                g[2].append(base + aligned)  # type: ignore[arg-type]
            aligned += 1
        pos = (base + aligned) * b  # flat scratch position of the next token-level token
        for fmt, dst, slot in sparse:
            c = fmt.kept_tokens(b)
            g = groups.setdefault(fmt, ([], [], []))
            g[0].append(dst)
            g[1].append(slot)
            g[2].append(torch.arange(pos, pos + c))  # type: ignore[arg-type]
            pos += c
        bad = [j for j in range(first_q, nb) if j in row.remap]
        if bad:  # the engine never compresses a block that receives queries (the hot tail)
            raise ValueError(f"blocks {bad} of a row are compressed but hold its query tokens: they must stay hot")
        tail = row.seq_len - first_q * b
        tok_src.append(torch.cat([row.blocks[j] * b + torch.arange(min(b, tail - (j - first_q) * b))
                                  for j in range(first_q, nb)]))
        tok_dst.append(torch.arange(pos, pos + tail))
        pos += tail
        used = pos - base * b
        n_blocks = -(-used // b)
        token_blocks.extend(range(base + aligned, base + n_blocks))
        pad.append(torch.arange(pos, (base + n_blocks) * b))
        tables.append(list(range(base, base + n_blocks)))
        seq_lens.append(used)
        base += n_blocks
    width = max((len(t) for t in tables), default=1)
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    out = ScratchPlan(
        num_blocks=base,
        block_table=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        hot_src=torch.tensor(hot_src, dtype=L),
        hot_dst=torch.tensor(hot_dst, dtype=L),
        tok_src=torch.cat(tok_src) if tok_src else torch.zeros(0, dtype=L),
        tok_dst=torch.cat(tok_dst) if tok_dst else torch.zeros(0, dtype=L),
    )
    hot = torch.zeros(base, dtype=torch.bool)
    hot[out.hot_dst] = True
    out.canonical = (~hot).nonzero().flatten()
    out.token_blocks = torch.tensor(token_blocks, dtype=L)
    out.pad = torch.cat(pad) if pad else torch.zeros(0, dtype=L)
    for fmt, (dsts, slots, target) in groups.items():
        tgt = torch.stack(target) if fmt.reduction == "sparse" else torch.tensor(target, dtype=L)  # type: ignore[arg-type]
        out.groups.append(ScratchGroup(fmt, torch.tensor(dsts, dtype=L), torch.tensor(slots, dtype=L), tgt))
    return out


def expand_centroids(k: torch.Tensor, v: torch.Tensor, log_count: torch.Tensor, tokens: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat each centroid by its member count: [N, C, H, D] -> [N, tokens, H, D].

    Counts of a (block, head) sum to the block's tokens, so position t takes the centroid whose
    cumulative count first exceeds t (empty centroids, log_count -inf, take no position).
    """
    counts = log_count.float().exp().round().long()  # exp(-inf) = 0
    cum = counts.cumsum(1)  # [N, C, H]
    t = torch.arange(tokens, device=k.device).view(1, tokens, 1, 1)
    idx = (cum.unsqueeze(1) <= t).sum(2).clamp_max(k.shape[1] - 1)  # [N, T, H]
    gidx = idx.unsqueeze(-1).expand(-1, -1, -1, k.shape[-1])
    return k.gather(1, gidx), v.gather(1, gidx)


def _fast_kernels(scratch: torch.Tensor, raw: RawReader | None) -> Any:
    """The numba kernels module when they apply (CPU bf16 scratch, a raw reader), else None."""
    if raw is None or scratch.dtype != torch.bfloat16 or scratch.device.type != "cpu":
        return None
    return numba_kernels()  # None without numba: the torch reference still works


def fill_scratch(plan: ScratchPlan, kv: torch.Tensor, read: Reader, scratch: torch.Tensor,
                 raw: RawReader | None = None, layout: PageLayout | None = None) -> None:
    """Fill `scratch` [num_blocks, H, 2B, D] from one layer's cache `kv` [N, H, B, 2D] (vLLM CPU).

    With `raw` (and a CPU bf16 scratch, and numba) compressed slots go through the fused kernels;
    `read` (the torch reference) serves every other case."""
    nb, h, b, d2 = kv.shape
    d = d2 // 2
    kv5 = kv.view(nb, h, 2, b, d)
    s5 = scratch.view(-1, h, 2, b, d)
    if len(plan.hot_src):
        s5.index_copy_(0, plan.hot_dst, kv5.index_select(0, plan.hot_src))
    layout = layout or canonical_layout(b, d)
    if len(plan.pad):
        s5[plan.pad // b, :, :, plan.pad % b] = 0
    if len(plan.tok_src):
        # Advanced indices on dims 0 and 3 (separated by slices) put the token axis first: [T, H, 2, D].
        s5[plan.tok_dst // b, :, :, plan.tok_dst % b] = layout.read_tokens(kv, plan.tok_src)
    fused = _fill_groups(plan, read, raw, s5, scratch, b, h, d, layout)
    # What was written in canonical order (the torch path: all but whole-block copies; the fused
    # path: the token-level parts) goes into the kernel's order.
    layout.to_kernel(scratch, plan.token_blocks if fused else plan.canonical)


def _fill_groups(plan: ScratchPlan, read: Reader, raw: RawReader | None, s5: torch.Tensor, scratch: torch.Tensor,
                 b: int, h: int, d: int, layout: PageLayout) -> bool:
    """Decompress every format group into the scratch; True if the fused kernels did it."""
    kernels = _fast_kernels(scratch, raw)
    if any(g.fmt.quant in LEAN_BITS for g in plan.groups):
        kernels = None  # the numba kernels do not read lean slots (rotated keys): the reference does
    if kernels is not None:
        assert raw is not None
        # numba has no bf16: write the bit patterns, into pages [B', H, 2bD]
        out = scratch.view(scratch.shape[0], h, -1).view(torch.int16).numpy().view(np.uint16)
        kernel_order, canonical = layout.page_pos.numpy(), _identity(2 * b * d)
        for g in plan.groups:  # block-aligned formats straight into the kernel's page order
            pos = canonical if g.fmt.reduction == "sparse" else kernel_order
            _fill_group_fast(kernels, g, raw(g.fmt, g.dst, g.slot), b, out, pos)
        return True
    for g in plan.groups:
        kh, vh, log_count = read(g.fmt, g.dst, g.slot)  # [N, C, H, D]
        if g.fmt.reduction == "sparse":
            flat = g.target.reshape(-1)
            s5[flat // b, :, 0, flat % b] = kh.reshape(-1, h, d)
            s5[flat // b, :, 1, flat % b] = vh.reshape(-1, h, d)
            continue
        if kh.shape[1] != b:  # centroids (this layer may store a cluster format in place of another)
            kh, vh = expand_centroids(kh, vh, log_count, b)
        s5[g.target, :, 0] = kh.transpose(1, 2)
        s5[g.target, :, 1] = vh.transpose(1, 2)
    return False


# --- fused CPU path ----------------------------------------------------------------------------

# Memoized constants, not state: each depends only on its argument (a few page sizes, two
# dtypes), is computed once per process and is read-only, so no caller can change what another sees.


@functools.lru_cache(maxsize=16)
def _identity(n: int) -> np.ndarray:
    """int64 [n] (read-only): page positions of the canonical order."""
    out = np.arange(n, dtype=np.int64)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=4)
def byte_lut(dtype: torch.dtype) -> np.ndarray:
    """float32 [256] (read-only): the exact value of each byte read as `dtype` (float8_e4m3fn or int8)."""
    out = torch.arange(256, dtype=torch.uint8).view(dtype).float().numpy()
    out.flags.writeable = False
    return out


def side_table(slots: RawSlots, name: str) -> np.ndarray:
    """A whole side table of `slots` for the numba kernels: float16 ones as their bit patterns
    (numba has no float16)."""
    t = slots.meta[name]
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.float16 else t.numpy()


def _token_map(kernels: Any, g: ScratchGroup, slots: RawSlots, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(src [N, T, H]: the slot token written at output token t, empty for the identity;
    dst [N, T]: the flat scratch position of output token t)."""
    n = len(g.dst)
    none = np.zeros((0, 0, 0), np.int64)
    if slots.fmt.reduction == "sparse":  # kept token t -> its packed position
        return none, g.target.reshape(n, -1).numpy()
    dst = (g.target.view(n, 1) * b + torch.arange(b)).numpy()
    if slots.fmt.reduction == "cluster":  # position t -> the centroid its cumulative count reaches
        return kernels.centroid_of_position(slots.meta["log_count"].numpy(), slots.rows.numpy(), b), dst
    return none, dst


def _fill_group_fast(kernels: Any, g: ScratchGroup, slots: RawSlots, b: int, out: np.ndarray,
                     pos: np.ndarray) -> None:
    """Decompress one format group's slots into `out` (the scratch's pages, uint16 [B', H, 2bD]),
    element (half, token, channel) at page position `pos[(half * b + token) * D + channel]`."""
    src, dst = _token_map(kernels, g, slots, b)
    rows = slots.rows.numpy()
    q, gs = slots.fmt.quant, slots.group_size
    k, v = slots.k.numpy(), slots.v.numpy()
    f16 = kernels.HALF_TO_FLOAT

    def meta(name: str) -> np.ndarray:
        return side_table(slots, name)

    if q == "bf16":
        kernels.copy_bf16(k.view(np.uint16), rows, src, dst, 0, out, pos)
        kernels.copy_bf16(v.view(np.uint16), rows, src, dst, 1, out, pos)
        return
    if q == "fp8":
        kernels.dequant_per_token(k, rows, byte_lut(torch.float8_e4m3fn), meta("k_scale"), src, dst, 0, out, pos)
    else:  # int8 / int4 / int2 keys: KIVI, per channel over token groups
        kernels.dequant_kivi(k, rows, meta("k_scale"), meta("k_zero"), f16, KIVI_KEYS[q], gs, True, src, dst, 0,
                             out, pos)
    if q in ("fp8", "int8"):  # per-token values
        lut = byte_lut(torch.float8_e4m3fn if q == "fp8" else torch.int8)
        kernels.dequant_per_token(v, rows, lut, meta("v_scale"), src, dst, 1, out, pos)
    else:
        kernels.dequant_kivi(v, rows, meta("v_scale"), meta("v_zero"), f16, KIVI_KEYS[q], gs, False, src, dst, 1,
                             out, pos)
