"""Activation policies (memplan.policies): resolved once per job, each framework's own list, the
refusals (one line, exit 2), and the memory-budget policy's bound."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from memplan import Job, load_model
from memplan.cli import app
from memplan.errors import JobConfigError
from memplan.estimate.engine import layer_activation_costs
from memplan.profiles.framework import PROFILES
from memplan.job import Batch, Recompute
from memplan.policies import POLICY_NAMES, framework_policies, resolve_policy

runner = CliRunner()


def _job(framework: str, mode: str, **recompute: object) -> Job:
    return Job(framework=framework, batch=Batch(micro_batch_size=2, seq_length=1024),  # type: ignore[arg-type]
               recompute=Recompute(mode=mode, **recompute))  # type: ignore[arg-type]


@pytest.mark.parametrize(("framework", "selective"), [
    ("megatron", "megatron-selective"), ("deepspeed", "attention-core"), ("torchtitan", "torchtitan-sac"),
    ("hf", "attention-module"),
])
def test_selective_is_the_frameworks_own_and_its_name_is_the_same_policy(framework: str, selective: str) -> None:
    by_alias, by_name = resolve_policy(_job(framework, "selective")), resolve_policy(_job(framework, selective))
    assert by_alias.name == by_name.name == selective
    model = load_model("llama-3.2-1b")
    assert layer_activation_costs(model, _job(framework, "selective"), 0) == \
        layer_activation_costs(model, _job(framework, selective), 0)


def test_parameters_travel_with_the_policy() -> None:
    full = resolve_policy(_job("megatron", "full", method="block", num_layers=3))
    assert (full.name, full.method, full.num_layers, full.label) == ("full", "block", 3, "full block x3")
    modules = resolve_policy(_job("megatron", "megatron-selective", modules="mlp,core_attn"))
    assert modules.modules == ("mlp", "core_attn")
    assert resolve_policy(_job("megatron", "selective")).modules == ("core_attn",)  # Megatron's default
    assert resolve_policy(_job("torchtitan", "memory-budget")).memory_budget == 0.5  # torchtitan's default
    ds = resolve_policy(Job(framework="deepspeed", recompute=Recompute(mode="full", partition_activations=True,
                                                                       cpu_checkpointing=True)))
    assert ds.partition_activations and ds.cpu_checkpointing


#: Every (framework, policy) pair the framework does not have.
MISSING = [(fw, name) for fw in PROFILES for name in POLICY_NAMES if name not in framework_policies(fw)]


@pytest.mark.parametrize(("framework", "policy"), MISSING)
def test_a_policy_the_framework_does_not_have_is_one_line_exit_2(framework: str, policy: str) -> None:
    with pytest.raises(JobConfigError, match=f"{policy} is not an activation policy of --framework {framework}"):
        _job(framework, policy)
    result = runner.invoke(app, ["estimate", "llama-3.2-1b", "--framework", framework, "--recompute", policy],
                           env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --recompute"), result.stderr


@pytest.mark.parametrize(("args", "says"), [
    (["--framework", "torchtitan", "--recompute", "full", "--memory-budget", "0.5"], "only applies with --recompute memory-budget"),
    (["--framework", "torchtitan", "--recompute", "memory-budget", "--memory-budget", "1.5"], "must be a number in [0, 1]"),
    (["--framework", "torchtitan", "--recompute", "torchtitan-sac", "--recompute-modules", "mlp"],
     "only applies with --recompute selective or megatron-selective"),
    (["--framework", "torchtitan", "--recompute", "selective", "--recompute-modules", "mlp"],
     "a Megatron-LM policy the chosen framework does not have"),
    (["--framework", "hf", "--recompute", "megatron-selective", "--recompute-modules", "mlp,mla_up_proj"],
     "mla_up_proj needs multi-latent attention"),
    (["--framework", "hf", "--recompute", "megatron-selective", "--peft", "lora"], "priced for full training only"),
])
def test_bad_policy_parameters_are_one_line_exit_2(args: list[str], says: str) -> None:
    result = runner.invoke(app, ["estimate", "llama-3.2-1b", *args], env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr


def test_memory_budget_lies_between_full_and_no_recompute() -> None:
    """torch's partitioner: budget 0 keeps the compiled region's inputs (full recompute's floor), 1 the
    default min-cut's saved values (bounded by eager autograd's); between, the budget's fraction."""
    model = load_model("llama-3.2-1b")
    kept = {b: layer_activation_costs(model, _job("torchtitan", "memory-budget", memory_budget=b), 0)[0]
            for b in (0.0, 0.25, 0.5, 1.0)}
    full = layer_activation_costs(model, _job("torchtitan", "full"), 0)[0]
    none = layer_activation_costs(model, _job("torchtitan", "none"), 0)[0]
    assert kept[0.0] == full and kept[1.0] == none
    assert abs(kept[0.5] - (full + (none - full) / 2)) <= 1
    assert kept[0.0] < kept[0.25] < kept[0.5] < kept[1.0]


def test_memory_budget_says_it_is_an_upper_bound() -> None:
    from memplan.estimate import estimate

    text = " ".join(estimate(load_model("llama-3.2-1b"), _job("torchtitan", "memory-budget",
                                                              memory_budget=0.3)).assumptions)
    assert "memory_budget 0.3" in text and "upper bound" in text


def test_uniform_groups_keep_one_input_per_group() -> None:
    """Megatron's uniform method checkpoints groups of N layers, each keeping only its input
    (transformer_block.py ``_checkpointed_forward``): 16 layers in groups of 4 keep 4 inputs."""
    from memplan.estimate import estimate

    model = load_model("llama-3.2-1b")
    layers = {n: estimate(model, _job("megatron", "full", method="uniform", num_layers=n)).stages[0]
              .transformer_layer_activations_bytes for n in (1, 4, 3)}
    assert layers[4] * 4 == layers[1]
    assert layers[3] * 16 == layers[1] * 6  # groups of 3 over 16 layers: 6 checkpoints (the last holds one)
