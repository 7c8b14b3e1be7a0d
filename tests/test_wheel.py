"""A non-editable install carries what the product reads: the wheel built from this tree holds the
shipped policies and every other package file, so `proxima validate balanced` and `proxima
simulate --policy balanced` work from `pip install .` (checked by hand in a fresh venv too).

The wheel is built from a copy of the tree's package sources (setuptools writes build/ and
*.egg-info next to them), without build isolation so no registry is needed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from proxima.policies import POLICY_DIR, shipped_names

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_carries_the_shipped_policies(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "proxima", src / "proxima", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "wheel"
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    (wheel,) = out.glob("proxima-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    shipped = shipped_names()
    assert {"off", "conservative", "balanced", "aggressive"} <= set(shipped)
    for name in shipped:
        packed = f"proxima/policies/{name}.yaml"
        assert packed in names, f"{wheel.name} lacks {packed}"
        assert zipfile.ZipFile(wheel).read(packed) == (POLICY_DIR / f"{name}.yaml").read_bytes()
    assert "proxima/py.typed" in names
    # Every file of the package is in it (modules and the data they read, e.g. the quality
    # harness's damage model) ...
    sources = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "proxima").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }
    assert sources <= names, f"{wheel.name} lacks {sorted(sources - names)}"
    # ... and nothing from outside the package (tests, bench, configs) rides along.
    assert all(n.startswith(("proxima/", "proxima-")) for n in names), sorted(
        n for n in names if not n.startswith(("proxima/", "proxima-")))
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "proxima = proxima.cli:app" in text and "proxima.integration.vllm.plugin:register" in text
