"""FSDP2 under a pipeline schedule (memplan.estimate.pipeline_fsdp): the stage's parameters stay
unsharded for the whole step and its gradients accumulate unsharded in fp32 until the last micro-batch."""

from __future__ import annotations

from dataclasses import replace

from memplan.estimate import estimate
from memplan.job import Batch, Job, Parallelism, Recompute, Sharding
from memplan.model import load_preset

GiB = 2**30


def _job(framework: str = "torchtitan", *, pp: int = 2, fsdp: str = "full", mbs: int = 1,
         gbs: int | None = None, seq: int = 8192) -> Job:
    return Job(framework=framework, parallel=Parallelism(world_size=4 * pp, pp=pp), sharding=Sharding(fsdp=fsdp),
               batch=Batch(micro_batch_size=mbs, seq_length=seq, global_batch_size=gbs),
               recompute=Recompute(mode="full"))


def test_every_parameter_is_unsharded_in_bf16_beside_fp32_accumulated_gradients() -> None:
    model = load_preset("llama-3.1-8b")
    result = estimate(model, _job(gbs=64, mbs=2))
    for stage in result.stages[:-1]:  # the last stage peaks at its loss
        # the backward's collective buffers are exactly the stage's unsharded bf16 parameters
        assert stage.peak_phase == "backward"
        assert stage.communication_bytes == 2 * stage.parameters_numel
        # the sharded fp32 gradients do not exist before the reduce-scatter: the gradients alive at the peak are
        # the accumulated unsharded ones (4 bytes per parameter), reported in gradients_bytes beside the sharded
        assert stage.gradients_bytes - stage.gradients_absent_at_peak_bytes == 4 * stage.parameters_numel
        assert stage.gradients_absent_at_peak_bytes == 4 * stage.parameters_numel // 4  # fp32, sharded over dp 4
    plain = estimate(model, replace(_job(gbs=64), parallel=Parallelism(world_size=2, pp=2),
                                    sharding=Sharding(fsdp="none")))
    # without FSDP nothing of this applies: full gradients, no unsharded copy (one data-parallel rank: torchtitan runs
    # DDP only as its one parallel dimension, "DDP has not supported > 1D parallelism")
    assert all(s.communication_bytes < s.parameters_numel for s in plain.stages)


def test_the_accumulated_gradients_are_four_bytes_per_parameter_at_the_backward() -> None:
    """At a backward with every in-flight micro-batch alive, beside the sharded states, the activations,
    the layer's gradient (temporary) and the unsharded parameters (communication), the stage holds its
    accumulated fp32 gradients: 4 bytes per parameter of the stage, in place of the sharded gradients."""
    model = load_preset("llama-3.1-8b")
    for stage in estimate(model, _job(gbs=64, mbs=2)).stages[:-1]:  # the last stage peaks at its loss
        assert stage.peak_phase == "backward"
        rest = (stage.parameters_bytes + stage.optimizer_bytes + stage.activations_bytes + stage.workspace_bytes
                + stage.temporary_bytes + stage.input_bytes + stage.communication_bytes)
        assert stage.peak_allocated_bytes - rest == 4 * stage.parameters_numel


def test_the_end_of_the_backward_adds_the_reduce_scatter_input() -> None:
    """Short sequences under full recompute peak at the end of the backward: unsharded parameters, the
    accumulated gradients, the sharded gradients as the reduce-scatter makes them and one unit's fp32 input."""
    model = load_preset("llama-3.1-8b")
    stage = estimate(model, _job(gbs=64, seq=1024)).stages[0]
    assert stage.peak_phase == "end of backward"
    embedding = model.vocab_size * model.hidden_size
    assert stage.communication_bytes == 2 * stage.parameters_numel + 4 * embedding


def test_first_stage_with_as_many_micro_batches_as_stages_drops_one_in_flight() -> None:
    """1F1B with micro-batches == stages: the only backward with pp micro-batches in flight is the first
    (no gradients yet); with gradients accumulated one micro-batch fewer is alive."""
    model = load_preset("llama-3.1-8b")
    tight = estimate(model, _job(pp=4, gbs=32, mbs=2)).stages[0]   # dp 4: 4 micro-batches, 4 stages
    loose = estimate(model, _job(pp=4, gbs=64, mbs=2)).stages[0]   # 8 micro-batches
    per_microbatch = loose.transformer_layer_activations_bytes // loose.inflight_microbatches
    assert tight.inflight_microbatches == loose.inflight_microbatches == 4
    assert loose.peak_allocated_bytes - tight.peak_allocated_bytes == per_microbatch


def test_megatron_and_fine_tuning_keep_their_pricing() -> None:
    model = load_preset("llama-3.1-8b")
    job = _job(gbs=64)
    assert not any("FSDP under pipeline" in a for a in estimate(model, replace(job, framework="hf")).assumptions)
    assert any("FSDP under pipeline" in a for a in estimate(model, job).assumptions)
