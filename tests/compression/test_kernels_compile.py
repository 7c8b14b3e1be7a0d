"""The k-means kernel compiles for the H200 (sm_90 PTX) without a GPU, first merges and
recompressions (COUNTS) alike, with and without pinned rows (HAS_PIN, `protect.merged_tokens`),
with the launch settings `compress_blocks` uses.

The interpreter runs Python, so it accepts what the compiler refuses (a runtime `if` whose
branches leave a name with two types, a mask of the wrong shape). The compile runs in a process
without TRITON_INTERPRET: this one's decorators built interpreter wrappers.
"""

import os
import subprocess
import sys

import pytest

COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from proxima.compression import blocks
from proxima.compression.kernels import cluster as kc

counts = sys.argv[1] == "1"
pin_by = int(sys.argv[2])  # -1: no pinned rows, else reference.PIN_BY's index
step = len(sys.argv) > 3 and sys.argv[3] == "1"  # the worker step's modes (`kernels.step.cluster_step`)
fn = kc._cluster_kernel
ptrs = {"k_ptr": "*bf16", "v_ptr": "*bf16", "w_ptr": "*fp32", "imp_ptr": "*fp32", "prot_ptr": "*fp32",
        "ko_ptr": "*bf16", "vo_ptr": "*bf16", "lc_ptr": "*fp32", "cnt_ptr": "*fp32", "tbl_ptr": "*i64",
        "rows_ptr": "*i64"}
consts = {"ITERS": blocks.DEFAULT_CLUSTER_ITERS, "HAS_PROT": False, "COUNTS": counts, "D": 128, "BLOCK_T": 32,
          "BLOCK_D": 128, "BLOCK_C": 16, "EXACT16": True, "BF16": kc.CLUSTER_BF16, "PRECISION": "tf32",
          "HW_CVT": True, "HAS_PIN": pin_by >= 0, "PIN_BY": max(pin_by, 0),
          "W_MODE": (2 if counts else 1) if step else 0, "LC_SLOTS": step, "HAS_ROWS": step}
names = list(fn.arg_names)
sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
opts = {"num_warps": kc.CLUSTER_WARPS} | ({"maxnreg": kc.CLUSTER_MAX_REGISTERS} if kc.CLUSTER_MAX_REGISTERS else {})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
print(".entry _cluster_kernel" in ptx)
"""


def _compiles(script: str, *args: str) -> None:
    """Run a compile script in a process without TRITON_INTERPRET; it prints True when the PTX has the kernel."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("True"), res.stderr[-2000:]


@pytest.mark.parametrize(("counts", "pin_by", "step"), [(False, -1, False), (True, -1, False), (False, 0, False),
                                                       (True, 0, False), (False, 2, False), (False, -1, True),
                                                       (True, 0, True)])
def test_the_cluster_kernel_compiles_for_the_h200_without_a_gpu(counts: bool, pin_by: int, step: bool) -> None:
    _compiles(COMPILE, "1" if counts else "0", str(pin_by), "1" if step else "0")


STEP_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from proxima.compression.kernels import step as ks

quant, kind, flag = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
kivi = quant != "fp8"
meta = {"fp8": ("*fp32", "*fp32"), "int8": ("*fp16", "*fp32"), "int4": ("*fp16", "*fp16")}[quant]
codes = {"fp8": ("*fp8e4nv", "*fp8e4nv"), "int8": ("*u8", "*i8"), "int4": ("*u8", "*u8")}[quant]
per = 2 if quant == "int4" else 1
consts = {"HAS_ROWS": True, "K_KIVI": kivi, "QK": {"fp8": 1, "int8": 2, "int4": 3}[quant],
          "QV": {"fp8": 1, "int8": 2, "int4": 3}[quant], "D": 128, "BLOCK_D": 128, "ROWS": 64, "BLOCK_W": 256,
          "GROUP": 32, "BITS": 8 // per, "PER": per, "HW_CVT": True}
ptrs = {"dk_ptr": codes[0], "dv_ptr": codes[1], "ks_ptr": meta[0], "kz_ptr": meta[0], "vs_ptr": meta[1],
        "vz_ptr": meta[1], "tbl_ptr": "*i64", "rows_ptr": "*i64"}
if kind == "quant":  # flag: read the KV pages
    fn = ks._quant_step_kernel
    consts |= {"PAGES": flag, "RT": 16, "QMAX_K": 448.0, "QMAX_V": 448.0 if quant == "fp8" else 127.0, "EVEN": True}
    ptrs |= {"xk_ptr": "*bf16", "xv_ptr": "*bf16", "kpos_ptr": "*i64", "vpos_ptr": "*i64"}
else:  # flag: copy the log-counts
    fn = ks._dequant_step_kernel
    consts |= {"LC": flag, "BLOCK_L": 256}
    ptrs |= {"lc_ptr": "*fp32", "ok_ptr": "*bf16", "ov_ptr": "*bf16", "olc_ptr": "*fp32"}
names = list(fn.arg_names)
sig = {n: "constexpr" if n in consts else ptrs.get(n, "i64") for n in names}
src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
print(f".entry {fn.__name__}" in ptx)
"""


@pytest.mark.parametrize(("quant", "kind", "flag"), [("int4", "quant", True), ("int8", "quant", True),
                                                     ("fp8", "quant", True), ("int4", "quant", False),
                                                     ("int4", "dequant", True), ("int8", "dequant", False),
                                                     ("fp8", "dequant", False)])
def test_the_step_kernels_compile_for_the_h200_without_a_gpu(quant: str, kind: str, flag: bool) -> None:
    """The worker step's kernels (`kernels.step`): a first compression from pages and a
    quantization of a batch, a dequantization with and without log-counts, per code type."""
    _compiles(STEP_COMPILE, quant, kind, "1" if flag else "0")


PROBE_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from proxima.compression.kernels import probe_error as pe

fn = pe._probe_error_kernel
ptrs = {"q_ptr": "*fp32", "valid_ptr": "*i1", "k_ptr": "*bf16", "v_ptr": "*bf16", "rlc_ptr": "*fp32",
        "kh_ptr": "*bf16", "vh_ptr": "*bf16", "lc_ptr": "*fp32", "part_ptr": "*fp32"}
consts = {"D": 128, "BLOCK_W": 32, "BLOCK_T": 32, "BLOCK_C": int(sys.argv[1]), "BLOCK_D": 128}
names = list(fn.arg_names)
sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n == "scale" else "i32") for n in names}
src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
print(".entry _probe_error_kernel" in ptx)
"""


@pytest.mark.parametrize("block_c", [16, 32])
def test_the_probe_error_kernel_compiles_for_the_h200_without_a_gpu(block_c: int) -> None:
    _compiles(PROBE_COMPILE, str(block_c))
