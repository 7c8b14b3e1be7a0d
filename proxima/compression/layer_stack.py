"""Every KV layer as one tensor, so a step's compression reads and writes all layers in one op.

vLLM 0.32 allocates the KV cache once and views it per layer (`vllm.v1.worker.utils.
allocate_kv_cache`: layer l of a block at `offset + l * layer_stride`). When the per-layer
tensors are such views (same shape, strides, dtype and storage, evenly spaced offsets, each
layer contiguous), `LayerStack.kv` is one strided `[L, N, H, B, 2D]` view over them, built once
at registration: reading the sources of a step's blocks in every layer is one `index_select`,
writing the compressed slots one `index_copy_` per tensor. Caches that are not such views
(stores built by hand in tests, other allocators) fall back to one op per layer, with the same
results.

A `SlotPool` is the compressed slots of one stored format in every layer: the byte views of the
KV tensor (`[L, n * r, C, H, P]` uint8, or one such view per layer without a stack) and the
side table (`[L, n * r, ...]` per metadata field, allocated here, for all layers at once). It is
the one slot-pool view: the vLLM worker writes all layers of it (`LayerStack.write`), the
attention backends read one layer of it (`LayerSlots`, `LayerSlots.blocks` for Proxima's
kernels), and the compression tests (`tests/compression/paged_world.py`, `test_layout.py`)
write and read these very bytes. Slot id = physical block * pack ratio + j (`layout.py`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from proxima.compression.blocks import CompressedBlocks
from proxima.compression.side_arena import SideArena, field_views
from proxima.compression.spec import SlotSpec


def stack_view(layers: list[torch.Tensor]) -> torch.Tensor | None:
    """One `[L, *shape]` view of `layers` (in this order) when they are evenly spaced contiguous
    views of one storage; else None."""
    first = layers[0]
    if not first.is_contiguous():
        return None
    base = first.untyped_storage().data_ptr()
    for t in layers:
        if (t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype
                or t.device != first.device or t.untyped_storage().data_ptr() != base):
            return None
    offsets = [t.storage_offset() for t in layers]
    step = offsets[1] - offsets[0] if len(layers) > 1 else first.numel()
    # Layers may interleave only if they never overlap: a step under one layer's extent would.
    if step < first.numel() or any(b - a != step for a, b in itertools.pairwise(offsets)):
        return None
    return torch.as_strided(first, (len(layers), *first.shape), (step, *first.stride()), offsets[0])


@dataclass
class SlotPool:
    """The slots of one stored format in every layer (see the module docstring)."""

    spec: SlotSpec
    meta: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> [L, n * r, ...] side table (CompressedBlocks' shapes, heads second after the slot)."""
    k_all: torch.Tensor | None = None
    """[L, n * r, C, H, P] uint8 view into vLLM's KV tensor over every layer when the caches
    stack; else None and `k_layers` holds one such view per layer."""
    v_all: torch.Tensor | None = None
    k_layers: list[torch.Tensor] = field(default_factory=list)
    v_layers: list[torch.Tensor] = field(default_factory=list)
    slots_all: torch.Tensor | None = None
    """[L, n * r, 2 * C * H * P] uint8: each slot's keys then values, one row per slot (a view,
    with `k_all`): a gather of slots reads both in one op."""
    arena: SideArena | None = None
    """The side arena `meta` lives in (a gather of slots reads every field in one op)."""

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of stack row i: [n * r, C, H, P] uint8 each."""
        if self.k_all is not None and self.v_all is not None:
            return self.k_all[i], self.v_all[i]
        return self.k_layers[i], self.v_layers[i]

    def at(self, i: int) -> LayerSlots:
        """Stack row i's view of the pool (no copy)."""
        return LayerSlots(self.spec, *self.layer(i), {n: t[i] for n, t in self.meta.items()})


@dataclass
class LayerSlots:
    """One layer's view of a `SlotPool`: what the attention backends read."""

    spec: SlotSpec
    k: torch.Tensor
    """[n * r, C, H, P] uint8 view into vLLM's KV tensor."""
    v: torch.Tensor
    meta: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> [n * r, ...]."""

    def blocks(self, k_dtype: torch.dtype, v_dtype: torch.dtype, dtype: torch.dtype) -> CompressedBlocks:
        """Every slot of this layer as `CompressedBlocks` (no copy), for Proxima's kernels: keys
        and values in the element types the slots were written with (`compress_blocks`' output,
        which may differ for keys and values), `dtype` the KV cache's."""
        spec = self.spec
        return CompressedBlocks(
            spec.fmt, self.k.view(k_dtype), self.v.view(v_dtype), head_dim=spec.head_dim, dtype=dtype,
            group_size=spec.group_size, source_tokens=spec.block_size, **self.meta,
        )  # fmt: skip


