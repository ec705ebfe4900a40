"""Mechanic: the model states of one GPU of a stage (weights, gradients, master weights, optimizer
states) and the optimizer step's temporaries, with the sentences that explain them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from dataclasses import fields, replace

from memplan.estimate.context import StageContext
from memplan.estimate.extras import optimizer_temporary_bytes
from memplan.estimate.finetune import StageFinetune, adapter_compute_bytes, finetune_assumptions, stage_finetune
from memplan.estimate.ledger import (
    CPU,
    GRADIENTS,
    MASTER,
    OPTIMIZER,
    PARAMETERS,
    TEMPORARY,
    Contribution,
)
from memplan.estimate.optimizers import (
    SmallTensors,
    describe_optimizer,
    in_backward_gradient_bytes,
    muon_scalar_numel,
    muon_weight_matrices,
    needs_small_tensors,
    small_tensors,
    small_tensors_of_sizes,
)
from memplan.estimate.states import (
    FinetuneStageParams,
    StageParams,
    StateBytes,
    device_step_counters,
    fp32_router_weights,
    stage_params,
    state_bytes,
)
from memplan.estimate.trained_dtypes import trained_dtypes_note
from memplan.frozen import frozen_dataclass
from memplan.job import Job, resolved_optimizer_impl
from memplan.optimizers import optimizer_kind
from memplan.model.tensors import stage_tensors
from memplan.peft.params import Adapter, finetune_params
from memplan.profiles.framework import vocab_split
from memplan.units import dtype_bytes

_STEP = ("optimizer step",)


@frozen_dataclass
class StageStates:
    """The stage's parameters and states, its fine-tuning split, and the optimizer step's temporaries."""

    params: StageParams
    states: StateBytes
    ft: StageFinetune | None
    step_temp: int
    contributions: tuple[Contribution, ...]


def model_states(ctx: StageContext) -> StageStates:
    """The stage's model states (:func:`memplan.estimate.states.state_bytes`) and optimizer step."""
    run, layout = ctx.run, ctx.layout
    model, job = run.model, run.job
    params = stage_params(model, job, layout, run.vocab_rows, vocab_parallel=run.profile.vocab_parallel)
    ft = stage_finetune(model, job, layout, params.total) if run.finetune else None
    if ft is not None:
        params = FinetuneStageParams(**{f.name: getattr(params, f.name) for f in fields(params)},
                                     layer_trainable=ft.layer_trainable,
                                     layer_adapter_bytes=ft.layer_adapters * adapter_compute_bytes(job, run.prec.weight_copies))
    states = state_bytes(model, job, params, run.prec, offload_moves_gradients=run.profile.offload_moves_gradients,
                         step_counters=_step_counters(ctx, ft), small=_small(ctx, ft),
                         finetune=ft, **_weight_matrices(ctx, params, ft))
    largest = (_largest_tensor(ctx) if ft is None or ft.full or ft.copies else _largest_trainable(ctx))
    step_temp = optimizer_temporary_bytes(job, run.profile, states, run.prec, largest)
    if job.optimizer.in_backward:
        # Optimizer hook: each gradient is stepped and freed in the backward (one alive at a time),
        # and the per-parameter step's temporaries join the backward's.
        stepped = params.total if ft is None else ft.trainable
        states = replace(states, gradients=in_backward_gradient_bytes(states.gradients, stepped, largest))
    items = tuple(_contributions(ctx, states, step_temp))
    return StageStates(params=params, states=states, ft=ft, step_temp=step_temp, contributions=items)


def _contributions(ctx: StageContext, states: StateBytes, step_temp: int) -> Iterator[Contribution]:
    job = ctx.job
    yield Contribution(PARAMETERS, states.parameters, note=_fp8_note(job))
    yield Contribution(GRADIENTS, states.gradients, note=_sharding_note(job))
    yield Contribution(MASTER, states.master)
    yield Contribution(OPTIMIZER, states.optimizer, note=_optimizer_note(job))
    where = describe_optimizer(job)
    if where:
        yield Contribution(OPTIMIZER, 0, note=where)
    if fp32_router_weights(job, ctx.prec) and any(layer.moe is not None and layer.moe.router_fp32
                                                  for layer in ctx.model.layers):
        yield Contribution(PARAMETERS, 0, note=(
            "transformers keeps the MoE router weights in fp32 (_keep_in_fp32_modules_strict): their weights, "
            "gradients and optimizer states are priced at 4 bytes, and each router's fp32 copy of its input as "
            "an activation" + ("; fine-tuning: frozen routers are priced at the base's dtype"
                               if ctx.run.finetune else "")))
    cpu = states.cpu_parameters + states.cpu_gradients + states.cpu_optimizer
    yield Contribution(CPU, cpu, note=_offload_note(job))
    yield Contribution(TEMPORARY, step_temp, _STEP)
    if ctx.run.finetune:
        for note in finetune_assumptions(ctx.model, job, ctx.prec):
            yield Contribution(PARAMETERS, 0, note=note)
        yield Contribution(PARAMETERS, 0, note=trained_dtypes_note(ctx.model, job.finetune, ctx.shape,
                                                                   dtype_bytes(ctx.prec.param), ctx.prec.param))


