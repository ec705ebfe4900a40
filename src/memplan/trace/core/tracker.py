"""The tracker: a ``FakeTensorMode`` that records every storage its operators create.

Fake tensors have no data but exact sizes, so a training step of any model runs in seconds and in
almost no memory. :class:`TracingFakeMode` is PyTorch's ``FakeTensorMode`` with one addition: after
each top-level operator it hands the storages of the outputs to an
:class:`~memplan.trace.core.recorder.AllocationRecorder`. Because the fake mode sits at the bottom of
the dispatch stack, it also sees the operators that tensor subclasses (DTensor) and FSDP run on
local shards. ``UntypedStorage.resize_`` (which FSDP2 uses to free and re-allocate unsharded
parameters) does not dispatch, so :func:`track_resize` patches it while a trace runs.

Only storages a real rank allocates are recorded. DTensor's sharding propagation
(``ShardingPropagator._propagate_tensor_meta_non_cached`` in
``torch/distributed/tensor/_sharding_prop.py``) derives an operator's global output shape by
re-running it on *global-shape* placeholders (``OpSchema.gen_fake_args``) inside whichever fake
mode is active; on a real rank that is a throwaway ``FakeTensorMode`` that allocates nothing, in a
trace it is this mode. :func:`unrecorded_sharding_propagation` pauses recording while it runs.

:class:`ModulePath` follows the running module (forward hooks, and multi-grad hooks for the
backward) and reports the innermost module's dotted path.

Autograd's backward formulas take another path for "tensor-subclass-like" tensors, and any active
dispatch mode makes every tensor so (``isTensorSubclassLike`` in ``ATen/TensorSubclassLikeUtils.h``).
One of them changes memory: ``index_backward`` (``FunctionsManual.cpp``, the gradient of ``x[idx]``)
makes zeros and accumulates into them in place (``_index_put_impl_``) on plain tensors, but returns a
new tensor (``index_put``) under a mode. :meth:`TracingFakeMode.dispatch` runs such an ``index_put``
(the backward's, accumulating into the zeros ``new_zeros`` has just made) in place, as an eager
run does.

Known limitations: allocations made inside a kernel (workspaces) are invisible, as are storages
created outside the dispatcher (``torch.from_numpy``); see docs/trace.md.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Self

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from memplan.categories import MemoryCategory
from memplan.trace.core.recorder import COLLECTIVE, AllocationRecorder

__all__ = ["ModulePath", "TracingFakeMode", "track_resize", "unrecorded_sharding_propagation"]

_COMMUNICATION = MemoryCategory.COMMUNICATION.value
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d", "fsdp", "_dtensor")
#: Functional collectives (DTensor's redistributions): their outputs may be kept for the backward.
_FUNCTIONAL_COLLECTIVES = "_c10d_functional"


class TracingFakeMode(FakeTensorMode):
    """``FakeTensorMode`` that reports each new output storage to ``recorder`` (when set)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.recorder: AllocationRecorder | None = None
        self._depth = 0
        self._paused = 0
        self._zeros: weakref.ref[torch.Tensor] | None = None

    @contextmanager
    def unrecorded(self) -> Iterator[None]:
        """Run operators in this mode without recording their outputs (they are not a rank's memory)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # ``dispatch`` (called by FakeTensorMode.__torch_dispatch__) is overridden rather than
        # ``__torch_dispatch__``, which TorchDispatchMode wraps once more per subclass.
        recorder = self.recorder
        if recorder is None or self._depth or self._paused:
            self._depth += 1
            try:
                return super().dispatch(func, types, args, kwargs)
            finally:
                self._depth -= 1
        func = self._eager_index_backward(func, args, kwargs, recorder.phase)
        op = f"{func.namespace}.{func.__name__}" if hasattr(func, "namespace") else str(func)
        recorder.op = op
        self._depth = 1
        try:
            out = super().dispatch(func, types, args, kwargs)
        except Exception as exc:
            if not hasattr(exc, "memplan_where"):
                exc.memplan_where = (op, recorder.module_of())  # type: ignore[attr-defined]
            raise
        finally:
            self._depth = 0
        if out is not NotImplemented:
            namespace = getattr(func, "namespace", "")
            role = (COLLECTIVE if namespace == _FUNCTIONAL_COLLECTIVES
                    else _COMMUNICATION if namespace in _COLLECTIVE_NAMESPACES else None)
            for tensor in _tensors(out):
                storage = tensor.untyped_storage()
                recorder.see(storage, op)
                if role is not None:
                    recorder.mark(storage, role)
        recorder.op = ""
        fresh = func is torch.ops.aten.new_zeros.default and isinstance(out, torch.Tensor)
        self._zeros = weakref.ref(out) if fresh else None
        return out

    def _eager_index_backward(self, func: Any, args: Any, kwargs: Any, phase: str) -> Any:
        """``aten.index_put_`` for the out-of-place ``index_put`` that ``index_backward`` runs under a mode.

        Only in the backward, accumulating, into the tensor the operator just before made with ``new_zeros``:
        on plain tensors the formula accumulates into those zeros in place (module docstring).
        """
        if func is not torch.ops.aten.index_put.default or phase != "backward" or self._zeros is None:
            return func
        accumulate = args[3] if len(args) > 3 else (kwargs or {}).get("accumulate", False)
        return torch.ops.aten.index_put_.default if accumulate and args[0] is self._zeros() else func


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (tuple, list)):
                yield from _tensors(item)


@contextmanager
def track_resize(recorder: AllocationRecorder) -> Iterator[None]:
    """Record ``UntypedStorage.resize_`` calls (FSDP2's unsharded parameters) while inside.

    FSDP2 allocates a parameter's unsharded storage with ``torch.empty`` the first time
    (``FSDPParam.init_all_gather_outputs``) and by ``resize_`` afterwards; both become
    ``communication`` once ``FSDPParam.alloc_all_gather_outputs`` has run, or, at one rank (where
    ``FSDPParamGroup.wait_for_unshard`` copies the shard into them without that call), once
    ``init_all_gather_outputs`` has.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    original = torch.UntypedStorage.resize_
    original_alloc = FSDPParam.alloc_all_gather_outputs
    original_init = FSDPParam.init_all_gather_outputs

    def resize_(storage: Any, size: int) -> Any:
        result = original(storage, size)
        recorder.resized(storage, int(size), _COMMUNICATION)
        return result

    def alloc_all_gather_outputs(fsdp_param: Any) -> None:
        original_alloc(fsdp_param)
        for tensor in fsdp_param.all_gather_outputs:
            recorder.mark(tensor.untyped_storage(), _COMMUNICATION)

    def init_all_gather_outputs(fsdp_param: Any, *args: Any, **kwargs: Any) -> None:
        original_init(fsdp_param, *args, **kwargs)
        for tensor in fsdp_param.all_gather_outputs:
            if tensor.untyped_storage().nbytes():
                recorder.mark(tensor.untyped_storage(), _COMMUNICATION)

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
    FSDPParam.alloc_all_gather_outputs = alloc_all_gather_outputs  # type: ignore[method-assign]
    FSDPParam.init_all_gather_outputs = init_all_gather_outputs  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]
        FSDPParam.alloc_all_gather_outputs = original_alloc  # type: ignore[method-assign]
        FSDPParam.init_all_gather_outputs = original_init  # type: ignore[method-assign]


