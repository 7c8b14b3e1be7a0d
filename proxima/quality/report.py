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


def _setting(r: Any) -> str:
    return str(_get(r, "setting")) if _has(r, "setting") else "after"


def markdown(rows: Sequence[Any], meta: dict | None = None) -> str:
    settings = list(dict.fromkeys(_setting(r) for r in rows))
    out = ["# Quality on SmolLM2-135M-Instruct", ""]
    if meta:
        out += [f"- {k}: {v}" for k, v in meta.items()] + [""]
    out += [
        "`achieved` is 16-bit KV bytes over the bytes held (compressed data, scales, zero points and "
        "log-counts; hot blocks at 16 bits); `nominal` counts each format at its pack ratio. "
        "Settings: `after` = the context is compressed before the question arrives; `inside` = the "
        "question is in the compressed prompt (vLLM's case). ppl / tf_top1 / KL are the same in "
        "both (see `proxima.quality.harness.SETTINGS`).",
        "",
    ]
    for st in settings:
        srows = [r for r in rows if _setting(r) == st]
        base = next(r for r in srows if _get(r, "method") == "baseline")
        bppl = _num(_get(base, "ppl"))
        out += [
            f"## Setting `{st}`",
            "",
            "| method | asked | achieved (bytes) | nominal (pack) | needle_acc (n) | ppl (Δ%) | tf_top1 | KL "
            "| agreement |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in srows:
            ppl = _num(_get(r, "ppl"))
            d = (ppl / bppl - 1) * 100 if bppl and not math.isnan(ppl) else float("nan")
            n = _get(r, "needle_n") if _has(r, "needle_n") else "?"
            out.append(
                f"| {_get(r, 'method')} | {_num(_get(r, 'ratio')):g} | {_fmt(_get(r, 'achieved_ratio'), 2)} "
                f"| {_fmt(_get(r, 'nominal_ratio') if _has(r, 'nominal_ratio') else None, 2)} "
                f"| {_fmt(_get(r, 'needle_acc'), 3)} ({n}) | {_fmt(ppl, 2)} ({d:+.1f}) | {_fmt(_get(r, 'tf_top1'))} "
                f"| {_fmt(_get(r, 'kl'), 4)} | {_fmt(_get(r, 'agreement'), 2)} |"
            )
        out += ["", f"### Targets, setting `{st}`", "", *check_targets(srows)]
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


TARGETS = (
    # (ratio, needle fraction of baseline, ppl increase, tf_top1)
    (4, 0.98, 0.03, 0.95),
    (6, 0.90, 0.06, 0.93),
)
REFERENCES_AT_8X = ("snapkv@8x", "streaming_llm@8x")


def check_targets(rows: Sequence[Any]) -> list[str]:
    """The issue's targets on the rows of one setting, one line each (PASS/FAIL with numbers).
    At each level the candidate is the best proxima policy whose *achieved* (bytes) ratio reaches
    it (98% of it), whatever ratio it was asked for."""
    by = {_get(r, "method"): r for r in rows}
    base = by["baseline"]
    cands = [r for r in rows if str(_get(r, "method")).startswith("proxima:")]
    if not cands:
        return ["no proxima policy in this run"]
    bn, bp = _num(_get(base, "needle_acc")), _num(_get(base, "ppl"))

    def key(r: Any) -> tuple[float, float]:
        return (_num(_get(r, "needle_acc")), _num(_get(r, "tf_top1")))

    def line(ok: bool, text: str) -> str:
        return f"- {'PASS' if ok else 'FAIL'}: {text}"

    def metrics(r: Any) -> tuple[float, float, float]:
        return _num(_get(r, "needle_acc")), _num(_get(r, "ppl")), _num(_get(r, "tf_top1"))

    out: list[str] = []
    for ratio, needle_frac, ppl_up, top1 in TARGETS:
        reaching = [r for r in cands if _num(_get(r, "achieved_ratio")) >= ratio * 0.98]
        if not reaching:
            best_ach = max(_num(_get(r, "achieved_ratio")) for r in cands)
            out.append(line(False, f">= {ratio}x: no policy reaches it (best achieved {best_ach:.2f})"))
            continue
        best = max(reaching, key=key)
        n, p, t = metrics(best)
        out.append(f"At >= {ratio}x: `{_get(best, 'method')}` (achieved {_num(_get(best, 'achieved_ratio')):.2f}).")
        out.append(line(n >= needle_frac * bn, f"needle {n:.3f} >= {needle_frac:.0%} of baseline {bn:.3f}"))
        out.append(line(p <= (1 + ppl_up) * bp, f"perplexity {p:.2f} <= baseline {bp:.2f} + {ppl_up:.0%}"))
        out.append(line(t >= top1, f"teacher-forced top-1 {t:.3f} >= {top1}"))
        if ratio == TARGET_RATIO:
            ach = _num(_get(best, "achieved_ratio"))
            uniform = [
                r
                for r in rows
                if (_get(r, "family") if _has(r, "family") else "") in ("format", "reference")
                and not str(_get(r, "method")).startswith(("snapkv", "streaming_llm"))
                and _num(_get(r, "achieved_ratio")) >= ach
            ]
            for ref in [*(by[x] for x in REFERENCES_AT_4X if x in by), *uniform]:
                rn, rp, rt = metrics(ref)
                won = [w for w, ok in (("needle", n > rn), ("ppl", p < rp), ("tf_top1", t > rt)) if ok]
                out.append(
                    line(len(won) >= 2, f"beats `{_get(ref, 'method')}` on {len(won)}/3 ({', '.join(won) or 'none'})")
                )
    reaching8 = [r for r in cands if _num(_get(r, "achieved_ratio")) >= 8 * 0.98]
    if not reaching8:
        best_ach = max(_num(_get(r, "achieved_ratio")) for r in cands)
        out.append(line(False, f">= 8x: no policy reaches it (best achieved {best_ach:.2f})"))
    else:
        best = max(reaching8, key=key)
        n, p, t = metrics(best)
        out.append(f"At >= 8x: `{_get(best, 'method')}` (achieved {_num(_get(best, 'achieved_ratio')):.2f}).")
        for ref in (by[x] for x in REFERENCES_AT_8X if x in by):
            rn, rp, rt = metrics(ref)
            won = [w for w, ok in (("needle", n > rn), ("ppl", p < rp), ("tf_top1", t > rt)) if ok]
            out.append(line(len(won) == 3, f"beats `{_get(ref, 'method')}` on all three ({', '.join(won) or 'none'})"))
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
        plotted = 0
        for key, rs in sorted(_series(rows).items()):
            rs = sorted(rs, key=lambda r: _num(_get(r, "achieved_ratio")))
            pts = [(_num(_get(r, "achieved_ratio")), _num(_get(r, metric))) for r in rs]
            pts = [(x, y) for x, y in pts if math.isfinite(x) and math.isfinite(y) and x > 0]
            if not pts:
                continue  # a metric this run did not measure (e.g. no passkey sample fitted the budget)
            style = "-o" if key.startswith("proxima") else ("--s" if not key.startswith("format") else ":.")
            lw = 2.5 if key.startswith("proxima") else 1.2
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=key, linewidth=lw, markersize=5)
            plotted += 1
        ax.set_title(label)
        if not plotted:
            ax.text(0.5, 0.5, "not measured in this run", ha="center", transform=ax.transAxes)
            continue
        ax.axhline(_num(_get(base, metric)), color="k", linewidth=0.8, label="uncompressed")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("achieved compression ratio of the context KV (16-bit bytes / bytes held)")
        if metric == "ppl":
            ax.set_yscale("log")
    with_lines = [ax for ax in axes if ax.get_lines()]
    if with_lines:
        with_lines[0].legend(fontsize=7, loc="lower left")
    fig.suptitle("SmolLM2-135M-Instruct: quality against KV compression (higher ratio = less memory)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge_shards(
    shard_rows: Sequence[Sequence[dict]], shard_meta: Sequence[dict], names: Sequence[str]
) -> tuple[list[dict], dict]:
    """Join shards' result rows (JSON dicts; each shard ran a disjoint part of the samples, the
    same methods and settings) into the rows of the whole run: every metric is the mean over all
    the shards' samples, weighted by `needle_n` for the passkey, by `text_n` for the
    teacher-forced metrics (every window scores the same number of positions; perplexity is
    joined in log space) and by their sum for the ratios, which every sample measured."""
    keys = [(r["method"], r["setting"]) for r in shard_rows[0]]
    for name, rows in zip(names, shard_rows, strict=True):
        if [(r["method"], r["setting"]) for r in rows] != keys:
            raise ValueError(f"{name}: its rows are not the same methods and settings as {names[0]}'s")
    out = []
    for i in range(len(keys)):
        parts = [rows[i] for rows in shard_rows]

        def mean(key: str, weight: str, parts: list[dict] = parts) -> float | None:
            pairs = [(r[key], _weight(r, weight)) for r in parts if r[key] is not None and _weight(r, weight) > 0]
            total = sum(w for _, w in pairs)
            return sum(v * w for v, w in pairs) / total if total else None

        logs = [(math.log(r["ppl"]), r["text_n"]) for r in parts if r["ppl"] is not None and r["text_n"]]
        n_text = sum(w for _, w in logs)
        formats: dict[str, int] = {}
        for r in parts:
            for k, v in r["formats"].items():
                formats[k] = formats.get(k, 0) + v
        row = dict(parts[0])
        row.update(
            achieved_ratio=round(mean("achieved_ratio", "samples") or 0.0, 3),
            nominal_ratio=round(mean("nominal_ratio", "samples") or 0.0, 3),
            needle_acc=mean("needle_acc", "needle_n"),
            needle_n=sum(r["needle_n"] for r in parts),
            text_n=sum(r["text_n"] for r in parts),
            ppl=math.exp(sum(v * w for v, w in logs) / n_text) if n_text else None,
            tf_top1=mean("tf_top1", "text_n"),
            kl=mean("kl", "text_n"),
            agreement=mean("agreement", "text_n"),
            formats=formats,
            seconds=round(sum(r["seconds"] for r in parts), 1),
        )
        out.append(row)
    meta = {k: v for k, v in shard_meta[0].items() if k not in ("shard", "partial")}
    meta.update(
        shards=[m.get("shard") for m in shard_meta],
        seconds=max(m.get("seconds", 0) for m in shard_meta),
        passkey_samples_run=out[0]["needle_n"],
        text_samples_run=out[0]["text_n"],
        complete=all(m.get("complete", False) for m in shard_meta),
        merged_from=list(names),
    )
    return out, meta


def _weight(row: dict, weight: str) -> int:
    return int(row["needle_n"] + row["text_n"]) if weight == "samples" else int(row[weight])
