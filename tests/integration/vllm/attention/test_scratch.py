"""The scratch KV that vLLM's kernel reads for rows with compressed blocks (no engine: fast).

Reference: attention of one query over each row's tokens as Proxima's formats define it (hot
tokens from the cache, compressed blocks decompressed, centroids weighted by their counts).
The scratch must give the same attention output with plain, unweighted attention, whatever the
mix of formats (quantized, sparse, cluster) in the row.
"""

from __future__ import annotations

import pytest
import torch

from proxima.formats import Format
from proxima.integration.vllm.attention.cpu_scratch import (
    ScratchRow,
    expand_centroids,
    fill_scratch,
    plan_scratch,
    store_reader,
)
from proxima.integration.vllm.plan import CompressAction, ProximaPlan
from proxima.integration.vllm.worker.store import WorkerStore

NB, H, B, D, HQ = 40, 2, 16, 32, 4
LAYER = "layer.0"


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, logw: torch.Tensor) -> torch.Tensor:
    """q [HQ, D]; k, v [T, H, D]; logw [T, H] -> [HQ, D], grouped-query attention in float32."""
    g = HQ // H
    kq = k.float().repeat_interleave(g, 1)  # [T, HQ, D]
    vq = v.float().repeat_interleave(g, 1)
    s = torch.einsum("hd,thd->th", q.float(), kq) / D**0.5 + logw.repeat_interleave(g, 1)
    p = torch.softmax(s, 0)
    return torch.einsum("th,thd->hd", p, vq)


def _scenario(formats: list[list[str | None]], seed: int = 0):  # type: ignore[no-untyped-def]
    """Rows of logical blocks (None = hot); returns store, cache, rows with the real compression."""
    torch.manual_seed(seed)
    kv = torch.randn(NB, H, B, 2 * D).to(torch.bfloat16)
    st = WorkerStore()
    st.register({LAYER: kv})
    rows: list[tuple[str, list[int], int]] = []
    acts: list[CompressAction] = []
    nxt = 1
    dst_of: dict[tuple[str, str], list[int]] = {}  # (request, format) -> [dst block, next slot]
    for r, fmts in enumerate(formats):
        rid = f"r{r}"
        blocks = list(range(nxt, nxt + len(fmts)))
        nxt += len(fmts)
        for j, f in enumerate(fmts):
            if f is None:
                continue
            fmt = Format.parse(f)
            cur = dst_of.get((rid, f))
            if cur is None or cur[1] == fmt.pack_ratio:
                cur = dst_of[(rid, f)] = [NB - 1 - len(dst_of), 0]
            acts.append(CompressAction(len(acts), rid, j, blocks[j], cur[0], cur[1], fmt))
            cur[1] += 1
        seq_len = (len(fmts) - 1) * B + 5 + r  # a partial last block
        rows.append((rid, blocks, seq_len))
    # Some token importance so that sparse keeps a non-trivial subset.
    for rid, _blocks, seq_len in rows:
        st.observe(rid, torch.rand(seq_len, H), reset=True)
    st.apply(ProximaPlan(actions=acts))
    rep = st.take_report()
    assert rep is not None and not rep.failed, rep
    return st, kv, rows


