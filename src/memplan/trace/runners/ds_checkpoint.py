"""DeepSpeed activation checkpointing run for real: ``--framework deepspeed --recompute full``.

Megatron-DeepSpeed wraps each transformer layer in ``deepspeed.checkpointing.checkpoint``; a
Hugging Face decoder layer calls its ``_gradient_checkpointing_func`` with the layer's hidden states
(its other arguments bound), so the tracer sets that function to DeepSpeed's own ``checkpoint``,
configured with DeepSpeed's own ``configure`` from the job's switches
(``deepspeed/runtime/activation_checkpointing/checkpointing.py``):

* ``--partition-activations`` → ``partition_activations``, with an ``mpu`` of the simulated tensor-parallel
  ranks (:class:`TensorParallelGroup`): each keeps 1/tp of a layer's input, gathered over the fake process
  group in the backward (at tp 1 the partition is a copy of the whole input);
* ``--cpu-checkpointing`` → ``checkpoint_in_cpu`` (with partitioning only, see below);
* ``--contiguous-checkpoints N`` → ``contiguous_checkpointing`` with ``num_checkpoints`` N.

Three things let DeepSpeed's code run on the tracer's fake tensors, none of them changing what it keeps
(:func:`deepspeed_on_fake_tensors`, active while a trace runs):

* the small per-input size tensors DeepSpeed saves beside each partition (``torch.tensor(arg.size())``,
  host memory on a GPU) are made real, their ``.numpy()`` (read by its backward's gather) answered
  without a dispatch the fake mode would turn into a fake;
* fake tensors all live on the CPU device, where ``.cpu()`` and ``.to(device)`` copy nothing: under
  ``--cpu-checkpointing`` each kept partition is copied into a fresh tensor counted as host memory (the
  recorder's ``host`` role) — and DeepSpeed's contiguous buffers, allocated on ``cpu``, are host memory
  too — and the backward copies it back to the device before DeepSpeed gathers it, as ``saved_data.to``
  does on a GPU;
* ``deepspeed.comm`` must be initialised for ``configure`` (it logs on rank 0): over the simulated
  ranks' process group, or a one-rank fake one for the call, with DeepSpeed's CPU shared-memory collective kernel (a JIT-compiled C++ op for CPU
  all-reduce, no memory on a GPU) left unbuilt.

Known limitations: tensor parallelism is Hugging Face's plan (the layer inputs are whole, replicated
tensors, as Megatron's are without sequence parallelism); no FSDP or ZeRO; ``--cpu-checkpointing`` without
``--partition-activations`` is refused: on a GPU DeepSpeed offloads with an asynchronous engine on CUDA
streams (``offload_activations.py``, two newest inputs kept on the device) that the tracer does not run.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memplan.errors import MissingDependencyError

if TYPE_CHECKING:
    import torch

    from memplan.policies import ActivationPolicy
    from memplan.trace.core.recorder import AllocationRecorder

__all__ = ["TensorParallelGroup", "apply_deepspeed_checkpoint", "deepspeed_on_fake_tensors", "import_checkpointing"]

#: The feature and extra errors name.
FEATURE = "memplan trace --framework deepspeed --recompute full"
EXTRA = "deepspeed"
#: ``deepspeed.ops.__compatible_ops__`` key of the CPU shared-memory collective op (``ShareMemCommBuilder``).
_SHM_OP = "deepspeed_shm_comm"


def import_checkpointing() -> Any:
    """``deepspeed.runtime.activation_checkpointing.checkpointing``; DeepSpeed's loggers write to stdout, so
    it is first imported with stdout on stderr (its handlers keep that stream) to keep ``--json`` clean."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            from deepspeed.runtime.activation_checkpointing import checkpointing
    except ModuleNotFoundError as exc:
        raise MissingDependencyError(exc.name or "deepspeed", feature=FEATURE, extra=EXTRA) from None
    return checkpointing


def apply_deepspeed_checkpoint(model: torch.nn.Module, policy: ActivationPolicy) -> None:
    """Configure DeepSpeed's checkpointing from ``policy`` and make it every decoder layer's checkpoint."""
    from memplan.errors import UnsupportedError

    function = _configured_checkpoint(policy)
    setter = getattr(model, "_set_gradient_checkpointing", None)
    if not callable(setter):
        raise UnsupportedError("--framework deepspeed --recompute full needs a Hugging Face model (its decoder "
                               "layers' _gradient_checkpointing_func)")
    setter(enable=True, gradient_checkpointing_func=function)


@dataclass(frozen=True)
class TensorParallelGroup:
    """The ``mpu`` DeepSpeed's ``configure`` reads (``get_tensor_model_parallel_rank/world_size/group``):
    the simulated tensor-parallel ranks, which are the whole process group of a deepspeed trace."""

    group: Any

    def get_tensor_model_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.group)

    def get_tensor_model_parallel_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self.group)

    def get_tensor_model_parallel_group(self) -> Any:
        return self.group


def _configured_checkpoint(policy: ActivationPolicy) -> Callable[..., Any]:
    import torch.distributed as dist

    checkpointing = import_checkpointing()
    contiguous = policy.contiguous_checkpoints is not None
    with _deepspeed_comm():
        mpu = TensorParallelGroup(dist.group.WORLD) if dist.get_world_size() > 1 else None
        _forget_model_parallel(checkpointing)
        checkpointing.configure(mpu, partition_activations=policy.partition_activations,
                                contiguous_checkpointing=contiguous,
                                num_checkpoints=policy.contiguous_checkpoints if contiguous else None,
                                checkpoint_in_cpu=policy.cpu_checkpointing, synchronize=False, profile=False)
    return checkpointing.checkpoint  # type: ignore[no-any-return]


