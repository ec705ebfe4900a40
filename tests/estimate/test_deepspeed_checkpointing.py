"""DeepSpeed activation checkpointing (memplan.estimate.ds_checkpointing): the bytes each switch
moves of full recompute's kept layer inputs, the backward's gathered input, the contiguous buffers,
and the refusals (one line)."""

from __future__ import annotations

import pytest

from memplan import Job, load_model
from memplan.errors import JobConfigError
from memplan.estimate import estimate
from memplan.estimate.engine import layer_activation_costs
from memplan.job import Batch, Offload, Parallelism, Recompute, Sharding

# llama-3.2-1b: 16 layers, hidden 2048; bf16 activations; full recompute keeps each layer's input.
MODEL = load_model("llama-3.2-1b")
S, B, H, C, LAYERS = 1024, 2, 2048, 2, 16
INPUT = S * B * H * C
MiB = 1 << 20


#: 8-way data parallelism: ZeRO-1's gradient partition, allocated whole at the reduction beside the full gradients
#: (memplan.estimate.zero12_bucket), is an eighth of the model, so the peak stays where the switches act (at DP 1 it
#: is all the model's gradients again and the end of the backward is the peak).
DP = 8


def _job(tp: int = 2, pp: int = 1, mode: str = "full", **switches: object) -> Job:
    return Job(framework="deepspeed", parallel=Parallelism(world_size=tp * pp * DP, tp=tp, pp=pp),
               sharding=Sharding(zero=1), batch=Batch(micro_batch_size=B, seq_length=S, global_batch_size=B * 4 * DP),
               recompute=Recompute(mode=mode, **switches))  # type: ignore[arg-type]


def test_the_kept_input_is_the_layer_input() -> None:
    assert layer_activation_costs(MODEL, _job(), 0)[0] == INPUT == 8 * MiB


