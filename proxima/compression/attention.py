"""Decode attention over a context made of blocks in several formats, and the compression probe.

A sequence's context is a list of *segments*, one per format: the hot bf16 paged blocks are
a segment of format `bf16` whose pool is vLLM's key/value cache, and each compressed format is a
segment whose pool is a set of slots (`CompressedBlocks`, see `layout.py` for views onto vLLM's
KV tensor). Each segment is attended separately (output and log-sum-exp per sequence and query
head), the partial results are merged by log-sum-exp, and the per-entry attention mass is
returned for the importance statistics.

Named dims: S sequences, Hq query heads, H KV heads (Hq = G * H, query head i reads KV head
i // G), D head dim, E entries (slots) per sequence in one segment, C slot capacity in tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from proxima.compression.blocks import Backend, CompressedBlocks, decompress_blocks, use_triton
from proxima.compression.segment import KVSegment
from proxima.compression.spec import LEAN_BITS
from proxima.formats import Format


@dataclass
class DecodeOutput:
    out: torch.Tensor
    """[S, Hq, D] attention output, dtype of q."""
    lse: torch.Tensor
    """[S, Hq] float32 natural-log sum of exp of the (scaled, count-corrected) logits."""
    entry_lse: list[torch.Tensor]
    """Per segment, [S, E, Hq] float32 log-sum-exp of each entry's logits (-inf for padding)."""

    @property
    def block_mass(self) -> list[torch.Tensor]:
        """Per segment, [S, E, Hq] float32: softmax mass each entry received (sums to 1 over all
        entries of all segments, per sequence and query head; 0 for padding). Computed on
        access, so a decode step that does not need it launches nothing for it."""
        return [torch.exp(e - self.lse.unsqueeze(1)).nan_to_num(0.0) for e in self.entry_lse]


def _check_q(q: torch.Tensor, segments: list[KVSegment]) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [S, Hq, D], got shape {tuple(q.shape)}")
    s, hq, d = q.shape
    if not segments:
        raise ValueError("decode attention needs at least one segment")
    for seg in segments:
        st = seg.store
        if st.head_dim != d:
            raise ValueError(f"segment {st.fmt}: head_dim {st.head_dim} != q's D {d}")
        if hq % st.num_kv_heads:
            raise ValueError(f"Hq={hq} must be a multiple of the KV heads {st.num_kv_heads} ({st.fmt})")
        if seg.slot_table.shape[0] != s:
            raise ValueError(f"segment {st.fmt}: slot_table has {seg.slot_table.shape[0]} rows, q has S={s}")


def decode_attention(
    q: torch.Tensor,
    segments: list[KVSegment],
    *,
    sm_scale: float | None = None,
    backend: Backend = "auto",
    num_splits: int | None = None,
) -> DecodeOutput:
    """One decode step: q [S, Hq, D] attends to every segment's entries (see module docstring).

    Cluster segments add log(count) to each centroid's logit. sm_scale defaults to 1/sqrt(D).
    """
    _check_q(q, segments)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    if not use_triton(backend, q):
        return decode_attention_reference(q, segments, sm_scale=scale)
    from proxima.compression import triton_attention as ta

    segments = [dequantized_segment(seg) if seg.store.fmt.quant in LEAN_BITS else seg for seg in segments]
    s, hq, d = q.shape
    splits = [ta.plan_splits(q, seg, num_splits) for seg in segments]
    o_all = torch.empty(sum(splits), s, hq, d, device=q.device, dtype=torch.float32)
    lse_all = torch.empty(sum(splits), s, hq, device=q.device, dtype=torch.float32)
    ents, p0 = [], 0
    for seg, sp in zip(segments, splits, strict=True):
        ents.append(ta.segment_partial(q, seg, scale, sp, o_all[p0 : p0 + sp], lse_all[p0 : p0 + sp]))
        p0 += sp
    out, lse = ta.merge(o_all, lse_all, q.dtype)
    return DecodeOutput(out, lse, ents)


