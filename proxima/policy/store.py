"""The policy store: the one live policy, its versions, atomic swaps, rollback and hot reload.

Readers take `store.current` (one attribute read of an immutable `PolicyVersion`), so a reader
during a swap sees the old or the new policy, never a mix. Writers serialise on a lock, so
versions strictly increase and no concurrent update is lost. A candidate that fails validation
raises `PolicyError` and changes nothing.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from proxima.policy.loader import PolicyError, Problem, clean_loc, field_path, load_policy, parse_policy
from proxima.policy.schema import Policy

MAX_HISTORY = 100


@dataclass(frozen=True)
class PolicyVersion:
    version: int
    policy: Policy
    source: str
    """Where it came from: a file path, 'api:PUT', 'rollback:3', ..."""
    created_at: float
    comment: str = ""


@dataclass(frozen=True)
class Change:
    path: str
    old: Any
    new: Any


def diff(old: Policy, new: Policy) -> list[Change]:
    """Field-level differences between two policies (JSON paths, lists compared whole)."""
    out: list[Change] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                walk(a.get(key), b.get(key), f"{path}.{key}" if path else key)
        elif a != b:
            out.append(Change(path, a, b))

    walk(old.model_dump(mode="json"), new.model_dump(mode="json"), "")
    return out


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _validation_problems(exc: ValidationError, source: str) -> PolicyError:
    problems = [
        Problem(source, None, None, field_path(clean_loc(e["loc"])), e["msg"].removeprefix("Value error, "))
        for e in exc.errors(include_url=False)
    ]
    return PolicyError(problems)


class PolicyStore:
    """Holds the live policy. Thread-safe; cheap to read."""

    def __init__(self, policy: Policy, source: str = "initial", clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        first = PolicyVersion(1, policy, source, clock())
        self._current = first
        self._history: list[PolicyVersion] = [first]
        self._listeners: list[Callable[[PolicyVersion, PolicyVersion], None]] = []

    @classmethod
    def from_file(cls, path: str | Path) -> PolicyStore:
        return cls(load_policy(path), source=str(path))

    @property
    def current(self) -> PolicyVersion:
        return self._current

    @property
    def policy(self) -> Policy:
        return self._current.policy

    def history(self) -> list[PolicyVersion]:
        with self._lock:
            return list(self._history)

    def subscribe(self, listener: Callable[[PolicyVersion, PolicyVersion], None]) -> None:
        """Call `listener(old, new)` after every swap (from the writer's thread)."""
        self._listeners.append(listener)

    def _install(self, policy: Policy, source: str, comment: str) -> tuple[PolicyVersion, list[Change]]:
        # Caller holds the lock.
        old = self._current
        new = PolicyVersion(old.version + 1, policy, source, self._clock(), comment)
        self._current = new
        self._history.append(new)
        del self._history[:-MAX_HISTORY]
        changes = diff(old.policy, policy)
        for listener in self._listeners:
            listener(old, new)
        return new, changes

    def swap(self, policy: Policy, source: str, comment: str = "") -> tuple[PolicyVersion, list[Change]]:
        """Install an already validated policy as a new version."""
        with self._lock:
            return self._install(policy, source, comment)

    def apply_text(self, text: str, source: str, comment: str = "") -> tuple[PolicyVersion, list[Change]]:
        """Validate YAML/JSON text and install it; on error raise `PolicyError`, live policy unchanged."""
        policy = parse_policy(text, source)
        return self.swap(policy, source, comment)

    def apply_data(self, data: Any, source: str, comment: str = "") -> tuple[PolicyVersion, list[Change]]:
        try:
            policy = Policy.model_validate(data)
        except ValidationError as exc:
            raise _validation_problems(exc, source) from None
        return self.swap(policy, source, comment)

    def patch(self, patch: dict[str, Any], source: str, comment: str = "") -> tuple[PolicyVersion, list[Change]]:
        """Apply a JSON merge patch to the live policy, atomically (read-modify-write under the lock)."""
        with self._lock:
            merged = merge_patch(self._current.policy.model_dump(mode="json"), patch)
            try:
                policy = Policy.model_validate(merged)
            except ValidationError as exc:
                raise _validation_problems(exc, source) from None
            return self._install(policy, source, comment)

    def rollback(self, version: int, comment: str = "") -> tuple[PolicyVersion, list[Change]]:
        """Re-install an earlier version's policy as a new version (versions never go backwards)."""
        with self._lock:
            match = next((v for v in self._history if v.version == version), None)
            if match is None:
                known = [v.version for v in self._history]
                raise KeyError(f"no policy version {version} in history (known: {known})")
            return self._install(match.policy, f"rollback:{version}", comment)


@dataclass
class FileWatcher:
    """Hot reload: re-reads a policy file when its content changes; a bad file never replaces the live one.

    Call `poll()` from any loop, or `start()` for a daemon thread polling every `interval_s`.
    """

    store: PolicyStore
    path: Path
    interval_s: float = 2.0
    on_error: Callable[[PolicyError], None] | None = None
    last_error: PolicyError | None = None
    _digest: str = field(default="", init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self._digest = self._read_digest()

    def _read_digest(self) -> str:
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return ""

    def poll(self) -> PolicyVersion | None:
        """Reload if the file changed. Returns the new version, or None (unchanged or rejected)."""
        digest = self._read_digest()
        if not digest or digest == self._digest:
            return None
        self._digest = digest
        try:
            version, _ = self.store.apply_text(self.path.read_text(encoding="utf-8"), str(self.path), "hot reload")
        except PolicyError as exc:
            self.last_error = exc
            if self.on_error:
                self.on_error(exc)
            return None
        self.last_error = None
        return version

    def start(self) -> threading.Thread:
        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                self.poll()

        t = threading.Thread(target=loop, name="proxima-policy-watch", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self._stop.set()
