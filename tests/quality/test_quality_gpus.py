"""`bench/quality_gpus.sh` in its dry run (`DRY_RUN=1`, `GPUS=N`): what it would launch on how
many GPUs, and how many files it would leave in OUT (the run tool brings 8 back)."""

from __future__ import annotations

import os
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "quality_gpus.sh"


def _dry(tmp_path: Path, gpus: int, **env: str) -> tuple[subprocess.CompletedProcess[str], list[tuple[int, str]]]:
    full = {**os.environ, "DRY_RUN": "1", "GPUS": str(gpus), "PX_MODEL": "/models/smollm2", **env}
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], env=full, capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    launched = [(int(m[1]), m[2]) for m in re.finditer(r"^launch: CUDA_VISIBLE_DEVICES=(\d+) .*?bench/(\w+)\.py",
                                                        proc.stdout, re.M)]
    return proc, launched


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
@pytest.mark.parametrize("with_vllm", ["0", "1"])
def test_one_process_per_gpu_and_at_most_8_files(tmp_path: Path, gpus: int, with_vllm: str) -> None:
    proc, launched = _dry(tmp_path, gpus, WITH_VLLM=with_vllm)
    assert proc.returncode == 0, proc.stderr
    shards = [g for g, what in launched if what == "quality"]
    vllm = [g for g, what in launched if what == "quality_vllm"]
    assert len(vllm) == int(with_vllm)
    assert len(shards) + len(vllm) + 1 <= 8  # s<i>.json each, vllm.json, logs.tar.gz
    assert all(0 <= g < gpus for g, _ in launched)
    if gpus > 1:  # one process per GPU, vLLM on the last; every GPU busy unless the files forbid it
        assert max(Counter(g for g, _ in launched).values()) == 1 and vllm in ([], [gpus - 1])
        assert len(launched) == min(gpus, 7)  # (7 processes: 7 or 6 JSONs + vllm.json, and the logs)
        assert "lowered" not in proc.stderr  # the default needs no lowering
    else:  # one GPU: three shards share it (host-bound), as docs/quality.md runs them
        assert len(shards) == 3
    assert f"--shard {len(shards) - 1}/{len(shards)} " in proc.stdout if shards else True
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_more_shards_than_gpus_are_lowered(tmp_path: Path) -> None:
    proc, launched = _dry(tmp_path, 8, SHARDS="8", WITH_VLLM="1")
    assert proc.returncode == 0 and "8 shards lowered to 6" in proc.stderr
    assert len(launched) == 7 and len({g for g, _ in launched}) == 7
    proc, launched = _dry(tmp_path, 4, SHARDS="4", WITH_VLLM="1")
    assert "lowered to 3" in proc.stderr and sorted(g for g, _ in launched) == [0, 1, 2, 3]
    proc, launched = _dry(tmp_path, 4, SHARDS="2", WITH_VLLM="1")  # fewer than the GPUs: as asked
    assert proc.returncode == 0 and "lowered" not in proc.stderr and len(launched) == 3


def test_nothing_to_run_and_bad_settings_are_refused(tmp_path: Path) -> None:
    proc, launched = _dry(tmp_path, 1, SHARDS="0", WITH_VLLM="0")
    assert proc.returncode == 2 and "nothing to run" in proc.stderr and not launched
    proc, launched = _dry(tmp_path, 1, SHARDS="0", WITH_VLLM="1")  # vLLM alone: an empty shard list is fine
    assert proc.returncode == 0 and [w for _, w in launched] == ["quality_vllm"]
    for env in ({"SHARDS": "two"}, {"WITH_VLLM": "yes"}):
        proc, _ = _dry(tmp_path, 2, **env)
        assert proc.returncode == 2 and "quality_gpus.sh:" in proc.stderr


def test_the_script_parses_and_guards_its_array_expansions() -> None:
    """`bash -n`, and no bare `"${a[@]}"`: under `set -u`, bash before 4.4 calls an empty array
    unbound (`${a[@]+"${a[@]}"}` expands to nothing instead)."""
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    text = SCRIPT.read_text()
    for m in re.finditer(r'"\$\{(\w+)\[@\]\}"', text):
        assert text[max(0, m.start() - len(m[1]) - 6): m.start()] == "${" + m[1] + "[@]+", m[0]