def _sharding_note(job: Job) -> str:
    sh = job.sharding
    if sh.fsdp != "none":
        return f"FSDP {sh.fsdp} shard: weights, gradients and optimizer states sharded over data parallelism"
    if sh.zero:
        return (f"ZeRO stage {sh.zero}: " + ("optimizer states", "optimizer states and gradients",
                                              "optimizer states, gradients and weights")[sh.zero - 1]
                + " sharded over data parallelism")
    if sh.distributed_optimizer:
        return "distributed optimizer: master weights and moments sharded over DP x CP; full gradient buffer kept"
    return "no optimizer-state sharding: every DP rank keeps full model states"


def _optimizer_note(job: Job) -> str:
    opt = job.optimizer
    return (f"optimizer {opt.name} ({resolved_optimizer_impl(job)} implementation)"
            + (f", momentum {opt.momentum}" if "momentum" in optimizer_kind(opt.name).knobs else ""))


def _fp8_note(job: Job) -> str:
    if not job.precision.fp8:
        return ""
    return (f"FP8 ({job.precision.fp8}): linear-layer inputs saved in FP8; "
            + ("weights kept in FP8 with an FP8 transpose" if job.precision.fp8_params
               else "an FP8 copy and transpose of every GEMM weight cached per step beside the 16-bit weight"))


def _offload_note(job: Job) -> str:
    off = job.offload
    if not off.any:
        return ""
    moved = [w for w, on in (("optimizer state", off.optimizer), ("weights", off.params),
                             ("activations", off.activations)) if on]
    # (job.py sets --offload-optimizer under FSDP with --offload-params: said here, not silently)
    fsdp = ("; under FSDP --offload-params offloads the optimizer state too (CPUOffloadPolicy moves parameters, "
            "gradients and the optimizer step together)" if off.params and job.sharding.fsdp != "none" else "")
    return ("offloaded to CPU memory: " + ", ".join(moved)
            + (f" ({off.optimizer_fraction:.0%} of the optimizer state)"
               if off.optimizer and off.optimizer_fraction < 1 else "") + fsdp)


def _step_counters(ctx: StageContext, ft: StageFinetune | None) -> int:
    layout = ctx.layout
    if ft is not None:
        return device_step_counters(ctx.job, ctx.profile, ft.trainable_tensors)
    if not device_step_counters(ctx.job, ctx.profile, 1):  # none on the device: the stage's tensors are not counted
        return 0
    tensors = stage_tensors(ctx.model, layout.layer_indices, has_embedding=layout.has_embedding,
                            has_head=layout.has_head)
    return device_step_counters(ctx.job, ctx.profile, tensors)


def _small(ctx: StageContext, ft: StageFinetune | None) -> SmallTensors | None:
    if not needs_small_tensors(ctx.job):
        return None
    if ft is None:
        return small_tensors(ctx.model, ctx.layout.layer_indices, has_head=ctx.layout.has_head)
    # bitsandbytes' small-tensor split of a PEFT stage's adapters (each often under the paging threshold)
    adapters = _stage_adapters(ctx)
    vectors = sum(a.module.out_features for a in adapters if a.dora)
    return small_tensors_of_sizes((n for a in adapters for n in adapter_tensor_sizes(a)), vectors=vectors)


def _weight_matrices(ctx: StageContext, params: StageParams, ft: StageFinetune | None) -> dict[str, Any]:
    """What an optimizer entry that steps 2-D weights one at a time (Muon) is priced from: the elements
    its scalar optimizer steps and the stage's 2-D weights (full training only)."""
    if not optimizer_kind(ctx.job.optimizer.name).weight_matrices or ft is not None:
        return {}
    model, job, layout = ctx.model, ctx.job, ctx.layout
    return {"muon_scalar": muon_scalar_numel(model, job, layout.layer_indices, params.root,
                                             has_embedding=layout.has_embedding),
            "matrices": muon_weight_matrices(model, job, layout.layer_indices, has_embedding=layout.has_embedding)}


def _stage_adapters(ctx: StageContext) -> list[Adapter]:
    layers = set(ctx.layout.layer_indices)
    root = ctx.layout.has_head or ctx.layout.has_embedding
    return [a for a in finetune_params(ctx.model, ctx.job.finetune).adapters
            if (a.module.layer in layers) or (a.module.layer is None and root)]


def adapter_tensor_sizes(adapter: Adapter) -> tuple[int, ...]:
    """lora_A, lora_B (and a DoRA magnitude) of one adapter, numel each."""
    m, rank = adapter.module, adapter.rank * adapter.experts
    return (rank * m.in_features, m.out_features * rank) + ((m.out_features,) if adapter.dora else ())


def _largest_trainable(ctx: StageContext) -> int:
    """Largest trainable adapter tensor of a PEFT stage (fully trained modules: the largest tensor bound)."""
    return max((n for a in _stage_adapters(ctx) for n in adapter_tensor_sizes(a)), default=0)


def _largest_tensor(ctx: StageContext) -> int:
    return ctx.run.vocab_rows * ctx.model.hidden_size // vocab_split(ctx.profile, ctx.job.parallel.tp)
