"""``memplan trace --torchtitan FILE.toml`` under pipeline parallelism: one stage of torchtitan's pipeline.

torchtitan's ``pipelining_fn`` (``pipeline_llm``: the split of ``generate_llm_fqn_per_model_part``,
``parallelize_fn`` on every model chunk, FSDP2 with its pipeline reshard policy, and the schedule of
``[parallelism] pipeline_parallel_schedule`` with ``local_batch_size / pipeline_parallel_microbatch_size``
micro-batches) builds the model chunks of this simulated rank, and torch's own schedule runs a step:
``schedule.step(tokens, target=labels, losses=...)`` under torchtitan's train context, as its
``forward_backward_step`` calls it. Every forward and backward of the rank's micro-batches, in the
schedule's order, the stage's FSDP handling (gradients accumulated unsharded, the reduce-scatter after
the last micro-batch) and its receive buffers run on fake tensors.

memplan's simulated process group has one live rank (rank 0, pipeline rank 0: the first stage, and with a
looped schedule also its later chunks), so what the other stages send is never computed: the fake
process group's point-to-point operations complete at once and the received tensors are the stage's own
receive buffers. Two things torch's stage learns from its neighbours are given instead:

* the tensors a stage receives and sends (static metadata, ``PipelineStage(input_args=, output_args=)``):
  the first stage's token ids, the hidden states ``(microbatch, seq, dim)`` between stages and the
  last stage's logits ``(microbatch, seq, vocab)``, in the dtype the blocks compute in;
* the warm-up vote that chooses static metadata (a collective whose answer a fake tensor has not):
  static, as every stage would vote with complete metadata.

Known limitations: one pipeline rank (the first) is traced; tensor parallelism under PP is refused
(refused in :mod:`memplan.trace.runners.torchtitan_setup`: DTensor hidden states between stages); the schedule's losses are summed as torchtitan sums them.
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.trace.run import StepJob

__all__ = ["pipeline_step_job"]


def pipeline_step_job(jc: Any, spec: Any, args: Any, dims: Any, *, built: Any, amp: torch.dtype | None,
                      cuda_autocast: bool, context: Any, dtypes: dict[str, torch.dtype]) -> StepJob:
    """The step of this rank's pipeline stages: torchtitan's ``pipelining_fn`` builds them from the
    meta-device model ``built(model)`` returns (inside the caller's mesh and fake-mode guards);
    ``dtypes`` is torchtitan's ``TORCH_DTYPE_MAP``."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    loss_sum = spec.build_loss_fn(jc, parallel_dims=dims)
    with unset_fake_temporarily():
        schedule, parts, first, last = built(lambda model: spec.pipelining_fn(
            model, dims, jc, torch.device("cpu"), args, spec.parallelize_fn, loss_sum))
    for part in parts:
        part.to_empty(device="cpu")
        part.train()
    stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
    microbatch = jc.parallelism.pipeline_parallel_microbatch_size
    dtype = _block_dtype(jc, dims, dtypes)
    for stage in stages:
        _static_metadata(stage, microbatch, jc.training.seq_len, args, dtype)
    _static_vote(schedule)
    optimizer = spec.build_optimizers_fn(parts, jc.optimizer, dims)
    shape = (jc.training.local_batch_size, jc.training.seq_len)
    batch = {"tokens": torch.randint(0, args.vocab_size, shape), "labels": torch.randint(0, args.vocab_size, shape)}

    def step() -> None:
        losses: list[torch.Tensor] | None = [] if last else None
        target = batch["labels"] if last else None
        if first:
            schedule.step(batch["tokens"], target=target, losses=losses, return_outputs=False)
        else:
            schedule.step(target=target, losses=losses, return_outputs=False)

    model = torch.nn.ModuleList(parts)
    return StepJob(model, batch, optimizer, _no_loss, amp, cuda_autocast=cuda_autocast, context=context,
                   step=step)


def _no_loss(output: Any, batch: Any) -> torch.Tensor:  # the schedule computes the loss itself
    raise AssertionError("a pipeline step runs its schedule, not a loss of the model's output")


def _block_dtype(jc: Any, dims: Any, dtypes: dict[str, torch.dtype]) -> torch.dtype:
    """The dtype the blocks compute in: FSDP's ``param_dtype`` (``mixed_precision_param``), else the
    parameters' (``training.dtype``); ``dtypes`` is torchtitan's name-to-dtype map."""
    name = jc.training.mixed_precision_param if dims.fsdp_enabled else jc.training.dtype
    return dtypes[name]  # type: ignore[no-any-return]


def _static_metadata(stage: Any, microbatch: int, seq: int, args: Any, dtype: torch.dtype) -> None:
    """What ``PipelineStage(input_args=, output_args=)`` records: token ids into the first stage, hidden
    states between stages, logits out of the last (gradients derived from them, as torch derives them)."""
    from torch.distributed.pipelining._utils import _StageMeta, extract_tensor_metas

    def meta(*shape: int, kind: torch.dtype, grad: bool) -> tuple[torch.Tensor]:
        return (torch.empty(shape, dtype=kind, device="meta", requires_grad=grad),)

    hidden = (microbatch, seq, args.dim)
    inputs = meta(microbatch, seq, kind=torch.long, grad=False) if stage.is_first else meta(*hidden, kind=dtype,
                                                                                              grad=True)
    outputs = meta(microbatch, seq, args.vocab_size, kind=dtype, grad=True) if stage.is_last \
        else meta(*hidden, kind=dtype, grad=True)
    stage._user_meta = _StageMeta(inputs=extract_tensor_metas(inputs), outputs=extract_tensor_metas(outputs))


def _static_vote(schedule: Any) -> None:
    """The schedule's warm-up vote, answered: every stage has complete static metadata."""
    from torch.distributed.pipelining.stage import InferenceMode

    def vote(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = vote
