"""Every method the quality harness compares, as one table (a method is tested the moment it is
registered: `tests/quality` parametrizes over `all_methods`).

A method acts on a `ProximaCache` right after the context was prefilled uncompressed, and before
the question or continuation arrives (the protocol of ../shared/FACTS.md). Methods:

- `baseline`: nothing compressed (ratio 1).
- `proxima:<policy>@<r>x`: a shipped policy driven by the real engine (`decide`) with a virtual
  pool sized so that its top band's target means a store r times smaller; the probe may refuse
  blocks, so the achieved ratio is reported next to the nominal one.
- `format:<fmt>`: one format on every block outside the protected windows (first and last
  block), so the format's own damage shows; achieved ratio slightly below the format's ratio.
- Baselines written here (no code from other projects): `streaming_llm@<r>x` (4 sink tokens +
  recent window, StreamingLLM-style), `snapkv@<r>x` (SnapKV-style: keep the tokens the last 32
  context queries attend to most, pooled over 7 neighbours, per KV head, plus the window),
  `h2o@<r>x` (H2O-style heavy hitters: keep the tokens with the most attention accumulated over
  *all* prefill queries, per KV head, no pooling, plus the same window; needs the sums hook
  `proxima.quality.h2o.AttentionSums` on the cache from the prefill on), `kivi-int4` (uniform
  int4 on all context tokens, KIVI grouping) and `fp8` (uniform fp8, what vLLM's `kv_cache_dtype="fp8"` stores).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from proxima.formats import Format
from proxima.integration.hf import ProximaCache
from proxima.policies import POLICY_DIR
from proxima.policy.loader import load_policy
from proxima.policy.schema import Policy
from proxima.quality.h2o import attention_sums


def policy_path(name: str, experiments: Path | None = None) -> Path:
    """A shipped policy (package data) or, failing that, `<experiments>/<name>.yaml`: candidate
    policies measured but not shipped live outside the package (bench/quality.py passes
    bench/policies/), so the product never reads the repository.

    Raises `FileNotFoundError` naming `name` and where it looked when it is neither."""
    shipped = POLICY_DIR / f"{name}.yaml"
    if shipped.is_file():
        return shipped
    candidate = experiments / f"{name}.yaml" if experiments is not None else None
    if candidate is not None and candidate.is_file():
        return candidate
    where = f"{POLICY_DIR}" + (f" or {experiments}" if experiments is not None else "")
    raise FileNotFoundError(f"policy {name!r}: no {name}.yaml in {where}")
SINKS = 4
"""StreamingLLM's attention sinks (tokens)."""
SNAP_WINDOW = 32
"""SnapKV observation window (queries) and always-kept recent tokens (H2O's recent window too)."""
SNAP_POOL = 7
PROBE_SLACK = 2.0
"""Calibrated probe bound = PROBE_SLACK x the format's median measured error."""


@dataclass(frozen=True)
class Method:
    name: str
    family: str
    """'baseline', 'proxima', 'format' or 'reference' (the baselines a user compares against)."""
    ratio: float
    """Nominal compression ratio of the context's KV."""
    apply: Callable[[ProximaCache], None]
    needs_accumulated_attention: bool = False
    """The method reads the accumulated attention (H2O, `proxima.quality.h2o`): the harness then
    prefills with an `AttentionSums` hook on the cache, which costs a second attention pass over
    the prompt in every layer, so only runs that select such a method pay for it."""


def _none(cache: ProximaCache) -> None:
    return None


def calibrated(policy: Policy, model: dict | None = None, slack: float = PROBE_SLACK) -> Policy:
    """The policy with its damage table and probe bounds taken from the fitted damage model:
    table = median measured probe error per format; bound = `slack` x that median (so the probe
    refuses the worst blocks of a format, not the format). Formats the model lacks keep the
    policy's own values."""
    from proxima.quality import damage

    model = model if model is not None else damage.load()
    table = dict(model["table"])
    bounds = {f: round(slack * e, 6) for f, e in table.items() if e > 0}
    shipped = policy.probes.compression
    probe = shipped.model_copy(update={"max_error": {**shipped.max_error, **bounds}})
    return policy.model_copy(
        update={
            "name": policy.name + "-calibrated",
            "damage": policy.damage.model_copy(update={"table": {**policy.damage.table, **table}}),
            "probes": policy.probes.model_copy(update={"compression": probe}),
        }
    )


def _policy(path: Path, ratio: float, calibrate: bool, cache: ProximaCache) -> None:
    policy = load_policy(path)
    cache.policy = calibrated(policy) if calibrate else policy
    cache.apply_policy(target_ratio=ratio)


def _format(
    fmt: str, cache: ProximaCache, group_size: int | None = None, pinned: int = 0, pin_by: str = "mixed"
) -> None:
    bs = cache.block_size
    cache.group_size = group_size
    if pinned:
        prot = cache.policy.protect.model_copy(update={"merged_tokens": pinned, "merged_by": pin_by})
        cache.policy = cache.policy.model_copy(update={"protect": prot})
    cache.compress_all(fmt, protect_sinks=bs, protect_recent=bs)


