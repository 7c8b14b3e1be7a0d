"""The one-pass decode's per-layer pool descriptor tables, kept current outside the forward.

Why here and not in the attention backend: under a CUDA graph the forward's Python does not run
on replay, so nothing in it may be what keeps a kernel input current. The connector refreshes
the tables right after it applies a step's plan to the device block table (`connector.py`,
`bind_connector_metadata`), which runs every step, before attention, outside any graph. A table
is one persistent tensor per layer (its address is what a graph captured) rewritten in place,
and only when the block table has met a new format since (rare: the policy's formats, once).
"""

from __future__ import annotations

import torch

from proxima.compression.blocks import CompressedBlocks
from proxima.compression.mixed_decode import MAX_CODES, pool_descriptors
from proxima.formats import Format
from proxima.integration.vllm.worker.block_table import DeviceBlockTable
from proxima.integration.vllm.worker.store import WorkerStore


def slot_pool_of(store: WorkerStore, layer: str, fmt: Format, device: torch.device) -> CompressedBlocks:
    """Every slot of `fmt` in `layer`, as the worker wrote them, for Proxima's kernels (no copy).

    `fmt` as the worker remembers the blocks; the pool is that of the format this layer stores
    (`WorkerStore.layer_format`: layer overrides, and the table a block was written under)."""
    fmt = store.layer_format(layer, fmt)
    p = store.pool(layer, fmt)
    kdt, vdt = store.dtypes[fmt]
    for name, t in p.meta.items():
        # `cuda` names the current device, `cuda:0` one in particular: the same memory when the index matches.
        if t.device.type != device.type or (device.index is not None and t.device.index != device.index):
            # Moving the side table every layer and step would cost more than the attention.
            raise RuntimeError(
                f"proxima: the {fmt} side table ({name}) of {layer} is on {t.device}, the KV cache on {device}; "
                "the worker must allocate it on the cache's device"
            )
    return p.blocks(kdt, vdt, store.kv_caches[layer].dtype)


def layer_descriptors(store: WorkerStore, table: DeviceBlockTable, layer: str) -> torch.Tensor:
    """`layer`'s descriptor table ([MAX_CODES, NUM_FIELDS] int64 on the cache's device), brought
    up to date with the table's codes in place (allocated on the layer's first call). Only codes
    in use are described (a freed code's row is zeroed: no entry holds it); a format that holds a
    code is one the worker has written (its dtypes known) or is writing this step."""
    version = (table.formats_version, len(store.dtypes))  # a format's dtypes arrive with its first write
    seen, desc = table.descriptors.get(layer, (None, None))
    if desc is not None and seen == version:
        return desc
    kv = store.kv_caches[layer]
    pools = {code: slot_pool_of(store, layer, f, kv.device) for f, code in table.coded().items()
             if store.layer_format(layer, f) in store.dtypes}
    new = pool_descriptors(pools, store.geometry(layer)[2], kv.device)
    if desc is None:
        desc = torch.zeros(MAX_CODES, new.shape[1], dtype=torch.int64, device=kv.device)
    desc.zero_()
    desc[: new.shape[0]].copy_(new)
    table.descriptors[layer] = (version, desc)
    return desc


def refresh_descriptors(store: WorkerStore, table: DeviceBlockTable) -> None:
    """Every layer's descriptor table, current with `table.formats` (a no-op unless a format is new)."""
    for layer in store.kv_caches:
        layer_descriptors(store, table, layer)


__all__ = ["layer_descriptors", "refresh_descriptors", "slot_pool_of"]
