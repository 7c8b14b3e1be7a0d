"""Tables, plots and target checks for quality runs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

METRICS = ("needle_acc", "ppl", "tf_top1", "kl", "agreement")
TARGET_RATIO = 4
REFERENCES_AT_4X = ("streaming_llm@4x", "snapkv@4x", "kivi-int4")


def _get(row: Any, key: str) -> Any:
    return row[key] if isinstance(row, dict) else getattr(row, key)


def _has(row: Any, key: str) -> bool:
    return key in row if isinstance(row, dict) else hasattr(row, key)


def _num(x: Any) -> float:
    return float("nan") if x is None else float(x)


def _fmt(x: Any, nd: int = 3) -> str:
    x = _num(x)
    return "—" if math.isnan(x) else f"{x:.{nd}f}"


def markdown(rows: Sequence[Any], meta: dict | None = None) -> str:
    base = next(r for r in rows if _get(r, "method") == "baseline")
    bppl = _num(_get(base, "ppl"))
    lines = [
        "| method | asked | achieved (bytes) | nominal (pack) | needle_acc | ppl (Δ%) | tf_top1 | KL | agreement |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ppl = _num(_get(r, "ppl"))
        d = (ppl / bppl - 1) * 100 if bppl and not math.isnan(ppl) else float("nan")
        lines.append(
            f"| {_get(r, 'method')} | {_num(_get(r, 'ratio')):g} | {_fmt(_get(r, 'achieved_ratio'), 2)} "
            f"| {_fmt(_get(r, 'nominal_ratio') if _has(r, 'nominal_ratio') else None, 2)} "
            f"| {_fmt(_get(r, 'needle_acc'), 2)} | {_fmt(ppl, 2)} ({d:+.1f}) | {_fmt(_get(r, 'tf_top1'))} "
            f"| {_fmt(_get(r, 'kl'), 4)} | {_fmt(_get(r, 'agreement'), 2)} |"
        )
    out = ["# Quality on SmolLM2-135M-Instruct", ""]
    if meta:
        out += [f"- {k}: {v}" for k, v in meta.items()] + [""]
    out += [
        "`achieved` is 16-bit KV bytes over the bytes held (compressed data, scales, zero points and "
        "log-counts; hot blocks at 16 bits); `nominal` counts each format at its pack ratio.",
        "",
        *lines,
        "",
        "## Targets (4x)",
        "",
        *check_targets(rows),
    ]
    return "\n".join(out) + "\n"


def check_targets(rows: Sequence[Any]) -> list[str]:
    """The issue's targets, evaluated on `rows`, one line each (PASS/FAIL with numbers)."""
    by = {_get(r, "method"): r for r in rows}
    base = by["baseline"]
    cands = [
        r
        for r in rows
        if str(_get(r, "method")).startswith("proxima:") and f"@{TARGET_RATIO}x" in str(_get(r, "method"))
    ]
    if not cands:
        return ["no proxima policy at 4x in this run"]

    def key(r: Any) -> tuple[float, float]:
        return (_num(_get(r, "needle_acc")), _num(_get(r, "tf_top1")))

    # The best policy among those that really reach the ratio (else the best of all, which fails it).
    reaching = [r for r in cands if _num(_get(r, "achieved_ratio")) >= TARGET_RATIO * 0.98]
    best = max(reaching or cands, key=key)
    bn, bp = _num(_get(base, "needle_acc")), _num(_get(base, "ppl"))
    n, p, t = _num(_get(best, "needle_acc")), _num(_get(best, "ppl")), _num(_get(best, "tf_top1"))
    ach = _num(_get(best, "achieved_ratio"))
    out = [f"Best policy at 4x: `{_get(best, 'method')}` (achieved ratio {ach:.2f})."]

    def line(ok: bool, text: str) -> str:
        return f"- {'PASS' if ok else 'FAIL'}: {text}"

    out.append(line(ach >= TARGET_RATIO * 0.98, f"achieved ratio {ach:.2f} >= {TARGET_RATIO * 0.98:.2f}"))
    out.append(line(n >= 0.98 * bn, f"needle {n:.2f} >= 98% of baseline {bn:.2f}"))
    out.append(line(p <= 1.03 * bp, f"perplexity {p:.2f} <= baseline {bp:.2f} + 3% ({1.03 * bp:.2f})"))
    out.append(line(t >= 0.95, f"teacher-forced top-1 {t:.3f} >= 0.95"))
    for ref in REFERENCES_AT_4X:
        if ref not in by:
            continue
        r = by[ref]
        wins = [
            ("needle", n > _num(_get(r, "needle_acc"))),
            ("ppl", p < _num(_get(r, "ppl"))),
            ("tf_top1", t > _num(_get(r, "tf_top1"))),
        ]
        won = [w for w, ok in wins if ok]
        out.append(line(len(won) >= 2, f"beats `{ref}` on {len(won)}/3 metrics ({', '.join(won) or 'none'})"))
    return out


def _series(rows: Sequence[Any]) -> dict[str, list[Any]]:
    """Group rows into lines: one per policy, per reference method, per format family."""
    groups: dict[str, list[Any]] = {}
    for r in rows:
        name = str(_get(r, "method"))
        if name == "baseline":
            continue
        if name.startswith("proxima:") or "@" in name:
            key = name.split("@")[0]
        elif name.startswith("format:"):
            f = name[len("format:") :]
            if "+" in f:
                key = "format:cluster(2)+int"
            elif f.startswith(("sparse", "cluster")):
                key = "format:" + f.split("(")[0]
            else:
                key = "format:quant (fp8/int8/int4/int2)" if f != "fp8" else "format:fp8"
        else:
            key = name
        groups.setdefault(key, []).append(r)
    return groups


def plot(rows: Sequence[Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next(r for r in rows if _get(r, "method") == "baseline")
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for ax, metric, label in zip(
        axes, ("needle_acc", "tf_top1", "ppl"), ("passkey accuracy", "teacher-forced top-1", "perplexity"), strict=True
    ):
        for key, rs in sorted(_series(rows).items()):
            rs = sorted(rs, key=lambda r: _num(_get(r, "achieved_ratio")))
            xs = [_num(_get(r, "achieved_ratio")) for r in rs]
            ys = [_num(_get(r, metric)) for r in rs]
            style = "-o" if key.startswith("proxima") else ("--s" if not key.startswith("format") else ":.")
            lw = 2.5 if key.startswith("proxima") else 1.2
            ax.plot(xs, ys, style, label=key, linewidth=lw, markersize=5)
        ax.axhline(_num(_get(base, metric)), color="k", linewidth=0.8, label="uncompressed")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("achieved compression ratio of the context KV (16-bit bytes / bytes held)")
        ax.set_title(label)
        if metric == "ppl":
            ax.set_yscale("log")
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle("SmolLM2-135M-Instruct: quality against KV compression (higher ratio = less memory)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
