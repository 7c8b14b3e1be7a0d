"""Hostile or broken policies, from every entry point (issue 12, section 2).

One table of policy files, each fed to every entry point that reads a policy: the loader,
`proxima validate`, `proxima simulate`, `proxima serve` (its check before vLLM starts),
`proxima api serve` (at startup), `PUT /v1/policy` with a YAML body, and the `--watch` reloader.
JSON bodies (`PUT`/`PATCH /v1/policy`, rollback, fallback) have their own table. Every case must
give a clear message naming the file and line (CLI: exit 2, no traceback) or the field path (API:
a 4xx, never 500), finish well within a generous timeout (before the reading layer existed the
alias bomb took 88 s and the 50 MB file 210-300 s and over 6 GiB), and leave the live policy as
it was.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

import proxima.api.server as api_server
from proxima.api.auth import TokenSource
from proxima.api.server import SimulatedServer, simulated
from proxima.cli import app
from proxima.policy.loader import PolicyError, load_policy
from proxima.policy.reader import MAX_DEPTH, MAX_POLICY_BYTES
from proxima.policy.store import FileWatcher

ROOT = Path(__file__).resolve().parents[1]
BALANCED = (ROOT / "proxima" / "policies" / "balanced.yaml").read_text()
TOKEN = "hostile-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TIMEOUT_S = 30.0
"""Generous: every case takes well under a second here; without the limits, minutes."""
PEAK_BYTES = 16 << 20
"""Memory the loader may allocate for any case (the 50 MB file must not be read)."""
runner = CliRunner()

T = TypeVar("T")


def within(seconds: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run `fn` on a thread and fail if it has not returned after `seconds` (a bound, not a speed test)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # re-raised in the caller's thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} did not finish within {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]  # type: ignore[no-any-return]


def _line_of(text: str, start: str, occurrence: int = 1) -> int:
    """The line number of the `occurrence`-th line that starts with `start`."""
    lines = [i for i, ln in enumerate(text.splitlines(), 1) if ln.startswith(start)]
    return lines[occurrence - 1]


def _alias_bomb() -> str:
    """A "billion laughs": 9 levels of 9 aliases each, about 9**9 values once expanded."""
    levels = ['  a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    names = "abcdefghi"
    for prev, name in itertools.pairwise(names):
        levels.append(f"  {name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    return BALANCED + "\ndamage:\n  table:\n" + "\n".join(levels) + "\n"


@dataclass(frozen=True)
class FileCase:
    id: str
    message: str
    """A substring every entry point's message must contain."""
    line: int | None
    """The line the message must name (None: no line, e.g. the size limit)."""
    status: int
    """The HTTP status of the same text sent as a YAML body to PUT /v1/policy."""
    text: bytes = b""
    field: str = ""
    """The field path the API reports, when the problem is one field's."""


BOMB = _alias_bomb()
DUPLICATE = BALANCED + "\nenabled: false\nenabled: true\n"
BOOL_INT = BALANCED.replace("max_blocks_per_step: 1024", "max_blocks_per_step: true")
RECURSIVE = BALANCED + "damage:\n  table: &t {int8: *t}\n"
NEGATIVE = BALANCED.replace("max_blocks_per_step: 1024", "max_blocks_per_step: -1")
FILE_CASES = [
    FileCase("alias-bomb", "expands the policy past", None, 400, BOMB.encode()),
    FileCase("50MB", f"policy text is limited to {MAX_POLICY_BYTES} bytes; this one is 52428800 bytes", None, 413),
    FileCase("yaml-500-deep", f"nested more than {MAX_DEPTH} levels deep", 1, 400,
             ("bands: " + "[" * 500 + "]" * 500 + "\n").encode()),
    FileCase("json-1000-deep", f"nested more than {MAX_DEPTH} levels deep", 1, 400,
             ('{"bands": ' + "[" * 1000 + "]" * 1000 + "}\n").encode()),
    FileCase("non-utf8", "not UTF-8: byte 0xe9 at line 5, column 13", 5, 400,
             BALANCED.replace("name: balanced", "name: balanc\u00e9").encode("latin-1")),
    FileCase("nul-byte", "character #x0000 is not allowed", 5, 400,
             BALANCED.replace("name: balanced", "name: bal\x00anced").encode()),
    FileCase("recursive-alias", "refers to a node that contains it", _line_of(RECURSIVE, "  table: &t"), 400,
             RECURSIVE.encode()),
    FileCase("duplicate-key", "duplicate key 'enabled' (first at line", _line_of(DUPLICATE, "enabled:", 2), 422,
             DUPLICATE.encode(), "enabled"),
    FileCase("true-as-integer", "Input should be a valid integer", _line_of(BOOL_INT, "  max_blocks_per_step"), 422,
             BOOL_INT.encode(), "budget.max_blocks_per_step"),
    FileCase("invalid-value", "greater than or equal to 1", _line_of(NEGATIVE, "  max_blocks_per_step"), 422,
             NEGATIVE.encode(), "budget.max_blocks_per_step"),
]


