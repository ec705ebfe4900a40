"""Activation policies run by the tracer (memplan.trace.policies): Megatron's --recompute-modules
checkpoint the model's own sub-modules for real, and the policies it cannot run are refused in one
line (exit 2) before any model is built. Agreement with the estimator: tests/trace/test_agreement_grid.py."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.trace import trace

runner = CliRunner()
COMMON = {"seq": 128, "mbs": 2, "precision": "bf16-mixed", "device": "cpu", "iterations": 1, "attention": "eager"}


@pytest.mark.parametrize(("flags", "says"), [
    (["--framework", "torchtitan", "--recompute", "memory-budget"], "torch.compile's partitioner"),
    (["--recompute", "megatron-selective", "--recompute-modules", "core_attn,layernorm"], "layernorm has none there"),
    (["--recompute", "full", "--recompute-layers", "2"], "checkpoints single decoder layers"),
    (["--framework", "torchtitan", "--recompute", "attention-module"], "not an activation policy of --framework"),
])
def test_policies_the_tracer_cannot_run_are_one_line_exit_2(tiny_llama: str, flags: list[str], says: str) -> None:
    result = runner.invoke(app, ["trace", tiny_llama, "--seq", "64", *flags], env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr


def test_each_traced_module_checkpoint_drops_what_its_module_saves(tiny_llama: str, tiny_mixtral: str) -> None:
    """Checkpointing a sub-module keeps less than no recompute and more than checkpointing the layer."""
    def acts(model: str, recompute: str, **flags: object) -> int:
        result = trace(model, recompute=recompute, **COMMON, **flags)  # type: ignore[arg-type]
        return result.summary.max_by_category["activation"]

    none, full = acts(tiny_llama, "none"), acts(tiny_llama, "full")
    core = acts(tiny_llama, "megatron-selective", recompute_modules="core_attn")
    mlp = acts(tiny_llama, "megatron-selective", recompute_modules="mlp")
    both = acts(tiny_llama, "megatron-selective", recompute_modules="core_attn,mlp")
    assert full < both < min(core, mlp) and max(core, mlp) < none
    moe_none = acts(tiny_mixtral, "none", moe_routing="balanced")
    moe = acts(tiny_mixtral, "megatron-selective", recompute_modules="moe", moe_routing="balanced")
    assert moe < moe_none
    # "mlp" is the dense MLP only: a MoE model's layers have none, as in Megatron
    assert acts(tiny_mixtral, "megatron-selective", recompute_modules="mlp", moe_routing="balanced") == moe_none
