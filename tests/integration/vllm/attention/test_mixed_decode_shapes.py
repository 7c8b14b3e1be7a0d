"""The one-pass decode kernel at the shapes the GPU engine runs (vLLM's block 32 as well as 16, head
dim 128, the 8B shape's 4 query heads per KV head), without an engine: blocks compressed by the
product's kernels into the product's slot pools over one cache (`LayerStack`), their places in a
`DeviceBlockTable`, the output compared with dense attention over the decompressed blocks.

Why beside test_mixed_decode.py: those tests run the connector at block 16 and head dim 32; an
engine run at block 32 (bench/capacity.py's throughput workload, 2026-12-06) ended in a CUDA error
with the one-pass decode on (bench/results/experiments/one-pass-e2e), so every addressing path is
also checked here at block 32. (This kernel is correct here; the engine's error is not explained.)"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

from proxima.compression.blocks import compress_blocks, decompress_blocks
from proxima.compression.layer_stack import LayerStack
from proxima.compression.mixed_decode import mixed_decode, pool_descriptors
from proxima.compression.spec import SlotSpec
from proxima.formats import DEFAULT_GROUP_SIZE, Format
from proxima.integration.vllm.worker.block_table import DeviceBlockTable

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
H, HQ, D = 2, 8, 128
# per request: (context length in tokens, {logical block: format}); the last block is never compressed
ROWS = [(5 * 32 + 7, {0: "int4", 1: "int4", 2: "cluster(2)+int4", 3: "fp8"}),
        (3 * 32, {0: "int8", 1: "int2"}),
        (40, {}),
        # lean blocks (rotated codes, a softmax state of their own) between pages and other formats
        (6 * 32 + 5, {0: "int4h", 1: "int4", 2: "int2h", 4: "cluster(2)+int4h", 5: "int4h"}),
        (2 * 32 + 1, {0: "int2h", 1: "int4h"})]


def _case(bs: int) -> tuple[dict, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Kernel inputs, and per request its dense (keys, values, log counts) in logical order."""
    torch.manual_seed(bs)
    nblk = [-(-n // bs) for n, _ in ROWS]
    width = max(nblk)
    n_hot = sum(nblk)
    formats = sorted({Format.parse(f) for _, comp in ROWS for f in comp.values()}, key=str)
    n_phys = 1 + n_hot + 4 * len(formats)  # null block, pages, then each format's destination blocks
    kv = torch.randn(n_phys, H, bs, 2 * D, device=DEV).bfloat16()
    tables = torch.zeros(len(ROWS), width, dtype=torch.int32)
    stack = LayerStack({"layer": kv})
    table = DeviceBlockTable(len(ROWS), width, n_phys, DEV, kv_heads=H, max_batch=len(ROWS))
    pools, dtypes, placed, dense = {}, {}, [], []
    next_page, next_slot = 1, {f: (1 + n_hot + 4 * i) * f.pack_ratio for i, f in enumerate(formats)}
    key_blocks, slots = {}, []
    for r, (n, comp) in enumerate(ROWS):
        ks, vs, lcs = [], [], []
        for j in range(nblk[r]):
            page = next_page
            next_page += 1
            tables[r, j] = page
            seen = min(bs, n - j * bs)
            k = kv[page, :, :, :D].transpose(0, 1).unsqueeze(0)  # [1, BS, H, D]
            v = kv[page, :, :, D:].transpose(0, 1).unsqueeze(0)
            if j not in comp:
                ks.append(k[0, :seen])
                vs.append(v[0, :seen])
                lcs.append(torch.zeros(seen, H, device=DEV))
                continue
            fmt = Format.parse(comp[j])
            spec = SlotSpec(fmt, bs, D, H)
            pool = pools.setdefault(fmt, stack.pool(fmt, spec))
            imp = torch.rand(1, bs, H, device=DEV) if fmt.reduction is not None else None
            cb = compress_blocks(fmt, k, v, token_importance=imp)
            dtypes[fmt] = (cb.k_data.dtype, cb.v_data.dtype)
            sid = next_slot[fmt]
            next_slot[fmt] += 1
            stack.write(pool, (0,), torch.tensor([sid], device=DEV), cb)
            kh, vh, lc = decompress_blocks(cb)
            ks.append(kh[0])
            vs.append(vh[0])
            lcs.append(lc[0])
            placed.append((f"r{r}", j, (fmt, sid // fmt.pack_ratio, sid % fmt.pack_ratio)))
            tables[r, j] = 0  # the page was freed: only the slot may be read
        key_blocks[int(tables[r, nblk[r] - 1])] = f"r{r}"
        slots.append(int(tables[r, nblk[r] - 1]) * bs + (n - 1) % bs)
        dense.append((torch.cat(ks), torch.cat(vs), torch.cat(lcs)))
    table.update(placed, [], key_blocks)
    descs = {table.code_of(f): pools[f].at(0).blocks(*dtypes[f], kv.dtype) for f in pools}
    inputs = {"kv": kv, "tables": tables.to(DEV), "seq_lens": torch.tensor([n for n, _ in ROWS], dtype=torch.int32,
              device=DEV), "qsl": torch.arange(len(ROWS) + 1, dtype=torch.int32, device=DEV),
              "slots": torch.tensor(slots, dtype=torch.long, device=DEV), "table": table,
              "desc": pool_descriptors(descs, bs, DEV),
              "stack": stack}  # the descriptors hold raw pointers into the stack's side tables: keep it alive
    return inputs, dense


@pytest.mark.parametrize("reader", ["tiles", "kernel"])
@pytest.mark.parametrize(("bs", "splits"), [(16, 1), (16, 3), (32, 1), (32, 3), (8, 2)])
def test_one_pass_equals_dense_attention_at_the_engines_shapes(bs: int, splits: int, reader: str) -> None:
    """(Block 8: below tl.dot's 16, every product, the lean rotations included, is a broadcast sum.)
    Both readers of the compressed blocks: inside the kernel ("tiles") and in a kernel of their
    own ("kernel", `mixed_comp.py`, whose partial state the main kernel starts from)."""
    x, dense = _case(bs)
    q = torch.randn(len(ROWS), HQ, D, device=DEV).bfloat16()
    out = torch.full_like(q, float("nan"))
    t = x["table"]
    mixed_decode(q, out, x["kv"], x["tables"], x["seq_lens"], x["qsl"], x["slots"], t.owner, t.entries, x["desc"],
                 sm_scale=D**-0.5, splits=splits, key_group=DEFAULT_GROUP_SIZE, compressed_reader=reader)
    for r, (k, v, lc) in enumerate(dense):
        kk = k.float().repeat_interleave(HQ // H, 1)
        vv = v.float().repeat_interleave(HQ // H, 1)
        logits = torch.einsum("hd,thd->ht", q[r].float(), kk) * D**-0.5 + lc.float().repeat_interleave(HQ // H, 1).T
        ref = torch.einsum("ht,thd->hd", torch.softmax(logits, -1), vv)
        assert torch.allclose(out[r].float(), ref, atol=3e-2, rtol=3e-2), (bs, splits, r,
                                                                          (out[r].float() - ref).abs().max())
        err = float((out[r].float() - ref).norm() / ref.norm())
        assert err < 1e-2, (bs, splits, r, err)  # the outputs are small (means of noise): relative too
