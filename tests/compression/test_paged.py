"""Paged attention over hot blocks + compressed slots (the CUDA backend's compute core).

Runs the Triton kernels under the interpreter on CPU (conftest) and compiled on a GPU; no vLLM
import, so the same file runs on a GPU machine without vLLM. Shapes are tiny for the interpreter.
"""

import pytest
import torch

from proxima.compression.paged import PagedRow, paged_attention, plan_rows
from proxima.formats import Format
from tests.compression.conftest import rel_err
from tests.compression.paged_world import build_world, reference

B = 16


def _q(world, hq: int, seed: int = 1) -> torch.Tensor:
    sq = sum(r.query_len for r in world.rows)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sq, hq, world.dense[0][0].shape[-1], generator=g).bfloat16().to(world.kv.device)


def _check(world, hq: int, *, backend: str = "triton", num_splits: int | None = 2) -> None:
    q = _q(world, hq)
    plan = plan_rows(world.rows, B).to(world.kv.device)
    got = paged_attention(q, plan, world.hot, world.pools, backend=backend, num_splits=num_splits)
    want_o, want_lse, want_mass = reference(world, q, B)
    assert rel_err(got.out.float().cpu(), want_o) < 1e-2
    assert torch.allclose(got.lse.cpu(), want_lse, atol=2e-2)
    mass = got.block_mass.cpu()
    # the kernel rounds dequantized KV differently from the reference (test_attention.MASS_ATOL)
    assert torch.allclose(mass, want_mass, atol=5e-3)
    assert torch.allclose(mass.sum(1), torch.ones(len(world.rows), hq), atol=1e-3)


@pytest.mark.parametrize("hq", [2, 4])  # GQA 1 and 2 (H = 2)
def test_decode_rows_mix_hot_and_compressed_blocks(hq, device):
    # row 0: int8 + int4 + fp8 blocks between hot ones, partial tail; row 1: nothing compressed;
    # row 2: every block but the tail compressed, including token-reducing formats
    world = build_world(
        [70, 40, 50], [1, 1, 1],
        [{0: "int8", 1: "int4", 3: "fp8"}, {}, {0: "cluster(2)", 1: "int4", 2: "sparse(2)+int8"}],
        device=device,
    )  # fmt: skip
    _check(world, hq)


def test_prefill_rows_see_only_their_causal_past(device):
    # a 3-token query whose tail spans two hot blocks, next to a decode row
    world = build_world([35, 20], [3, 1], [{0: "int4"}, {0: "int8"}], device=device)
    _check(world, 4)


def test_nothing_compressed_equals_dense_attention(device):
    world = build_world([33, 17], [1, 2], [{}, {}], device=device)
    _check(world, 2)


def test_torch_backend_agrees(device):
    world = build_world([40], [1], [{0: "int2", 1: "fp8"}], device=device)
    _check(world, 2, backend="torch", num_splits=None)


def test_plan_tables():
    rows = [
        PagedRow([5, 0, 7], 40, 2, {1: (Format.parse("int4"), 9, 2)}),
        PagedRow([3], 10),
    ]
    plan = plan_rows(rows, B)
    assert plan.max_blocks == 3 and plan.query_request.tolist() == [0, 0, 1]
    hot, int4 = plan.segments
    assert hot.fmt.is_hot and int4.fmt == Format.parse("int4")
    assert hot.slot_table.tolist() == [[5, 7], [5, 7], [3, 0]]
    # query tokens at positions 38, 39 see 7, 8 tokens of block 2; the decode row its 10 tokens
    assert hot.slot_tokens.tolist() == [[16, 7], [16, 8], [10, 0]]
    assert int4.slot_table[:2].tolist() == [[9 * 4 + 2], [9 * 4 + 2]]
    assert int4.slot_tokens.tolist() == [[16], [16], [0]]
    assert hot.logical_block.tolist() == [[0, 2], [0, 2], [0, 0]]


def test_plan_errors():
    with pytest.raises(ValueError, match="query_len"):
        plan_rows([PagedRow([1], 10, 11)], B)
    with pytest.raises(ValueError, match="block per"):
        plan_rows([PagedRow([1], 40)], B)
    with pytest.raises(ValueError, match="partly visible"):
        # a cluster slot whose block is cut by the query's causal boundary
        plan_rows([PagedRow([0, 2], 20, 10, {0: (Format.parse("cluster(2)"), 3, 0)})], B)
    plan = plan_rows([PagedRow([0], 10, 1, {0: (Format.parse("int8"), 3, 0)})], B)
    q = torch.zeros(1, 2, 32).bfloat16()
    world = build_world([10], [1], [{}])
    with pytest.raises(ValueError, match="no pool"):
        paged_attention(q, plan, world.hot, {})
    with pytest.raises(ValueError, match="rows"):
        paged_attention(q[:0], plan, world.hot, {})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton kernels need a GPU")
def test_compiled_on_gpu_larger_batch():
    """The compiled kernels (not the interpreter): 8 requests, GQA 4, D 128, mixed formats."""
    seq = [300, 129, 520, 64, 1000, 77, 256, 33]
    comp = [{j: ("int8", "int4", "fp8", "int2")[j // 2 % 4] for j in range(0, (n - 1) // B, 2)} for n in seq]
    world = build_world(seq, [1, 1, 4, 1, 1, 2, 1, 1], comp, h=2, d=128, device="cuda")
    _check(world, 8, num_splits=None)