@pytest.fixture(scope="module")
def policy_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hostile")
    paths = {}
    for case in FILE_CASES:
        path = folder / f"{case.id}.yaml"
        with path.open("wb") as f:
            if case.id == "50MB":  # valid YAML all the way (one long comment), written in chunks
                chunk = b"# " + b"x" * ((1 << 20) - 3) + b"\n"
                for _ in range(50):
                    f.write(chunk)
            else:
                f.write(case.text)
        paths[case.id] = path
    assert paths["50MB"].stat().st_size == 50 * (1 << 20)
    return paths


def _assert_located(output: str, path: Path, case: FileCase) -> None:
    assert "Traceback" not in output, output
    assert case.message in output, output
    if case.line is not None:
        assert re.search(rf"{re.escape(str(path))}:{case.line}:\d+:", output), output
    else:
        assert f"{path}:" in output, output


# -- the loader -----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", FILE_CASES, ids=lambda c: c.id)
def test_loader(case: FileCase, policy_files: dict[str, Path]) -> None:
    path = policy_files[case.id]
    tracemalloc.start()
    try:
        with pytest.raises(PolicyError) as info:
            within(TIMEOUT_S, load_policy, path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    _assert_located(str(info.value), path, case)
    assert peak < PEAK_BYTES, f"the loader allocated {peak / 2**20:.1f} MiB"


def test_loader_stops_reading_an_endless_file() -> None:
    with pytest.raises(PolicyError, match="is longer than that"):
        within(TIMEOUT_S, load_policy, "/dev/zero")


# -- the CLI: validate, simulate, serve (before vLLM starts), api serve (at startup) ---------------
@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards, not stand-ins: if a command wrongly accepted a bad policy, fail instead of serving."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a server was started with a bad policy")

    monkeypatch.setattr("os.execvpe", refuse)
    monkeypatch.setattr(api_server, "serve", refuse)


