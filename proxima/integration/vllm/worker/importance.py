"""Attention importance observed in the worker: one implementation for every attention backend.

vLLM's kernels return no attention probabilities, so in one layer per step (`WorkerStore.observe_layer`)
the scheduled rows' observation-window queries (the last `observation_window` prompt tokens of a
prefill chunk, the new token of a decode row) are scored against their hot keys with torch, beside
vLLM's kernel. The attention mass per token feeds the worker's token importance (sparse and
cluster use it) and, summed per block, the scheduler's policy engine (`ProximaReport.importance`).

The CPU backend (`backend.py`) and the CUDA backend (`cuda_backend.py`) both call
`plan_observation` once per step (when they resolve the step's rows) and `observe_safely` in the
observed layer. The plan is built on the host; `observe` moves it to the cache's device, and
brings the masses back in one copy (on CUDA: one synchronisation per step, in one layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from proxima.observation import fold_heads

if TYPE_CHECKING:
    from proxima.integration.vllm.worker.store import WorkerStore


@dataclass
class Observation:
    """Which queries to score against which keys in the observed layer, for one step."""

    decode_rids: list[str]
    decode_q: torch.Tensor  # long [Rd]: query token of each decode row
    decode_table: torch.Tensor  # long [Rd, W]: physical blocks (compressed ones point at block 0)
    decode_visible: torch.Tensor  # bool [Rd, W * B]: token exists and is hot
    decode_lens: list[int]
    prefill: list[tuple[str, torch.Tensor, torch.Tensor, int, list[int]]]
    """Per prefill row: (request, its observation-window query tokens, its blocks, seq_len, its
    compressed blocks: their table entries are freed sources, never read)."""


def plan_observation(rids: list[str | None], remaps: list[dict], qsl: list[int], seq_lens: list[int],  # type: ignore[type-arg]
                     block_table: torch.Tensor, b: int, window: int) -> Observation | None:
    """The step's observation plan, on the host.

    rids: each batch row's request (None: not Proxima's, e.g. a dummy row); remaps: each row's
    compressed blocks (logical index -> slot; only the keys matter here); qsl: query start
    locations [R + 1]; seq_lens: [R]; block_table: [R, >= max blocks] physical ids (any device).
    """
    bt = block_table.cpu()
    nblk = [-(-sl // b) for sl in seq_lens]
    dec = [r for r, rid in enumerate(rids) if rid is not None and qsl[r + 1] - qsl[r] == 1]
    pre = [r for r, rid in enumerate(rids) if rid is not None and qsl[r + 1] - qsl[r] > 1]
    if not dec and not pre:
        return None
    width = max((nblk[r] for r in dec), default=1)
    table = torch.zeros(len(dec), width, dtype=torch.long)
    visible = torch.zeros(len(dec), width * b, dtype=torch.bool)
    for i, r in enumerate(dec):
        table[i, : nblk[r]] = bt[r, : nblk[r]].long()
        visible[i, : seq_lens[r]] = True
        for j in remaps[r]:  # compressed: the table's entry is a freed source, never read
            table[i, j] = 0
            visible[i, j * b: (j + 1) * b] = False
    prefill = []
    for r in pre:
        w = min(window, qsl[r + 1] - qsl[r])
        blocks = bt[r, : nblk[r]].long().clone()
        blocks[list(remaps[r])] = 0
        prefill.append((rids[r], torch.arange(qsl[r + 1] - w, qsl[r + 1]), blocks, seq_lens[r], sorted(remaps[r])))
    return Observation([rids[r] for r in dec], torch.tensor([qsl[r] for r in dec], dtype=torch.long),  # type: ignore[misc]
                       table, visible, [seq_lens[r] for r in dec], prefill)  # type: ignore[arg-type]


def observe(store: WorkerStore, layer_kv: torch.Tensor, query: torch.Tensor, obs: Observation, scale: float) -> None:
    """Attention mass of the observed queries over each row's hot tokens, folded into `store`.

    layer_kv: the observed layer's cache [N, H, B, 2D]; query: the layer's queries [T, Hq, D].
    Computed in float32 with torch, in one layer only: about 1/L of the attention's cost.
    """
    _nb, h, b, d2 = layer_kv.shape
    d = d2 // 2
    dev = layer_kv.device
    layout = store.page_layout(layer_kv)
    g = query.shape[1] // h

    def fold(p: torch.Tensor) -> torch.Tensor:  # [..., G, T] probabilities -> [..., T] per KV head
        return fold_heads(p, store.aggregate, -2)

    if obs.decode_rids:
        rd, w = obs.decode_table.shape
        visible = obs.decode_visible.to(dev)
        keys = layout.read_keys(layer_kv, obs.decode_table.to(dev))
        k = keys.permute(0, 2, 1, 3, 4).reshape(rd, h, w * b, d).float()
        qd = query[obs.decode_q.to(dev)]  # [Rd, Hq, D]: each row's new query (also the probe's)
        q = qd.view(rd, h, g, d).float()
        s = torch.einsum("rhgd,rhtd->rhgt", q, k) * scale
        s = s.masked_fill(~visible[:, None, None, :], float("-inf"))
        mass = fold(torch.softmax(s, -1))  # [Rd, H, T]
        mass = mass.masked_fill(~visible[:, None, :], float("nan")).cpu()
        keep_queries = store.probes_compressions
        for i, (rid, n) in enumerate(zip(obs.decode_rids, obs.decode_lens, strict=True)):
            store.observe(rid, mass[i, :, :n].transpose(0, 1).contiguous(), reset=False)
            if keep_queries:
                store.recent_queries.add(rid, qd[i: i + 1], scale)
    for rid, qt, blocks, seq_len, compressed in obs.prefill:
        k = layout.read_keys(layer_kv, blocks.to(dev)).permute(1, 0, 2, 3).reshape(h, -1, d)[:, :seq_len].float()
        q = query[qt.to(dev)].view(len(qt), h, g, d).permute(1, 2, 0, 3).float()  # [H, G, W, D]
        s = torch.einsum("hgwd,hld->hgwl", q, k) * scale
        qpos = torch.arange(seq_len - len(qt), seq_len, device=dev).view(-1, 1)
        hidden = torch.zeros(seq_len, dtype=torch.bool)  # compressed earlier chunks: not seen here
        for j in compressed:
            hidden[j * b: (j + 1) * b] = True
        hidden_dev = hidden.to(dev)
        s = s.masked_fill((torch.arange(seq_len, device=dev).view(1, -1) > qpos) | hidden_dev, float("-inf"))
        mass = fold(torch.softmax(s, -1).mean(2)).transpose(0, 1).cpu()  # [H, G, L] -> [H, L] -> [L, H]
        mass[hidden] = float("nan")
        store.observe(rid, mass.contiguous(), reset=True)
        if store.probes_compressions:
            store.recent_queries.add(rid, query[qt.to(dev)], scale)


def observe_safely(store: WorkerStore, layer_kv: torch.Tensor, query: torch.Tensor, obs: Observation,
                   scale: float) -> None:
    """`observe`, but importance is advisory: an error is reported, never raised into the forward."""
    try:
        observe(store, layer_kv, query, obs, scale)
    except Exception as e:
        store.report.errors.append(f"importance: {type(e).__name__}: {e}")
