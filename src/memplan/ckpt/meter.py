"""Memory meters: live tensor bytes on CPU (a dispatch mode) and CUDA (allocator statistics).

Both meters answer the same three questions — bytes live now, the peak since the last mark, and
whether a limit was crossed — so the planner, the safety net and the benchmark run unchanged on a
laptop and on a GPU.

* :class:`CpuMeter` counts the bytes of every tensor *storage* that is alive, the way PyTorch's
  ``MemTracker`` does: a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every
  operator's outputs; a new storage is counted once and uncounted by a weak-reference callback
  when it dies. Outputs that alias an input (views, in-place and ``out=`` ops, marked in the
  operator's schema) are skipped, so pre-existing tensors are never double counted. Tensors that
  existed before the meter started are counted only when :meth:`CpuMeter.adopt` is given them.
  With ``limit_bytes`` set, the operator whose output crosses the limit raises
  :class:`OutOfBudgetError` — a simulated out-of-memory at the exact point a GPU would fail.
* :class:`CudaMeter` reads ``torch.cuda.memory_allocated`` / ``max_memory_allocated``; the caching
  allocator raises the real ``torch.OutOfMemoryError``.

Known limitations: the CPU meter counts storage bytes, not allocator blocks (no 512-byte rounding,
no fragmentation); tensors created outside the meter and never adopted are invisible to it.

Example::

    meter = CpuMeter()
    with meter:
        meter.adopt(model.parameters())
        loss = model(x).sum(); loss.backward()
    print(meter.peak_bytes)
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["CpuMeter", "CudaMeter", "MemoryMeter", "OutOfBudgetError", "local_tensors", "make_meter", "storage_bytes",
           "tensor_bytes"]


class OutOfBudgetError(torch.OutOfMemoryError):
    """The CPU meter's live bytes crossed its limit: what a GPU with that much memory would raise."""


class MemoryMeter(Protocol):
    """What the planner and the safety net need from a meter (CPU or CUDA)."""

    #: Raise an out-of-memory error when live bytes exceed this (``None``: never).
    limit_bytes: int | None

    @property
    def active(self) -> bool: ...

    @property
    def current_bytes(self) -> int: ...

    @property
    def peak_bytes(self) -> int: ...

    def __enter__(self) -> MemoryMeter: ...  # noqa: PYI034 (typing.Self needs Python 3.11)

    def __exit__(self, *exc: object) -> None: ...

    def adopt(self, tensors: Iterable[Any]) -> None: ...

    def mark(self) -> int: ...


def local_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding ``t``'s data on this process: ``t`` itself, or for a wrapper subclass
    (a ``DTensor``: its local shard) the tensors it wraps, recursively.

    A wrapper subclass's own ``untyped_storage()`` is a placeholder the size of the *global* tensor
    (for a ``DTensor`` sharded over 2 ranks, twice the bytes this rank holds), owning no memory.
    """
    if type(t) is torch.Tensor or type(t) is nn.Parameter or not is_traceable_wrapper_subclass(t):
        yield t
        return
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    for name in names:
        inner = getattr(t, name)
        if isinstance(inner, torch.Tensor):
            yield from local_tensors(inner)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements held on this process (a ``DTensor``: its local shard)."""
    return sum(x.numel() * x.element_size() for x in local_tensors(t))


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (non-tensors and meta tensors ignored; a
    ``DTensor`` by its local shard)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        for t in local_tensors(tensor):
            if t.device.type != "meta":
                st = t.untyped_storage()
                seen[st._cdata] = st.nbytes()
    return sum(seen.values())


#: Operator namespaces that write into buffers FSDP2 resizes in place: collectives (c10d's, its
#: functional form's) and FSDP2's own copy operators (into the unsharded parameters).
_COLLECTIVES = frozenset({"c10d", "_c10d_functional", "fsdp"})


def _counted_outputs(func: Any) -> tuple[int, ...] | None:
    """Indices of the schema returns that are new storages (not views, in-place or ``out=`` results);
    ``None`` when the callable has no ATen schema (every output is then counted)."""
    try:
        returns = func._schema.returns
    except AttributeError:  # pragma: no cover - non-ATen callables
        return None
    return tuple(i for i, ret in enumerate(returns) if ret.alias_info is None)


