"""The damage model: predict a block's compression-time probe error from cheap features.

Data: every (layer, block, format) compressed during a quality run or `proxima calibrate`
yields a `ProbeRecord` (importance, key-norm spread, layer, format, measured relative error of
the observation window's attention output). Model: per format, a ridge regression of
log(error) on [importance, log importance, key-norm spread, layer fraction, layer fraction^2]
(scikit-learn), exported as plain JSON (coefficients, no pickle):

    {"version": 1, "kind": "per-format-log-linear", "features": [...],
     "formats": {"int4": {"intercept": c0, "coef": [c1..c5], "n": rows, "median_error": e}, ...},
     "table": {"int4": e, ...}, "r2": overall R^2 on log error, "source": "..."}

`predict(model, fmt, features)` evaluates it; `table` (median measured error per format) drops
straight into a policy's `damage.table`, which the engine minimises.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

DEFAULT_PATH = Path(__file__).resolve().parent / "data" / "damage-smollm2.json"
FEATURES = ("importance", "log_importance", "key_norm_spread", "layer_frac", "layer_frac_sq")
_EPS = 1e-6


def features(importance: float, key_norm_spread: float, layer: int, n_layers: int) -> list[float]:
    lf = layer / max(1, n_layers - 1)
    return [importance, math.log(importance + _EPS), key_norm_spread, lf, lf * lf]


def records_to_rows(records: Iterable[Any]) -> list[dict[str, Any]]:
    recs = list(records)
    n_layers = 1 + max((r.layer for r in recs), default=0)
    return [
        {"fmt": r.fmt, "x": features(r.importance, r.key_norm_spread, r.layer, n_layers), "error": r.error}
        for r in recs
    ]


def fit(rows: Sequence[dict[str, Any]], *, alpha: float = 1.0, source: str = "") -> dict[str, Any]:
    import numpy as np
    from sklearn.linear_model import Ridge
    from sklearn.metrics import r2_score

    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["fmt"], []).append(r)
    formats: dict[str, Any] = {}
    ys, preds = [], []
    for fmt, rs in sorted(by.items()):
        x = np.array([r["x"] for r in rs], dtype=float)
        y = np.log(np.array([r["error"] for r in rs], dtype=float) + _EPS)
        reg = Ridge(alpha=alpha).fit(x, y)
        ys.append(y)
        preds.append(reg.predict(x))
        formats[fmt] = {
            "intercept": float(reg.intercept_),
            "coef": [float(c) for c in reg.coef_],
            "n": len(rs),
            "median_error": float(np.median(np.exp(y) - _EPS)),
        }
    r2 = float(r2_score(np.concatenate(ys), np.concatenate(preds))) if ys else float("nan")
    return {
        "version": 1,
        "kind": "per-format-log-linear",
        "features": list(FEATURES),
        "formats": formats,
        "table": {f: round(v["median_error"], 6) for f, v in formats.items()},
        "r2": r2,
        "rows": len(rows),
        "source": source,
    }


def predict(model: dict[str, Any], fmt: str, x: Sequence[float]) -> float:
    m = model["formats"].get(fmt)
    if m is None:
        raise KeyError(f"no damage model for format {fmt!r}; have {sorted(model['formats'])}")
    z = m["intercept"] + sum(c * v for c, v in zip(m["coef"], x, strict=True))
    return max(0.0, math.exp(z) - _EPS)


def load(path: Path = DEFAULT_PATH) -> dict[str, Any]:
    import json

    return json.loads(Path(path).read_text())


CALIBRATION_FORMATS = (
    "fp8", "int8", "int4", "int2", "sparse(4)", "cluster(4)",
    "cluster(2)+int4", "cluster(4)+int4", "sparse(4)+int4",
)  # fmt: skip
"""Every format a shipped policy's ladder uses, plus the single-format rows of the benchmark."""


def calibrate(
    model,
    tokenizer,
    *,
    contexts: int = 1,
    context_len: int = 1024,
    block_size: int = 64,
    formats: Sequence[str] = CALIBRATION_FORMATS,
    log=print,
) -> dict[str, Any]:
    """Prefill a few Wikipedia contexts, compress every block (outside the first) into every
    format, and fit the model on the probe errors. No generation, so it takes a few minutes."""
    import copy

    import torch

    from proxima.formats import Format
    from proxima.integration.hf import ProximaCache, enable
    from proxima.quality.datasets import text_samples
    from proxima.quality.probe_records import ProbeLog, probe_records

    enable(model)
    records: list[Any] = []
    for i, s in enumerate(text_samples(tokenizer, context_len, contexts, seed=7)):
        cache = ProximaCache(block_size=block_size, probe_hook=ProbeLog())
        with torch.no_grad():
            model(torch.tensor([s.context_ids], device=model.device), past_key_values=cache)
        n = cache.proxima_layers[0].n_blocks
        for f in formats:
            c = copy.deepcopy(cache)
            c.compress_blocks(list(range(1, n)), Format.parse(f))
            records += probe_records(c)
        log(f"[calibrate] context {i + 1}/{contexts}: {len(records)} probe records")
    return fit(records_to_rows(records), source=f"proxima calibrate: {contexts} x {context_len} tokens, SmolLM2")
