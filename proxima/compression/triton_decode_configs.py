"""Launch configuration of the Triton decode kernel (`triton_attention._decode_kernel`): the
per-format configs chosen by the H200 sweep, the occupancy read from compiled kernels, and the
split count planned from it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from proxima.compression.segment import KVSegment
from proxima.compression.spec import VALUES_PER_BYTE
from proxima.compression.triton_ops import _p2


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of `_decode_kernel` for one format."""

    tokens: int
    """Tokens per iteration (EPT = tokens / slot capacity entries, at least one entry)."""
    num_warps: int
    num_stages: int
    scale_values: bool = False
    """fp8 / int8: apply per-token value scales to the value rows instead of the probabilities
    (fewer instructions and registers when compiled; fp8 ships with it, the H200 sweep's fastest)."""
    planes: bool = False
    """int4 / int2 with a power-of-two head dim: unpack each tile into PER channel planes (plane i:
    channels PER j + i, `_nibble_planes_f16` / `_crumb_planes_f16`), one key dot and one value dot
    with its own accumulator per plane, with no join or reshape of the codes."""
    unpack_asm: int = 0
    """Unpack by inline PTX, four bytes at a time, the keys (1) or the keys and the values (2):
    int4 / int2 with `planes`, and int8 (no planes needed: its codes are whole bytes). Compiled
    kernels only (the interpreter runs the same arithmetic in plain ops)."""
    max_registers: int | None = None
    """Register cap per thread passed to ptxas (`maxnreg`; None: the compiler's choice). A lower cap
    fits more programs per SM (65,536 registers: 4 programs of 4 warps at <= 128) at the price of
    spills; chosen by the sweep."""

    @property
    def variant(self) -> str:
        """The fields beyond tokens / warps / stages that differ from the defaults, e.g.
        'planes, unpack_asm=2, max_registers=128' ('' for none): a label for benchmark tables."""
        out = []
        for f in dataclasses.fields(self):
            if f.name in ("tokens", "num_warps", "num_stages"):
                continue
            v = getattr(self, f.name)
            if v != f.default:
                out.append(f.name if v is True else f"{f.name}={v}")
        return ", ".join(out)


DECODE_CONFIGS: dict[str, DecodeConfig] = {
    "bf16": DecodeConfig(64, 4, 2),
    "fp8": DecodeConfig(64, 2, 2, scale_values=True),
    "int8": DecodeConfig(64, 2, 2, unpack_asm=2),
    "int4": DecodeConfig(64, 2, 3, planes=True, unpack_asm=2),
    "int2": DecodeConfig(64, 2, 2, planes=True, unpack_asm=2),
}
"""Per quantization, from `bench/kernels.py --sweep` on the H200 at 32k x 8 (us, each against the
previous shipped config in the same run). 2026-12-04: the compressed formats moved to 2 warps
with no register cap: int4 269.9 -> 232.1 (2 warps at 2 stages 235.6; 2 warps capped at 168 / 128
registers 299.3 / 540.4, spills; 1 warp 499.4), int2 296.3 -> 241.4, int8 314.3 -> 260.0 (PTX
unpacking of the values too; keys only 295.5), fp8 276.9 -> 264.5; bf16 247.1 at 4 warps, 246.7 at
2. Two warps of 255 registers fit 4 programs (8 warps) per SM, as 4 warps at 128 did, but each
warp holds twice the tile in registers with no spills, and the softmax reductions cross 2 warps
instead of 4. Earlier (2026-12-02, 4 warps): int4 344.4 before channel planes, 274.0 with them,
269.2 with the 128 cap; int2 364.1 before planes; int8 318.5 without PTX unpacking. At vLLM's
block 16 (`bench/paged_decode.py`, half the blocks compressed, CUDA-graph medians, 2026-12-04) the
new configs are faster as well: int4 313 vs 342 us, int8 300 vs 378, int2 318 vs 353, fp8 291 vs 314."""

_SPEC_KEYS = {"tokens": "tokens", "warps": "num_warps", "stages": "num_stages", "maxnreg": "max_registers"}


def parse_decode_spec(spec: str) -> tuple[str, DecodeConfig]:
    """`FMT[:key=integer...]` -> (format, its shipped `DecodeConfig` with those fields changed), e.g.
    `int4:planes=1:unpack_asm=2:maxnreg=128`; keys: tokens, warps, stages, maxnreg and the boolean /
    integer fields of `DecodeConfig` by name; maxnreg=0 means no register cap. For the benchmarks'
    command lines."""
    fmt, *kvs = spec.split(":")
    if fmt not in DECODE_CONFIGS:
        raise ValueError(f"{spec!r}: unknown format {fmt!r} (one of {', '.join(DECODE_CONFIGS)})")
    fields = dict(DECODE_CONFIGS[fmt].__dict__)
    for kv in kvs:
        key, _, val = kv.partition("=")
        name = _SPEC_KEYS.get(key, key)
        if name not in fields or not val.isdigit():
            keys = ", ".join(sorted(set(_SPEC_KEYS) | set(fields) - set(_SPEC_KEYS.values())))
            raise ValueError(f"{spec!r}: {kv!r} is not key=integer with key in {keys}")
        fields[name] = bool(int(val)) if isinstance(fields[name], bool) else int(val)
    if not fields["max_registers"]:
        fields["max_registers"] = None  # maxnreg=0: no cap
    if fields["unpack_asm"] not in (0, 1, 2):
        raise ValueError(f"{spec!r}: unpack_asm must be 0, 1 or 2, got {fields['unpack_asm']}")
    return fmt, DecodeConfig(**fields)