class CpuMeter(TorchDispatchMode):
    """Live tensor-storage bytes seen through a dispatch mode; the meter for CPU runs and tests."""

    def __init__(self, *, limit_bytes: int | None = None) -> None:
        super().__init__()
        self.limit_bytes = limit_bytes
        self._live: dict[int, int] = {}
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._current = 0
        self._peak = 0
        self._depth = 0
        self._outputs: dict[Any, tuple[int, ...] | None] = {}  # operator → the returns it counts
        #: storages a collective wrote into: FSDP2 frees and re-allocates them by resizing in place
        self._resizable: set[int] = set()

    # -- reading ---------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether the meter is entered (counting) now."""
        return self._depth > 0

    @property
    def current_bytes(self) -> int:
        """Bytes of counted storages alive now."""
        return self._current

    @property
    def peak_bytes(self) -> int:
        """Highest :attr:`current_bytes` since the last :meth:`mark` (or since creation)."""
        return self._peak

    def mark(self) -> int:
        """Return the peak since the last mark and start a new phase at the current bytes.

        Storages a collective wrote into are re-read first: one FSDP2 freed (resized to 0) since
        stops counting here.
        """
        for key in list(self._resizable):
            st = self._refs[key]() if key in self._refs else None
            if st is None:
                self._resizable.discard(key)
            else:
                self._resize(key, st.nbytes())
        peak, self._peak = self._peak, self._current
        return peak

    def _resize(self, key: int, n: int) -> None:
        self._current += n - self._live[key]
        self._live[key] = n
        self._peak = max(self._peak, self._current)

    # -- counting --------------------------------------------------------------------------
    def adopt(self, tensors: Iterable[Any]) -> None:
        """Count tensors that existed before the meter started (weights, grads, optimizer states, batch)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._count(t, check=False)

    def _count(self, t: torch.Tensor, *, check: bool) -> None:
        if type(t) is not torch.Tensor and type(t) is not nn.Parameter and is_traceable_wrapper_subclass(t):
            for inner in local_tensors(t):  # a DTensor: its local shard, not its global-size placeholder
                self._count(inner, check=check)
            return
        if t.is_meta:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse / opaque tensors own no plain storage
            return
        key = st._cdata
        if key in self._live:
            return
        n = st.nbytes()
        self._live[key] = n
        self._refs[key] = weakref.ref(st, functools.partial(self._forget, key))
        self._current += n
        self._peak = max(self._peak, self._current)
        if check and self.limit_bytes is not None and self._current > self.limit_bytes:
            raise OutOfBudgetError(
                f"CPU meter: {self._current} live bytes exceed the limit of {self.limit_bytes} bytes"
            )

    def forget_all(self) -> None:
        """Stop counting every storage (between steps: the next forward adopts what is live)."""
        if self.active:
            raise RuntimeError("CpuMeter.forget_all: the meter is counting a step")
        self._live.clear()
        self._refs.clear()
        self._resizable.clear()
        self._current = self._peak = 0

    def _forget(self, key: int, _ref: object = None) -> None:
        n = self._live.pop(key, None)
        self._refs.pop(key, None)
        if n is not None:
            self._current -= n

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if getattr(func, "namespace", "") in _COLLECTIVES:
            self._written_by_collective(args, kwargs)
        try:
            counted = self._outputs[func]
        except KeyError:
            counted = self._outputs[func] = _counted_outputs(func)
        if counted == (0,) and isinstance(out, torch.Tensor):  # the common case: one new tensor (fake ones too)
            self._count(out, check=True)
            return out
        if counted == ():  # views, in-place and out= operators: nothing new
            return out
        if counted is None or len(func._schema.returns) == 1:  # no schema, or one return (maybe a list)
            parts = [out]
        else:
            parts = [out[i] for i in counted]
        for t in tree_leaves(parts):
            if isinstance(t, torch.Tensor):
                self._count(t, check=True)
        return out

    def _written_by_collective(self, args: Any, kwargs: Any) -> None:
        """A collective (or FSDP2's copy) writes into buffers passed to it, storages FSDP2 resized up
        (invisible to a dispatch mode): count them at their size now, and re-read them at each mark."""
        for t in tree_leaves((args, kwargs)):
            if not isinstance(t, torch.Tensor):
                continue
            for inner in local_tensors(t):
                if inner.is_meta:
                    continue
                st = inner.untyped_storage()
                key = st._cdata
                if key in self._live:
                    self._resize(key, st.nbytes())
                else:
                    self._count(inner, check=False)
                if key in self._live:
                    self._resizable.add(key)

    def __enter__(self) -> CpuMeter:  # noqa: PYI034
        self._depth += 1
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._depth -= 1


class CudaMeter:
    """The CUDA caching allocator's own statistics behind the :class:`MemoryMeter` interface.

    ``limit_bytes`` is informational here: the allocator raises ``torch.OutOfMemoryError`` itself
    when the device is full; use ``torch.cuda.set_per_process_memory_fraction`` to emulate a
    smaller GPU.
    """

    def __init__(self, device: torch.device | str | int | None = None, *, limit_bytes: int | None = None) -> None:
        self.device = torch.device(device if device is not None else "cuda")
        self.limit_bytes = limit_bytes
        self._depth = 0

    @property
    def active(self) -> bool:
        return self._depth > 0

    @property
    def current_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    @property
    def peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def mark(self) -> int:
        peak = self.peak_bytes
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    def adopt(self, tensors: Iterable[Any]) -> None:
        """Nothing to do: the allocator already knows every tensor on the device."""

    def __enter__(self) -> CudaMeter:  # noqa: PYI034
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1


def make_meter(device: torch.device, *, limit_bytes: int | None = None) -> MemoryMeter:
    """The meter for ``device``: :class:`CudaMeter` on CUDA, :class:`CpuMeter` otherwise."""
    if device.type == "cuda":
        return CudaMeter(device, limit_bytes=limit_bytes)
    return CpuMeter(limit_bytes=limit_bytes)
