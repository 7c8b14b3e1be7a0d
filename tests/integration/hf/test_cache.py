"""ProximaCache on a tiny random Llama: pass-through equality, compression, memory, generation."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hf_helpers import tiny_llama  # type: ignore[import-not-found]
from transformers import DynamicCache

from proxima.formats import Format
from proxima.integration.hf import ProximaCache, enable
from proxima.integration.hf.attention import proxima_sdpa_attention, set_active
from proxima.policy.loader import load_policy
from proxima.quality.stacking import stacked as stack

FORMATS = ["fp8", "int8", "int4", "int2", "sparse(4)", "cluster(4)", "sparse(2)+int8", "cluster(2)+int4"]


@torch.no_grad()
@pytest.mark.parametrize("attn", ["sdpa", "proxima"])
def test_off_equals_dynamic_cache_exactly(model, ids, attn):
    if attn == "proxima":
        enable(model)
    ref_cache, cache = DynamicCache(), ProximaCache(block_size=32)
    a = model(ids, past_key_values=ref_cache).logits
    b = model(ids, past_key_values=cache).logits
    assert torch.equal(a, b)
    for _ in range(3):  # decode steps cross a block boundary (300 -> 303 tokens, block 32)
        nxt = a[:, -1:].argmax(-1)
        a = model(nxt, past_key_values=ref_cache).logits
        b = model(nxt, past_key_values=cache).logits
        assert torch.equal(a, b)
    for layer_ref, layer in zip(ref_cache.layers, cache.layers, strict=True):
        wk, _, wb = layer.materialize()
        assert wb is None
        assert torch.equal(torch.cat([wk, layer.tail_k], -2), layer_ref.keys)


@torch.no_grad()
def test_generate_off_matches_dynamic(model, ids):
    enable(model)
    a = model.generate(ids[:, :40], max_new_tokens=40, do_sample=False)
    b = model.generate(ids[:, :40], max_new_tokens=40, do_sample=False, past_key_values=ProximaCache(block_size=16))
    assert torch.equal(a, b)


@torch.no_grad()
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_shrinks_the_store_and_stays_close(model, ids, fmt):
    enable(model)
    ref_cache, cache = DynamicCache(), ProximaCache(block_size=32)
    model(ids, past_key_values=ref_cache)
    model(ids, past_key_values=cache)
    before = cache.stored_nbytes()
    rep = cache.compress_all(fmt, protect_sinks=32, protect_recent=32)
    assert rep.actions == 7  # 9 full blocks minus the sink block and the last one
    f = Format.parse(fmt)
    hot_bytes = before / 300 * (300 - 7 * 32)
    comp_bytes = before / 300 * 7 * 32 / f.pack_ratio
    # Real bytes: payload plus metadata (scales, counts) stay within 40% of the nominal size.
    assert cache.stored_nbytes() <= hot_bytes + 1.4 * comp_bytes
    assert cache.stored_nbytes() < before
    nxt = torch.randint(0, 256, (1, 8))
    a = model(nxt, past_key_values=ref_cache).logits
    b = model(nxt, past_key_values=cache).logits
    assert torch.isfinite(b).all()
    assert (a - b).abs().max() < 1.0


@torch.no_grad()
def test_resident_memory_shrinks_without_working_copy(model, ids):
    enable(model)
    cache = ProximaCache(block_size=32, keep_working_copy=False)
    model(ids, past_key_values=cache)
    before = cache.resident_nbytes()
    cache.compress_all("int4", protect_sinks=32, protect_recent=32)
    assert cache.resident_nbytes() < 0.6 * before
    out = model(torch.randint(0, 256, (1, 4)), past_key_values=cache).logits
    assert torch.isfinite(out).all()
    assert cache.resident_nbytes() < 0.6 * before


def test_log_count_equals_repeating_the_centroid():
    """cluster(2) of a block holding each key twice is exact: a centroid with log 2 added to its
    logit is the two copies. (Tokens i and i + 8 are equal; with uniform importance the k-means
    seeds are tokens 0..7, all distinct.)"""
    torch.manual_seed(0)
    b, h, d, bs = 1, 2, 32, 16
    # bf16-representable, so that the cast to the 16-bit KV dtype before compression is exact.
    base_k = torch.randn(b, h, bs // 2, d).bfloat16().float()
    base_v = torch.randn(b, h, bs // 2, d).bfloat16().float()
    k = base_k.repeat(1, 1, 2, 1)
    v = base_v.repeat(1, 1, 2, 1)
    tail_k, tail_v = torch.randn(b, h, 3, d), torch.randn(b, h, 3, d)
    q = torch.randn(b, 2 * h, 1, d)

    class Mod(torch.nn.Module):
        layer_idx = 0
        num_key_value_groups = 2
        is_causal = True

    def attend(cache: ProximaCache) -> torch.Tensor:
        keys, values = cache.update(tail_k[..., :1, :], tail_v[..., :1, :], 0)
        out, _ = proxima_sdpa_attention(Mod(), q, keys, values, None, scaling=d**-0.5)
        return out

    exact = ProximaCache(block_size=bs)
    exact.update(torch.cat([k, tail_k], 2), torch.cat([v, tail_v], 2), 0)
    set_active(None)
    ref = attend(exact)

    comp = ProximaCache(block_size=bs)
    comp.update(torch.cat([k, tail_k], 2), torch.cat([v, tail_v], 2), 0)
    comp._obs[0] = torch.zeros(b, 2 * h, 4, d)  # uniform attention
    comp.compress_blocks([0], Format.parse("cluster(2)"))
    got = attend(comp)
    assert torch.allclose(got, ref, atol=1e-5)
    assert comp.proxima_layers[0].materialize()[2] is not None


@torch.no_grad()
def test_reduced_formats_need_proxima_attention(model, ids):
    cache = ProximaCache(block_size=32)
    model(ids, past_key_values=cache)
    cache.compress_all("sparse(2)")
    with pytest.raises(RuntimeError, match="enable"):
        model(ids[:, :2], past_key_values=cache)


def _without_compression_probe(path: str):  # type: ignore[no-untyped-def]
    """A shipped policy with its compression-time probe off (a random model's flat attention
    puts int4 errors over the shipped bounds)."""
    policy = load_policy(path)
    no_probe = policy.probes.compression.model_copy(update={"enabled": False})
    policy = policy.model_copy(update={"probes": policy.probes.model_copy(update={"compression": no_probe})})
    return policy


@torch.no_grad()
def test_policy_engine_reaches_target_ratio(model, ids):
    enable(model)
    # A random model's attention is flat, so int4 errors exceed the shipped probe bounds: probes off here.
    policy = _without_compression_probe("proxima/policies/balanced.yaml")
    cache = ProximaCache(policy, block_size=16)
    model(ids, past_key_values=cache)
    rep = cache.apply_policy(target_ratio=4)
    assert rep.actions > 0
    fmts = {f.name for f in cache.block_formats()}
    assert fmts <= {"bf16", "int8", "int4", "cluster(2)+int4", "int2"}
    # sinks (32 tokens = 2 blocks) and the recent window stay hot
    assert cache.block_formats()[0].is_hot and cache.block_formats()[1].is_hot
    assert cache.block_formats()[-1].is_hot
    assert cache.nominal_ratio() > 2.0  # 6 of 19 blocks are protected (sinks 32, recent 64)
    # the target's virtual pool enters every band: its band is not the cache's afterwards (a
    # later real pool starts from the band it had), the engine's step count is
    assert cache.engine_state.active_band is None and cache.engine_state.step > 0


@torch.no_grad()
def test_generate_with_pressure_driven_policy(model, ids):
    enable(model)
    policy = load_policy("proxima/policies/aggressive.yaml")
    cache = ProximaCache(policy, block_size=16, capacity_blocks=6, record_probes=True)
    out = model.generate(ids[:, :100], past_key_values=cache, max_new_tokens=30, do_sample=False)
    assert out.shape == (1, 130)
    assert any(not f.is_hot for f in cache.block_formats())
    assert cache.probe_log and all(r.error >= 0 for r in cache.probe_log)


def test_supported_transformers_range_is_checked():
    import transformers

    from proxima.integration.hf.attention import check_transformers_version

    check_transformers_version(transformers.__version__)  # the installed one is inside the range
    for ok in ("5.2.0", "5.19.0", "5.99.1+local"):
        check_transformers_version(ok)
    for bad in ("4.57.1", "5.1.9", "6.0.0"):
        with pytest.raises(RuntimeError, match=r"transformers .* is not supported .* >= 5\.2, < 6\.0"):
            check_transformers_version(bad)


def test_attention_that_drops_the_bias_fails_loudly(monkeypatch):
    """transformers 5.2 silently ignored sdpa's `position_bias`: merged and evicted tokens were
    attended as if whole. Proxima now folds the bias into the mask and checks, when its attention
    is registered, that the bias reaches the softmax; an SDPA path that drops it (here: one that
    ignores the mask, as 5.2 ignored `position_bias`) is refused instead of computing wrong attention."""
    from transformers.integrations import sdpa_attention

    from proxima.integration.hf.attention import check_bias_reaches_softmax, register

    check_bias_reaches_softmax()  # the installed transformers applies it
    original = sdpa_attention.sdpa_attention_forward

    def drops_the_mask(module, query, key, value, attention_mask, **kwargs):
        kwargs.pop("position_bias", None)
        return original(module, query, key, value, None, **kwargs)

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", drops_the_mask)
    with pytest.raises(RuntimeError, match="does not apply the per-key bias"):
        register()
    with pytest.raises(RuntimeError, match="does not apply the per-key bias"):
        enable(tiny_llama())


@torch.no_grad()
def test_cluster_bias_reaches_the_model_output(model, ids):
    """End to end through the model: attention over a cluster(2) block with its log-counts differs
    from the same centroids attended without them: the bias changes what the model computes."""
    enable(model)
    cache = ProximaCache(block_size=32)
    model(ids[:, :100], past_key_values=cache)
    cache.compress_blocks([0, 1], Format.parse("cluster(2)"))
    layer = cache.proxima_layers[0]
    _, _, bias = layer.materialize()
    assert bias is not None and torch.isinf(bias).any() and (bias > 0).any()  # -inf slots, log 2 centroids
    nxt = ids[:, 100:101]
    with_counts = model(nxt, past_key_values=copy.deepcopy(cache)).logits
    for lay in cache.proxima_layers:  # the same centroids, counts dropped (empty slots still hidden)
        wk, wv, wb = lay.materialize()
        assert wb is not None
        lay._work = (wk, wv, torch.where(torch.isinf(wb), wb, torch.zeros_like(wb)))
    without = model(nxt, past_key_values=cache).logits
    assert not torch.allclose(with_counts, without, atol=1e-4)


@torch.no_grad()
def test_merged_blocks_merge_further(model, ids):
    """cluster(2)+int4 blocks recompressed to cluster(4)+int4: centroid pairs merge, counts add (each
    block still accounts for all its tokens), bytes held fall; a merged block asked for a sparse
    format merges further instead (the ladder's reachable format of at least that ratio)."""
    enable(model)
    cache = ProximaCache(block_size=32)
    model(ids, past_key_values=cache)
    cache.compress_all("cluster(2)+int4", protect_sinks=32, protect_recent=32)
    blocks = [i for i, f in enumerate(cache.block_formats()) if not f.is_hot]
    assert len(blocks) == 7
    r8 = cache.achieved_ratio()

    def slot_bytes() -> int:
        return sum(s.nbytes for layer in cache.proxima_layers for s in layer.slots if s is not None)

    before = slot_bytes()
    rep = cache.compress_blocks(blocks[:4], Format.parse("cluster(4)+int4"))
    assert rep.actions == 4 and rep.formats == {"cluster(4)+int4": 4}
    rep = cache.compress_blocks(
        blocks[4:], Format.parse("sparse(4)+int4"), ladder=[Format.parse("cluster(4)+int4")]
    )
    assert rep.formats == {"cluster(4)+int4": 3}
    assert not cache.ineligible & set(blocks)
    assert {f.name for f in cache.block_formats()[1:-1]} == {"cluster(4)+int4"}
    assert slot_bytes() < 0.6 * before  # half the centroids, their int4 metadata and counts
    assert cache.achieved_ratio() > r8
    for layer in cache.proxima_layers:
        _, _, bias = layer.materialize()
        assert bias is not None
        per_block = bias[..., : layer.n_blocks * 32].unflatten(-1, (layer.n_blocks, 32))
        mass = torch.logsumexp(per_block[..., blocks, :], -1)  # log of the tokens each block stands for
        assert torch.allclose(mass, torch.full_like(mass, math.log(32)), atol=1e-4)
    out = model(ids[:, :4], past_key_values=cache).logits
    assert torch.isfinite(out).all()


@torch.no_grad()
def test_policy_asked_for_more_recompresses_merged_blocks(model, ids):
    """The engine, asked for 5x then 10x, moves blocks it already merged to 16x or 32x formats
    (before, merged blocks were final and the second request stopped short)."""
    enable(model)
    policy = _without_compression_probe("proxima/policies/aggressive.yaml")
    cache = ProximaCache(policy, block_size=16)
    model(ids, past_key_values=cache)
    cache.apply_policy(target_ratio=5)
    merged = {i for i, f in enumerate(cache.block_formats()) if f.name == "cluster(2)+int4"}
    assert merged
    r5 = cache.achieved_ratio()
    cache.apply_policy(target_ratio=10)
    after = cache.block_formats()
    assert all(after[i].pack_ratio >= 16 for i in merged)
    assert cache.achieved_ratio() > 1.3 * r5


@torch.no_grad()
def test_stacked_caches_decode_as_each_alone(model, ids):
    """`proxima.quality.stacking.stacked` (the quality harness decodes every method's copy in one batch) gives
    each row the logits its cache gives alone: exact, quantized, merged (log-count bias) and
    token-evicted blocks, across a block boundary."""
    enable(model)
    base = ProximaCache(block_size=32)
    model(ids[:, :250], past_key_values=base)  # 7 full blocks + a tail of 26
    caches = []
    for fmt in (None, "int4", "cluster(2)+int4", "evict"):
        c = copy.deepcopy(base)
        if fmt == "evict":
            layer0 = c.proxima_layers[0]
            keep = torch.rand(1, 2, layer0.n_blocks * 32, generator=torch.Generator().manual_seed(1)) > 0.5
            c.evict_tokens([keep] * len(c.layers))
        elif fmt is not None:
            c.compress_all(fmt, protect_sinks=32)
        caches.append(c)
    stacked = stack(caches)
    step = ids[:, 250:260]  # 250 -> 260 tokens: a new full block (256) is appended to every row
    alone = [model(step, past_key_values=c).logits for c in caches]
    together = model(step.expand(len(caches), -1), past_key_values=stacked).logits
    for i, a in enumerate(alone):
        assert torch.allclose(together[i], a[0], atol=1e-5), i
    assert not torch.allclose(alone[0], alone[2], atol=1e-3)  # the rows really differ
    for _ in range(8):  # then greedy decode, each row from its own argmax
        nxt = together[:, -1:].argmax(-1)
        alone = [model(nxt[i : i + 1], past_key_values=c).logits for i, c in enumerate(caches)]
        together = model(nxt, past_key_values=stacked).logits
        for i, a in enumerate(alone):
            assert torch.allclose(together[i], a[0], atol=1e-5), i
    with pytest.raises(ValueError, match="must match"):
        stack([caches[0], base])
    with pytest.raises(ValueError, match="cannot be forked"):
        stacked.fork()


@torch.no_grad()
@pytest.mark.parametrize(
    "fmts", [("int4",), ("cluster(2)+int4", "cluster(4)+int4"), ("sparse(4)", "cluster(4)"), ("int8", "int2")]
)
def test_working_copy_equals_a_fresh_read_of_the_store(model, ids, fmts):
    """The working copy is patched in place, a whole stored batch at once; it must hold exactly
    what reading every block back from the store gives (recompression included)."""
    enable(model)
    cache = ProximaCache(block_size=32)
    model(ids, past_key_values=cache)
    for f in fmts:
        cache.compress_blocks([1, 3, 4, 6], Format.parse(f))
        cache.compress_blocks([2, 7], Format.parse(f))
    for layer in cache.proxima_layers:
        wk, wv, wb = layer.materialize()
        layer._work = None
        layer.keep_working_copy = False
        fk, fv, fb = layer.materialize()
        assert torch.equal(wk, fk) and torch.equal(wv, fv)
        assert (wb is None) == (fb is None) and (wb is None or torch.equal(wb, fb))


@torch.no_grad()
def test_target_ratio_is_reached_in_bytes(model, ids, monkeypatch):
    """`apply_policy(target_ratio=r)` means r times fewer bytes held (metadata and hot blocks
    included), not r at the formats' pack ratios: one engine pass stops short by the metadata,
    the next asks for more by the shortfall."""
    from proxima.policy import target

    enable(model)
    policy = _without_compression_probe("proxima/policies/aggressive.yaml")
    base = ProximaCache(policy, block_size=16)
    model(ids, past_key_values=base)
    one_round = copy.deepcopy(base)
    monkeypatch.setattr(target, "BYTE_PASSES", 1)
    monkeypatch.setattr(target, "REFINE_PASSES", 0)  # (raising may use the refine trials too)
    one_round.apply_policy(target_ratio=3.5)
    monkeypatch.undo()
    assert one_round.achieved_ratio() < 3.5 * 0.98 < one_round.nominal_ratio()
    passes = copy.deepcopy(base)
    passes.apply_policy(target_ratio=3.5)
    assert passes.achieved_ratio() >= 3.5 * (1 - 1e-3)
    assert passes.achieved_ratio() < one_round.nominal_ratio()  # asked for more, not for everything


def test_group_size_comes_from_the_policy_unless_given() -> None:
    """`storage.group_size` (the vLLM worker's setting) is the cache's too; an explicit
    `group_size=` overrides it; a group that cannot store the format at this head dim is refused
    with the setting named, and nothing is stored."""
    from pathlib import Path

    from proxima.policy.schema import Storage

    base = load_policy(Path(__file__).resolve().parents[3] / "proxima" / "policies" / "balanced.yaml")
    lean = base.model_copy(update={"storage": Storage(group_size=64)})
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 128, 64), torch.randn(1, 2, 128, 64)
    held = {}
    for name, cache in (("policy", ProximaCache(lean)), ("default", ProximaCache(base)),
                        ("explicit", ProximaCache(lean, group_size=32))):
        cache.update(k, v, 0)
        cache.compress_blocks([0], Format.parse("int4"))
        slot = cache.proxima_layers[0].slots[0]
        assert slot is not None
        held[name] = (slot.cb.group_size, slot.nbytes)
    assert held["policy"][0] == 64 and held["default"][0] == 32 and held["explicit"] == held["default"]
    assert held["policy"][1] < held["default"][1]
    bad = ProximaCache(base.model_copy(update={"storage": Storage(group_size=128)}))
    bad.update(k, v, 0)
    with pytest.raises(ValueError, match=r"storage\.group_size=128 does not divide the model's head_dim 64: int4"):
        bad.compress_blocks([0], Format.parse("int4"))
    assert bad.proxima_layers[0].slots[0] is None


