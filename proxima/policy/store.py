"""The policy store: the one live policy, its versions, atomic swaps, rollback and hot reload.

Readers take `store.current` (one attribute read of an immutable `PolicyVersion`), so a reader
during a swap sees the old or the new policy, never a mix. Writers serialise on a lock, so
versions strictly increase and no concurrent update is lost. A candidate that fails validation
raises `PolicyError` and changes nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from proxima.policy.loader import PolicyError, Problem, clean_loc, field_path, load_policy, parse_policy
from proxima.policy.reader import ReadError, read_bounded
from proxima.policy.schema import Policy

MAX_HISTORY = 100
log = logging.getLogger("proxima.policy.watch")


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
        self.requirements: Callable[[Policy, str], list[Problem]] | None = None
        """What the engine behind this store cannot do: the problems of a candidate policy (e.g. a
        drift probe in an engine without its observer). A candidate with any is refused, as an
        invalid one (`PolicyError`); the first version is not checked (the engine started with it)."""

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
        problems = self.requirements(policy, source) if self.requirements is not None else []
        if problems:
            raise PolicyError(problems)
        old = self._current
        was, now = old.policy.storage, policy.storage
        if now != was:
            # Stored slots and their side tables are laid out for the start-up group sizes.
            if now.group_size != was.group_size:
                field, old_v, new_v = "storage.group_size", str(was.group_size), str(now.group_size)
            else:
                field, old_v, new_v = "storage.group_sizes", str(was.group_sizes), str(now.group_sizes)
            msg = f"is fixed while serving: {old_v} at start-up, got {new_v}; restart to change it"
            raise PolicyError([Problem(source, None, None, field, msg)])
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

    def apply_text(self, text: str | bytes, source: str, comment: str = "") -> tuple[PolicyVersion, list[Change]]:
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
    A refused file is logged and passed to `on_error` (the API raises an alert) once per
    change; polling goes on, so the next valid edit is installed. Whatever one poll raises, the
    thread survives it: a watcher that stops silently would leave an operator editing a file
    that no longer reaches the engine.
    """

    store: PolicyStore
    path: Path
    interval_s: float = 2.0
    on_error: Callable[[PolicyError], None] | None = None
    last_error: PolicyError | None = None
    _digest: str = field(default="", init=False)
    """What the last poll saw: the content's SHA-256, or a description of why it could not be read."""
    _stop: threading.Event = field(default_factory=threading.Event, init=False)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        with contextlib.suppress(OSError, ReadError):
            self._digest = hashlib.sha256(read_bounded(self.path)).hexdigest()

    def poll(self) -> PolicyVersion | None:
        """Reload if the file changed. Returns the new version, or None (unchanged or rejected)."""
        try:
            # Read whole on every poll (at most the size limit): comparing contents, not mtimes,
            # never misses an edit that lands within the file system's timestamp granularity.
            data = read_bounded(self.path)
        except OSError:
            return None  # missing (an editor's rename in progress): the next poll sees the new file
        except ReadError as exc:  # too large: refused before reading, reported once per change
            seen = f"unread: {exc.message}"  # the message names the size
            if seen != self._digest:
                self._digest = seen
                self._refuse(PolicyError([Problem(str(self.path), None, None, "", exc.message)], reason=exc.kind))
            return None
        digest = hashlib.sha256(data).hexdigest()
        if digest == self._digest:
            return None
        self._digest = digest
        try:
            version, _ = self.store.apply_text(data, str(self.path), "hot reload")
        except PolicyError as exc:
            self._refuse(exc)
            return None
        self.last_error = None
        log.info("policy %s reloaded as version %d", self.path, version.version)
        return version

    def _refuse(self, exc: PolicyError) -> None:
        self.last_error = exc
        log.warning(
            "policy file refused, the live policy stays at version %d:\n%s", self.store.current.version, exc
        )
        if self.on_error:
            self.on_error(exc)

    def start(self) -> threading.Thread:
        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                try:
                    self.poll()
                except Exception:  # a bug, not a bad file (those are PolicyErrors): say so, keep watching
                    log.exception("policy watcher: reloading %s failed; still watching", self.path)

        t = threading.Thread(target=loop, name="proxima-policy-watch", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self._stop.set()
