"""The compression-time probe's error in two launches: attention over each block before and after.

`reference`: `compression.attention.attention_errors` (torch), whose semantics this kernel keeps:
per block n, every observation query w of every query head attends to the block alone, once to
its rows as they were (k, v, with their log-counts as a bias when they are centroids) and once to
the compressed rows (kh, vh, bias log-count, -inf for an empty centroid); the error is
||O_hat - O||_F / ||O||_F over the block's valid queries and heads (0 where O is zero).

Why a kernel: the torch form dispatches about 45 ops per candidate format (repeat_interleave,
einsum, softmax, norms), and the worker probes every candidate of every compressing group in
every step; here it is two launches (a program per block and query head, then the norms per
block). Products in float32 (`input_precision="ieee"`: the verdict compares against bounds like
0.05).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from proxima.compression.kernels.common import _p2


@triton.jit
def _attend(q, k, v, bias, scale):
    """softmax(q k^T * scale + bias) v for one head: q [W, D], k, v [R, D], bias [R] (-inf: no row)."""
    logits = tl.dot(q, tl.trans(k), input_precision="ieee") * scale + bias[None, :]
    m = tl.max(logits, axis=1)
    p = tl.exp(logits - m[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    return tl.dot(p, v, input_precision="ieee")


@triton.jit(do_not_specialize=["W", "has_valid", "has_ref"])
def _probe_error_kernel(
    q_ptr,  # [N, W, Hq, D] float32 observation queries
    valid_ptr,  # [N, W] bool (read only with has_valid)
    k_ptr, v_ptr,  # [N, T, H, D] the block as it was
    rlc_ptr,  # [N, T, H] float32 its rows' log-counts (read only with has_ref)
    kh_ptr, vh_ptr,  # [N, C, H, D] the block compressed, decompressed
    lc_ptr,  # [N, C, H] float32 their log-counts
    part_ptr,  # [N, Hq, 2] float32: per query head, sum of squared differences and of squared outputs
    W, T, C, H, G, scale,
    has_valid, has_ref,  # runtime flags, not constexpr: one compiled variant per format (see probe_errors)
    D: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per (block, query head): a block's heads in parallel (a program per block
    looping over 32 heads ran ~1 ms each on the H100, serially for every probed block)."""
    n = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1).to(tl.int64)
    h = hq // G  # query head hq reads KV head hq // G
    ow = tl.arange(0, BLOCK_W)
    ot = tl.arange(0, BLOCK_T)
    oc = tl.arange(0, BLOCK_C)
    od = tl.arange(0, BLOCK_D)
    mw, mt, mc, md = ow < W, ot < T, oc < C, od < D
    keep = mw
    if has_valid:
        keep = keep & (tl.load(valid_ptr + n * W + ow, mask=mw, other=0) != 0)
    src = ((n * T + ot[:, None]) * H + h) * D + od[None, :]
    m_src = mt[:, None] & md[None, :]
    k = tl.load(k_ptr + src, mask=m_src, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + src, mask=m_src, other=0.0).to(tl.float32)
    if has_ref:
        b_ref = tl.load(rlc_ptr + (n * T + ot) * H + h, mask=mt, other=float("-inf"))
    else:
        b_ref = tl.where(mt, 0.0, float("-inf"))
    cmp = ((n * C + oc[:, None]) * H + h) * D + od[None, :]
    m_cmp = mc[:, None] & md[None, :]
    kh = tl.load(kh_ptr + cmp, mask=m_cmp, other=0.0).to(tl.float32)
    vh = tl.load(vh_ptr + cmp, mask=m_cmp, other=0.0).to(tl.float32)
    b_hat = tl.load(lc_ptr + (n * C + oc) * H + h, mask=mc, other=float("-inf"))
    qo = ((n * W + ow[:, None]) * (H * G) + hq) * D + od[None, :]
    q = tl.load(q_ptr + qo, mask=mw[:, None] & md[None, :], other=0.0)
    o = _attend(q, k, v, b_ref, scale)
    diff = tl.where(keep[:, None], _attend(q, kh, vh, b_hat, scale) - o, 0.0)
    o = tl.where(keep[:, None], o, 0.0)
    tl.store(part_ptr + (n * H * G + hq) * 2, tl.sum(tl.sum(diff * diff, axis=1), axis=0))
    tl.store(part_ptr + (n * H * G + hq) * 2 + 1, tl.sum(tl.sum(o * o, axis=1), axis=0))


@triton.jit
def _probe_error_finish(part_ptr, out_ptr, HQ, BLOCK_HQ: tl.constexpr):
    """err[n] = sqrt(sum of squared differences) / sqrt(sum of squared outputs), 0 where O is zero."""
    n = tl.program_id(0).to(tl.int64)
    oh = tl.arange(0, BLOCK_HQ)
    m = oh < HQ
    num = tl.sqrt(tl.sum(tl.load(part_ptr + (n * HQ + oh) * 2, mask=m, other=0.0), axis=0))
    den = tl.sqrt(tl.sum(tl.load(part_ptr + (n * HQ + oh) * 2 + 1, mask=m, other=0.0), axis=0))
    tl.store(out_ptr + n, tl.where(den > 0, num / tl.maximum(den, 1e-30), 0.0))


def probe_errors(
    q_obs: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    log_count: torch.Tensor,
    *,
    scale: float,
    q_valid: torch.Tensor | None = None,
    ref_log_count: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 [N] on k's device: `attention_errors`' numbers (see the module docstring).

    One compiled variant per (format, model shape), so the engine's warm-up compiles all of them
    (`attention/triton.py` `warm_up`) and serving never stalls on a compile: the window W, which
    changes with requests' ages, is not specialized on and pads to at least 32 rows; the padding
    mask and the reference counts are runtime flags.

    q_obs [N, W, Hq, D]; k, v [N, T, H, D]; kh, vh [N, C, H, D] and log_count [N, C, H] as
    `decompress_blocks` returns them; q_valid bool [N, W]; ref_log_count [N, T, H]."""
    n, t, h, d = k.shape
    w, hq = q_obs.shape[1], q_obs.shape[2]
    c = kh.shape[1]
    q, k, v, kh, vh = (x.contiguous() for x in (q_obs.float(), k, v, kh, vh))
    lc = log_count.float().contiguous()
    rlc = ref_log_count.float().contiguous() if ref_log_count is not None else lc
    valid = q_valid.contiguous() if q_valid is not None else lc
    out = torch.empty(n, device=k.device, dtype=torch.float32)
    if n:
        part = torch.empty(n, hq, 2, device=k.device, dtype=torch.float32)
        _probe_error_kernel[(n, hq)](
            q, valid, k, v, rlc, kh, vh, lc, part, w, t, c, h, hq // h, float(scale),
            int(q_valid is not None), int(ref_log_count is not None), D=d,
            BLOCK_W=_p2(w, 32), BLOCK_T=_p2(t, 16), BLOCK_C=_p2(c, 16), BLOCK_D=_p2(d, 16), num_warps=4,
        )  # fmt: skip
        _probe_error_finish[(n,)](part, out, hq, BLOCK_HQ=_p2(hq, 16))
    return out
