"""A flag that only means something under another flag's value is refused without it (exit 2, one sentence
naming both), and accepted where the condition comes from a dialect file instead of a typed flag."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.cli import app

runner = CliRunner()

MEGATRON = ("--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --ffn-hidden-size 8192 --seq-length 2048 "
            "--max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 8 --bf16 --swiglu "
            "--vocab-size 32000 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
            "--use-distributed-optimizer --optimizer-cpu-offload")


@pytest.mark.parametrize(("flags", "needs"), [
    (["--adapter-dtype", "fp32"], "--peft lora or dora"),
    (["--optimizer-offload-fraction", "0.5"], "--offload-optimizer"),
    (["--cuda-graph-modules", "attn"], "--cuda-graph-impl local or transformer_engine"),
    (["--min-offloaded-tensor-size", "10"], "--offload-modules"),
    (["--activation-offload-fraction", "0.5"], "--offload-modules"),
    (["--offload-pp-delta", "100"], "--offload-modules"),
    (["--frozen-dtype", "fp32"], "frozen weights"),
    (["--checkpoint-reentrant"], "a --recompute policy"),
])
def test_a_flag_without_its_condition_is_refused(flags, needs):
    """These were accepted and changed nothing (the estimate was the same as without them)."""
    result = runner.invoke(app, ["estimate", "llama-3.2-1b", *flags])
    assert result.exit_code == 2, result.output
    assert f"{flags[0]}: only applies with {needs}" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("flags", [
    ["--peft", "lora", "--adapter-dtype", "bf16"],
    ["--offload-optimizer", "--optimizer-offload-fraction", "0.5", "--distributed-optimizer", "--gpus", "8"],
    ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn"],
    ["--offload-modules", "core_attn", "--min-offloaded-tensor-size", "10", "--activation-offload-fraction", "0.5"],
    ["--peft", "lora", "--frozen-dtype", "fp32"],
    ["--trainable", "layers.1", "--frozen-dtype", "fp32"],
])
def test_a_flag_with_its_condition_is_accepted(flags):
    result = runner.invoke(app, ["estimate", "llama-3.2-1b", *flags, "--json"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(("flags", "field", "value"), [
    (["--recompute-layers", "2"], ("recompute", "num_layers"), 2),
    (["--optimizer-offload-fraction", "0.5"], ("offload", "optimizer_fraction"), 0.5),
])
def test_the_condition_may_come_from_megatron_args(tmp_path, flags, field, value):
    """--megatron-args' --recompute-granularity full / --optimizer-cpu-offload are the conditions: a typed flag
    that refines them was refused as lacking them."""
    args = tmp_path / "args.txt"
    args.write_text(MEGATRON)
    result = runner.invoke(app, ["estimate", "--megatron-args", str(args), "--gpus", "8", *flags, "--json"])
    assert result.exit_code == 0, result.output
    job = json.loads(result.stdout)["job"]
    assert job[field[0]][field[1]] == value
