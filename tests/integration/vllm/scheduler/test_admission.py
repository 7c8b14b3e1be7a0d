"""Admission of a long prompt under chunked prefill, over a real vLLM `KVCacheManager` (no engine).

vLLM admits a request only if its whole prompt fits uncompressed (`scheduler_reserve_full_isl`).
A policy that compresses finished prompt chunks (`protect.prefilling: false`) replaces that gate
with the prompt's compressed footprint; a policy that waits for the end of the prefill keeps it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

from proxima.formats import Format
from proxima.integration.vllm.plan import CACHE_8BIT, NO_READER, ProximaReport
from proxima.integration.vllm.scheduler.ledger import CompressedSlot
from proxima.integration.vllm.scheduler.manager import ProximaKVCacheManager, install
from proxima.placement import BlockId, SlotIndex
from proxima.policy.loader import load_policy
from proxima.policy.schema import Policy

ROOT = Path(__file__).resolve().parents[4]
B = 32


def _manager(policy: Policy, blocks: int) -> ProximaKVCacheManager:
    spec = FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    cfg = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    m = install(KVCacheManager(cfg, max_model_len=4096, scheduler_block_size=B, hash_block_size=B,
                               enable_caching=False), policy)
    assert m is not None
    return m


def _cheapest(m: ProximaKVCacheManager) -> float:
    """Blocks one block costs in the cheapest format of the policy's highest band, metadata included."""
    return min(m.px.meta.block_cost(f) for f in m.px.policy.bands[-1].ladder)


def _request(rid: str, tokens: int, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(1, tokens + 1)), SamplingParams(max_tokens=max_tokens), None)


@pytest.mark.parametrize("prefilling", [False, True])
def test_a_long_prompt_is_admitted_on_its_compressed_footprint(prefilling: bool) -> None:
    policy = load_policy(ROOT / "proxima" / "policies" / "balanced.yaml")
    policy = policy.model_copy(update={"protect": policy.protect.model_copy(update={"prefilling": prefilling})})
    m = _manager(policy, blocks=24)  # 23 usable blocks
    assert m.allocate_slots(_request("resident", 6 * B), 6 * B) is not None  # 6 blocks used, 17 free
    # 20 blocks of prompt: uncompressed it does not fit. Balanced keeps 1 sink + 2 recent + the
    # tail hot; the rest, before any compression, is expected in its high band's cheapest format
    # (8x: an eighth of a block each, plus its scales and zero points: the side tables are
    # charged to the pool).
    cheap = _cheapest(m)
    assert 0.125 < cheap < 0.2
    assert m.compressed_footprint(20 * B) == 4 + math.ceil(16 * cheap)
    # Admission counts the request's end state: its 8 output tokens make a 21st block.
    got = m.allocate_slots(_request("long", 20 * B), 8 * B, full_sequence_must_fit=True)
    assert (got is not None) == (not prefilling)
    # A prompt whose compressed footprint does not fit either waits, and counts as pressure.
    m2 = _manager(policy, blocks=24)
    assert m2.allocate_slots(_request("resident", 6 * B), 6 * B) is not None
    assert m2.resident_growth() == 0  # 6 blocks + 8 tokens: still 7 blocks, 5 once compressed
    assert m2.allocate_slots(_request("huge", 120 * B), 8 * B, full_sequence_must_fit=True) is None
    footprint = 4 + math.ceil(117 * cheap)  # 120 blocks + 8 output tokens
    assert m2.px.waiting_need == (footprint + 2 if not prefilling else 8 + 1 + 2)  # end state or chunk, + reserve


def _finish(m: ProximaKVCacheManager, req: Request, outputs: int) -> None:
    for _ in range(outputs):
        req.append_output_token_ids(7)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    m.free(req)


