"""Lean formats (issue 40): int4h / int2h, one float16 scale per (token, head), keys rotated by a
seeded randomised Hadamard matrix. Kernels against the reference, bytes against the spec, the
rotation's properties, the policy spelling and the readers that refuse or fall back."""

import os
import subprocess
import sys

import pytest
import torch

from proxima.compression import KVSegment, compress_blocks, decode_attention, decode_attention_reference
from proxima.compression import reference as ref
from proxima.compression.blocks import decompress_blocks
from proxima.compression.spec import LEAN_BITS, slot_spec
from proxima.formats import Format, FormatError, recompressible
from proxima.policy.loader import parse_policy
from tests.compression.conftest import rel_err
from tests.compression.synthetic import realistic_kv

LEAN = ["int4h", "int2h"]


def test_rotation_is_orthogonal_seeded_and_randomised() -> None:
    for d in (16, 64, 128):
        r = ref.rotation(d)
        assert torch.allclose(r @ r.T, torch.eye(d), atol=1e-6)
        assert torch.allclose(r.abs(), torch.full_like(r, d**-0.5))  # a scaled Hadamard matrix
        signs = ref._rotation_signs(d)
        assert signs == ref._rotation_signs(d)  # plain integer arithmetic: the same every call
        assert 0.25 * d < signs.count(-1.0) < 0.75 * d  # randomised, not the plain Hadamard matrix
    ref._rotation_cpu.cache_clear()
    again = ref.rotation(64)
    assert torch.equal(again, ref.rotation(64))
    assert torch.equal(again[:, 0].sign(), torch.tensor(ref._rotation_signs(64)))
    for bad in (8, 96):
        with pytest.raises(ValueError, match="power-of-two head_dim"):
            ref.rotation(bad)


@pytest.mark.parametrize("quant", LEAN)
@pytest.mark.parametrize("shape", [(3, 64, 3, 64), (2, 5, 2, 128)])  # a full block; a partial one at D 128
def test_triton_matches_reference(quant: str, shape: tuple[int, int, int, int], device: str) -> None:
    k, v = realistic_kv(*shape, seed=sum(shape), device=device)
    a = compress_blocks(quant, k, v, backend="torch")
    b = compress_blocks(quant, k, v, backend="triton")
    bits = LEAN_BITS[quant]
    assert a.k_zero is not None and b.k_zero is not None and a.v_zero is None and b.v_zero is None
    assert a.k_zero.shape == (shape[0], 1, shape[2], shape[3]) and a.k_zero.dtype == torch.float16
    # The rotation's and the mean's float32 sums run in another order than torch's: a value may move
    # by an ulp and, on a rounding tie, a mean by a float16 step, a code by one, a row to another
    # clipping candidate. On the CPU (interpreter) the two agree exactly; on a GPU, rarely not.
    assert torch.allclose(a.k_zero.float(), b.k_zero.float(), rtol=1e-3, atol=1e-3)
    for da, db, sa, sb in ((a.k_data, b.k_data, a.k_scale, b.k_scale), (a.v_data, b.v_data, a.v_scale, b.v_scale)):
        assert sa.dtype == sb.dtype == torch.float16 and sa.shape == shape[:3]
        assert (sa != sb).float().mean() < 1e-2
        ca, cb_ = ref.unpack_codes(da, bits), ref.unpack_codes(db, bits)
        same = (sa == sb).unsqueeze(-1).expand_as(ca)
        assert (ca - cb_)[same].abs().max() <= 1 and (ca != cb_)[same].float().mean() < 1e-3
    kr, vr, _ = decompress_blocks(a, backend="torch")
    kt, vt, _ = decompress_blocks(b, backend="triton")
    kx, vx, _ = decompress_blocks(a, backend="triton")  # the same payload through both dequantizers
    assert rel_err(kx.float(), kr.float()) < 1e-2 and rel_err(vx.float(), vr.float()) < 1e-2  # bf16 rounding
    assert rel_err(kt.float(), kr.float()) < 2e-2 and rel_err(vt.float(), vr.float()) < 2e-2
    tol = {"int4h": 0.12, "int2h": 0.45}[quant]
    assert rel_err(kt.float(), k.float()) < tol and rel_err(vt.float(), v.float()) < tol


def test_dequantize_reads_pool_views_in_place(device: str) -> None:
    """A pool's slots are strided views (slots inside vLLM blocks): the kernel reads them as they are."""
    k, v = realistic_kv(6, 32, 2, 64, seed=3, device=device)
    cb = compress_blocks("int4h", k, v, backend="torch")
    sub = cb.select(torch.tensor([4, 1, 1], device=device))
    want = decompress_blocks(sub, backend="torch")
    got = decompress_blocks(sub, backend="triton")
    assert rel_err(got[0].float(), want[0].float()) < 1e-2 and rel_err(got[1].float(), want[1].float()) < 1e-2
    assert torch.equal(got[0][1], got[0][2])  # the same slot twice