@contextmanager
def unrecorded_sharding_propagation() -> Iterator[None]:
    """Pause the active :class:`TracingFakeMode` while DTensor propagates tensor metadata.

    ``_propagate_tensor_meta_non_cached`` builds one full-size placeholder per DTensor argument
    and runs the operator on them to learn the global output shape: for a foreach optimizer step
    over FSDP-sharded parameters that is several copies of the whole unsharded model, none of
    which exists on a real rank (there the placeholders live in a private ``FakeTensorMode``).
    """
    from torch._guards import detect_fake_mode
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self: ShardingPropagator, op_schema: Any) -> Any:
        mode = detect_fake_mode()  # the mode the original runs its placeholders in
        if not isinstance(mode, TracingFakeMode):
            return original(self, op_schema)
        with mode.unrecorded():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


class ModulePath:
    """The dotted path of the innermost module running now, forward or backward.

    Paths are relative to the root module (the root itself is ``""``), as in
    ``model.named_modules()``: the deepest entered module on the line of the most recently entered
    one. The forward is followed with global module hooks; the backward with
    ``register_multi_grad_hook(mode="any")``: a module's backward starts at the first gradient of
    one of its outputs and ends at the first gradient of one of its inputs.

    This is PyTorch's ``ModTracker`` idea without its one cost to a memory trace: ``ModTracker``
    ends a module's backward with an ``"all"``-mode hook, which keeps each input gradient (and the
    input's autograd node) in a buffer until the gradients of every input have arrived, so that a
    trace with it carries gradients a real step has already freed (a DoRA layer's, a recomputed
    block's). Nothing here holds a tensor.
    """

    def __init__(self) -> None:
        self._names: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self._active: Counter[str] = Counter()
        self._backward_task: int | None = None
        self._handles: list[Any] = []

    def __enter__(self) -> Self:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._handles = [register_module_forward_pre_hook(self._pre_forward),
                         register_module_forward_hook(self._post_forward, always_call=True)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._active.clear()

    def __call__(self) -> str:
        if not self._active:
            return ""
        # The most recently entered module and its line (ancestors, descendants): in the backward a
        # sibling branch can stay entered until its own input gradient arrives, later.
        last = next(reversed(self._active))
        line = [name for name in self._active
                if name == last or name.startswith(last + ".") or last.startswith(name + ".")]
        return max(line, key=len)

    def _name(self, module: torch.nn.Module) -> str:
        name = self._names.get(module)
        if name is None:  # a module first seen outside any known one is a root
            self._names[module] = name = ""
            for path, sub in module.named_modules():
                self._names.setdefault(sub, path)
        return name

    def _enter(self, name: str) -> None:
        if name:
            self._active[name] = self._active.pop(name, 0) + 1  # (re)entered: now the most recent

    def _leave(self, name: str) -> None:
        if self._active.get(name, 0) > 1:
            self._active[name] -= 1
        else:
            self._active.pop(name, None)

    def _in_backward(self) -> bool:
        task = torch._C._current_graph_task_id()
        if task == -1:
            return False
        if self._backward_task != task:  # the first hook of this backward: clear what is left at its end
            self._backward_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        return True

    def _end_backward(self) -> None:
        self._active.clear()
        self._backward_task = None

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        name = self._name(module)
        self._enter(name)
        if torch._C._current_graph_task_id() != -1:
            return  # a recomputed forward inside the backward: its gradients are not this module's
        tensors = _requiring_grad(args)
        if tensors:
            register_multi_grad_hook(tensors, lambda _grad, name=name: self._in_backward() and self._leave(name),
                                     mode="any")

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        name = self._name(module)
        self._leave(name)
        if torch._C._current_graph_task_id() != -1:
            return
        tensors = _requiring_grad(output)
        if tensors:
            register_multi_grad_hook(tensors, lambda _grad, name=name: self._in_backward() and self._enter(name),
                                     mode="any")


def _requiring_grad(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