def test_admission_reserves_what_the_residents_will_still_grow_by() -> None:
    """The residents' remaining output counts against a new request (else vLLM preempts the newest,
    usually mid-prefill); how much they will output is learned from requests that finished."""
    policy = load_policy(ROOT / "proxima" / "policies" / "balanced.yaml")
    cost = _cheapest(_manager(policy, blocks=8))
    # A resident of 4 prompt blocks (all hot: 1 sink, 2 recent, the tail) that may write 24 more:
    # before any request finished, a request is expected to output as many tokens as its prompt
    # holds, so it ends at 8 blocks, 4 hot and 4 compressed.
    growth = 4 + math.ceil(4 * cost) - 4
    # A new request of 20 prompt and 8 output blocks, in a pool where its end state fits (with
    # the 2 blocks of reserve) but not beside the resident's growth.
    need = 4 + math.ceil(24 * cost)
    m = _manager(policy, blocks=1 + 4 + need + 2 + growth - 1)
    a = _request("a", 4 * B, max_tokens=24 * B)
    assert m.allocate_slots(a, 4 * B) is not None
    assert growth > 0 and m.resident_growth() == growth
    b = _request("b", 20 * B, max_tokens=8 * B)
    assert m.compressed_footprint(28 * B) == need and m.summary()["expected_output_tokens"] is None
    assert m.allocate_slots(b, 8 * B, full_sequence_must_fit=True) is None
    # Requests that finished after 2 tokens teach that outputs are short: now it fits.
    for i in range(8):
        done = _request(f"done{i}", B, max_tokens=64)
        assert m.allocate_slots(done, B) is not None
        _finish(m, done, outputs=2)
    assert m.summary()["expected_output_tokens"] == 2.0  # (the stats file shows it)
    assert m.px.outputs.expected(a) == 2 and m.resident_growth() == 1  # 130 tokens: 4 hot blocks + 1 compressed
    assert m.allocate_slots(b, 8 * B, full_sequence_must_fit=True) is not None
    # A preempted or aborted request teaches nothing.
    mean = m.px.outputs.mean
    m.px.outputs.observe(_request("aborted", B))  # (status WAITING, as a preempted one)
    assert m.px.outputs.mean == mean


def _pressured(policy: Policy, max_tokens: int = 8) -> tuple[ProximaKVCacheManager, Request]:
    """A resident request that fills most of a small pool, fully prefilled: the engine compresses."""
    m = _manager(policy, blocks=24)
    req = _request("a", 18 * B, max_tokens)
    assert m.allocate_slots(req, 18 * B) is not None
    req.num_computed_tokens = 18 * B
    assert m.allocate_slots(req, 1) is not None
    return m, req


@pytest.mark.parametrize("why", [NO_READER, CACHE_8BIT])
def test_a_worker_without_a_reader_turns_compression_off(why: str) -> None:
    """No Proxima backend reads the blocks, or vLLM's own 8-bit cache (`worker/cache_dtype.py`)."""
    m, _ = _pressured(load_policy(ROOT / "proxima" / "policies" / "balanced.yaml"))
    plan = m.build_plan(["a"])
    assert plan.actions  # under pressure: the engine compresses
    m.apply_report(ProximaReport(failed=[a.action_id for a in plan.actions], errors=[why]))
    assert m.px.disabled == why
    assert not m.build_plan(["a"]).actions and not m.px.in_flight  # never planned again
    # ... and admission is vLLM's own again (whole prompt uncompressed).
    assert m.allocate_slots(_request("long", 20 * B), 8 * B, full_sequence_must_fit=True) is None


def test_compressed_blocks_stay_readable_after_the_policy_is_switched_off() -> None:
    m, _ = _pressured(load_policy(ROOT / "proxima" / "policies" / "balanced.yaml"))
    plan = m.build_plan(["a"])
    m.apply_report(ProximaReport(ok=[a.action_id for a in plan.actions]))
    assert m.px.ledger["a"].compressed
    m.set_policy(Policy(enabled=False))  # e.g. PATCH {"enabled": false} through the live API
    plan = m.build_plan(["a"])
    # The worker needs the request's key block to route it through the compressed path.
    assert not plan.actions and list(plan.key_blocks.values()) == ["a"]