@pytest.mark.parametrize("tp", [2, 4])
def test_partition_keeps_one_tp_share_per_layer(tp: int) -> None:
    base, part = estimate(MODEL, _job(tp)).stages[0], estimate(MODEL, _job(tp, partition_activations=True)).stages[0]
    assert base.transformer_layer_activations_bytes == LAYERS * INPUT
    assert part.transformer_layer_activations_bytes == LAYERS * INPUT // tp
    assert base.peak_allocated_bytes - part.peak_allocated_bytes == LAYERS * (INPUT - INPUT // tp)
    assert part.cpu_activations_bytes == 0


@pytest.mark.parametrize("tp", [2, 4])
def test_cpu_checkpointing(tp: int) -> None:
    cpu = estimate(MODEL, _job(tp, cpu_checkpointing=True)).stages[0]
    # the offload engine leaves the newest input and the one being copied on the GPU
    assert cpu.transformer_layer_activations_bytes == 2 * INPUT
    assert cpu.cpu_activations_bytes == (LAYERS - 1) * INPUT
    both = estimate(MODEL, _job(tp, partition_activations=True, cpu_checkpointing=True)).stages[0]
    assert both.transformer_layer_activations_bytes == 0
    assert both.cpu_activations_bytes == LAYERS * INPUT // tp


@pytest.mark.parametrize("tp", [2, 4])
def test_contiguous_buffers(tp: int) -> None:
    part = estimate(MODEL, _job(tp, partition_activations=True)).stages[0]
    contiguous = estimate(MODEL, _job(tp, partition_activations=True, contiguous_checkpoints=20)).stages[0]
    # 20 buffers of one partition each: the 4 unused ones sit beside the activations at the loss
    assert contiguous.peak_phase == part.peak_phase == "loss"
    assert contiguous.activations_bytes - part.activations_bytes == (20 - LAYERS) * INPUT // tp
    on_cpu = estimate(MODEL, _job(tp, partition_activations=True, cpu_checkpointing=True,
                                  contiguous_checkpoints=20)).stages[0]
    assert on_cpu.cpu_activations_bytes == 20 * INPUT // tp
    assert on_cpu.transformer_layer_activations_bytes == 0


@pytest.mark.parametrize("tp", [2, 4])
def test_backward_gathers_or_fetches_the_full_input(tp: int) -> None:
    # pp 2: stage 0 has no head, its peak is a layer's backward with 2 micro-batches in flight
    def stage0(**switches: object):
        return estimate(MODEL, _job(tp, pp=2, **switches)).stages[0]

    base = stage0()
    assert base.peak_phase == "backward"
    # the gathered full input replaces the partition; a fetched one comes back whole
    extra = {
        "partition": (stage0(partition_activations=True), INPUT - INPUT // tp),
        "cpu": (stage0(cpu_checkpointing=True), INPUT),
        "both": (stage0(partition_activations=True, cpu_checkpointing=True), INPUT),
    }
    for name, (stage, gathered) in extra.items():
        assert stage.peak_phase == "backward", name
        assert stage.temporary_bytes - base.temporary_bytes == gathered, name


def test_contiguous_buffers_must_hold_a_warm_up() -> None:
    # stage 0 of pp 2 runs 2 forwards of 8 checkpointed layers before its first backward
    with pytest.raises(JobConfigError, match="--contiguous-checkpoints.*16"):
        estimate(MODEL, _job(2, pp=2, partition_activations=True, contiguous_checkpoints=15))
    ok = estimate(MODEL, _job(2, pp=2, partition_activations=True, contiguous_checkpoints=16))
    part = estimate(MODEL, _job(2, pp=2, partition_activations=True))
    # after a backward a forward fills 8 of 16 fresh buffers: 8 unused beside 2 micro-batches' inputs
    assert ok.stages[0].forward_activations_bytes - part.stages[0].forward_activations_bytes == 8 * INPUT // 2


def test_tp_1_partition_is_the_whole_input() -> None:
    plain, part = estimate(MODEL, _job(1)), estimate(MODEL, _job(1, partition_activations=True))
    assert part.stages[0].peak_allocated_bytes == plain.stages[0].peak_allocated_bytes


def test_no_effect_without_full_recompute() -> None:
    for mode in ("none", "selective"):
        plain = estimate(MODEL, _job(2, mode=mode))
        switched = estimate(MODEL, _job(2, mode=mode, partition_activations=True, cpu_checkpointing=True))
        assert switched.stages[0].peak_allocated_bytes == plain.stages[0].peak_allocated_bytes
        assert any("have no effect" in a and f"--recompute {mode}" in a for a in switched.assumptions)
    full = estimate(MODEL, _job(2, partition_activations=True))
    assert any(a.startswith("DeepSpeed activation checkpointing: each recomputed layer's input is partitioned")
               for a in full.assumptions)


def test_refusals() -> None:
    with pytest.raises(JobConfigError, match="--partition-activations.*--framework deepspeed"):
        Job(recompute=Recompute(mode="full", partition_activations=True))
    with pytest.raises(JobConfigError, match="--offload-activations"):
        Job(framework="deepspeed", recompute=Recompute(mode="full", cpu_checkpointing=True),
            offload=Offload(activations=True))
    with pytest.raises(JobConfigError, match="--contiguous-checkpoints.*--partition-activations"):
        Recompute(mode="full", contiguous_checkpoints=8)
    with pytest.raises(JobConfigError, match="--contiguous-checkpoints"):
        Recompute(mode="full", partition_activations=True, contiguous_checkpoints=0)


def test_cli_flags_reach_the_estimate() -> None:
    import json

    from typer.testing import CliRunner

    from memplan.cli import app

    args = ["estimate", "llama-3.2-1b", "--framework", "deepspeed", "--recompute", "full", "--gpus", str(4 * DP),
            "--tp", "4",
            "--zero", "1", "--mbs", str(B), "--gbs", str(B * 4 * DP), "--seq", str(S), "--json"]  # as _job
    plain = json.loads(CliRunner().invoke(app, args).stdout)
    result = CliRunner().invoke(app, [*args, "--partition-activations", "--cpu-checkpointing",
                                      "--contiguous-checkpoints", "20"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["job"]["recompute"]["contiguous_checkpoints"] == 20
    [stage], [before] = data["stages"], plain["stages"]
    assert stage["cpu_activations_bytes"] == 20 * INPUT // 4
    assert before["transformer_layer_activations_bytes"] - stage["transformer_layer_activations_bytes"] == LAYERS * INPUT
    refused = CliRunner().invoke(app, [*args, "--contiguous-checkpoints", "20"])
    assert refused.exit_code == 2 and "--partition-activations" in refused.output


def test_fit_search_refuses_the_switches_it_would_drop() -> None:
    from typer.testing import CliRunner

    from memplan.cli import app

    refused = CliRunner().invoke(app, ["fit", "llama-3.2-1b", "--gpus", "8", "--framework", "deepspeed",
                                       "--partition-activations"])
    assert refused.exit_code == 2 and "--partition-activations: is chosen by the layout search" in refused.output


def test_fit_search_refuses_a_config_with_the_switches(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from memplan.cli import app

    # memplan fit reads a DeepSpeed config through Hugging Face TrainingArguments' deepspeed field
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"deepspeed": {"zero_optimization": {"stage": 1},
                                              "activation_checkpointing": {"partition_activations": True}}}))
    refused = CliRunner().invoke(app, ["fit", "llama-3.2-1b", "--gpus", "8", "--hf-args", str(path)])
    assert refused.exit_code == 2 and "activation_checkpointing: is not searched by memplan fit" in refused.output
