import pytest

from proxima.compression.spec import slot_spec
from proxima.formats import Format

FORMATS = ["bf16", "fp8", "int8", "int4", "int2", "sparse(4)", "cluster(2)", "sparse(2)+int4", "cluster(4)+int8",
           "int4h", "int2h", "cluster(2)+int4h"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size,head_dim,heads", [(16, 64, 3), (128, 128, 8), (32, 96, 1)])
def test_slot_data_fills_a_block_exactly(fmt, block_size, head_dim, heads):
    if "h" in fmt.split("+")[-1] and head_dim & (head_dim - 1):
        # lean formats rotate rows by a Hadamard matrix: a power-of-two head_dim or a clear refusal
        with pytest.raises(ValueError, match="head_dim"):
            slot_spec(fmt, block_size=block_size, head_dim=head_dim, num_kv_heads=heads)
        return
    spec = slot_spec(fmt, block_size=block_size, head_dim=head_dim, num_kv_heads=heads)
    f = Format.parse(fmt)
    assert spec.data_bytes_per_slot * f.pack_ratio == spec.block_data_bytes
    assert spec.slot_tokens == block_size // f.reduction_ratio
    # metadata exists exactly for the formats that need scales or counts
    needs_meta = f.quant != "bf16" or f.reduction == "cluster"
    assert (spec.meta_bytes_per_slot > 0) == needs_meta


def test_bytes_per_token_int4_block128():
    spec = slot_spec("int4", block_size=128, head_dim=128, num_kv_heads=8)
    # data: 2 (K, V) * 8 heads * 64 bytes; metadata: keys 4 groups * 128 ch * 2 (scale, zero) * 2 B
    # per 128 tokens, values 4 groups * 2 * 2 B per token, per head
    data = 2 * 8 * 64
    meta = 8 * (4 * 128 * 4 / 128 + 4 * 4)
    assert spec.bytes_per_token == pytest.approx(data + meta)
    assert spec.meta_fields()[0].name == "k_scale"


def test_invalid_specs_say_what_is_wrong():
    with pytest.raises(ValueError, match="multiple of group_size"):
        slot_spec("int4", block_size=32, head_dim=60, num_kv_heads=1)
    with pytest.raises(ValueError, match="power of two"):
        slot_spec("int4", block_size=32, head_dim=96, num_kv_heads=1, group_size=24)
    with pytest.raises(ValueError):
        slot_spec("sparse(4)", block_size=30, head_dim=64, num_kv_heads=1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_payload_bytes_equal_the_spec_and_give_the_bytes_ratio(fmt):
    """One byte accounting: a compressed payload holds exactly what its `SlotSpec` says (data plus
    side-table metadata), and the reported ratio is 16-bit bytes over that, below the pack ratio
    whenever there is metadata."""
    import torch

    from proxima.compression import compress_blocks
    from proxima.compression.spec import bytes_ratio, kv16_bytes

    b, h, d = 64, 3, 64
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, b, h, d, generator=g).to(torch.bfloat16) for _ in range(2))
    cb = compress_blocks(fmt, k, v, backend="torch")
    spec = slot_spec(fmt, block_size=b, head_dim=d, num_kv_heads=h)
    assert cb.held_nbytes == 2 * spec.held_bytes_per_slot
    assert kv16_bytes(b, h, d) == spec.block_data_bytes
    f = Format.parse(fmt)
    assert spec.bytes_ratio == pytest.approx(bytes_ratio(2 * kv16_bytes(b, h, d), cb.held_nbytes))
    assert spec.bytes_ratio <= f.pack_ratio
    assert (spec.bytes_ratio < f.pack_ratio) == (spec.meta_bytes_per_slot > 0)


def test_bytes_ratio_edges():
    from proxima.compression.spec import bytes_ratio

    assert bytes_ratio(0, 0) == 1.0
    assert bytes_ratio(100, 25) == 4.0
    with pytest.raises(ValueError, match="byte counts"):
        bytes_ratio(100, -1)


def test_group_size_check_names_the_field_and_the_formats() -> None:
    """int4 / int2 values group along the head dim, so a group must divide it; int8 values are per
    token and fp8 / bf16 are not grouped, so any power of two stores them."""
    from proxima.compression.spec import check_group_size

    fmts = [Format.parse(f) for f in ("int8", "cluster(2)+int4", "int2", "fp8")]
    check_group_size(64, 64, fmts)
    check_group_size(128, 64, [Format.parse("int8"), Format.parse("fp8")])
    want = r"storage\.group_size=128 does not divide the model's head_dim 64: cluster\(2\)\+int4, int2"
    with pytest.raises(ValueError, match=want):
        check_group_size(128, 64, fmts)
    with pytest.raises(ValueError, match=r"ProximaCache\(group_size=\)=48: .* power of two"):
        check_group_size(48, 64, fmts, "ProximaCache(group_size=)")


@pytest.mark.parametrize(("fmt", "g32", "g64"), [("int8", 1.83, 1.88), ("int4", 3.20, 3.56), ("int2", 5.33, 6.40)])
def test_group_64_byte_ratios_at_smollm2_geometry(fmt: str, g32: float, g64: float) -> None:
    """The numbers docs/compression.md and bench/results/experiments/groups/ quote (block 64, head_dim 64)."""
    for g, want in ((32, g32), (64, g64)):
        spec = slot_spec(fmt, block_size=64, head_dim=64, num_kv_heads=3, group_size=g)
        assert spec.bytes_ratio == pytest.approx(want, abs=0.005)