def test_released_destinations_are_sent_to_be_scrubbed() -> None:
    """Every destination block the manager gives back to vLLM (request freed, slot released by
    recompression or failure) is listed once in the next plan, for the worker to zero."""
    m, req = _pressured(load_policy(ROOT / "proxima" / "policies" / "balanced.yaml"))
    plan = m.build_plan(["a"])
    assert plan.actions and not plan.scrub
    dests = {a.dst for a in plan.actions}
    # A failed batch releases its destinations at once.
    m.apply_report(ProximaReport(failed=[a.action_id for a in plan.actions]))
    assert sorted(m.build_plan(["a"]).scrub) == sorted(dests)
    assert not m.build_plan(["a"]).scrub  # sent once
    # Committed destinations are released with their request.
    m, req = _pressured(load_policy(ROOT / "proxima" / "policies" / "balanced.yaml"))
    plan = m.build_plan(["a"])
    m.apply_report(ProximaReport(ok=[a.action_id for a in plan.actions]))
    dests = {d for _, d, _ in m.px.ledger["a"].compressed.values()}
    assert dests and not m.build_plan(["a"]).scrub
    dests = {d.block for d in m.px.packer.destinations("a")}  # with any the last plan reserved
    m.free(req)
    assert set(m.build_plan([]).scrub) == dests


def test_pool_usage_accounts_for_every_block() -> None:
    m, _ = _pressured(load_policy(ROOT / "proxima" / "policies" / "balanced.yaml"))
    before = m.pool_usage()
    # "side": the blocks held back for the side tables (always charged to the pool): none yet.
    assert before == {"resident": 1, "hot": 19, "dest": 0, "dest_fill": 0.0, "free": 23 - 19, "side": 0}
    plan = m.build_plan(["a"])
    m.apply_report(ProximaReport(ok=[a.action_id for a in plan.actions]))
    u = m.pool_usage()
    n = len(plan.actions)
    assert u["hot"] == 19 - n and u["dest"] >= 1 and u["hot"] + u["dest"] + u["free"] + u["side"] == 23
    slots = sum(d.fmt.pack_ratio for d in m.px.packer.destinations("a"))
    assert u["dest_fill"] == round(n / slots, 3)
    assert m.summary()["pool_at_peak"]["resident"] == 1