KERNEL_INFO: dict[tuple, dict[str, int]] = {}
"""Registers, spills, shared memory and programs per SM of each compiled decode specialization
(filled on the GPU after a specialization's first launch; read by bench/kernels.py)."""
_OCCUPANCY: dict[tuple, int] = {}
"""Programs per SM of each compiled specialization, read from the compiled kernel after its
first launch (registers, shared memory, warps); the split count is planned from it."""
_DEFAULT_OCCUPANCY = 2


def _occupancy_of(kernel, num_warps: int, device: torch.device) -> int:  # type: ignore[no-untyped-def]
    """Resident programs per SM for a compiled Triton kernel (0 if unknown, e.g. interpreter)."""
    n_regs = getattr(kernel, "n_regs", None)
    if kernel is None or n_regs is None:
        return 0
    props = torch.cuda.get_device_properties(device)
    threads = 32 * num_warps
    # registers are allocated per warp in units of 256
    regs_per_warp = -(-max(int(n_regs), 1) * 32 // 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * num_warps)
    by_threads = props.max_threads_per_multi_processor // threads
    smem = int(kernel.metadata.shared) + 1024  # the driver reserves 1 KiB per block
    by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // smem if smem else 32
    return max(1, min(by_regs, by_threads, by_smem, 32))


def _launch_key(seg: KVSegment, q: torch.Tensor, cfg: DecodeConfig) -> tuple:
    st = seg.store
    return (st.fmt.quant, st.slot_tokens, q.shape[-1], q.shape[1] // st.num_kv_heads, st.log_count is not None, cfg)


@functools.lru_cache(maxsize=4096)
def choose_splits(programs_per_split: int, tiles: int, slots: int) -> int:
    """Split count minimising the modelled time waves x (tiles per program + 2): a program that
    waits for a second wave costs a whole program's time, and a program's fixed cost (queries in,
    partials out) is about two tiles. Ties go to fewer splits (less merging).

    Only split counts that just fill a whole number of waves (up to 8) can be optimal, so only
    those are scored: a few dozen candidates, cached, since the CUDA backend asks once per
    segment, layer and step.
    """
    cands = {1, max(1, tiles)}
    for waves in range(1, 9):
        full = waves * slots // max(1, programs_per_split)
        cands.update(x for x in (full, full + 1) if 1 <= x <= max(1, tiles))
    best, best_t = 1, None
    for sp in sorted(cands):
        waves = -(-(programs_per_split * sp) // slots)
        cost = waves * (-(-tiles // sp) + 2)
        if best_t is None or cost < best_t:
            best, best_t = sp, cost
    return best


def _entries_per_it(seg: KVSegment, cfg: DecodeConfig) -> int:
    return max(1, cfg.tokens // seg.store.slot_tokens)


def plan_splits(q: torch.Tensor, seg: KVSegment, num_splits: int | None) -> int:
    if num_splits:
        return num_splits
    cfg = DECODE_CONFIGS[seg.store.fmt.quant]
    ept = _entries_per_it(seg, cfg)
    tiles = -(-max(int(seg.slot_table.shape[1]), 1) // ept)
    if q.device.type != "cuda":
        return max(1, min(4, tiles))
    occ = _OCCUPANCY.get(_launch_key(seg, q, cfg), _DEFAULT_OCCUPANCY)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return choose_splits(q.shape[0] * seg.store.num_kv_heads, tiles, sms * occ)


def _uses_planes(cfg: DecodeConfig, quant: str, head_dim: int, group_size: int) -> bool:
    """Whether a launch takes the channel-plane path: int4 / int2 with `planes`, a power-of-two
    head dim whose planes are at least 16 channels wide (`tl.dot`'s smallest K on the tensor
    cores), and value groups that split evenly over the planes."""
    per = VALUES_PER_BYTE.get(quant, 0)
    return cfg.planes and per > 0 and _p2(head_dim, 16) == head_dim and head_dim // per >= 16 and group_size % per == 0


def _strides3(t: torch.Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if t is None else tuple(t.stride()[:3])  # type: ignore[return-value]
