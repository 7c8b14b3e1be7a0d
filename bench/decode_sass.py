"""Static profile of the decode kernel for the H200 (sm_90), made on a CPU machine.

    PYTHONPATH=. python bench/decode_sass.py [--out bench/results] [SPEC ...]

Compiles `triton_attention._decode_kernel` ahead of time for sm_90 (no GPU needed: Triton's own
ptxas and cuobjdump do the work), and reports per specialization the registers, stack (spills),
shared memory and the SASS instructions of the main loop's body (one iteration = one tile of
`tokens` tokens, per warp), by opcode. Device time is scarce; this tells in seconds whether a
change removes instructions or registers before a GPU run says whether it saves time. The numbers
are the compiler's, not the GPU's: a loop with fewer instructions can still be slower (latency,
memory), so timings still come from `bench/kernels.py --sweep` on the H200.

SPEC is `FMT[:key=value...]` (`triton_attention.parse_decode_spec`: tokens, warps, stages, maxnreg
and the other `DecodeConfig` fields), e.g. `int4:tokens=64:warps=4:stages=2:planes=1:unpack_asm=2`. Without SPECs, every
format's shipped `DECODE_CONFIGS` entry is compiled. Shapes: 32 query heads, 8 KV heads, head dim
128, block 64, KIVI group 32, the shapes of bench/kernels.py. Compile with the Triton version the
GPU runs (the device image has 3.6) for numbers that match it; the version used is in the output:

    pip download --no-deps --only-binary=:all: triton==3.6.0 -d /tmp/w && mkdir -p /tmp/triton-3.6 \
        && unzip -q /tmp/w/triton-3.6.0-*.whl -d /tmp/triton-3.6
    PYTHONPATH=/tmp/triton-3.6:. .venv/bin/python bench/decode_sass.py --out bench/results

(3.6's registers matched the H200's compiled kernels within a few: bf16 142 here, 141 there.)
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the device's default (Triton 3.6)

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from proxima.compression import triton_attention as ta
from proxima.compression.spec import QUANT_CODE, VALUES_PER_BYTE

HQ, H, D, C, GROUP = 32, 8, 128, 64, 32
_INT_DIV16 = ("E", "Hq", "E_PER_SPLIT")
"""Integer arguments the launch specializes as multiples of 16 at bench/kernels.py's shapes
(strides too); S (the batch) is not."""


def _signature(fmt: str, cfg: ta.DecodeConfig) -> tuple[dict, dict, dict]:
    kern = ta._decode_kernel
    per = VALUES_PER_BYTE.get(fmt, 1)
    kivi = fmt in ("int8", "int4", "int2")
    data = "*bf16" if fmt == "bf16" else "*u8"
    meta16 = "*bf16" if fmt == "bf16" else "*fp16"
    ptrs = {
        "q_ptr": "*bf16", "k_ptr": data, "v_ptr": data,
        "ks_ptr": "*fp32" if fmt == "fp8" else meta16, "kz_ptr": meta16,
        "vs_ptr": "*fp32" if fmt in ("fp8", "int8") else meta16, "vz_ptr": meta16,
        "lc_ptr": "*fp32", "tab_ptr": "*i32", "ntok_ptr": "*i32",
        "o_ptr": "*fp32", "lse_ptr": "*fp32", "ent_ptr": "*fp32",
    }  # fmt: skip
    ept = max(1, cfg.tokens // C)
    consts = {
        "QUANT": QUANT_CODE[fmt], "HAS_COUNT": False, "GROUP": GROUP, "PER": per,
        "G": HQ // H, "G_PAD": ta._p2(HQ // H, 16), "D": D, "BLOCK_D": D, "C": C, "EPT": ept,
        "RS": min(GROUP, C) if kivi else C, "DOT_F32": False, "SCALE_V": cfg.scale_values,
        "PLANES": ta._uses_planes(cfg, fmt, D, GROUP), "UNPACK_ASM": cfg.unpack_asm,
    }  # fmt: skip
    sig: dict = {}
    for name in kern.arg_names:
        if name in ptrs:
            sig[name] = ptrs[name]
        elif name in consts:
            sig[name] = "constexpr"
        elif name == "sm_scale_log2":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    div16 = set(ptrs) | {n for n in kern.arg_names if n.startswith(("sq_", "sk", "sv", "slc")) or n in _INT_DIV16}
    attrs = {
        (i,): [["tt.divisibility", 16]] for i, n in enumerate(kern.arg_names) if n in div16 and sig[n] != "constexpr"
    }
    return sig, {(kern.arg_names.index(k),): v for k, v in consts.items()}, attrs


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def loop_bodies(sass: str) -> list[list[str]]:
    """The instructions of every loop (a backward branch's range) in a cuobjdump listing, in the
    order of their branches."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    out = []
    for addr, txt in ins:
        t = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", txt)
        if t and int(t.group(1), 16) < addr:
            out.append([x for a, x in ins if int(t.group(1), 16) <= a <= addr])
    return out


def loop_body(sass: str) -> list[str]:
    """The instructions of the largest loop in a cuobjdump listing."""
    return max(loop_bodies(sass), key=len, default=[])


def opcode(instr: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instr).split()[0].split(".")[0]


def compile_sm90(src: ASTSource, options: dict) -> tuple[dict, str]:
    """Compile for the H200 (sm_90) on this machine: ({"regs", "stack", "smem"}, the SASS listing)."""
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True)
        sass = subprocess.run([_tool("cuobjdump"), "--dump-sass", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    res = {"regs": int(m.group(1)) if m else None, "stack": int(m.group(2)) if m else None}
    return res | {"smem": int(ck.metadata.shared)}, sass


def write_results(out_dir: str | None, stem: str, command: str, rows: list[dict], render) -> None:
    """With out_dir, write STEM.json (meta + rows) and STEM.md (`render(meta, rows)`)."""
    meta = {
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command,
        "python": sys.version.split()[0],
    }
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
            f.write(render(meta, rows))


def profile(fmt: str, cfg: ta.DecodeConfig) -> dict:
    sig, consts, attrs = _signature(fmt, cfg)
    src = ASTSource(fn=ta._decode_kernel, signature=sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    res, sass = compile_sm90(src, opts | ({"maxnreg": cfg.max_registers} if cfg.max_registers else {}))
    body = loop_body(sass)
    ops = collections.Counter(opcode(x) for x in body)
    return {
        "format": fmt, "tokens": cfg.tokens, "warps": cfg.num_warps, "stages": cfg.num_stages,
        "variant": cfg.variant, **res, "loop_instrs": len(body),
        "warp_instrs_per_token": len(body) * cfg.num_warps / cfg.tokens, "opcodes": dict(ops.most_common()),
    }  # fmt: skip


def parse_spec(spec: str) -> tuple[str, ta.DecodeConfig]:
    try:
        return ta.parse_decode_spec(spec)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def markdown(meta: dict, rows: list[dict]) -> str:
    out = [
        "# Decode kernel, static profile for sm_90 (compiled on a CPU machine)", "",
        f"Triton {meta['triton']}, {meta['date']}. Command: `{meta['command']}`", "",
        "Main-loop body per warp (one iteration = one tile of `tokens` tokens); "
        "`warp instr / token` = loop instructions x warps / tokens. The compiler's view, not timings.", "",
        "| format | tokens | warps | stages | variant | regs | stack | smem | loop instrs | warp instr / token "
        "| top opcodes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        top = ", ".join(f"{k} {v}" for k, v in list(r["opcodes"].items())[:8])
        var = r["variant"]
        out.append(
            f"| {r['format']} | {r['tokens']} | {r['warps']} | {r['stages']} | {var} | {r['regs']} | {r['stack']} "
            f"| {r['smem']} | {r['loop_instrs']} | {r['warp_instrs_per_token']:.1f} | {top} |"
        )
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="*", help="FMT[:key=value...]; default: every shipped DECODE_CONFIGS entry")
    ap.add_argument("--out", help="write decode-sass.{json,md} here")
    args = ap.parse_args()
    specs = [parse_spec(s) for s in args.specs] or list(ta.DECODE_CONFIGS.items())
    rows = []
    for fmt, cfg in specs:
        r = profile(fmt, cfg)
        rows.append(r)
        print(f"{fmt:5s} {cfg}: regs {r['regs']} stack {r['stack']} loop {r['loop_instrs']} instrs "
              f"({r['warp_instrs_per_token']:.1f} warp instr / token)", flush=True)  # fmt: skip
    command = "PYTHONPATH=/tmp/triton-3.6:. python bench/decode_sass.py " + " ".join(args.specs)
    write_results(args.out, "decode-sass", command, rows, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
