"""Running training iterations: the optimizer a job uses, recompute, autocast, and the step loop.

The same loop runs the fake, traced step and the real-tensor reference step of the accuracy
tests, so both do exactly the same things in the same order (forward → loss → backward →
``optimizer.step()`` → ``zero_grad(set_to_none=True)``, as the Hugging Face Trainer does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch

from memplan.categories import MemoryCategory
from memplan.errors import UnsupportedError
from memplan.optimizers import optimizer_kind
from memplan.optimizers.kind import TraceRequest
from memplan.policies import ActivationPolicy
from memplan.profiles import get_profile
from memplan.trace.build import TORCH_DTYPES
from memplan.trace.core.recorder import HOST, AllocationRecorder
from memplan.trace.setup import TraceSetup

__all__ = [
    "LossAfterForward",
    "StepJob",
    "apply_recompute",
    "convert_outputs_to_fp32",
    "hf_step_job",
    "local_tensor",
    "make_batch",
    "make_optimizer",
    "register_state",
    "run_iterations",
    "token_sum_cross_entropy",
]

LossFn = Callable[[Any, Any], torch.Tensor]
_LEARNING_RATE = 1e-4


@dataclass(frozen=True)
class StepJob:
    """What one training iteration needs: ``loss_fn(model(batch), batch)`` then ``optimizer.step()``.

    ``batch`` is passed as ``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple/list and
    ``model(batch)`` otherwise. ``loss_fn`` gets the model output and the batch.
    """

    model: torch.nn.Module
    batch: Any
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn
    #: dtype for ``torch.autocast`` during forward and loss (None: no autocast).
    autocast_dtype: torch.dtype | None = None
    #: Apply CUDA's autocast fp32 policies on top of CPU autocast (a ``--device cuda`` trace).
    cuda_autocast: bool = False
    #: What the forward calls instead of ``model`` (``--loss fused-linear``: the decoder alone).
    call: Callable[..., Any] | None = None
    #: A context entered around each iteration's forward and backward (torchtitan's train
    #: context: ``loss_parallel`` under TP, whose backward must run inside it too).
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    #: What an iteration runs instead of forward, loss and backward (``--torchtitan`` under pipeline
    #: parallelism: the schedule's step, every micro-batch's forward and backward of this rank's stages).
    step: Callable[[], None] | None = None


def hf_loss(output: Any, batch: Any) -> torch.Tensor:
    """The loss a Hugging Face causal LM computes itself when given ``labels``."""
    return output.loss


@dataclass(frozen=True)
class LossAfterForward:
    """The causal-LM loss computed on the logits after the model's forward has returned, as a trainer that calls
    ``loss_fn(model(inputs), labels)`` does (torchtitan's ``train.py``: ``pred = model(inputs)``, then
    ``self.loss_fn(pred, labels)``): under FSDP2 the root's post-forward has then run (its last parked all-gather
    output freed) before the loss. The model is called without ``labels``.

    ``token_sum``: the model's ``loss_function`` is torchtitan's summed cross-entropy
    (:func:`token_sum_cross_entropy`, set by :func:`hf_step_job`) and the sum is divided by the count of tokens, as
    torchtitan's ``forward_backward_step`` divides ``loss_sum`` by ``global_valid_tokens`` (every label is valid here).
    Not modelled: the 0-dim count tensors torchtitan's ``train_step`` keeps on the device (512 B each)."""

    model: torch.nn.Module
    vocab_size: int
    token_sum: bool = False

    def __call__(self, output: Any, batch: Any) -> torch.Tensor:
        labels = batch["labels"]
        if self.token_sum:
            return self.model.loss_function(output.logits, labels, self.vocab_size) / float(labels.numel())
        return self.model.loss_function(logits=output.logits, labels=labels, vocab_size=self.vocab_size)

    def call(self, labels: torch.Tensor, **inputs: Any) -> Any:
        """The model's forward without the labels (its logits, no loss)."""
        return self.model(**inputs)


