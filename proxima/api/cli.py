"""`proxima api serve`, and the client commands that talk to a running API.

`proxima policy get|set|patch|rollback|history`, `proxima stats`, `proxima alerts` and
`proxima fallback` read the server from `--url` (default `$PROXIMA_API_URL`, else
http://127.0.0.1:8765) and the token from `$PROXIMA_API_TOKEN`. A 4xx answer is printed as
`field: message` lines and exits 2; an unreachable server exits 1.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
import yaml

DEFAULT_URL = "http://127.0.0.1:8765"
UrlOpt = Annotated[
    str | None, typer.Option("--url", help="API base URL (default $PROXIMA_API_URL or http://127.0.0.1:8765).")
]


def _client(url: str | None) -> httpx.Client:
    """Replaced in tests by a client bound to an in-process app."""
    base = url or os.environ.get("PROXIMA_API_URL") or DEFAULT_URL
    headers = {}
    token = os.environ.get("PROXIMA_API_TOKEN")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.Client(base_url=base, headers=headers, timeout=10.0)


def _echo_err(message: str) -> None:
    sys.stderr.write(message.rstrip("\n") + "\n")


def _call(url: str | None, method: str, path: str, **kwargs: Any) -> Any:
    try:
        with _client(url) as client:
            resp = client.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        _echo_err(f"cannot reach the Proxima API at {url or os.environ.get('PROXIMA_API_URL') or DEFAULT_URL}: {exc}")
        raise typer.Exit(1) from None
    if resp.status_code >= 400:
        try:
            body = resp.json()
        except ValueError:
            body = {"error": resp.text}
        _echo_err(f"error {resp.status_code}: {body.get('error', body)}")
        for p in body.get("problems") or []:
            where = p.get("field") or "(policy)"
            line = f" (line {p['line']})" if p.get("line") else ""
            _echo_err(f"  {where}{line}: {p.get('message')}")
        if resp.status_code == 401:
            _echo_err("hint: export PROXIMA_API_TOKEN=<token>")
        raise typer.Exit(2)
    return resp.json() if "json" in resp.headers.get("content-type", "") else resp.text


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def _print_write(result: dict[str, Any]) -> None:
    sys.stdout.write(f"policy version {result['version']} ({result['source']})\n")
    for c in result["changes"]:
        sys.stdout.write(f"  {c['path']}: {json.dumps(c['old'])} -> {json.dumps(c['new'])}\n")
    if not result["changes"]:
        sys.stdout.write("  (no field changed)\n")


def _parse_assignment(text: str) -> dict[str, Any]:
    """'budget.max_blocks_per_step=64' -> {"budget": {"max_blocks_per_step": 64}} (value read as YAML)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise typer.BadParameter(f"expected KEY.PATH=VALUE, got {text!r}")
    value: Any = yaml.safe_load(raw) if raw.strip() else ""
    for part in reversed(key.strip().split(".")):
        value = {part: value}
    return value  # type: ignore[no-any-return]


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def register(app: typer.Typer) -> None:
    from proxima.cli import policy_app

    api_app = typer.Typer(help="The runtime tuning API.", no_args_is_help=True)
    app.add_typer(api_app, name="api")

    @api_app.command("serve")
    def serve(
        simulate: Annotated[bool, typer.Option("--simulate", help="Serve over the simulator (no vLLM).")] = False,
        policy: Annotated[Path, typer.Option(help="Initial policy file.")] = Path("proxima/policies/balanced.yaml"),
        host: Annotated[str | None, typer.Option(help="Bind address (default: the policy's api.host).")] = None,
        port: Annotated[int | None, typer.Option(help="Port (default: the policy's api.port).")] = None,
        seed: Annotated[int, typer.Option(help="Simulated workload seed.")] = 0,
        watch: Annotated[bool, typer.Option(help="Reload the policy file when it changes.")] = False,
    ) -> None:
        """Run the API in the foreground until interrupted."""
        from proxima.api.auth import TokenConfigError
        from proxima.api.server import serve as run_server
        from proxima.api.server import simulated
        from proxima.policy.loader import PolicyError, load_policy
        from proxima.policy.store import FileWatcher

        if not simulate:
            _echo_err(
                "the live API runs inside the vLLM engine process (enable it with the policy's api.enabled); "
                "use --simulate to serve over the simulator"
            )
            raise typer.Exit(2)
        try:
            pol = load_policy(policy)
        except PolicyError as exc:
            _echo_err(str(exc))
            raise typer.Exit(2) from None
        # Policy changes, reloads and alerts go to proxima.* loggers; uvicorn only configures its own.
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            srv = simulated(pol, source=str(policy), seed=seed)
        except TokenConfigError as exc:
            _echo_err(f"proxima: refusing to start the API: {exc}")
            raise typer.Exit(2) from None
        if srv.controller.store.policy.api.token_file is None and not os.environ.get(pol.api.token_env):
            _echo_err(f"warning: {pol.api.token_env} is not set; the API will refuse every change")
        # A refused reload is logged by the watcher and raised as an alert (GET /v1/alerts, webhook).
        watcher = FileWatcher(srv.controller.store, policy, on_error=srv.controller.policy_file_refused)
        if watch:
            watcher.start()
        srv.driver.start()
        try:
            run_server(srv.app, host or pol.api.host, port or pol.api.port)
        finally:
            srv.driver.stop()
            watcher.stop()

    @policy_app.command("get")
    def policy_get(
        url: UrlOpt = None,
        version: Annotated[int | None, typer.Option(help="An older version from history.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="JSON instead of YAML.")] = False,
    ) -> None:
        """Print the live policy (YAML, with its version as a comment)."""
        body = _call(url, "GET", "/v1/policy", params={"version": version} if version else None)
        if as_json:
            _print_json(body)
        else:
            sys.stdout.write(f"# version {body['version']} from {body['source']}\n")
            sys.stdout.write(yaml.safe_dump(body["policy"], sort_keys=False))

    @policy_app.command("set")
    def policy_set(
        file: Annotated[Path, typer.Argument(help="Policy YAML (or JSON) file to install.")],
        url: UrlOpt = None,
        comment: Annotated[str, typer.Option(help="Kept in the history.")] = "",
        if_version: Annotated[int | None, typer.Option(help="Only if the live version is this one.")] = None,
    ) -> None:
        """Replace the live policy with FILE; prints the new version and the diff."""
        headers = {"Content-Type": "application/yaml"}
        if if_version is not None:
            headers["If-Match"] = f'"{if_version}"'
        from proxima.policy.reader import ReadError, read_bounded

        try:
            # Sent as bytes: the server reads them like a policy file (UTF-8 and the rest checked
            # there, reported with line and column).
            data = read_bounded(file)
        except (OSError, ReadError) as exc:
            _echo_err(f"{file}: {exc.strerror if isinstance(exc, OSError) else exc}")
            raise typer.Exit(2) from None
        _print_write(_call(url, "PUT", "/v1/policy", content=data, headers=headers, params={"comment": comment}))

    @policy_app.command("patch")
    def policy_patch(
        changes: Annotated[
            list[str],
            typer.Argument(help="KEY.PATH=VALUE pairs (e.g. budget.max_blocks_per_step=64), or one JSON object."),
        ],
        url: UrlOpt = None,
        comment: Annotated[str, typer.Option(help="Kept in the history.")] = "",
        if_version: Annotated[int | None, typer.Option(help="Only if the live version is this one.")] = None,
    ) -> None:
        """Change single knobs of the live policy (a JSON merge patch)."""
        if len(changes) == 1 and changes[0].lstrip().startswith("{"):
            try:
                patch = json.loads(changes[0])
            except json.JSONDecodeError as exc:
                raise typer.BadParameter(f"not valid JSON: {exc}") from None
        else:
            patch = {}
            for c in changes:
                patch = _merge(patch, _parse_assignment(c))
        headers = {"Content-Type": "application/merge-patch+json"}
        if if_version is not None:
            headers["If-Match"] = f'"{if_version}"'
        body = json.dumps(patch).encode()
        _print_write(_call(url, "PATCH", "/v1/policy", content=body, headers=headers, params={"comment": comment}))

    @policy_app.command("rollback")
    def policy_rollback(
        version: Annotated[int, typer.Argument(help="Version to re-install.")],
        url: UrlOpt = None,
        comment: Annotated[str, typer.Option(help="Kept in the history.")] = "",
    ) -> None:
        """Re-install an earlier version (as a new version)."""
        _print_write(_call(url, "POST", "/v1/policy/rollback", json={"version": version, "comment": comment}))

    @policy_app.command("history")
    def policy_history(url: UrlOpt = None) -> None:
        """List the kept versions, newest last."""
        body = _call(url, "GET", "/v1/policy/history")
        for v in body["versions"]:
            live = " (live)" if v["version"] == body["live"] else ""
            note = f"  {v['comment']}" if v["comment"] else ""
            sys.stdout.write(f"{v['version']:>5}  {v['created_at']:.0f}  {v['source']}{live}{note}\n")

    @app.command("stats")
    def stats(url: UrlOpt = None) -> None:
        """Pressure, blocks per format, bytes saved, effective compression (JSON)."""
        _print_json(_call(url, "GET", "/v1/stats"))

    @app.command("alerts")
    def alerts(
        url: UrlOpt = None,
        limit: Annotated[int, typer.Option(min=1, max=1000)] = 20,
    ) -> None:
        """The most recent alerts, oldest first."""
        for a in _call(url, "GET", "/v1/alerts", params={"limit": limit})["alerts"]:
            sys.stdout.write(f"#{a['id']} {a['at']:.0f} [{a['severity']}] {a['kind']}: {a['message']}\n")

    @app.command("fallback")
    def fallback(
        level: Annotated[
            str | None, typer.Argument(help="Level index or name to pin, 'release' to unpin; omit to show.")
        ] = None,
        url: UrlOpt = None,
    ) -> None:
        """Show the fallback ladder, pin it at a level, or release the pin."""
        if level is None:
            body = _call(url, "GET", "/v1/fallback")
        else:
            target: int | str | None = None if level == "release" else (int(level) if level.isdigit() else level)
            body = _call(url, "POST", "/v1/fallback", json={"level": target})
        pin = f", pinned at {body['forced']}" if body["forced"] is not None else ""
        sys.stdout.write(f"level {body['level']} ({body['level_name']}){pin}\n")
