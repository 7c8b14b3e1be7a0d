"""Tables, plots and target checks for quality runs."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

METRICS = ("needle_acc", "ppl", "tf_top1", "kl", "agreement")
TARGET_RATIO = 4
REFERENCES_AT_4X = ("streaming_llm@4x", "snapkv@4x", "h2o@4x", "kivi-int4")
EVICTION = ("snapkv", "streaming_llm", "h2o")
"""Name prefixes of the token-eviction references (`methods.py`): a curve each over their ratios,
never counted as uniform formats."""


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
        if meta.get("partial"):
            out += ["**Partial results**: the run was still going (or was killed) when these were written.", ""]
        elif meta.get("complete") is False:
            ran = f"{meta.get('passkey_samples_run', '?')} of {meta.get('passkey_samples', '?')} passkeys"
            texts = f"{meta.get('text_samples_run', '?')} of {len(meta.get('text_samples', [])) or '?'} text windows"
            out += [f"**Not the whole suite**: {ran} and {texts} ran (`needle_n` / `text_n` per row).", ""]
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
        out += ["", f"### Each policy against the uniform formats holding no more bytes, setting `{st}`", ""]
        out += against_uniform(srows)
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


TARGETS = (
    # (ratio, needle fraction of baseline, ppl increase, tf_top1)
    (4, 0.98, 0.03, 0.95),
    (6, 0.90, 0.06, 0.93),
)
REFERENCES_AT_8X = ("snapkv@8x", "streaming_llm@8x", "h2o@8x")


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
            uniform = [r for r in rows if _uniform(r) and _num(_get(r, "achieved_ratio")) >= ach]
            for ref in [*(by[x] for x in REFERENCES_AT_4X if x in by), *uniform]:
                rn, rp, rt = metrics(ref)
                won = [w for w, ok in (("needle", n > rn), ("ppl", p < rp), ("tf_top1", t > rt)) if ok]
                # the fixed references are reported whatever their ratio; the target proper is
                # the uniform formats at >= the policy's bytes ratio (the table below)
                name = f"`{_get(ref, 'method')}` at {_num(_get(ref, 'achieved_ratio')):.2f}x"
                out.append(line(len(won) >= 2, f"beats {name} on {len(won)}/3 ({', '.join(won) or 'none'})"))
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


UNIFORM_EVERY = "uniform quantization, every token (fp8, kivi-int4, lean-int4h)"
UNIFORM_FORMAT = "uniform quantization, first / last block 16-bit (format:int8 ... int2)"
REDUCING_FORMAT = "token-reducing formats, first / last block 16-bit (format:cluster / sparse)"
ENVELOPE = "Proxima, best policy at >= each ratio"


def family_curve(row: Any) -> str | None:
    """The plot's curve a row belongs to: one per Proxima policy (over the ratios it was asked
    for), one per eviction reference (snapkv, streaming_llm, h2o, over their ratios), and one per kind
    of uniform format, over the formats' byte ratios: every token quantized (fp8, kivi-int4 at
    its groups), quantized outside the first and last block (`format:int8` ... `format:int2:g64`),
    token-reducing formats (`format:cluster(2)+int4`, `sparse(4)`, `cluster(4)`). None: baseline."""
    name = str(_get(row, "method"))
    family = str(_get(row, "family")) if _has(row, "family") else ""
    if name == "baseline" or family == "baseline":
        return None
    if name.startswith("proxima:"):
        return name.split("@")[0]
    if name.startswith("format:"):
        fmt = name[len("format:") :]
        return REDUCING_FORMAT if fmt.startswith(("sparse", "cluster")) or "+" in fmt else UNIFORM_FORMAT
    if "@" in name:
        return name.split("@")[0]
    return UNIFORM_EVERY


def _uniform(row: Any) -> bool:
    """A uniform format: one format on every block (`format:*`, kivi-int4, fp8), not token eviction."""
    family = _get(row, "family") if _has(row, "family") else ""
    return family in ("format", "reference") and not str(_get(row, "method")).startswith(EVICTION)


def _wins(a: Any, b: Any) -> list[str]:
    """The metrics on which row `a` is strictly better than row `b` (needle, ppl, tf_top1)."""
    pairs = (("needle", "needle_acc", 1), ("ppl", "ppl", -1), ("tf_top1", "tf_top1", 1))
    return [w for w, key, sign in pairs if sign * (_num(_get(a, key)) - _num(_get(b, key))) > 0]


def against_uniform(rows: Sequence[Any]) -> list[str]:
    """A table row per Proxima policy (rows of one setting): the uniform formats whose achieved
    bytes ratio is at least the policy's, and which of them it beats on at least 2 of needle /
    perplexity / top-1 (the issue's comparison at equal or fewer bytes, at every ratio)."""
    uniform = [r for r in rows if _uniform(r)]
    policies = [r for r in rows if str(_get(r, "method")).startswith("proxima:")]
    if not policies or not uniform:
        return ["no proxima policy or no uniform format in this run"]
    out = [
        "| policy | achieved | uniform formats at >= its bytes | beaten on >= 2 of 3 | not beaten (metrics won) |",
        "|---|---:|---:|---|---|",
    ]
    for p in sorted(policies, key=lambda r: _num(_get(r, "achieved_ratio"))):
        ach = _num(_get(p, "achieved_ratio"))
        lean = sorted(
            (u for u in uniform if _num(_get(u, "achieved_ratio")) >= ach),
            key=lambda r: _num(_get(r, "achieved_ratio")),
        )
        beaten = [u for u in lean if len(_wins(p, u)) >= 2]
        kept = [u for u in lean if len(_wins(p, u)) < 2]
        lost = [f"{_get(u, 'method')} ({', '.join(_wins(p, u)) or 'none'})" for u in kept]
        won = ", ".join(str(_get(u, "method")) for u in beaten) or "—"
        out.append(f"| {_get(p, 'method')} | {ach:.2f} | {len(lean)} | {won} | {', '.join(lost) or '—'} |")
    return out


def _series(rows: Sequence[Any]) -> dict[str, list[Any]]:
    groups: dict[str, list[Any]] = {}
    for r in rows:
        key = family_curve(r)
        if key is not None:
            groups.setdefault(key, []).append(r)
    return groups


def _short(row: Any) -> str:
    """A point's label on the plot: the asked ratio for a policy or eviction reference, the format otherwise."""
    name = str(_get(row, "method"))
    if "@" in name:
        return "@" + name.split("@")[1]
    return name.removeprefix("format:")


def envelope(pts: Sequence[tuple[float, float]], higher_is_better: bool) -> list[tuple[float, float]]:
    """The points no other point beats at an equal or higher ratio (the best quality reachable at
    >= each ratio), sorted by ratio."""
    better = (lambda a, b: a > b) if higher_is_better else (lambda a, b: a < b)
    out: list[tuple[float, float]] = []
    for x, y in sorted(pts, key=lambda p: (-p[0], -p[1] if higher_is_better else p[1])):
        if not out or better(y, out[-1][1]):
            out.append((x, y))
    return out[::-1]


XMAX = 13.0
"""The plot's widest ratio (cluster(4)+int4 blocks hold 11.1x)."""
PANELS = (
    # (metric, title, higher is better)
    ("needle_acc", "passkey accuracy", True),
    ("ppl_delta", "perplexity vs uncompressed (%)", False),
    ("tf_top1", "teacher-forced top-1", True),
)


def _value(row: Any, metric: str, base_ppl: float) -> float:
    if metric == "ppl_delta":
        p = _num(_get(row, "ppl"))
        return (p / base_ppl - 1) * 100 if base_ppl and math.isfinite(p) else float("nan")
    return _num(_get(row, metric))


def plot(rows: Sequence[Any], path: Path) -> None:
    """Quality against achieved bytes ratio: a row of panels per setting (passkey accuracy,
    perplexity change, teacher-forced top-1), in each a curve per method family over its ratios
    (`family_curve`), the best-Proxima envelope, the uncompressed level and the issue's targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(_setting(r) for r in rows))
    fig, axes = plt.subplots(len(settings), len(PANELS), figsize=(18, 5.2 * len(settings)), squeeze=False)
    keys = sorted(_series(rows), key=lambda k: (not k.startswith("proxima"), k))
    ours = [k for k in keys if k.startswith("proxima")]
    others = [k for k in keys if not k.startswith("proxima")]
    # Proxima's curves in warm and strong colours, the uniform formats in blues, eviction in grays.
    warm = plt.get_cmap("tab20")
    palette = [warm(i) for i in (6, 2, 4, 8, 10, 16, 12, 18, 7, 3, 5, 9, 11, 17, 13, 19)]
    fixed = {UNIFORM_EVERY: "tab:blue", UNIFORM_FORMAT: "navy", REDUCING_FORMAT: "tab:cyan"}
    grays = ["dimgray", "darkgray", "black", "silver"]
    colors: dict[str, Any] = {k: palette[i % len(palette)] for i, k in enumerate(ours)}
    colors.update({k: grays[i % len(grays)] for i, k in enumerate(o for o in others if o not in fixed)})
    colors.update({k: v for k, v in fixed.items() if k in others})
    handles: dict[str, Any] = {}
    for si, st in enumerate(settings):
        srows = [r for r in rows if _setting(r) == st]
        base = next(r for r in srows if _get(r, "method") == "baseline")
        bppl = _num(_get(base, "ppl"))
        series = _series(srows)
        for ax, (metric, title, up) in zip(axes[si], PANELS, strict=True):
            proxima_pts: list[tuple[float, float]] = []
            for key in keys:
                rs = series.get(key, [])
                pts = [(_num(_get(r, "achieved_ratio")), _value(r, metric, bppl), _short(r)) for r in rs]
                pts = sorted(p for p in pts if math.isfinite(p[0]) and math.isfinite(p[1]) and p[0] > 0)
                if not pts:
                    continue  # a metric this run did not measure (e.g. no passkey sample fitted the budget)
                is_ours = key.startswith("proxima")
                if is_ours:
                    proxima_pts += [(x, y) for x, y, _ in pts]
                style = "-o" if is_ours else ("--s" if key in (UNIFORM_EVERY, UNIFORM_FORMAT) else ":^")
                (line,) = ax.plot(
                    [x for x, _, _ in pts],
                    [y for _, y, _ in pts],
                    style,
                    color=colors[key],
                    label=key,
                    linewidth=2.0 if is_ours else 1.3,
                    markersize=5,
                )
                handles.setdefault(key, line)
                for x, y, lab in pts:
                    ax.annotate(lab, (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6, color=colors[key])
            if proxima_pts:
                env = envelope(proxima_pts, up)
                (line,) = ax.plot(
                    [x for x, _ in env],
                    [y for _, y in env],
                    "-",
                    drawstyle="steps-pre",  # the best at >= x: each point's value holds back to the previous point
                    color="crimson",
                    alpha=0.25,
                    linewidth=7,
                    label=ENVELOPE,
                    zorder=0,
                )
                handles.setdefault(ENVELOPE, line)
            ax.set_title(f"{title}, setting `{st}`")
            if not ax.get_lines():
                ax.text(0.5, 0.5, "not measured in this run", ha="center", transform=ax.transAxes)
                continue
            level = 0.0 if metric == "ppl_delta" else _num(_get(base, metric))
            if math.isfinite(level):
                handles.setdefault("uncompressed", ax.axhline(level, color="k", linewidth=0.8, label="uncompressed"))
            for (ratio, needle_frac, ppl_up, top1), ls in zip(TARGETS, ("--", ":"), strict=True):
                target = {"needle_acc": needle_frac * level, "ppl_delta": ppl_up * 100, "tf_top1": top1}[metric]
                if math.isfinite(target):
                    ax.plot([ratio, XMAX], [target, target], ls, color="gray", linewidth=0.9)
            for ratio in (4, 6, 8):
                ax.axvline(ratio, color="gray", linewidth=0.5, alpha=0.5)
            if metric == "ppl_delta":
                ys = [y for line in ax.get_lines() for y in line.get_ydata() if math.isfinite(y)]
                top, low = max(ys, default=0), min(ys, default=0)
                if top > 30:  # a collapsed method would flatten everything else: linear to 10%, log above
                    ax.set_yscale("symlog", linthresh=10, linscale=3)
                    ticks = [t for t in (-10, -5, -2, 0, 3, 6, 10, 30, 100, 300, 1000) if low - 3 <= t <= top * 1.5]
                    ax.set_yticks(ticks)
                    ax.set_yticklabels([f"{t:+d}" if t else "0" for t in ticks])
                    ax.set_ylim(min(low, 0) - 2, top * 1.6)
            ax.set_xscale("log", base=2)
            ax.set_xticks([1, 1.5, 2, 3, 4, 6, 8, 12])
            ax.set_xticklabels(["1", "1.5", "2", "3", "4", "6", "8", "12"])
            ax.set_xlim(0.9, XMAX)
            ax.set_xlabel("achieved ratio: 16-bit KV bytes / bytes held (metadata included)")
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(
        "SmolLM2-135M-Instruct: quality against KV bytes (further right = less memory); gray: the issue's "
        "targets at >= 4x (dashed) and >= 6x (dotted)"
    )
    fig.tight_layout(rect=(0, 0.03 + 0.025 * math.ceil(len(handles) / 3), 1, 0.97))
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
    per_shard = ("shard", "only_samples", "partial", "command", "date", "budget_s")
    meta = {k: v for k, v in shard_meta[0].items() if k not in per_shard}
    # What the shards planned to run, joined (each shard's meta lists only its own samples). A
    # key some shards lack is left out rather than taken from the first shard alone.
    joined = ("passkey_samples", "text_samples", "text_context_tokens", "passkey_lengths", "passkey_depths",
              "passkey_names")
    for key in joined:
        if not all(key in m for m in shard_meta):
            meta.pop(key, None)
    if "passkey_samples" in meta:
        meta["passkey_samples"] = sum(int(m["passkey_samples"]) for m in shard_meta)
    for key in ("text_context_tokens", "passkey_lengths", "passkey_depths"):
        if key in meta:
            meta[key] = sorted({x for m in shard_meta for x in m[key]})
    # Samples by name, in the order they ran: a budget stops a shard at the first sample that does
    # not fit, so the first `needle_n` of its `passkey_names` (`text_n` of its `text_samples`) ran.
    # A shard of the samples another one left unstarted (`--samples`) re-plans them: count
    # distinct samples, and refuse one that ran twice (it would weigh double). The merged lists
    # keep that reading (the ran ones first, in shard order, then those that never ran), so a
    # merged result can be merged again with another shard.
    by_name_ok = True
    named = (("passkey_names", "needle_n", "passkey samples"), ("text_samples", "text_n", "text windows"))
    for key, count, what in named:
        if key not in meta:
            continue
        ran = [n for m, rows in zip(shard_meta, shard_rows, strict=True) for n in m[key][: int(rows[0][count])]]
        twice = sorted(n for n, k in Counter(ran).items() if k > 1)
        if twice:
            raise ValueError(f"{what} ran in more than one shard: {', '.join(twice)}")
        done = set(ran)
        planned = list(dict.fromkeys(n for m in shard_meta for n in m[key]))
        meta[key] = ran + [n for n in planned if n not in done]
        by_name_ok = by_name_ok and done == set(planned)
    if "passkey_names" in meta:
        meta["passkey_samples"] = len(meta["passkey_names"])
    # Without names, only shards that all completed ran everything they planned.
    by_name = "passkey_names" in meta and "text_samples" in meta
    every_sample_ran = by_name_ok and (by_name or all(m.get("complete", False) for m in shard_meta))
    planned_n = (meta.get("passkey_samples"), len(meta["text_samples"]) if "text_samples" in meta else None)

    def flat(list_key: str, key: str) -> list:
        """Per shard, an already merged result's own shards included (a merge of merges stays flat)."""
        return [x for m in shard_meta for x in (m[list_key] if "merged_from" in m else [m.get(key)])]

    meta.update(
        shards=flat("shards", "shard"),
        commands=flat("commands", "command"),
        dates=flat("dates", "date"),
        budgets_s=flat("budgets_s", "budget_s"),
        shard_seconds=flat("shard_seconds", "seconds"),
        seconds=max(m.get("seconds", 0) for m in shard_meta),
        passkey_samples_run=out[0]["needle_n"],
        text_samples_run=out[0]["text_n"],
        # No shard was killed (that left `partial` results) and every planned sample ran: in
        # some shard, when the shards name their samples (a budget-cut shard's samples may have
        # run in a later `--samples` shard), else in shards that all completed.
        complete=not any(m.get("partial", False) for m in shard_meta) and every_sample_ran
        and planned_n[0] in (None, out[0]["needle_n"])
        and planned_n[1] in (None, out[0]["text_n"]),
        merged_from=[x for m, name in zip(shard_meta, names, strict=True)
                     for x in m.get("merged_from", [name])],
        # kept, so that merging this result again still sees a killed shard inside it
        partial=any(m.get("partial", False) for m in shard_meta),
    )
    return out, meta


def _weight(row: dict, weight: str) -> int:
    return int(row["needle_n"] + row["text_n"]) if weight == "samples" else int(row[weight])