class LayerStack:
    """The worker's KV layers in stack order, and their pools per stored format."""

    def __init__(self, kv_caches: dict[str, torch.Tensor]) -> None:
        named = list(kv_caches.items())
        # Stack order is storage order (vLLM's allocation order); dict order when they do not stack.
        by_offset = sorted(named, key=lambda nt: nt[1].storage_offset())
        kv = stack_view([t for _, t in by_offset]) if named else None
        order = by_offset if kv is not None else named
        self.names = [n for n, _ in order]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.layers = [t for _, t in order]
        self.kv = kv
        """[L, N, H, B, 2D] over every layer, or None (then `layers` one by one)."""
        self.pools: dict[object, SlotPool] = {}
        self._rows: dict[tuple[int, ...], torch.Tensor] = {}
        self.arenas: dict[object, SideArena] = {}
        """Stored format -> the side arena its tables live in (`reserve`, or its own)."""
        self.meta_bytes = 0

    def __len__(self) -> int:
        return len(self.layers)

    def rows(self, layers: tuple[int, ...]) -> torch.Tensor | None:
        """Device tensor of stack rows (built once per distinct set); None for all layers in order."""
        if layers == tuple(range(len(self))):
            return None
        t = self._rows.get(layers)
        if t is None:
            t = self._rows[layers] = torch.tensor(layers, dtype=torch.long, device=self.layers[0].device)
        return t

    # --- bf16 pages -----------------------------------------------------------------------------

    def pages(self, layers: tuple[int, ...], blocks: torch.Tensor) -> torch.Tensor:
        """[len(layers) * A, H, 2BD] pages of `blocks` (long [A], device) in those layers, layer-major."""
        n, h = self.layers[0].shape[:2]
        if self.kv is not None:
            allp = self.kv.view(len(self), n, h, -1)
            rows = self.rows(layers)
            sel = allp.index_select(1, blocks) if rows is None else allp[rows.view(-1, 1), blocks.view(1, -1)]
            return sel.reshape(-1, h, sel.shape[-1])
        return torch.cat([self.layers[i].view(n, h, -1).index_select(0, blocks) for i in layers])

    # --- compressed slots -----------------------------------------------------------------------

    def reserve(self, specs: dict[object, SlotSpec]) -> None:
        """Lay the side tables of these stored formats over one shared arena (`side_arena.py`: a
        pool block holds one format's slots at a time), allocated now. Formats already given a
        pool, and formats without metadata, keep what they have."""
        todo = {k: s for k, s in specs.items() if k not in self.arenas and s.meta_fields()}
        if not todo or not self.layers:
            return
        arena = SideArena.allocate(todo.values(), len(self), self.layers[0].shape[0], self.layers[0].device)
        self.meta_bytes += arena.nbytes
        for k in todo:
            self.arenas[k] = arena

    def pool(self, key: object, spec: SlotSpec) -> SlotPool:
        """The pool of the stored format `key` (its `SlotSpec` is the same in every layer).

        Each layer must be a dense 16-bit `[N, H, B, 2D]` tensor whose blocks hold exactly
        `spec.block_data_bytes` (the slot views reinterpret its bytes)."""
        p = self.pools.get(key)
        if p is not None:
            return p
        first = self.layers[0]
        n, h = first.shape[:2]
        if first.element_size() != 2 or not first.is_contiguous():
            raise ValueError(f"slot pools need dense 16-bit KV layers (bf16/fp16), got {first.dtype} "
                             f"with strides {first.stride()}")
        if first[0].numel() * 2 != spec.block_data_bytes:
            raise ValueError(f"{spec.fmt}: a block of this KV cache has {first[0].numel() * 2} bytes, the spec "
                             f"expects {spec.block_data_bytes} (B={spec.block_size}, H={spec.num_kv_heads}, "
                             f"D={spec.head_dim}, 16-bit cache)")
        r, c = spec.fmt.pack_ratio, spec.slot_tokens
        p = SlotPool(spec)
        if self.kv is not None:
            raw_all = self.kv.view(torch.uint8).view(len(self), n * r, 2, c, h, -1)
            p.k_all, p.v_all = raw_all[:, :, 0], raw_all[:, :, 1]
            p.slots_all = raw_all.flatten(2)
        for t in self.layers if self.kv is None else ():
            raw = t.view(torch.uint8).view(n * r, 2, c, h, -1)
            p.k_layers.append(raw[:, 0])
            p.v_layers.append(raw[:, 1])
        if spec.meta_fields():
            arena = self.arenas.get(key)
            if arena is None or spec not in arena.specs:  # not reserved, or reserved as another spec
                arena = self.arenas[key] = SideArena.allocate((spec,), len(self), n, first.device)
                self.meta_bytes += arena.nbytes
            p.meta, p.arena = arena.views(spec), arena
        self.pools[key] = p
        return p

    def gather(self, p: SlotPool, layers: tuple[int, ...], idx: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Slots `idx` (long [A], device) of those layers, layer-major: k, v [R * A, C, H, P] uint8
        and each metadata field [R * A, ...]."""
        rows = self.rows(layers)

        def take(t: torch.Tensor) -> torch.Tensor:
            sel = t.index_select(1, idx) if rows is None else t[rows.view(-1, 1), idx.view(1, -1)]
            return sel.flatten(0, 1)

        # Every field at once: the slots' side-table regions in one gather, then views.
        meta = field_views(take(p.arena.regions(p.spec)), p.spec) if p.arena is not None else {}
        if p.slots_all is not None and p.k_all is not None:
            kv = take(p.slots_all).view(-1, 2, *p.k_all.shape[2:])  # keys and values in one gather
            return kv[:, 0], kv[:, 1], meta
        k = torch.cat([p.k_layers[i].index_select(0, idx) for i in layers])
        v = torch.cat([p.v_layers[i].index_select(0, idx) for i in layers])
        return k, v, meta

    def write(self, p: SlotPool, layers: tuple[int, ...], idx: torch.Tensor, cb: CompressedBlocks) -> None:
        """Store compressed blocks into slots `idx` (long [A], device) of those layers: `cb` holds
        A full blocks per layer, layer-major (`compress_blocks` over the layers' rows); data as
        raw bytes (any element types), metadata cast to the side tables' types."""
        slot = p.k_all.shape[2:] if p.k_all is not None else p.k_layers[0].shape[1:]  # [C, H, P], no dispatch
        shape = (cb.k_data.shape[0], *slot)
        meta = {name: getattr(cb, name) for name in p.meta}
        self.scatter(p, layers, idx, cb.k_data.contiguous().view(torch.uint8).reshape(shape),
                     cb.v_data.contiguous().view(torch.uint8).reshape(shape), meta)

    def scatter(self, p: SlotPool, layers: tuple[int, ...], idx: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, meta: dict[str, torch.Tensor]) -> None:
        """Write slots `idx` of those layers from layer-major k, v [R * A, C, H, P] uint8 and metadata."""
        rows = self.rows(layers)
        a = idx.shape[0]

        def put(t: torch.Tensor, x: torch.Tensor) -> None:
            x = x.view(len(layers), a, *x.shape[1:])
            if rows is None:
                t.index_copy_(1, idx, x)
            else:
                t.index_put_((rows.view(-1, 1), idx.view(1, -1)), x)

        for name, t in p.meta.items():
            put(t, meta[name].to(t.dtype))
        if p.k_all is not None and p.v_all is not None:
            put(p.k_all, k)
            put(p.v_all, v)
            return
        for j, i in enumerate(layers):
            p.k_layers[i].index_copy_(0, idx, k[j * a:(j + 1) * a])
            p.v_layers[i].index_copy_(0, idx, v[j * a:(j + 1) * a])


def upload(rows: list[list[int]] | list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host-built step data on `device`: one pinned, non-blocking copy on a GPU, no sync (the
    stream orders it before its readers). A step makes one for its action table, and one per
    first merge for the blocks' token importance (kept on the host, `token_importance`).
    `worker/step_counter.py` counts the worker's calls of it (`store._upload`) as uploads, apart from would-be syncs."""
    host = rows if isinstance(rows, torch.Tensor) else torch.tensor(rows, dtype=torch.long)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