def _uniform(fmt: str, cache: ProximaCache, group_size: int | None = None) -> None:
    cache.group_size = group_size
    cache.compress_all(fmt)


def _tokens(cache: ProximaCache) -> tuple[int, int]:
    """(tokens in full blocks, tokens in the hot tail). Eviction acts on full blocks; the tail
    (the newest tokens) is always kept and counts against the budget."""
    layer = cache.proxima_layers[0]
    tail = layer.tail_k.shape[-2] if layer.tail_k is not None else 0
    return layer.n_blocks * layer.block_size, tail


def _streaming(ratio: float, cache: ProximaCache) -> None:
    t, tail = _tokens(cache)
    budget = round((t + tail) / ratio)
    keep = torch.zeros(t, dtype=torch.bool, device=cache.proxima_layers[0].device)
    keep[:SINKS] = True
    recent = max(0, budget - SINKS - tail)
    if recent:
        keep[t - recent :] = True
    masks = []
    for layer in cache.proxima_layers:
        assert layer.tail_k is not None
        b, h = layer.tail_k.shape[:2]
        masks.append(keep.view(1, 1, t).expand(b, h, t))
    evict_tokens(cache, masks)


def evict_tokens(cache: ProximaCache, keep: Sequence[torch.Tensor]) -> None:
    """Token eviction for the baselines: per layer a bool keep mask `[B, H_kv, T_full]` over the
    full blocks (the layers' storage masks them: `ProximaLayer.evict`)."""
    for layer, kp in zip(cache.proxima_layers, keep, strict=True):
        layer.evict(kp)


def _budget(cache: ProximaCache, ratio: float) -> tuple[int, int]:
    """(full-block tokens to keep per KV head, of them the recent window always kept) for a
    token-scoring baseline at `ratio`: the hot tail counts against the budget and against the
    `SNAP_WINDOW` recent tokens; the window never exceeds the budget."""
    t, tail = _tokens(cache)
    budget = max(0, round((t + tail) / ratio) - tail)
    return budget, min(budget, max(0, SNAP_WINDOW - tail))


def _keep_top(scores: torch.Tensor, budget: int, window: int) -> torch.Tensor:
    """Keep mask `[B, H, T]`: the last `window` tokens and the `budget - window` others with the
    highest `scores` `[B, H, T]`, per (batch row, head). `scores` is not modified."""
    t = scores.shape[-1]
    recent = torch.arange(t, device=scores.device) >= t - window
    ranked = torch.where(recent, float("inf"), scores)  # the window always wins the top-k
    keep = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    keep.scatter_(-1, ranked.topk(budget, dim=-1).indices, True)
    return keep


def _snapkv(ratio: float, cache: ProximaCache) -> None:
    t, _ = _tokens(cache)
    budget, window = _budget(cache, ratio)
    masks = []
    for li in range(len(cache.layers)):
        imp = cache.token_importance(li)
        if imp is None:
            raise RuntimeError("snapkv needs observation queries: enable Proxima attention before prefill")
        b, h, _ = imp.shape
        pooled = torch.nn.functional.avg_pool1d(
            imp.reshape(b * h, 1, t), SNAP_POOL, stride=1, padding=SNAP_POOL // 2
        ).reshape(b, h, t)
        masks.append(_keep_top(pooled, budget, window))
    evict_tokens(cache, masks)


def _h2o(ratio: float, cache: ProximaCache) -> None:
    """H2O's heavy hitters: per layer and KV head, the tokens with the most attention summed over
    every prefill query (`proxima.quality.h2o.AttentionSums`), plus the recent window. SnapKV
    differs in scoring by the last `SNAP_WINDOW` queries only and pooling the scores."""
    budget, window = _budget(cache, ratio)
    masks = []
    for li in range(len(cache.layers)):
        try:
            scores = attention_sums(cache).scores(cache, li)
        except RuntimeError as e:
            raise RuntimeError(f"h2o@{ratio:g}x: {e}") from e
        masks.append(_keep_top(scores, budget, window))
    evict_tokens(cache, masks)


RATIOS = (2, 4, 8)
EXPERIMENT_RATIOS = (3, 3.5, 4, 8)
"""Asks for the experimental candidates (bench/policies/): 3x and 3.5x are what quantization alone
reaches at 1k-2k tokens."""
GROUP_VARIANTS = (64,)
"""Quantization groups the uniform int4 / int2 rows are also measured at (`<method>:g<G>`; the
plain rows use the default, 32): bench/results/experiments/groups/."""
PIN_VARIANTS = ((2, "mixed"), (4, "mixed"), (16, "mixed"), (4, "outlier"), (4, "importance"))
"""Protected tokens per merged block and KV head (`protect.merged_tokens`, `merged_by`) the merging
rows are also measured with (`<method>:p<k>` for `mixed`, `<method>:p<k>-<merged_by>` otherwise):
bench/results/experiments/protected-tokens/."""
POLICIES = ("conservative", "balanced", "aggressive")
FORMATS_BY_RATIO: dict[int, tuple[str, ...]] = {
    2: ("int8",),
    4: ("int4", "int4h", "sparse(4)", "cluster(4)"),
    8: ("int2", "int2h", "cluster(2)+int4"),
    16: ("cluster(4)+int4",),
}