def token_sum_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **_: Any) -> torch.Tensor:
    """torchtitan's ``cross_entropy_loss`` (torchtitan/components/loss.py) in the signature of a Hugging Face model's
    ``loss_function``: batch and sequence dimensions flattened, the logits upcast to fp32, the labels used as given
    (torchtitan's data loader shifts them), summed over the tokens (-100 ignored)."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum",
                                             ignore_index=-100)


#: ``--packing``: documents per row of a packed batch (equal lengths; the memory does not depend on it).
PACKED_DOCUMENTS = 4


def make_batch(vocab_size: int, options: TraceSetup) -> dict[str, torch.Tensor]:
    """Token ids and labels (int64, mbs x seq), as a data collator for causal LM makes them.

    ``--packing``: also ``position_ids`` restarting at every document (``PACKED_DOCUMENTS`` per row),
    as TRL's ``DataCollatorWithFlattening`` gives them."""
    input_ids = torch.randint(0, vocab_size, (options.mbs, options.seq), dtype=torch.long)
    batch = {"input_ids": input_ids, "labels": input_ids.clone()}
    if options.job.batch.packing:
        document = max(1, -(-options.seq // PACKED_DOCUMENTS))
        batch["position_ids"] = (torch.arange(options.seq, dtype=torch.long) % document).expand(options.mbs, -1)
    return batch


def make_optimizer(params: Iterable[torch.nn.Parameter] | torch.nn.Module, options: TraceSetup) -> torch.optim.Optimizer:
    """The optimizer of ``options`` over the parameters that train (``requires_grad``, as the Hugging
    Face Trainer selects them) with the implementation PyTorch picks on ``options.device``, built by the
    optimizer's registry entry (:mod:`memplan.optimizers`). Pass the module itself when the optimizer
    chooses parameters by module (GaLore's target modules).

    ``--optimizer-in-backward``: one optimizer per parameter stepped by a post-accumulate-grad hook
    (:class:`~memplan.trace.standins.in_backward.InBackwardOptimizer`)."""
    model = params if isinstance(params, torch.nn.Module) else None
    trained = [p for p in (model.parameters() if model is not None else params) if p.requires_grad]
    if options.job.optimizer.in_backward:
        from memplan.trace.standins.in_backward import InBackwardOptimizer

        return InBackwardOptimizer(trained, lambda one: _optimizer([one], options, None))
    return _optimizer(trained, options, model)


def _optimizer(params: list[torch.nn.Parameter], options: TraceSetup, model: torch.nn.Module | None) -> torch.optim.Optimizer:
    kind = optimizer_kind(options.optimizer)
    if kind.build is None:
        raise UnsupportedError(f"--optimizer {kind.name}: {kind.untraceable}")
    request = TraceRequest(params=params, groups=_groups_by_tensor_type(params), model=model,
                           implementation=options.resolved_optimizer_impl, device=options.device,
                           learning_rate=_LEARNING_RATE, settings=options.job.optimizer)
    return kind.build(request)


def _groups_by_tensor_type(params: Iterable[torch.nn.Parameter]) -> list[dict[str, Any]]:
    """One param group per tensor type: foreach kernels cannot mix DTensor (TP-sharded) and plain
    tensors (replicated embeddings), so a TP job keeps them apart as torchtitan-style code does."""
    groups: dict[bool, list[torch.nn.Parameter]] = {}
    for param in params:
        groups.setdefault(hasattr(param, "_local_tensor"), []).append(param)
    return [{"params": group} for group in groups.values()]


def apply_recompute(model: torch.nn.Module, policy: ActivationPolicy, *, cuda_autocast: bool = False) -> None:
    """Apply the job's activation policy to ``model`` (:func:`memplan.trace.runners.policies.apply_policy`)."""
    from memplan.trace.runners.policies import apply_policy

    apply_policy(model, policy, cuda_autocast=cuda_autocast)


def hf_step_job(model: torch.nn.Module, options: TraceSetup, *, autocast: bool = True) -> StepJob:
    """A Hugging Face causal LM's step: token batch, the job's optimizer, autocast for ``*-mixed``.

    ``autocast=False`` when FSDP's mixed-precision policy casts the parameters instead.
    """
    config: Any = getattr(model, "config", None)
    vocab = int(config.vocab_size)
    batch = make_batch(vocab, options)
    optimizer = make_optimizer(model, options)
    autocast_dtype = TORCH_DTYPES[options.compute_dtype] if options.mixed and autocast else None
    convert_outputs_to_fp32(model, options)
    if options.job.loss == "chunked":  # torchtune's chunked-output cross-entropy
        from memplan.trace.standins.chunked_loss import chunked_call_and_loss

        call, chunked = chunked_call_and_loss(model)
        return StepJob(model, batch, optimizer, chunked, autocast_dtype, cuda_autocast=options.device == "cuda",
                       call=call)
    if options.job.loss == "fused-linear":
        from memplan.trace.standins.fused_loss import decoder_call_and_loss

        call, loss_fn = decoder_call_and_loss(model)
        return StepJob(model, batch, optimizer, loss_fn, autocast_dtype, cuda_autocast=options.device == "cuda",
                       call=call)
    profile = get_profile(options.job.framework)
    token_sum = profile.trainer_loss == "token-sum"
    if token_sum or (options.job.sharding.fsdp != "none" and not profile.loss_in_model_forward):
        # FSDP2's root post-forward before the loss (the estimate's field); torchtitan's own loss
        if token_sum:
            model.loss_function = token_sum_cross_entropy  # type: ignore[assignment]
        after = LossAfterForward(model, vocab, token_sum)
        return StepJob(model, batch, optimizer, after, autocast_dtype, cuda_autocast=options.device == "cuda",
                       call=after.call)
    return StepJob(model, batch, optimizer, hf_loss, autocast_dtype, cuda_autocast=options.device == "cuda")


def convert_outputs_to_fp32(model: torch.nn.Module, options: TraceSetup) -> None:
    """Wrap ``model.forward`` in accelerate's own ``convert_outputs_to_fp32`` where the job's trainer does: a 16-bit
    precision on a framework whose profile says ``fp32_outputs`` (the HF Trainer: ``Accelerator.prepare_model`` under
    ``native_amp``), not on DeepSpeed's engine (``--zero``). The output is rebuilt with fp32 copies of its 16-bit
    floating tensors (the logits) while the 16-bit ones are still referenced; the loss alone leaves the step's
    forward, so the copies die before the backward, as in the Trainer's ``compute_loss``."""
    from memplan.profiles import get_profile
    from memplan.profiles.zero_engine import zero_engine

    if options.compute_dtype == "fp32" or not get_profile(zero_engine(options.job)[0].framework).fp32_outputs:
        return
    from accelerate.utils.operations import convert_outputs_to_fp32 as wrap

    forward: Any = model.forward
    func = getattr(forward, "__func__", None)
    model.forward = MethodType(wrap(func), model) if func is not None else wrap(forward)  # type: ignore[method-assign]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, the tensor itself otherwise."""
    return getattr(tensor, "_local_tensor", tensor)


def register_state(recorder: AllocationRecorder, job: StepJob) -> None:
    """Register the storages alive before the step: parameters, buffers and the batch."""
    for path, module in job.model.named_modules():
        for param in module.parameters(recurse=False):
            recorder.register(local_tensor(param).untyped_storage(), MemoryCategory.PARAMETER.value, path)
        # a quantized layer's buffers (absmax, codes, row scales) are part of its weight
        category = MemoryCategory.PARAMETER if getattr(module, "buffers_are_weight_state", False) \
            else MemoryCategory.BUFFER
        for buffer in module.buffers(recurse=False):
            recorder.register(local_tensor(buffer).untyped_storage(), category.value, path)
    for tensor in _batch_tensors(job.batch):
        recorder.register(local_tensor(tensor).untyped_storage(), MemoryCategory.INPUT.value)


def _batch_tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for value in batch.values():
            yield from _batch_tensors(value)
    elif isinstance(batch, (tuple, list)):
        for value in batch:
            yield from _batch_tensors(value)


def _forward(job: StepJob) -> torch.Tensor:
    ctx = (torch.autocast("cpu", dtype=job.autocast_dtype) if job.autocast_dtype is not None
           else contextlib.nullcontext())
    policy: Any = contextlib.nullcontext()
    if job.autocast_dtype is not None and job.cuda_autocast:
        from memplan.trace.cuda.autocast import CudaAutocastFp32

        policy = CudaAutocastFp32()
    with ctx, policy:
        batch = job.batch
        if job.call is not None:
            output = job.call(**batch)
        elif isinstance(batch, dict):
            output = job.model(**batch)
        elif isinstance(batch, (tuple, list)):
            output = job.model(*batch)
        else:
            output = job.model(batch)
        return job.loss_fn(output, batch)


def run_iterations(job: StepJob, iterations: int, recorder: AllocationRecorder | None = None,
                   *, host_step: bool = False, offload_activations: bool = False) -> None:
    """Run ``iterations`` training iterations of ``job``; tell ``recorder`` phases and roles.

    ``host_step``: optimizer ``step`` counters live in host memory (a GPU run of a non-fused,
    non-capturable optimizer), so they are marked to be left out of a CUDA trace.
    ``offload_activations``: the forward runs under :func:`memplan.trace.standins.offload.save_on_host`.
    """
    params = [p for group in job.optimizer.param_groups for p in group["params"]]
    observe = getattr(job.optimizer, "observe", None)
    if recorder is not None and callable(observe):  # --optimizer-in-backward: marked as each step runs
        observe(lambda param: _mark_gradients(recorder, [param]),
                lambda one: _mark_optimizer_state(recorder, one, host_step))
    for iteration in range(iterations):
        with job.context() if job.context is not None else contextlib.nullcontext():
            _set(recorder, "forward", iteration)
            if job.step is not None:
                job.step()
            else:
                with _saved_tensors(recorder, offload_activations):
                    loss = _forward(job)
                _set(recorder, "backward", iteration)
                if recorder is not None:
                    recorder.start_backward()
                loss.backward()
                del loss
        if recorder is not None:
            _mark_gradients(recorder, params)
        _set(recorder, "optimizer", iteration)
        job.optimizer.step()
        if recorder is not None:
            _mark_optimizer_state(recorder, job.optimizer, host_step)
        job.optimizer.zero_grad(set_to_none=True)
    _set(recorder, "other", iterations - 1)


def _saved_tensors(recorder: AllocationRecorder | None, offload: bool) -> Any:
    if not offload:
        return contextlib.nullcontext()
    from memplan.trace.standins.offload import save_on_host

    return save_on_host(recorder)


def _set(recorder: AllocationRecorder | None, phase: str, iteration: int) -> None:
    if recorder is not None:
        recorder.phase, recorder.iteration = phase, iteration


def _mark_gradients(recorder: AllocationRecorder, params: list[torch.Tensor]) -> None:
    gradient = MemoryCategory.GRADIENT.value
    for param in params:
        if param.grad is not None:
            recorder.mark(local_tensor(param.grad).untyped_storage(), gradient)


def _mark_optimizer_state(recorder: AllocationRecorder, optimizer: torch.optim.Optimizer, host_step: bool) -> None:
    state_role = MemoryCategory.OPTIMIZER_STATE.value
    outside = getattr(optimizer, "outside_allocator", frozenset())  # bitsandbytes' paged states
    # a container of optimizers (torchtitan's OptimizersContainer) keeps its states in its members
    members = getattr(optimizer, "optimizers", None)
    states = [s for member in members for s in member.state.values()] if isinstance(members, list) \
        else list(optimizer.state.values())
    for state in states:
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                on_host = (host_step and key == "step" and value.dim() == 0) or id(value) in outside
                recorder.mark(local_tensor(value).untyped_storage(), HOST if on_host else state_role)
            else:  # a helper object's tensors (GaLore's projector keeps its projection matrix)
                for held in _held_tensors(value):
                    recorder.mark(local_tensor(held).untyped_storage(), state_role)


def _held_tensors(value: object) -> Iterator[torch.Tensor]:
    """Tensors an object in an optimizer's state holds as attributes (or in a list attribute)."""
    for attribute in getattr(value, "__dict__", {}).values():
        items = attribute if isinstance(attribute, (list, tuple)) else [attribute]
        yield from (item for item in items if isinstance(item, torch.Tensor))