@torch.no_grad()
def test_importance_and_the_probe_read_the_observed_layer_only(model, ids) -> None:
    """As in the vLLM worker (`proxima.observation`): block importance comes from the middle
    layer's observation window alone, and the compression-time probe measures that layer alone."""
    from proxima.observation import observed_layer

    enable(model)
    base = ProximaCache(_without_compression_probe("proxima/policies/aggressive.yaml"), block_size=16)
    model(ids, past_key_values=base)
    seen, other = observed_layer(len(base.layers)), 0
    assert seen != other
    ref = base.fork().refresh_importance()
    noisy = base.fork()
    noisy._obs = {**noisy._obs, other: torch.randn_like(noisy._obs[other])}
    assert torch.equal(noisy.refresh_importance(), ref)
    moved = base.fork()
    moved._obs = {**moved._obs, seen: torch.randn_like(moved._obs[seen])}
    assert not torch.equal(moved.refresh_importance(), ref)
    _, errs = base.fork()._encode_all_layers([2, 3], Format.parse("cluster(4)+int4"), measure=True)
    assert torch.all(errs[other] == 0) and torch.all(errs[seen] > 0)


@torch.no_grad()
def test_a_refused_block_takes_what_the_vllm_worker_would_give_it(model, ids) -> None:
    """The probe decision is the worker's (`policy.refusal.milder_formats` walked by
    `probes.choose_within_bound`): int2 refused everywhere, the milder formats at 4x are tried by
    damage (cluster(4) before int4, though the ladder lists int4 first), and every block lands there."""
    from proxima.formats import HOT
    from proxima.policy.loader import parse_policy
    from proxima.policy.refusal import milder_formats

    policy = parse_policy("""
schema_version: 1
name: t
bands:
  - {name: high, enter: 0.8, exit: 0.7, target_free: 0.5, ladder: [int2, int4, "cluster(4)"]}
damage:
  table: {"cluster(4)": 0.01, int4: 0.5}
probes:
  compression: {enabled: true, max_error: {int2: 1.0e-9, int4: 100.0, "cluster(4)": 100.0}}
""")
    enable(model)
    cache = ProximaCache(policy, block_size=32)
    model(ids, past_key_values=cache)
    int2 = Format.parse("int2")
    expected = milder_formats(policy, int2, HOT)[0]
    rep = cache.compress_blocks([1, 2, 3], int2, ladder=policy.bands[0].ladder, probe=True)
    assert expected.name == "cluster(4)"
    assert rep.actions == 3 and rep.formats == {"cluster(4)": 3}
    assert rep.rejected == 3  # each block refused once, in int2
    assert [cache.chosen[i].name for i in (1, 2, 3)] == ["cluster(4)"] * 3
    assert all(layer.formats[2].name == "cluster(4)" for layer in cache.proxima_layers)