def _reference(st: WorkerStore, kv: torch.Tensor, rid: str, blocks: list[int], seq_len: int, q: torch.Tensor):  # type: ignore[no-untyped-def]
    assert st.layout is not None
    ks, vs, ws = [], [], []
    nb = -(-seq_len // B)
    for j in range(nb):
        hit = st.remap.get(rid, {}).get(j)
        if hit is None:
            n = min(B, seq_len - j * B)
            k, v = st.layout.read_blocks(kv, torch.tensor([blocks[j]]))  # the kernel's page order -> [1, B, H, D]
            ks.append(k[0, :n])
            vs.append(v[0, :n])
            ws.append(torch.zeros(n, H))
        else:
            fmt, dst, slot = hit
            kh, vh, lc = st.read_with_counts(LAYER, fmt, torch.tensor([dst]), torch.tensor([slot]))
            ks.append(kh[0])
            vs.append(vh[0])
            ws.append(lc[0].float())
    return _attend(q, torch.cat(ks), torch.cat(vs), torch.cat(ws))


@pytest.mark.parametrize("formats", [
    [["int4", "int8", None, None]],
    [["cluster(2)+int4", None, "int4", None], [None, "cluster(4)", None]],
    [["sparse(4)+int4", "sparse(2)", None, "int2", None], ["int8", "sparse(4)", "cluster(2)+int4", None, None]],
    [["int4h", "int4", None, "cluster(2)+int4h", None], [None, "int2h", None]],  # lean formats (issue 40)
])
def test_scratch_attention_equals_the_formats_attention(formats: list[list[str | None]]) -> None:
    st, kv, rows = _scenario(formats)
    plan = plan_scratch([ScratchRow(blocks, seq_len, st.remap.get(rid, {})) for rid, blocks, seq_len in rows], B)
    scratch = torch.full((plan.num_blocks, H, 2 * B, D), float("nan"), dtype=kv.dtype)
    assert st.layout is not None
    fill_scratch(plan, kv, lambda f, d, s: st.read_with_counts(LAYER, f, d, s), scratch, layout=st.layout)
    for i, (rid, blocks, seq_len) in enumerate(rows):
        n = int(plan.seq_lens[i])
        assert n <= seq_len
        tb = plan.block_table[i, : -(-n // B)].long()
        ks, vs = st.layout.read_blocks(scratch, tb)  # [nb, B, H, D], read in the kernel's page order
        k = ks.reshape(-1, H, D)[:n]  # [n, H, D] in scratch order
        v = vs.reshape(-1, H, D)[:n]
        assert not torch.isnan(k.float()).any(), "the kernel would read an unfilled scratch position"
        q = torch.randn(HQ, D)
        got = _attend(q, k, v, torch.zeros(n, H))
        want = _reference(st, kv, rid, blocks, seq_len, q)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


ALL_FORMATS = ["fp8", "int8", "int4", "int2", "sparse(4)+int4", "sparse(2)", "cluster(2)+int4", "cluster(4)"]


def test_fused_fill_equals_the_torch_fill_bit_for_bit() -> None:
    """The numba kernels (`cpu_dequant.py`) round the reference's float32 results to the same bf16."""
    # Every format in two rows, mixed with hot blocks, so groups span rows and targets interleave.
    formats: list[list[str | None]] = [[*ALL_FORMATS, None, None], [None, *reversed(ALL_FORMATS), None]]
    st, kv, rows = _scenario(formats, seed=1)
    plan = plan_scratch([ScratchRow(blocks, seq_len, st.remap.get(rid, {})) for rid, blocks, seq_len in rows], B)
    assert {str(g.fmt) for g in plan.groups} == set(ALL_FORMATS)
    want = torch.full((plan.num_blocks, H, 2 * B, D), float("nan"), dtype=kv.dtype)
    got = want.clone()
    read = lambda f, d, s: st.read_with_counts(LAYER, f, d, s)  # noqa: E731
    fill_scratch(plan, kv, read, want, layout=st.layout)
    fill_scratch(plan, kv, read, got, raw=store_reader(st, LAYER), layout=st.layout)
    # Bit patterns, so NaN (positions neither path fills) compares equal too.
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert int(torch.isnan(got.float()).sum()) < got.numel() // 4  # the groups were really written


def test_a_lean_group_takes_the_torch_fill() -> None:
    """The numba kernels do not read lean slots (rotated rows): with one in the step, a raw reader
    still fills the scratch exactly as the torch reader does."""
    formats: list[list[str | None]] = [["int4h", "int4", "cluster(2)+int2h", None], [None, "fp8", None]]
    st, kv, rows = _scenario(formats, seed=2)
    plan = plan_scratch([ScratchRow(blocks, seq_len, st.remap.get(rid, {})) for rid, blocks, seq_len in rows], B)
    want = torch.full((plan.num_blocks, H, 2 * B, D), float("nan"), dtype=kv.dtype)
    got = want.clone()
    read = lambda f, d, s: st.read_with_counts(LAYER, f, d, s)  # noqa: E731
    fill_scratch(plan, kv, read, want, layout=st.layout)
    fill_scratch(plan, kv, read, got, raw=store_reader(st, LAYER), layout=st.layout)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert int(torch.isnan(got.float()).sum()) < got.numel() // 4


def test_expand_centroids_repeats_by_count() -> None:
    k = torch.arange(3).float().view(1, 3, 1, 1).expand(1, 3, 1, 2)
    lc = torch.tensor([2.0, 0.0, 3.0]).log().view(1, 3, 1)  # counts 2, 0, 3
    ke, _ = expand_centroids(k, k, lc, 5)
    assert ke[0, :, 0, 0].tolist() == [0.0, 0.0, 2.0, 2.0, 2.0]


def test_a_compressed_last_block_is_refused() -> None:
    row = ScratchRow([1, 2], 2 * B, {1: (Format.parse("int4"), 9, 0)})
    with pytest.raises(ValueError, match="query tokens"):
        plan_scratch([row], B)


def test_observe_keeps_compressed_blocks_importance_and_reports_per_block() -> None:
    st = WorkerStore()
    st.register({LAYER: torch.zeros(4, H, B, 2 * D, dtype=torch.bfloat16)})
    st.ema_decay = 0.5
    first = torch.zeros(2 * B, H)
    first[3, 1] = 1.0  # all of head 1's mass on token 3 (block 0)
    st.observe("r", first, reset=True)
    rep = st.take_report()
    assert rep is not None and rep.importance["r"] == [1.0, 0.0]
    nxt = torch.zeros(2 * B + 1, H)
    nxt[:B] = float("nan")  # block 0 compressed: not visible this step
    nxt[B + 2, 0] = 1.0
    st.observe("r", nxt, reset=False)
    imp = st.token_importance["r"]
    assert imp[3, 1] == 1.0  # unseen: kept
    assert imp[B + 2, 0] == 0.5  # EMA: 0.5 * 0 + 0.5 * 1
    assert imp.shape[0] == 2 * B + 1
    rep = st.take_report()
    assert rep is not None
    got = rep.importance["r"]
    assert got[0] != got[0] and got[1] == 0.5 and got[2] == 0.0  # NaN, EMA mass, new token's first mass


@pytest.mark.parametrize(("formats", "query_lens"), [
    ([["int4", "sparse(4)+int4", None, "cluster(2)+int4", None], [None, "int8", None]], [1, 1]),
    # A prefill chunk (2 blocks and 5 tokens) over compressed earlier chunks, beside a decode row.
    ([["int4", "sparse(4)+int4", "cluster(2)+int4", None, None, None], [None, "int8", None]], [2 * B + 5, 1]),
    # A chunk starting mid-block: block 3 holds B - 5 computed tokens, then the first queries.
    ([["int4", "cluster(2)+int4", "sparse(4)+int4", None, None, None]], [B + 10]),
])
def test_vllm_kernel_over_the_scratch_equals_the_formats_attention(formats: list[list[str | None]],
                                                                   query_lens: list[int]) -> None:
    """vLLM's own CPU kernel reading the scratch (its page layout, ISA-specific: keys channel-major
    on x86 without AMX) must compute the formats' attention: this catches any layout mismatch.
    A chunk's queries are causal: query i sees the compressed blocks and the tail up to itself."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    st, kv, rows = _scenario(formats)
    plan = plan_scratch([ScratchRow(blocks, seq_len, st.remap.get(rid, {}), ql)
                         for (rid, blocks, seq_len), ql in zip(rows, query_lens, strict=True)], B)
    # NaN where nothing is written: the fill must leave no NaN the kernel reads (it reads whole
    # blocks, past a row's last token too).
    scratch = torch.full((plan.num_blocks, H, 2 * B, D), float("nan"), dtype=kv.dtype)
    fill_scratch(plan, kv, lambda f, d, s: st.read_with_counts(LAYER, f, d, s), scratch,
                 raw=store_reader(st, LAYER), layout=st.layout)
    q = torch.randn(sum(query_lens), HQ, D).to(torch.bfloat16)
    qsl = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    isa = _get_attn_isa(torch.bfloat16, B, D)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(rows), num_heads=HQ, num_kv_heads=H, head_dim=D, seq_lens=plan.seq_lens, dtype=torch.bfloat16,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
        kv_cache_dtype="auto",
    )  # fmt: skip
    out = torch.empty_like(q)
    kc, vc = scratch.chunk(2, dim=2)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl, seq_lens=plan.seq_lens,
        scale=D**-0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=plan.block_table,
        softcap=0.0, scheduler_metadata=sched, s_aux=None, dynamic_causal=None, k_scale=1.0, v_scale=1.0,
        kv_cache_dtype="auto",
    )  # fmt: skip
    for r, ((rid, blocks, seq_len), ql) in enumerate(zip(rows, query_lens, strict=True)):
        for i in range(ql):
            t = int(qsl[r]) + i
            visible = seq_len - ql + 1 + i  # causal: the query at position visible - 1 sees tokens < visible
            want = _reference(st, kv, rid, blocks, visible, q[t].float())
            err = (out[t].float() - want).norm() / want.norm()
            assert err < 1e-2, (rid, i, float(err))


def test_prefill_observation_scores_each_visible_token() -> None:
    """Importance of a prefill chunk's window: mean over its queries of each token's softmax mass
    (causal), max over a KV head's query heads; an earlier chunk already compressed is unseen
    (its tokens keep their last importance) and its freed source is never read."""
    from proxima.integration.vllm.worker import importance

    torch.manual_seed(3)
    kv = torch.randn(NB, H, B, 2 * D).to(torch.bfloat16)
    st = WorkerStore()
    st.register({LAYER: kv})
    st.aggregate = "max"
    seq_len, q_len, window = 2 * B + 10, B + 10, 4
    before = torch.full((seq_len, H), 0.25)
    st.observe("r", before, reset=True)
    bt = torch.tensor([[5, 6, 7]])
    obs = importance.plan_observation(["r"], [{0: (Format.parse("int4"), 9, 0)}], [0, q_len], [seq_len], bt, B, window)
    assert obs is not None and len(obs.prefill) == 1
    kv[5] = float("nan")  # block 0's freed source: reading it would poison every score
    query = torch.randn(q_len, HQ, D).to(torch.bfloat16)
    importance.observe(st, kv, query, obs, D**-0.5)
    got = st.token_importance["r"]

    assert st.layout is not None
    k, _ = st.layout.read_blocks(kv, bt[0])  # [3, B, H, D]
    k = k.reshape(-1, H, D)[:seq_len].float()
    g = HQ // H
    q = query[-window:].float().view(window, H, g, D)
    s = torch.einsum("whgd,lhd->whgl", q, k) * D**-0.5
    pos = torch.arange(seq_len - window, seq_len).view(-1, 1, 1, 1)
    keep = (torch.arange(seq_len) <= pos) & (torch.arange(seq_len) >= B)
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)  # [W, H, G, L]
    want = p.mean(0).amax(1).transpose(0, 1)  # [L, H]
    torch.testing.assert_close(got[B:], want[B:], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[:B], before[:B])  # the compressed chunk keeps its last importance


@pytest.mark.parametrize("aggregate", ["max", "mean"])
def test_hf_cache_and_vllm_worker_score_tokens_alike(aggregate: str) -> None:
    """One definition of importance (`proxima.observation.fold_heads`): the transformers cache
    and the vLLM worker, given the same keys and the same window of queries, give every token the
    same mass per KV head, and fold a block's heads the same way."""
    from proxima.integration.hf import ProximaCache
    from proxima.integration.vllm.worker import importance
    from proxima.policy.schema import Policy

    torch.manual_seed(5)
    seq_len, window = 3 * B + 7, 6
    kv = torch.randn(NB, H, B, 2 * D).to(torch.bfloat16)
    st = WorkerStore()
    st.register({LAYER: kv})
    st.aggregate = aggregate
    bt = torch.tensor([[4, 9, 2, 7]])
    obs = importance.plan_observation(["r"], [{}], [0, seq_len], [seq_len], bt, B, window)
    assert obs is not None
    query = torch.randn(seq_len, HQ, D).to(torch.bfloat16)
    importance.observe(st, kv, query, obs, D**-0.5)
    vllm_mass = st.token_importance["r"]  # [T, H]

    assert st.layout is not None
    k, v = st.layout.read_blocks(kv, bt[0])  # [4, B, H, D]
    k, v = (x.reshape(-1, H, D)[:seq_len].transpose(0, 1)[None].float() for x in (k, v))  # [1, H, T, D]
    policy = Policy.model_validate({"enabled": False, "importance": {"aggregate": aggregate}})
    hf = ProximaCache(policy=policy, block_size=B, observation_window=window)
    hf.update(k, v, 0)
    hf._obs[0] = query[-window:].float().transpose(0, 1)[None]  # [1, HQ, W, D]: what the attention records
    hf_mass = hf.token_importance(0)  # [1, H, 3B]: full blocks only
    assert hf_mass is not None
    full = 3 * B
    torch.testing.assert_close(hf_mass[0].transpose(0, 1), vllm_mass[:full], atol=1e-5, rtol=1e-4)
    vllm_blocks = torch.tensor(st.report.importance["r"][:3])
    torch.testing.assert_close(hf.refresh_importance().float(), vllm_blocks, atol=1e-5, rtol=1e-4)