def dequantized_segment(seg: KVSegment) -> KVSegment:
    """A lean segment (int4h / int2h, rotated keys) as a segment of its dequantized rows in the
    source dtype, read by the split kernel's bf16 path. The kernel does not read lean codes (it
    would need the query rotated and per-token scales on int4 codes); this is correct for every
    reader but costs a decompression of the referenced slots per call (S x E slots, no host sync:
    padding entries read slot 0 and stay masked by their 0 tokens)."""
    st = seg.store
    s, e = seg.slot_table.shape
    idx = torch.where(seg.slot_tokens > 0, seg.slot_table, torch.zeros_like(seg.slot_table)).long().flatten()
    kh, vh, lc = decompress_blocks(st.select(idx.to(st.k_data.device)))
    store = CompressedBlocks(
        Format(st.fmt.reduction, st.fmt.reduction_ratio, "bf16"), kh, vh, head_dim=st.head_dim, dtype=st.dtype,
        group_size=st.group_size, log_count=lc if st.log_count is not None else None, source_tokens=st.source_tokens,
    )  # fmt: skip
    table = torch.arange(s * e, device=seg.slot_table.device, dtype=torch.int32).view(s, e)
    return KVSegment(store, table, seg.slot_tokens)


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge P partial attentions: o [P, S, Hq, D] (each normalised), lse [P, S, Hq].

    A part that saw no token has lse = -inf and weight 0; a row no part saw gets output 0 and
    lse -inf.
    """
    total = torch.logsumexp(lse, 0)  # -inf only if every part is -inf
    w = torch.exp(lse - total.unsqueeze(0)).nan_to_num(0.0)
    return (w.unsqueeze(-1) * o.float()).sum(0), total


def _segment_logits(q: torch.Tensor, seg: KVSegment, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference logits [S, Hq, E*C] (masked -inf) and dequantized values [S, Hq, E*C, D]."""
    s, hq, d = q.shape
    st = seg.store
    e, c, h = seg.slot_table.shape[1], st.slot_tokens, st.num_kv_heads
    g = hq // h
    valid_entry = seg.slot_tokens > 0
    idx = torch.where(valid_entry, seg.slot_table, torch.zeros_like(seg.slot_table)).long().flatten()
    kh, vh, lc = decompress_blocks(st.select(idx), backend="torch")  # [S*E, C, H, D]
    kf = kh.float().reshape(s, e * c, h, d).repeat_interleave(g, 2)  # [S, E*C, Hq, D]
    vf = vh.float().reshape(s, e * c, h, d).repeat_interleave(g, 2)
    lcf = lc.reshape(s, e * c, h).repeat_interleave(g, 2)  # [S, E*C, Hq]
    logits = torch.einsum("shd,sthd->sht", q.float(), kf) * scale + lcf.transpose(1, 2)
    tok = torch.arange(c, device=q.device)
    valid = (tok.view(1, 1, c) < seg.slot_tokens.unsqueeze(-1)).reshape(s, 1, e * c)
    logits = logits.masked_fill(~valid, float("-inf"))
    # padding reads slot 0, which may hold anything (NaN bytes in fp8): 0 * NaN would leak
    vf = vf.masked_fill(~valid.reshape(s, e * c, 1, 1), 0.0)
    return logits, vf.permute(0, 2, 1, 3)