@torch.no_grad()
def test_policy_merged_tokens_pin_tokens_in_every_layer(model, ids):
    """`protect.merged_tokens: 2` in the cache's policy: every merged block keeps two rows per
    (batch, head) of count 1 ahead of its centroids, in every layer, first merge and
    recompression alike; each is one of the block's tokens as it was (bf16 cluster: bit-exact)."""
    enable(model)
    policy = _without_compression_probe("proxima/policies/aggressive.yaml")
    pinned = policy.model_copy(update={"protect": policy.protect.model_copy(update={"merged_tokens": 2})})
    caches = {}
    for name, pol in (("plain", policy), ("pinned", pinned)):
        cache = ProximaCache(pol, block_size=32)
        model(ids, past_key_values=cache)
        hot = [layer.materialize()[0].clone() for layer in cache.proxima_layers]  # [B, H, T, D]
        cache.compress_all("cluster(2)", protect_sinks=32, protect_recent=32)
        caches[name] = (cache, hot)
    cache, hot = caches["pinned"]
    blocks = [i for i, f in enumerate(cache.block_formats()) if not f.is_hot]
    for layer, wk in zip(cache.proxima_layers, hot, strict=True):
        for i in blocks:
            slot = layer.slots[i]
            assert slot is not None
            kh, _vh, lc = slot.decode()
            for r in slot.rows:
                assert torch.equal(lc[r, :2], torch.zeros_like(lc[r, :2]))
                src = wk[r % wk.shape[0], :, i * 32:(i + 1) * 32].to(kh.dtype)  # [H, 32, D], as stored
                for h in range(src.shape[0]):
                    assert ((src[h] == kh[r, 0, h]).all(-1)).any() and ((src[h] == kh[r, 1, h]).all(-1)).any()
    plain = caches["plain"][0].proxima_layers[0].slots[blocks[0]]
    pinned_slot = cache.proxima_layers[0].slots[blocks[0]]
    assert plain is not None and pinned_slot is not None
    assert not torch.equal(plain.decode()[2], pinned_slot.decode()[2])
    rep = cache.compress_blocks(blocks, Format.parse("cluster(8)"))
    assert rep.actions == len(blocks)
    for layer in cache.proxima_layers:
        for i in blocks:
            slot = layer.slots[i]
            assert slot is not None
            _kh, _vh, lc = slot.decode()
            assert torch.allclose(lc[slot.rows].exp().sum(1), torch.full_like(lc[slot.rows][:, 0], 32.0), atol=1e-3)
            # two pinned rows again: singletons kept, or merged rows with their counts
            assert lc[slot.rows, :2].isfinite().all()