def _forget_model_parallel(checkpointing: Any) -> None:
    """Reset DeepSpeed's module-level model-parallel state to one rank before ``configure``.

    ``configure(None, ...)`` keeps the ``mpu`` of an earlier call (``if mpu_ is not None: mpu = mpu_``) and
    with it ``mp_rank``/``mp_size``/``mp_group``: after a ``--tp 2`` trace in the same process, a one-rank
    trace would read the first one's destroyed process group (``Group ... is not registered``) or partition
    activations over its two ranks."""
    checkpointing.mpu, checkpointing.mp_rank, checkpointing.mp_size, checkpointing.mp_group = None, 0, 1, None


@contextlib.contextmanager
def _deepspeed_comm() -> Iterator[None]:
    """``deepspeed.comm`` over the running process group, or a one-rank fake one for the call."""
    import deepspeed.comm
    import deepspeed.ops
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    compatible = deepspeed.ops.__compatible_ops__
    deepspeed.ops.__compatible_ops__ = {**compatible, _SHM_OP: False}
    try:
        with contextlib.redirect_stdout(sys.stderr):
            deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False,
                                            verbose=False)
        yield
    finally:
        deepspeed.ops.__compatible_ops__ = compatible
        if started:
            dist.destroy_process_group()


@contextlib.contextmanager
def deepspeed_on_fake_tensors(recorder: AllocationRecorder | None, *, host: bool) -> Iterator[None]:
    """While a trace runs: DeepSpeed's checkpoint on fake tensors (see the module docstring).

    ``host``: a ``--device cuda`` trace, where what DeepSpeed keeps on ``cpu`` is host memory."""
    checkpointing = import_checkpointing()
    originals = {name: getattr(checkpointing, name) for name in
                 ("partition_activations", "get_partitioned_activations_for_backward",
                  "gather_partitioned_activations")}
    checkpointing.get_partitioned_activations_for_backward = _real_sizes(
        originals["get_partitioned_activations_for_backward"])
    host_recorder = recorder if host else None
    if host_recorder is not None:
        checkpointing.partition_activations = _kept_on_host(originals["partition_activations"], checkpointing,
                                                            host_recorder)
        checkpointing.gather_partitioned_activations = _brought_back(originals["gather_partitioned_activations"],
                                                                     checkpointing)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(checkpointing, name, original)


def _real_sizes(original: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    """DeepSpeed saves ``[arg, size]`` pairs; each ``size`` becomes a real tensor of the arg's shape whose
    ``.numpy()`` (what DeepSpeed's gather reads) answers without the fake mode turning it into a fake."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def sized(args: Any, inputs: Any, contiguous_checkpoint: bool) -> list[Any]:
        shapes = [tuple(arg.size()) if torch.is_tensor(arg) else None for arg in args]
        saved = original(args, inputs, contiguous_checkpoint)
        with unset_fake_temporarily():
            for index, shape in enumerate(shapes):
                if shape is not None:
                    saved[2 * index + 1] = _shape_tensor(shape)
        return saved

    return sized


def _shape_tensor(shape: tuple[int, ...]) -> Any:
    import numpy as np
    import torch

    class ShapeTensor(torch.Tensor):
        """``torch.tensor(shape)`` whose ``numpy()`` is the shape itself (no dispatch)."""

        def numpy(self, *, force: bool = False) -> Any:
            return np.array(shape, dtype=np.int64)

    return torch.tensor(shape).as_subclass(ShapeTensor)


def _kept_on_host(original: Callable[..., list[Any]], checkpointing: Any,
                  recorder: AllocationRecorder) -> Callable[..., list[Any]]:
    """Partitions DeepSpeed puts on ``cpu`` (``.cpu()``, or its contiguous buffers made on ``cpu``) are
    copies in host memory; on fake tensors ``.cpu()`` returns the device partition itself."""
    import torch

    from memplan.trace.core.recorder import HOST

    def partitioned(args: Any, cpu_checkpoint: bool, contiguous_checkpoint: bool) -> list[Any]:
        kept = original(args, cpu_checkpoint, contiguous_checkpoint)
        if not cpu_checkpoint:
            return kept
        if contiguous_checkpoint:
            for buffers in checkpointing.contiguous_data_buffers:
                for buffer in buffers or ():
                    recorder.mark(buffer.untyped_storage(), HOST)
            return kept
        for index, (arg, part) in enumerate(zip(args, kept, strict=True)):
            if checkpointing.is_activation_to_checkpoint(arg):
                copy = torch.empty(part.size(), dtype=part.dtype)
                copy.copy_(part)
                recorder.mark(copy.untyped_storage(), HOST)
                kept[index] = copy
        return kept

    return partitioned


def _brought_back(original: Callable[..., tuple[Any, ...]], checkpointing: Any) -> Callable[..., tuple[Any, ...]]:
    """The backward's ``saved_data.to(device)``: a device copy of each host partition before the gather."""
    import torch

    def gathered(tensors: Any, device: Any = None) -> tuple[Any, ...]:
        if checkpointing.CPU_CHECKPOINT:
            for item in tensors[::2]:
                if checkpointing.is_activation_to_checkpoint(item):
                    on_device = torch.empty(item.size(), dtype=item.dtype)
                    on_device.copy_(item)
                    item.data = on_device.data
        return original(tensors, device)

    return gathered