def all_methods(experiments: Path | None = None) -> list[Method]:
    """Every method; `experiments` is a folder of candidate policies (`proxima:<name>@<r>x` for
    each of its YAML files at EXPERIMENT_RATIOS), None for the shipped ones only."""
    out = [Method("baseline", "baseline", 1.0, _none)]
    shipped = {p: POLICY_DIR / f"{p}.yaml" for p in POLICIES}
    # Shipped policies exactly as written (their probe bounds included), at 4x ...
    out += [Method(f"proxima:{p}@4x", "proxima", 4, partial(_policy, shipped[p], 4, False)) for p in POLICIES]
    # ... and aggressive at 8x: the one whose ladder reaches it in bytes (balanced's harshest
    # formats, cluster(2)+int4 and int2, pack 8x but hold 3.7-4.3x with their metadata)
    out.append(Method("proxima:aggressive@8x", "proxima", 8, partial(_policy, shipped["aggressive"], 8, False)))
    # ... and with damage table and probe bounds from the calibrated damage model: all three at
    # 4x, the two that can reach 8x (balanced, aggressive) at 2x and 8x.
    for r in RATIOS:
        out += [
            Method(f"proxima:{p}-cal@{r}x", "proxima", r, partial(_policy, shipped[p], r, True))
            for p in POLICIES
            if r == 4 or p != "conservative"
        ]
    if experiments is not None and not experiments.is_dir():
        raise FileNotFoundError(f"experimental policies: {experiments} is not a directory")
    for path in sorted(experiments.glob("*.yaml")) if experiments is not None else []:
        out += [
            Method(f"proxima:{path.stem}@{r:g}x", "proxima", r, partial(_policy, path, r, False))
            for r in EXPERIMENT_RATIOS
        ]
    for r in RATIOS:
        out += [Method(f"streaming_llm@{r}x", "reference", r, partial(_streaming, r))]
        out += [Method(f"snapkv@{r}x", "reference", r, partial(_snapkv, r))]
        out += [Method(f"h2o@{r}x", "reference", r, partial(_h2o, r), needs_accumulated_attention=True)]
    out += [Method("kivi-int4", "reference", 4, partial(_uniform, "int4"))]
    out += [Method(f"kivi-int4:g{g}", "reference", 4, partial(_uniform, "int4", group_size=g)) for g in GROUP_VARIANTS]
    # the lean 4-bit format (issue 40), compressed the same way as kivi-int4 (every full block)
    out += [Method("lean-int4h", "reference", 4, partial(_uniform, "int4h"))]
    out += [Method("fp8", "reference", 2, partial(_uniform, "fp8"))]
    for r, fmts in FORMATS_BY_RATIO.items():
        for f in fmts:
            assert Format.parse(f).pack_ratio == r
            out += [Method(f"format:{f}", "format", r, partial(_format, f))]
            if Format.parse(f).reduction is None and f in ("int4", "int2"):  # KIVI-grouped: a group to vary
                out += [
                    Method(f"format:{f}:g{g}", "format", r, partial(_format, f, group_size=g)) for g in GROUP_VARIANTS
                ]
            if Format.parse(f).reduction == "cluster" and Format.parse(f).quant != "bf16":  # the merges policies ship
                out += [
                    Method(f"format:{f}:p{k}" + ("" if by == "mixed" else f"-{by}"), "format", r,
                           partial(_format, f, pinned=k, pin_by=by))
                    for k, by in PIN_VARIANTS
                ]
    return out


def select(names: list[str] | None, experiments: Path | None = None) -> list[Method]:
    """The methods `names` picks (all when empty) out of `all_methods(experiments)`, baseline first."""
    methods = all_methods(experiments)
    if not names:
        return methods
    by = {m.name: m for m in methods}
    unknown = [n for n in names if n not in by and not any(m.name.startswith(n) for m in methods)]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; valid: {sorted(by)}")
    # A full method name selects that method only (`kivi-int4` is not also `kivi-int4:g64`);
    # anything else selects every method it begins (`proxima:quantized` -> all its ratios).
    prefixes = [n for n in names if n not in by]
    chosen = [m for m in methods if m.name in names or any(m.name.startswith(n) for n in prefixes)]
    if chosen[0].name != "baseline":
        chosen.insert(0, by["baseline"])  # every metric is relative to the uncompressed model
    return chosen
