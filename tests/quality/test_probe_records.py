"""The damage model's samples (`proxima.quality.probe_records`): a probe hook on `ProximaCache`."""

from __future__ import annotations

import copy

import torch
from hf_helpers import tiny_llama  # type: ignore[import-not-found]

from proxima.compression.attention import attention_errors
from proxima.compression.blocks import compress_blocks
from proxima.formats import Format
from proxima.integration.hf import ProximaCache, enable
from proxima.quality.probe_records import ProbeLog, probe_records

BLOCK = 32


def _prefilled(hook: ProbeLog | None) -> ProximaCache:
    model = enable(tiny_llama())
    cache = ProximaCache(block_size=BLOCK, probe_hook=hook, kv_dtype=None)
    ids = torch.randint(0, 256, (1, 5 * BLOCK + 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids, past_key_values=cache)
    return cache


def test_one_record_per_layer_and_block_with_the_error_the_probe_measures() -> None:
    cache = _prefilled(ProbeLog())
    assert probe_records(cache) == []  # the prefill compressed nothing
    layer0 = [(layer.hot_k[2].clone(), layer.hot_v[2].clone()) for layer in cache.proxima_layers]  # [B, H, bs, D]
    fmt = Format.parse("int2")
    cache.compress_blocks([2, 3], fmt)
    recs = probe_records(cache)
    # every layer measured (a hook is attached), each block once, in the order compressed
    assert [(r.layer, r.block, r.fmt) for r in recs] == [(li, b, "int2") for li in range(2) for b in (2, 3)]
    assert all(r.error > 0 and r.importance > 0 and r.key_norm_spread > 0 for r in recs)
    # block 2's error in layer 1, recomputed from the block and the observation window's queries
    k, v = (t.transpose(1, 2) for t in layer0[1])  # [B, bs, H, D]
    q = cache.window_queries(1)
    assert q is not None
    cb = compress_blocks(fmt, k, v, group_size=cache.group_for(fmt))
    want = attention_errors(q.transpose(1, 2), k, v, cb).mean()
    assert abs(recs[2].error - float(want)) < 1e-4


def test_forks_and_copies_keep_their_own_records() -> None:
    base = _prefilled(ProbeLog())
    a, b = base.fork(), copy.deepcopy(base)
    a.compress_blocks([1], Format.parse("int4"))
    assert len(probe_records(a)) == 2 and probe_records(b) == [] and probe_records(base) == []
    b.compress_blocks([1, 2], Format.parse("int8"))
    assert len(probe_records(b)) == 4 and len(probe_records(a)) == 2
    assert probe_records(_prefilled(None)) == []  # no hook: nothing recorded, nothing measured beyond the probe
