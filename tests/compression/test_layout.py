"""Views onto vLLM's per-layer KV tensor: hot blocks (`layout`) and compressed slots inside
blocks (`layer_stack`: the slot pool the vLLM worker writes, tested through its own write)."""

import pytest
import torch

from proxima.compression import (
    CompressedBlocks,
    KVLayout,
    KVSegment,
    LayerStack,
    SlotPool,
    compress_blocks,
    decode_attention,
    decompress_blocks,
    hot_store,
    slot_spec,
)
from tests.compression.conftest import rel_err
from tests.compression.synthetic import realistic_kv

NB, H, B, D = 4, 2, 32, 64


def _cpu_cache():
    return torch.randn(NB, H, B, 2 * D).bfloat16()


def _flash_cache():
    # logical [NB, H, B, 2D] stored physically as [NB, B, H, 2D] (block-contiguous, LBNHC)
    return torch.randn(NB, B, H, 2 * D).bfloat16().transpose(1, 2)


def test_cpu_attn_hot_view_matches_the_backend_reinterpretation():
    kv = _cpu_cache()
    st = hot_store(kv, KVLayout.CPU_ATTN, num_kv_heads=H, head_dim=D)
    pages = kv.view(NB, H, 2 * B, D)  # what CPU_ATTN does: K for all tokens, then V
    key_cache, value_cache = pages.chunk(2, dim=2)
    assert torch.equal(st.k_data, key_cache.permute(0, 2, 1, 3))
    assert torch.equal(st.v_data, value_cache.permute(0, 2, 1, 3))
    assert st.k_data.data_ptr() == kv.data_ptr()  # a view, not a copy


def test_flash_attn_hot_view_matches_the_backend_split():
    kv = _flash_cache()
    st = hot_store(kv, KVLayout.FLASH_ATTN, num_kv_heads=H, head_dim=D)
    key_cache, value_cache = kv.transpose(1, 2).split(D, dim=-1)
    assert torch.equal(st.k_data, key_cache) and torch.equal(st.v_data, value_cache)


def _written(kv: torch.Tensor, fmt: str, ids: torch.Tensor, cb: CompressedBlocks) -> tuple[LayerStack, SlotPool]:
    """`cb` written into slots `ids` of `kv` as the vLLM worker writes them (`LayerStack.write`)."""
    stack = LayerStack({"layer": kv})
    sp = stack.pool(fmt, slot_spec(fmt, block_size=B, head_dim=D, num_kv_heads=H))
    stack.write(sp, (0,), ids, cb)
    return stack, sp


@pytest.mark.parametrize("fmt", ["int4", "fp8", "int8", "sparse(4)", "cluster(2)+int4", "int2", "int4h", "int2h"])
def test_slots_round_trip_and_stay_inside_their_block(fmt):
    kv = _cpu_cache()
    before = kv.clone()
    r = slot_spec(fmt, block_size=B, head_dim=D, num_kv_heads=H).fmt.pack_ratio
    k, v = realistic_kv(r, B, H, D, seed=r)
    cb = compress_blocks(fmt, k, v)
    target = 2  # fill every slot of physical block 2
    ids = torch.arange(target * r, (target + 1) * r)
    stack, sp = _written(kv, fmt, ids, cb)
    changed = (kv.view(torch.int16) != before.view(torch.int16)).flatten(1).any(1)
    assert changed.tolist() == [b == target for b in range(NB)]
    pool = sp.at(0).blocks(cb.k_data.dtype, cb.v_data.dtype, kv.dtype)  # what the attention backends read
    assert pool.num_slots == NB * r and pool.slot_tokens == B // cb.fmt.reduction_ratio
    assert pool.k_data.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()  # a view, not a copy
    back = pool.select(ids)
    for name in ("k_data", "v_data", "k_scale", "k_zero", "v_scale", "v_zero", "log_count"):
        x, y = getattr(cb, name), getattr(back, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.dtype == torch.float8_e4m3fn \
                else torch.equal(x.to(y.dtype), y), name
    kh, vh, _ = decompress_blocks(back)
    kw, vw, _ = decompress_blocks(cb)
    assert torch.equal(kh, kw) and torch.equal(vh, vw)
    # the gather the executor reads recompressions with returns the same bytes
    k8, _, meta = stack.gather(sp, (0,), ids)
    assert torch.equal(k8.view(cb.k_data.dtype), cb.k_data.contiguous()) and set(meta) == set(sp.meta)


def test_attention_through_the_pool_view():
    kv = _cpu_cache()
    k, v = realistic_kv(2, B, H, D, seed=11)
    cb = compress_blocks("int4", k, v)
    ids = torch.tensor([5, 9])
    _, sp = _written(kv, "int4", ids, cb)
    pool = sp.at(0).blocks(cb.k_data.dtype, cb.v_data.dtype, kv.dtype)
    q = torch.randn(1, 4, D).bfloat16()
    lens = torch.full((1, 2), 20, dtype=torch.int32)  # the causal tail: 20 of each block's tokens
    seg_pool = KVSegment(pool, ids.view(1, 2).int(), lens)
    seg_dense = KVSegment(cb, torch.tensor([[0, 1]], dtype=torch.int32), lens)
    a = decode_attention(q, [seg_pool], backend="triton")
    b = decode_attention(q, [seg_dense], backend="torch")
    assert rel_err(a.out.float(), b.out.float()) < 1e-2


def test_layout_errors():
    with pytest.raises(ValueError, match="num_blocks"):
        hot_store(torch.zeros(2, 3, 4, 5), KVLayout.CPU_ATTN, num_kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="bytes"):
        LayerStack({"l": _cpu_cache()}).pool("int4", slot_spec("int4", block_size=16, head_dim=D, num_kv_heads=H))
    spec = slot_spec("int4", block_size=B, head_dim=D, num_kv_heads=H)
    with pytest.raises(ValueError, match="16-bit"):
        LayerStack({"l": torch.zeros(NB, H, B, 2 * D)}).pool("int4", spec)
    with pytest.raises(ValueError, match="dense"):  # the slots reinterpret a block's bytes in order
        LayerStack({"l": _flash_cache()}).pool("int4", spec)