COMMANDS = {
    "validate": lambda p: ["validate", str(p)],
    "simulate": lambda p: ["simulate", "--policy", str(p), "--requests", "4"],
    "serve": lambda p: ["serve", "--model", "unused-model", "--policy", str(p)],
    "api-serve": lambda p: ["api", "serve", "--simulate", "--policy", str(p), "--port", "1"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("case", FILE_CASES, ids=lambda c: c.id)
def test_cli(case: FileCase, command: str, policy_files: dict[str, Path], no_server: None) -> None:
    path = policy_files[case.id]
    res = within(TIMEOUT_S, runner.invoke, app, COMMANDS[command](path), env={"PROXIMA_API_TOKEN": TOKEN})
    assert res.exit_code == 2, res.output
    _assert_located(res.output, path, case)


# -- the API -------------------------------------------------------------------------------------
@pytest.fixture
def server() -> Iterator[SimulatedServer]:
    srv = simulated(
        load_policy(ROOT / "proxima" / "policies" / "balanced.yaml"),
        tokens=TokenSource(None, "PROXIMA_API_TOKEN", environ={"PROXIMA_API_TOKEN": TOKEN}.get),
        registry=CollectorRegistry(),
    )
    yield srv
    srv.controller.stop()


@pytest.fixture
def client(server: SimulatedServer) -> Iterator[TestClient]:
    with TestClient(server.app) as c:
        yield c


def _live(client: TestClient) -> tuple[int, dict[str, Any]]:
    body = client.get("/v1/policy").json()
    return body["version"], body["policy"]


@pytest.mark.parametrize("case", FILE_CASES, ids=lambda c: c.id)
def test_api_put_yaml(case: FileCase, policy_files: dict[str, Path], client: TestClient) -> None:
    before = _live(client)
    body = policy_files[case.id].read_bytes()
    headers = {**AUTH, "Content-Type": "application/yaml"}
    r = within(TIMEOUT_S, client.put, "/v1/policy", content=body, headers=headers)
    assert r.status_code == case.status, r.text
    err = r.json()
    if case.id == "50MB":  # refused from Content-Length by the body limit, before any reading
        assert "api.max_body_bytes" in err["error"]
    else:
        [problem] = err["problems"]
        assert case.message in problem["message"], err
        assert problem["field"] == case.field
        if case.line is not None:
            assert problem["line"] == case.line, err
    assert _live(client) == before


def test_api_reader_limit_applies_when_the_body_limit_is_higher(client: TestClient) -> None:
    r = client.patch("/v1/policy", json={"api": {"max_body_bytes": 4 << 20}}, headers=AUTH)
    assert r.status_code == 200
    before = _live(client)
    text = BALANCED + "# " + "x" * MAX_POLICY_BYTES + "\n"
    r = within(TIMEOUT_S, client.put, "/v1/policy", content=text, headers={**AUTH, "Content-Type": "text/yaml"})
    assert r.status_code == 413 and f"limited to {MAX_POLICY_BYTES} bytes" in r.json()["problems"][0]["message"]
    r = client.patch("/v1/policy", content=json.dumps({"description": "x" * MAX_POLICY_BYTES}), headers=AUTH)
    assert r.status_code == 413
    assert _live(client) == before


@dataclass(frozen=True)
class JsonCase:
    id: str
    method: str
    path: str
    body: bytes
    status: int
    field: str
    message: str


DEEP_JSON = ('{"description": ' + "[" * 1000 + "]" * 1000 + "}").encode()
JSON_CASES = [
    JsonCase("put-1000-deep", "PUT", "/v1/policy", DEEP_JSON, 400, "", f"nested more than {MAX_DEPTH} levels"),
    JsonCase("patch-1000-deep", "PATCH", "/v1/policy", DEEP_JSON, 400, "", f"nested more than {MAX_DEPTH} levels"),
    JsonCase("rollback-1000-deep", "POST", "/v1/policy/rollback", b'{"version": ' + b"[" * 1000 + b"]" * 1000 + b"}",
             400, "", "nested more than"),
    JsonCase("patch-duplicate", "PATCH", "/v1/policy", b'{"enabled": false, "enabled": true}', 422, "enabled",
             "duplicate key 'enabled'"),
    JsonCase("patch-nested-duplicate", "PATCH", "/v1/policy",
             b'{"budget": {"max_blocks_per_step": 1, "max_blocks_per_step": 2}}', 422, "budget.max_blocks_per_step",
             "duplicate key"),
    JsonCase("patch-non-utf8", "PATCH", "/v1/policy", b'{"description": "caf\xe9"}', 400, "",
             "not UTF-8: byte 0xe9 at line 1, column 21"),
    JsonCase("patch-true-as-integer", "PATCH", "/v1/policy", b'{"budget": {"max_blocks_per_step": true}}', 422,
             "budget.max_blocks_per_step", "valid integer"),
    JsonCase("patch-true-as-number", "PATCH", "/v1/policy", b'{"fallback": {"cooldown_s": true}}', 422,
             "fallback.cooldown_s", "valid number"),
    JsonCase("patch-1-as-bool", "PATCH", "/v1/policy", b'{"enabled": 0}', 422, "enabled", "valid boolean"),
    JsonCase("rollback-true", "POST", "/v1/policy/rollback", b'{"version": true}', 422, "version", "valid integer"),
    JsonCase("fallback-true", "POST", "/v1/fallback", b'{"level": true}', 422, "level",
             "must be a level index (integer), a level name (string) or null, not a boolean"),
    JsonCase("fallback-duplicate", "POST", "/v1/fallback", b'{"level": 1, "level": null}', 422, "level",
             "duplicate key"),
]


@pytest.mark.parametrize("case", JSON_CASES, ids=lambda c: c.id)
def test_api_json(case: JsonCase, client: TestClient) -> None:
    before = _live(client), client.get("/v1/fallback").json()
    headers = {**AUTH, "Content-Type": "application/json"}
    r = within(TIMEOUT_S, client.request, case.method, case.path, content=case.body, headers=headers)
    assert r.status_code == case.status, r.text
    problems = r.json()["problems"]
    assert any(p["field"] == case.field and case.message in p["message"] for p in problems), r.text
    assert (_live(client), client.get("/v1/fallback").json()) == before


# -- --watch ------------------------------------------------------------------------------------
def _watched(tmp_path: Path) -> tuple[SimulatedServer, Path, FileWatcher]:
    path = tmp_path / "live.yaml"
    path.write_text(BALANCED)
    srv = simulated(load_policy(path), source=str(path), registry=CollectorRegistry())
    watcher = FileWatcher(srv.controller.store, path, on_error=srv.controller.policy_file_refused)
    return srv, path, watcher


@pytest.mark.parametrize("case", FILE_CASES, ids=lambda c: c.id)
def test_watch_reports_then_takes_the_next_valid_edit(
    case: FileCase, policy_files: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    srv, path, watcher = _watched(tmp_path)
    path.write_bytes(policy_files[case.id].read_bytes())
    with caplog.at_level(logging.WARNING, logger="proxima.policy.watch"):
        assert within(TIMEOUT_S, watcher.poll) is None
    assert srv.controller.store.current.version == 1
    assert case.message in caplog.text and str(path) in caplog.text
    [alert] = srv.controller.alerts.recent()
    assert alert.kind == "policy_reload_refused" and alert.severity == "warning"
    assert str(path) in alert.message and case.message in alert.message
    assert watcher.poll() is None and len(srv.controller.alerts.recent()) == 1  # reported once per change
    path.write_text(BALANCED.replace("max_blocks_per_step: 1024", "max_blocks_per_step: 77"))
    version = watcher.poll()
    assert version is not None and version.version == 2
    assert srv.controller.store.policy.budget.max_blocks_per_step == 77


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_watch_thread_survives_bad_files(tmp_path: Path, policy_files: dict[str, Path]) -> None:
    """The issue's failure: after a non-UTF-8 or deeply nested file, reloading stopped for good."""
    srv, path, watcher = _watched(tmp_path)
    watcher.interval_s = 0.02
    thread = watcher.start()
    try:
        for n, case_id in enumerate(("non-utf8", "yaml-500-deep", "alias-bomb"), 1):
            path.write_bytes(policy_files[case_id].read_bytes())
            _wait_for(lambda n=n: len(srv.controller.alerts.recent()) == n, f"alert {n} ({case_id})")
            assert srv.controller.store.current.version == 1
        path.write_text(BALANCED.replace("max_blocks_per_step: 1024", "max_blocks_per_step: 77"))
        _wait_for(lambda: srv.controller.store.current.version == 2, "the valid edit")
        assert thread.is_alive()
    finally:
        watcher.stop()
        thread.join(5)