def test_the_mean_and_the_rotation_each_cut_the_key_error() -> None:
    """On keys with outlier channels (a large, stable offset: realistic_kv) one scale per token is
    set by the outliers. Taking out the block's channel mean removes their offset, the rotation
    spreads what is left: each step lowers the key error at the same bits and bytes."""
    k, _ = realistic_kv(8, 64, 2, 64, seed=0, outlier_channels=4, outlier_scale=12.0)
    kf, r = k.float(), ref.rotation(64)
    mu = kf.mean(1, keepdim=True)

    def err(y: torch.Tensor, back: torch.Tensor | None, add: torch.Tensor | float) -> float:
        c, s = ref.lean_codes(y, 4)
        yh = (c - 7.5) * s.float().unsqueeze(-1)
        return rel_err((yh if back is None else yh @ back) + add, kf)

    plain, centred, rotated = err(kf, None, 0.0), err(kf - mu, None, mu), err((kf - mu) @ r, r.T, mu)
    assert rotated < 0.7 * centred < 0.7 * plain
    kh, _, _ = decompress_blocks(compress_blocks("int4h", k, k, backend="torch"), backend="torch")
    assert rel_err(kh.float(), kf) < 1.01 * rotated  # what the format does (plus bf16 rounding)


@pytest.mark.parametrize(("block", "d", "heads"), [(64, 64, 3), (128, 128, 8)])  # SmolLM2's and the 8B's shape
@pytest.mark.parametrize("quant", LEAN)
def test_bytes_held_come_close_to_the_nominal_ratio(quant: str, block: int, d: int, heads: int) -> None:
    bits = LEAN_BITS[quant]
    spec = slot_spec(quant, block_size=block, head_dim=d, num_kv_heads=heads)
    # per token and head: keys and values d * bits / 8 bytes each, two float16 scales, and the
    # block's float16 key mean (d channels) shared by its tokens
    per_block_head = block * (2 * d * bits // 8 + 2 * 2) + 2 * d
    assert spec.held_bytes_per_slot == heads * per_block_head
    assert spec.bytes_ratio == pytest.approx(block * 2 * d * 2 / per_block_head)
    kivi = slot_spec(quant[:-1], block_size=block, head_dim=d, num_kv_heads=heads, group_size=d)
    assert spec.bytes_ratio > kivi.bytes_ratio  # more than KIVI even at its largest group
    if quant == "int4h":
        assert spec.bytes_ratio >= 3.6  # issue 40's target for a uniform 4-bit format
    k, v = realistic_kv(2, block, heads, d, seed=1)
    assert compress_blocks(quant, k, v, backend="torch").held_nbytes == 2 * spec.held_bytes_per_slot


def test_spelling_grammar_and_recompression_rules() -> None:
    F = Format.parse
    for text in ("int4h", "int2h", "cluster(2)+int4h", "sparse(4)+int2h"):
        assert F(text).name == text and F(F(text).name) == F(text)
    assert F("int4h").pack_ratio == F("int4").pack_ratio == 4 and F("cluster(2)+int2h").pack_ratio == 16
    for bad in ("int4hh", "int8h", "hint4", "cluster(2)int4h"):
        with pytest.raises(FormatError):
            F(bad)
    assert recompressible(F("int8"), F("int4h")) and recompressible(F("int4h"), F("int2h"))
    assert recompressible(F("int4h"), F("cluster(2)+int4h"))
    assert recompressible(F("cluster(2)+int4h"), F("cluster(4)+int4h"))
    # same pack ratio: no move between int4 and int4h either way (a move must raise the ratio)
    assert not recompressible(F("int4"), F("int4h")) and not recompressible(F("int4h"), F("int4"))
    policy = parse_policy(
        "name: lean\nbands:\n  - {name: b, enter: 0.7, exit: 0.6, target_free: 0.35,\n"
        '     ladder: [int4h, "cluster(2)+int4h", int2h]}\n'
    )
    assert [f.name for f in policy.bands[0].ladder] == ["int4h", "cluster(2)+int4h", "int2h"]


def test_lean_formats_need_a_power_of_two_head_dim() -> None:
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        slot_spec("int4h", block_size=32, head_dim=96, num_kv_heads=1)
    k, v = realistic_kv(1, 8, 1, 96, seed=0)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        compress_blocks("int4h", k, v, backend="torch")


@pytest.mark.parametrize("fmt", ["int4h", "cluster(2)+int2h"])
def test_decode_attention_reads_lean_segments(fmt: str, device: str) -> None:
    """The split kernel reads a lean segment dequantized: it equals the reference (which
    dequantizes too), partial and padding entries included, next to a KIVI segment."""
    s, hq, h, d, b = 2, 6, 2, 64, 32
    segs = []
    for i, f in enumerate((fmt, "int4")):
        k, v = realistic_kv(7, b, h, d, seed=i, device=device)
        cb = compress_blocks(f, k, v, token_importance=torch.rand(7, b, h, device=device))
        table = torch.tensor([[5, 2, 0], [1, 6, 3]], dtype=torch.int32, device=device)
        ntok = torch.full((s, 3), cb.slot_tokens, dtype=torch.int32, device=device)
        ntok[0, 2], ntok[1, 0] = 3, 0
        segs.append(KVSegment(cb, table, ntok))
    q = torch.randn(s, hq, d, generator=torch.Generator().manual_seed(len(fmt))).to(device)
    r = decode_attention_reference(q.bfloat16(), segs)
    o = decode_attention(q.bfloat16(), segs, backend="triton", num_splits=2)
    assert rel_err(o.out.float(), r.out.float()) < 1e-2
    assert torch.allclose(o.lse, r.lse, atol=1e-2)
    assert torch.all(o.block_mass[0][segs[0].slot_tokens == 0] == 0)


def test_the_split_kernel_refuses_lean_codes(device: str) -> None:
    """The split path's per-format kernel does not read lean codes (`attention.py` dequantizes a
    lean segment first); the one-pass kernel does (`mixed_decode_lean.py`, test below)."""
    from proxima.compression import triton_attention as ta

    k, v = realistic_kv(2, 16, 1, 64, seed=0, device=device)
    cb = compress_blocks("int4h", k, v)
    seg = KVSegment(cb, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1, dtype=torch.int32))
    q = torch.randn(1, 1, 64, device=device)
    o, lse = torch.empty(1, 1, 1, 64, device=device), torch.empty(1, 1, 1, device=device)
    with pytest.raises(ValueError, match="does not read int4h codes"):
        ta.segment_partial(q, seg, 0.125, 1, o, lse)


