"""The benchmark's judge: a live-storage counter over the whole training step, independent of memplan.

:class:`StepMeter` shares no code with :mod:`memplan.ckpt.meter` (the meter the controller plans
with), so a bug there cannot hide itself here. It is a ``TorchDispatchMode`` entered *outside*
everything memplan does — around forward, backward and the optimizer's step — and counts the
distinct storages (keyed by data pointer) of every operator output, aliasing or not, until a
``weakref.finalize`` on the storage says it died. At :meth:`StepMeter.start` it is given what
existed before the step (weights, gradients, optimizer states, the batch), found by walking the
model and the optimizer itself. A tensor subclass wrapping others (FSDP2's ``DTensor`` parameters,
gradients and optimizer states) is counted by the tensors it wraps, this process's shard. A
storage resized in place (FSDP2 frees and re-allocates its all-gathered weights so) is counted at
its new data pointer and size from the next operator that touches it, and from then on re-read
after every operator (a free is seen at the next operator); so is every buffer a collective or
FSDP2's copy operator writes into, from that operator on.

Known limitation, shared with every storage counter: bytes a kernel allocates internally and
frees before returning (workspaces) are invisible; on CPU nothing else can see them either.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["StepMeter"]

#: Operator namespaces whose operators write into buffers FSDP2 resizes in place: collectives and
#: FSDP2's own copies (its all-gathered weights).
_WRITES_RESIZED = ("c10d", "_c10d_functional", "fsdp")


class StepMeter(TorchDispatchMode):
    """Peak live tensor-storage bytes of whole training steps (CPU).

    Example::

        judge = StepMeter()
        with judge:
            judge.start(model, opt, batch)
            model(batch).loss.backward(); opt.step(); opt.zero_grad()
            peak = judge.stop()
    """

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[tuple[int, int], int] = {}
        self._held: dict[int, tuple[int, int]] = {}  # storage → the (data pointer, bytes) counted for it
        self._resized: dict[int, weakref.ref[Any]] = {}  # storages seen resized: re-read after every operator
        self.live_bytes = 0
        self.peak = 0

    def _add(self, t: torch.Tensor) -> None:
        if type(t) is not torch.Tensor and hasattr(type(t), "__tensor_flatten__"):
            # a tensor wrapping others (a DTensor wraps this rank's shard): its own storage is a
            # placeholder holding nothing, so count the tensors inside
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._add(inner)
            return
        if t.device.type == "meta" or t.is_sparse or isinstance(t, FakeTensor):  # a fake tensor owns no memory
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = (storage.data_ptr(), storage.nbytes())
        owner = storage._cdata
        held = self._held.get(owner)
        if held == key or key in self._sizes:
            return
        if held is not None:  # the storage was resized in place since: its old bytes are gone
            self._drop(held)
            self._resized[owner] = weakref.ref(storage)
        else:
            weakref.finalize(storage, self._release, owner)
        if key[1] == 0:
            self._held.pop(owner, None)
            return
        self._held[owner] = key
        self._sizes[key] = key[1]
        self.live_bytes += key[1]
        self.peak = max(self.peak, self.live_bytes)

    def _watch(self, t: torch.Tensor) -> None:
        if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
            storage = t.untyped_storage()
            if storage._cdata in self._held:
                self._resized.setdefault(storage._cdata, weakref.ref(storage))
        elif hasattr(type(t), "__tensor_flatten__"):
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._watch(inner)

    def _recount(self, owner: int, storage: Any) -> None:
        key = (storage.data_ptr(), storage.nbytes()) if storage.nbytes() else (0, 0)
        held = self._held.get(owner)
        if held == key:
            return
        if held is not None:
            self._drop(held)
            self._held.pop(owner)
        if key[1] and key not in self._sizes:
            self._held[owner] = key
            self._sizes[key] = key[1]
            self.live_bytes += key[1]
            self.peak = max(self.peak, self.live_bytes)

    def _release(self, owner: int) -> None:
        key = self._held.pop(owner, None)
        if key is not None:
            self._drop(key)

    def _drop(self, key: tuple[int, int]) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.live_bytes -= size

    def start(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *batch: Any) -> None:
        """Count what exists before the step; the peak restarts at the live bytes."""
        for p in model.parameters():
            self._add(p)
            if p.grad is not None:
                self._add(p.grad)
        for b in model.buffers():
            self._add(b)
        if optimizer is not None:
            for state in optimizer.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        self._add(v)
        for t in tree_leaves(batch):
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = self.live_bytes

    def stop(self) -> int:
        """The peak since :meth:`start`."""
        return self.peak

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if getattr(func, "namespace", "") in _WRITES_RESIZED:
            for t in tree_leaves((args, kwargs, out)):  # the buffers it writes: counted, then re-read
                if isinstance(t, torch.Tensor):
                    self._add(t)
                    self._watch(t)
        if self._resized:  # resizing seen: a storage resized since it was counted may come back as an input
            for t in tree_leaves((args, kwargs)):
                if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
                    storage = t.untyped_storage()
                    if storage._cdata in self._held and storage._cdata not in self._resized:
                        self._resized[storage._cdata] = weakref.ref(storage)
            for owner, ref in list(self._resized.items()):
                storage = ref()
                if storage is None:
                    del self._resized[owner]
                else:
                    self._recount(owner, storage)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out
