"""Views onto vLLM's per-layer KV tensor: hot blocks and compressed slots inside blocks."""

import pytest
import torch

from proxima.compression import (
    KVLayout,
    KVSegment,
    SideTable,
    compress_blocks,
    decode_attention,
    decompress_blocks,
    hot_store,
    read_slots,
    slot_pool,
    slot_spec,
    write_slots,
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


@pytest.mark.parametrize("layout", [KVLayout.CPU_ATTN, KVLayout.FLASH_ATTN])
@pytest.mark.parametrize("fmt", ["int4", "fp8", "int8", "sparse(4)", "cluster(2)+int4", "int2"])
def test_slots_round_trip_and_stay_inside_their_block(layout, fmt):
    kv = _cpu_cache() if layout == KVLayout.CPU_ATTN else _flash_cache()
    before = kv.clone()
    spec = slot_spec(fmt, block_size=B, head_dim=D, num_kv_heads=H)
    r = spec.fmt.pack_ratio
    side = SideTable(spec, NB * r)
    pool = slot_pool(kv, spec, side)
    assert pool.num_slots == NB * r and pool.slot_tokens == B // spec.fmt.reduction_ratio
    k, v = realistic_kv(r, B, H, D, seed=r)
    cb = compress_blocks(fmt, k, v)
    target = 2  # fill every slot of physical block 2
    ids = torch.arange(target * r, (target + 1) * r)
    write_slots(pool, ids, cb)
    changed = (kv.view(torch.int16) != before.view(torch.int16)).flatten(1).any(1)
    assert changed.tolist() == [b == target for b in range(NB)]
    back = read_slots(pool, ids, cb.slot_tokens)
    for name in ("k_data", "v_data", "k_scale", "k_zero", "v_scale", "v_zero", "log_count"):
        x, y = getattr(cb, name), getattr(back, name)
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(
                x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y,
            ), name
    kh, vh, _ = decompress_blocks(back)
    kw, vw, _ = decompress_blocks(cb)
    assert torch.equal(kh, kw) and torch.equal(vh, vw)


def test_partial_block_in_a_slot_and_attention_through_pool_views():
    kv = _flash_cache()
    spec = slot_spec("int4", block_size=B, head_dim=D, num_kv_heads=H)
    pool = slot_pool(kv, spec)
    k, v = realistic_kv(2, 20, H, D, seed=11)  # partial blocks of 20 tokens
    cb = compress_blocks("int4", k, v)
    ids = torch.tensor([5, 9])
    write_slots(pool, ids, cb)
    q = torch.randn(1, 4, D).bfloat16()
    seg_pool = KVSegment(pool, ids.view(1, 2).int(), torch.full((1, 2), 20, dtype=torch.int32))
    seg_dense = KVSegment(cb, torch.tensor([[0, 1]], dtype=torch.int32), torch.full((1, 2), 20, dtype=torch.int32))
    a = decode_attention(q, [seg_pool], backend="triton")
    b = decode_attention(q, [seg_dense], backend="torch")
    assert rel_err(a.out.float(), b.out.float()) < 1e-2


def test_layout_errors():
    with pytest.raises(ValueError, match="num_blocks"):
        hot_store(torch.zeros(2, 3, 4, 5), KVLayout.CPU_ATTN, num_kv_heads=2, head_dim=4)
    spec = slot_spec("int4", block_size=16, head_dim=D, num_kv_heads=H)
    with pytest.raises(ValueError, match="bytes"):
        slot_pool(_cpu_cache(), spec)
    with pytest.raises(ValueError, match="16-bit"):
        slot_pool(torch.zeros(NB, H, B, 2 * D), slot_spec("int4", block_size=B, head_dim=D, num_kv_heads=H))