@pytest.mark.parametrize("fmt", ["int4h", "int2h", "cluster(2)+int4h"])
def test_the_one_pass_descriptors_describe_lean_pools(fmt: str, device: str) -> None:
    """A lean code's descriptor row holds what the one-pass kernel needs beyond the other formats':
    the key mean's own strides ([N, 1, H, D], not its scale's [N, C, H]) and the address of the
    rotation's first column (signs / sqrt(D)), one tensor per head dim for the process's life
    (CUDA graphs replay the address). 16-bit slots (`cluster(2)`) are still refused."""
    from proxima.compression import mixed_decode_pools as mp

    k, v = realistic_kv(3, 16, 2, 64, seed=1, device=device)
    imp = torch.rand(3, 16, 2, device=device)
    cb = compress_blocks(fmt, k, v, token_importance=imp if "cluster" in fmt else None)
    assert cb.k_zero is not None and cb.k_scale is not None
    d = mp.pool_descriptors({2: cb}, 16, torch.device(device)).cpu()
    assert d.shape == (3, mp.NUM_FIELDS) and d[:2].eq(0).all()  # rows 0 (pages) and 1 (unused) empty
    row = d[2]
    assert int(row[mp.F_QUANT]) == (5 if "int4h" in fmt else 6)
    assert int(row[mp.F_KZ]) == cb.k_zero.data_ptr()
    assert (int(row[mp.F_KZ_SLOT]), int(row[mp.F_KZ_H])) == (cb.k_zero.stride(0), cb.k_zero.stride(2))
    assert int(row[mp.F_KS]) == cb.k_scale.data_ptr() and int(row[mp.F_KS_T]) == cb.k_scale.stride(1)
    col = mp.lean_rotation_column(64, cb.k_zero.device)
    assert int(row[mp.F_ROT]) == col.data_ptr() and col is mp.lean_rotation_column(64, cb.k_zero.device)
    assert torch.equal(col.cpu(), ref.rotation(64)[:, 0])
    assert torch.equal(col.cpu().sign(), torch.tensor(ref._rotation_signs(64)))
    assert int(row[mp.F_LC] != 0) == int("cluster" in fmt)
    plain = compress_blocks("cluster(2)", k, v, token_importance=imp)
    with pytest.raises(ValueError, match="PROXIMA_ONE_PASS_DECODE=0"):
        mp.pool_descriptors({1: plain}, 16, torch.device(device))


KERNEL_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from proxima.compression.kernels import lean

for fn, ptrs, consts in (
    (lean._lean_quant_kernel,
     {"x_ptr": "*bf16", "r_ptr": "*fp32", "d_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*fp16"},
     {"D": 64, "ROWS": 32, "BITS": 4, "PER": 2, "IS_KEY": True, "K_DEN": 20, "NCLIP": 7, "MIN_SCALE": 2.0**-14,
      "HW_CVT": True}),
    (lean._lean_dequant_kernel,
     {"d_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*fp16", "r_ptr": "*fp32", "o_ptr": "*bf16"},
     {"D": 128, "ROWS": 64, "BITS": 2, "PER": 4, "HAS_ZERO": True, "HW_CVT": True}),
):
    names = list(fn.arg_names)
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    print(f".entry {fn.__name__}" in ptx)
"""


def test_lean_kernels_compile_for_the_h200_without_a_gpu() -> None:
    """The interpreter accepts what the compiler refuses: compile both kernels to sm_90 PTX (in a
    process without TRITON_INTERPRET, as test_kernels_compile.py does)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", KERNEL_COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.split() == ["True", "True"], res.stderr[-2000:]
