"""Count what one piece of product code dispatches: torch ops, kernel launches, would-be GPU syncs.

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
`.to(cuda)` is a no-op on CPU. The GPU run (`torch.cuda.set_sync_debug_mode("error")`) catches
those; `bench/step_ops.py --device cuda` runs it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


def _host_work_hooks(stack: contextlib.ExitStack, counts: Counts) -> None:
    try:
        from proxima.integration.vllm.worker.store import WorkerStore
    except ImportError:
        return
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
    try:
        from proxima.integration.vllm.worker import store
    except ImportError:
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