def decode_attention_reference(
    q: torch.Tensor, segments: list[KVSegment], *, sm_scale: float | None = None
) -> DecodeOutput:
    """Torch reference of `decode_attention`: dequantize everything, one softmax in float32."""
    _check_q(q, segments)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    s, hq, _ = q.shape
    pieces = [_segment_logits(q, seg, scale) for seg in segments]
    logits = torch.cat([p[0] for p in pieces], -1)  # [S, Hq, Ntot]
    values = torch.cat([p[1] for p in pieces], 2)  # [S, Hq, Ntot, D]
    lse = torch.logsumexp(logits, -1)
    p = torch.exp(logits - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("shn,shnd->shd", p, values)
    ents, start = [], 0
    for seg in segments:
        e, c = seg.slot_table.shape[1], seg.store.slot_tokens
        le = torch.logsumexp(logits[..., start : start + e * c].reshape(s, hq, e, c), -1)
        ents.append(le.transpose(1, 2).contiguous())
        start += e * c
    return DecodeOutput(out.to(q.dtype), lse, ents)


def attention_error(
    q_obs: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cb: CompressedBlocks,
    *,
    sm_scale: float | None = None,
) -> float:
    """Compression-time probe: relative error of attention over one block, before vs after.

    q_obs: [W, Hq, D] observation-window queries; k, v: [T, H, D] the block as it was; cb: that
    block compressed (N = 1). Each query attends to the block alone (no mask: the block is in
    every query's past). Returns ||O_hat - O||_F / ||O||_F over all W queries and heads, float32
    arithmetic (0.0 when O is zero). One block of `attention_errors`.
    """
    if q_obs.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"need q_obs [W, Hq, D] and k, v [T, H, D], got {tuple(q_obs.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if cb.num_slots != 1:
        raise ValueError(f"attention_error takes one compressed block, got {cb.num_slots}")
    return float(attention_errors(q_obs, k.unsqueeze(0), v.unsqueeze(0), cb, sm_scale=sm_scale)[0])


def attention_errors(
    q_obs: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cb: CompressedBlocks,
    *,
    q_valid: torch.Tensor | None = None,
    sm_scale: float | None = None,
    ref_log_count: torch.Tensor | None = None,
    on_host: bool = True,
    backend: Backend = "torch",
) -> torch.Tensor:
    """The compression-time probe for N blocks at once (every integration calls this one).

    q_obs: [W, Hq, D] (the same queries for every block) or [N, W, Hq, D] (each block its own,
    e.g. its request's recent queries in the vLLM worker); k, v: [N, T, H, D] the blocks as they
    were; cb: those N blocks compressed. Returns float32 [N] on the CPU: per block,
    ||O_hat - O||_F / ||O||_F over its W queries and Hq heads (0 where O is zero). Centroids count
    with their log(count) and empty ones not at all. q_valid: bool [N, W], False for padding
    queries (a request with fewer than W recent queries): padding counts in neither norm.
    `ref_log_count` [N, T, H]: the reference rows are themselves centroids (recompressing a
    merged block: the error is measured against what the block held before this step).
    `on_host=False` leaves the errors on k's device (the vLLM worker reads them a step later:
    a copy to the host here would wait for the device). `backend`: the torch reference by
    default; the vLLM worker passes its own kernels' (on a GPU, Triton: the decompression and
    then both attentions and the norms in two launches, `kernels/probe_error.py`, instead of
    about 45 torch ops per call; the tests hold the two equal).
    """
    if cb.num_slots != k.shape[0]:
        raise ValueError(f"cb holds {cb.num_slots} blocks, k holds {k.shape[0]}")
    kh, vh, lc = decompress_blocks(cb, backend=backend)  # [N, C, H, D], [N, C, H]
    return attention_errors_dense(q_obs, k, v, kh, vh, lc, q_valid=q_valid, sm_scale=sm_scale,
                                  ref_log_count=ref_log_count, on_host=on_host, backend=backend)


def attention_errors_dense(
    q_obs: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    log_count: torch.Tensor,
    *,
    q_valid: torch.Tensor | None = None,
    sm_scale: float | None = None,
    ref_log_count: torch.Tensor | None = None,
    on_host: bool = True,
    backend: Backend = "torch",
) -> torch.Tensor:
    """`attention_errors` with the compressed blocks already decompressed: kh, vh [N, C, H, D]
    and their log-counts [N, C, H] (0 for a token, -inf for an empty centroid), e.g. read from
    their slots by the step kernels (the vLLM worker's probe)."""
    if k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"need k, v [N, T, H, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    n, _, h, d = k.shape
    if q_obs.dim() == 3:
        q_obs = q_obs.unsqueeze(0).expand(n, *q_obs.shape)
    if q_obs.dim() != 4 or q_obs.shape[0] != n or q_obs.shape[-1] != d:
        raise ValueError(f"need q_obs [W, Hq, D] or [N={n}, W, Hq, D={d}], got {tuple(q_obs.shape)}")
    if kh.dim() != 4 or vh.shape != kh.shape or kh.shape[0] != n or log_count.shape != kh.shape[:3]:
        raise ValueError(f"need kh, vh [N={n}, C, H, D] and log-counts [N, C, H], got {tuple(kh.shape)}, "
                         f"{tuple(vh.shape)}, {tuple(log_count.shape)}")
    hq = q_obs.shape[2]
    if hq % h:
        raise ValueError(f"Hq={hq} must be a multiple of H={h}")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    g = hq // h
    if use_triton(backend, k):  # the same numbers in two launches (`kernels/probe_error.py`)
        from proxima.compression.kernels.probe_error import probe_errors

        out = probe_errors(q_obs, k, v, kh, vh, log_count, scale=scale, q_valid=q_valid,
                           ref_log_count=ref_log_count)
        return out.cpu() if on_host else out
    qf = q_obs.float()

    def attend(kk: torch.Tensor, vv: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kq = kk.float().repeat_interleave(g, 2)  # [N, T, Hq, D]: query head i reads KV head i // g
        vq = vv.float().repeat_interleave(g, 2)
        logits = torch.einsum("nwhd,nthd->nwht", qf, kq) * scale
        if bias is not None:
            logits = logits + bias.repeat_interleave(g, 2).transpose(1, 2).unsqueeze(1)
        return torch.einsum("nwht,nthd->nwhd", torch.softmax(logits, -1), vq)

    o = attend(k, v, ref_log_count)
    o_hat = attend(kh, vh, log_count)
    diff = o_hat - o
    if q_valid is not None:
        keep = q_valid.to(o.device).view(n, -1, 1, 1).float()
        o, diff = o * keep, diff * keep
    num = diff.flatten(1).norm(dim=1)
    den = o.flatten(1).norm(dim=1)
    out = torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(num))
    return out.cpu() if on_host else out
