"""Vanilla vs policy: run both on one workload and present the comparison."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from proxima.policy.schema import Policy
from proxima.simulator.sim import PoolConfig, RunResult, Simulator
from proxima.simulator.workload import RequestSpec


@dataclass(frozen=True)
class Comparison:
    pool: PoolConfig
    policy_name: str
    seed: int
    num_requests: int
    baseline: RunResult
    policy: RunResult

    def to_json(self) -> dict[str, object]:
        return {
            "policy_name": self.policy_name,
            "seed": self.seed,
            "requests": self.num_requests,
            "pool": {"total_blocks": self.pool.total_blocks, "block_size": self.pool.block_size},
            "baseline": self.baseline.summary(),
            "policy": self.policy.summary(),
            "gain": {
                "peak_resident_requests_x": round(
                    self.policy.peak_resident_requests / max(self.baseline.peak_resident_requests, 1), 3
                ),
                "mean_resident_requests_x": round(
                    self.policy.mean_resident_requests / max(self.baseline.mean_resident_requests, 1e-9), 3
                ),
                "steps_x": round(self.baseline.steps / max(self.policy.steps, 1), 3),
            },
        }

    def table(self) -> Table:
        b, p = self.baseline, self.policy
        pool = f"pool {self.pool.total_blocks} x {self.pool.block_size} tokens"
        t = Table(title=f"{self.num_requests} requests, {pool}, seed {self.seed}")
        t.add_column("")
        t.add_column("vanilla", justify="right")
        t.add_column(f"policy: {self.policy_name}", justify="right")
        t.add_column("gain", justify="right")
        t.add_row(
            "peak resident requests",
            str(b.peak_resident_requests),
            str(p.peak_resident_requests),
            f"{p.peak_resident_requests / max(b.peak_resident_requests, 1):.2f}x",
        )
        t.add_row(
            "mean resident requests",
            f"{b.mean_resident_requests:.1f}",
            f"{p.mean_resident_requests:.1f}",
            f"{p.mean_resident_requests / max(b.mean_resident_requests, 1e-9):.2f}x",
        )
        t.add_row("steps to finish", str(b.steps), str(p.steps), f"{b.steps / max(p.steps, 1):.2f}x faster")
        t.add_row("preemptions", str(b.preemptions), str(p.preemptions), "")
        decisions = ", ".join(f"{k}: {v}" for k, v in sorted(p.decisions_by_format.items())) or "none"
        t.add_row("decisions by format", "-", decisions, "")
        t.add_row("peak fragmentation (blocks)", "0", f"{p.peak_fragmentation_blocks:.1f}", "")
        return t


def compare(
    pool: PoolConfig, policy: Policy, workload: list[RequestSpec], seed: int, timeline: bool = False
) -> Comparison:
    base = Simulator(pool, None, seed, label="vanilla").run(workload, record_timeline=timeline)
    pol = Simulator(pool, policy, seed, label=policy.name).run(workload, record_timeline=timeline)
    return Comparison(pool, policy.name, seed, len(workload), base, pol)


def plot_timeline(report: Comparison, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for run, style in ((report.baseline, "--"), (report.policy, "-")):
        ax1.plot(run.timeline_pressure, style, label=run.label)
        ax2.plot(run.timeline_resident, style, label=run.label)
    ax1.set_ylabel("pool pressure (used fraction)")
    ax2.set_ylabel("resident requests")
    ax2.set_xlabel("engine step")
    ax1.legend()
    ax1.set_title(f"Proxima simulator: vanilla vs {report.policy_name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