def test_admission_estimate_follows_the_achieved_mix() -> None:
    """Before any compression the estimate assumes the top band's cheapest format; afterwards,
    the cost the resident requests' committed blocks actually reached, floored by the live policy."""
    policy = load_policy(ROOT / "proxima" / "policies" / "aggressive.yaml")
    m, _ = _pressured(policy)
    assert not m.px.ledger.formats()
    hot = -(-policy.protect.sink_tokens // B) + -(-policy.protect.recent_tokens // B) + 1  # + the tail
    cheapest = m.px.meta.block_cost(Format.parse("cluster(8)+int4"))
    assert cheapest == min(m.px.meta.block_cost(f) for f in policy.bands[-1].ladder)
    assert m.compressed_footprint(20 * B) == hot + math.ceil((20 - hot) * cheapest - 1e-9)
    plan = m.build_plan(["a"])
    m.apply_report(ProximaReport(ok=[a.action_id for a in plan.actions]))
    st = m.px.ledger["a"]
    assert len(st.compressed) >= 4
    # Pretend the engine reached one 16x block for every 8x one (about 10.7x).
    c2, c4 = Format.parse("cluster(2)+int4"), Format.parse("cluster(4)+int4")
    for i, (idx, (_, dst, slot)) in enumerate(sorted(st.compressed.items())):
        st.commit(idx, CompressedSlot(c4 if i % 2 else c2, dst, slot))
    n = len(st.compressed)
    assert m.px.ledger.formats() == {c2: -(-n // 2), c4: n // 2}
    mix = (-(-n // 2) * m.px.meta.block_cost(c2) + (n // 2) * m.px.meta.block_cost(c4)) / n
    mixed = hot + math.ceil((20 - hot) * mix - 1e-9)
    assert m.compressed_footprint(20 * B) == mixed > hot + math.ceil((20 - hot) * cheapest - 1e-9)
    # A policy switched live to int8 only cannot reach that mix: the estimate follows the policy.
    m.set_policy(load_policy(ROOT / "proxima" / "policies" / "conservative.yaml").model_copy(update={"bands": [
        b.model_copy(update={"ladder": [Format.parse("int8")]}) for b in policy.bands]}))
    prot = m.px.policy.protect
    hot = -(-prot.sink_tokens // B) + -(-prot.recent_tokens // B) + 1
    int8 = m.px.meta.block_cost(Format.parse("int8"))
    assert m.compressed_footprint(20 * B) == hot + math.ceil((20 - hot) * int8 - 1e-9)


def test_a_request_sampling_its_last_token_is_not_compressed() -> None:
    """vLLM frees a request that finishes in a step before it applies that step's connector
    report: compressing its blocks would be wasted work (and its destinations a scrub). Only
    the regular plan skips it: an emergency (its own allocation failing) still may compress it."""
    balanced = load_policy(ROOT / "proxima" / "policies" / "balanced.yaml")
    for max_tokens, last in ((2, True), (3, False)):
        m, req = _pressured(balanced, max_tokens=max_tokens)
        req.append_output_token_ids(7)  # decoding its second token: the last one if max_tokens == 2
        assert req.num_computed_tokens == req.num_tokens - 1
        assert bool(m.build_plan(["a"]).actions) != last
        if last:
            assert m._plan(pending_blocks=4) > 0  # the emergency path


def test_side_tables_charged_to_the_pool_hold_back_their_blocks() -> None:
    """The manager holds exactly the pool blocks the live side tables (committed and in-flight
    slots) fill; owned + free still equals the pool; the blocks go back with the request."""
    from proxima.integration.vllm.scheduler.side_tables import blocks_needed

    m, req = _pressured(load_policy(ROOT / "proxima" / "policies" / "aggressive.yaml"))
    assert not m.px.charge.held
    free_before = m.block_pool.get_num_free_blocks()
    plan = m.build_plan(["a"])
    assert plan.actions
    in_flight = m.side_table_bytes()
    assert in_flight > 0 and len(m.px.charge.held) == blocks_needed(in_flight, m.px.meta.block_bytes)
    m.check_accounting()
    m.apply_report(ProximaReport(ok=[a.action_id for a in plan.actions]))
    side = m.px.meta.side_table_bytes(m.px.ledger)
    need = blocks_needed(side, m.px.meta.block_bytes)
    assert need >= 1 and len(m.px.charge.held) == need
    u = m.pool_usage()
    assert u["side"] == need and u["hot"] + u["dest"] + u["free"] + u["side"] == 23
    m.check_accounting()
    assert m.summary()["side_table_held_peak_blocks"] >= need
    assert m.block_pool.get_num_free_blocks() < free_before + len(plan.actions)  # the charge is paid
    m.free(req)
    m.build_plan([])
    assert not m.px.charge.held and m.block_pool.get_num_free_blocks() == 23
    m.check_accounting()


@pytest.mark.parametrize("name", ["conservative", "balanced", "aggressive"])
def test_the_pool_and_the_side_tables_stay_within_the_kv_budget(name: str) -> None:
    """Charging the side tables is the only mode (no switch, no environment). Through a compressing
    run with each shipped policy: vLLM's blocks, Proxima's destinations and the blocks held back
    for the side tables never exceed the pool vLLM sized to its KV budget; the held blocks cover
    the side tables' bytes whenever no action is in flight, and while some are the uncovered part
    (no block was free when the plan's metadata grew: `side_tables.py`) is recorded as the
    shortfall and is taken back once the sources are freed (the next step)."""
    from proxima.integration.vllm.scheduler.side_tables import blocks_needed

    m, req = _pressured(load_policy(ROOT / "proxima" / "policies" / f"{name}.yaml"))
    block_bytes = m.px.meta.block_bytes
    budget = 24 * block_bytes  # the configured KV budget: the pool vLLM sized (its null block included)
    usable = m.block_pool.num_gpu_blocks - 1  # vLLM's null block is never handed out
    peak_side = uncovered_peak = 0
    for step in range(6):
        plan = m.build_plan(["a"])
        side, held = m.side_table_bytes(), len(m.px.charge.held)
        u = m.pool_usage()
        assert u["hot"] + u["dest"] + u["side"] + u["free"] == usable and u["side"] == held, (step, u)
        assert (1 + u["hot"] + u["dest"] + u["side"]) * block_bytes <= budget
        uncovered = side - held * block_bytes
        if uncovered > 0:  # a lag: only with this plan's actions in flight and no block free
            assert plan.actions and u["free"] == 0, (step, u, side)
        else:
            assert held == blocks_needed(side, block_bytes), (step, held, side)
        uncovered_peak = max(uncovered_peak, uncovered)
        m.check_accounting()
        m.apply_report(ProximaReport(ok=[a.action_id for a in plan.actions]))
        peak_side = max(peak_side, side)
    m.build_plan([])  # nothing in flight: every byte covered
    side = m.side_table_bytes()
    assert side == peak_side > 0 and len(m.px.charge.held) == blocks_needed(side, block_bytes)
    s = m.summary()
    assert s["side_tables_in_pool"] is True and s["side_table_shortfall_peak_bytes"] == max(0, uncovered_peak)
    m.free(req)
    m.build_plan([])
    assert not m.px.charge.held and m.block_pool.get_num_free_blocks() == usable


def test_the_summary_counts_compressions_per_compressed_block() -> None:
    m, _ = _pressured(load_policy("aggressive"))
    plan = m.build_plan(["a"])
    assert plan.actions and all(a.from_fmt.is_hot for a in plan.actions)
    m.apply_report(ProximaReport(ok=[a.action_id for a in plan.actions]))
    s = m.summary()
    n = len(plan.actions)
    assert (s["committed"], s["blocks_compressed"], s["compressions_per_block"]) == (n, n, 1.0)


def test_an_admission_check_does_not_walk_the_compressed_blocks() -> None:
    """Admission runs at every scheduling step with a waiting request: its work grows with the
    residents and their formats, not with their compressed blocks (a per-block sum cost 14.6 ms
    a check at 660 blocks on the CPU, and showed on the H100 as 10 ms more per engine step)."""
    policy = load_policy(ROOT / "proxima" / "policies" / "balanced.yaml")
    m = _manager(policy, blocks=400)
    fmts = [Format.parse("int4"), Format.parse("cluster(2)+int4")]
    for r in range(3):
        assert m.allocate_slots(_request(f"r{r}", 64 * B, max_tokens=32 * B), 64 * B) is not None
        entry = m.px.ledger[f"r{r}"]
        for i in range(60):
            entry.commit(i, CompressedSlot(fmts[i % 2], BlockId(1), SlotIndex(i)))
        entry.commit(0, CompressedSlot(fmts[1], BlockId(1), SlotIndex(0)))  # a recompression
    assert m.px.ledger.formats() == {fmts[0]: 87, fmts[1]: 93}
    assert sum(m.px.ledger.formats().values()) == sum(len(e.compressed) for e in m.px.ledger.values())
    calls = 0
    cost = m.px.meta.block_cost

    def counted(fmt: Format) -> float:
        nonlocal calls
        calls += 1
        return cost(fmt)

    m.px.meta.block_cost = counted  # type: ignore[method-assign]
    m.compressed_footprint(64 * B)
    m.resident_growth()
    # per check: the mix (2 formats + the policy's 5) and each resident's 2 formats, twice over
    assert 0 < calls <= 2 * (7 + 3 * 2)


def test_resident_growth_rounds_the_sum_not_each_resident() -> None:
    """Each resident's growth is a fraction of a block (its end state and its holdings both
    fractional); rounding each up added a block per resident and kept aggressive's CPU capacity
    run at 15 residents (mean 7.74) where 16 (mean 9.01) fit."""
    policy = load_policy(ROOT / "proxima" / "policies" / "balanced.yaml")
    m = _manager(policy, blocks=64)
    cost = _cheapest(m)
    for r in range(3):  # 4 prompt blocks, all hot; 2 tokens of output make a 5th, compressed
        assert m.allocate_slots(_request(f"r{r}", 4 * B, max_tokens=2), 4 * B) is not None
    assert 3 * cost < 1 and m.resident_growth() == 1
