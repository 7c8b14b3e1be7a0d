"""A child process whose whole process group ends with the call that started it.

Benchmarks and harnesses start one vLLM engine per row in a child process; an engine starts
processes of its own (`VLLM::EngineCore`, `VLLM::Worker`). A plain `subprocess.run` kills only
the direct child on a timeout, and nothing when the parent itself is sent SIGTERM, so an
engine could outlive its benchmark and keep CPU cores or the GPU busy under the next one (seen:
a capacity run's tokens/s skewed by an orphaned worker at 30% CPU). The quality harness's
engines and the CPU capacity rows run one child at a time through `run_logged`; the GPU
capacity rows, several side by side, keep a group per row the same way
(`bench/capacity_rows.py's `_kill_session``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path


def run_logged(cmd: Sequence[str], env: dict[str, str], timeout_s: float, log_path: Path) -> int:
    """Run `cmd` with its stdout and stderr going to `log_path` as it runs (Python children
    unbuffered), so a child that is killed or runs past `timeout_s` still leaves what it printed.
    Returns the child's exit status.

    The child leads a process group of its own, and nothing of that group outlives this call:
    whether the child exits, runs past its timeout, or this process is interrupted or sent
    SIGTERM (as `timeout` does to a benchmark), the whole group is killed, so an engine's own
    processes never keep the GPU after the call. Being in its own group, the child does not
    receive a signal sent to ours: SIGTERM is turned into SystemExit here while the child runs
    (main thread only; Python's default would end this process without cleaning up)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as fh:
        proc = subprocess.Popen(list(cmd), env={**env, "PYTHONUNBUFFERED": "1"}, stdin=subprocess.DEVNULL,
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        previous = _exit_on_sigterm()
        try:
            return proc.wait(timeout=timeout_s)
        finally:
            with contextlib.suppress(ProcessLookupError):  # (the group is gone already)
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if previous is not _NOT_SET:
                # None: a handler installed from C, which Python cannot name; the default then
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


_NOT_SET = object()
"""`_exit_on_sigterm` set no handler (not the main thread): nothing to restore."""


def _exit_on_sigterm():  # type: ignore[no-untyped-def]
    """Make SIGTERM raise SystemExit(143) in this process; returns the previous handler to restore
    (`signal.signal`'s answer: None for one installed from C), or `_NOT_SET` when not on the main
    thread, where handlers cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        return _NOT_SET

    def _raise(signum, frame):  # type: ignore[no-untyped-def]
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, _raise)
