"""Reading Megatron launch files: every form detected from its content, launch-script variables."""

from __future__ import annotations

import json

import pytest

from memplan.errors import ConfigError
from memplan.frameworks.megatron_args import load_megatron_args


TINY_FLAGS = {"--num-layers": 4, "--hidden-size": 256, "--num-attention-heads": 4, "--seq-length": 512,
              "--max-position-embeddings": 512, "--tensor-model-parallel-size": 2, "--bf16": True}


@pytest.mark.parametrize("text", [
    "--num-layers: 4\n--hidden-size: 256\n--num-attention-heads: 4\n--seq-length: 512\n"
    "--max-position-embeddings: 512\n--tensor-model-parallel-size: 2\n--bf16: true\n",
    "# functional-test arguments\n\n--num-layers: 4\n--hidden-size: 256\n--num-attention-heads: 4\n"
    "--seq-length: 512\n--max-position-embeddings: 512\n--tensor-model-parallel-size: 2\n--bf16: true\n",
    "---\nMODEL_ARGS:\n  --num-layers: 4\n  --hidden-size: 256\n  --num-attention-heads: 4\n  --seq-length: 512\n"
    "  --max-position-embeddings: 512\n  --tensor-model-parallel-size: 2\n  --bf16: true\n",
    "%YAML 1.2\n---\nnum_layers: 4\nhidden_size: 256\nnum_attention_heads: 4\nseq_length: 512\n"
    "max_position_embeddings: 512\ntensor_model_parallel_size: 2\nbf16: true\n",
    json.dumps(TINY_FLAGS, indent=2),
    '\n  {"MODEL_ARGS": ' + json.dumps(TINY_FLAGS) + "}",
    "- --num-layers\n- 4\n- --hidden-size\n- 256\n- --num-attention-heads\n- 4\n- --seq-length\n- 512\n"
    "- --max-position-embeddings\n- 512\n- --tensor-model-parallel-size\n- 2\n- --bf16\n",
    '["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "512",'
    ' "--max-position-embeddings", "512", "--tensor-model-parallel-size", "2", "--bf16"]',
    "--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 512 "
    "--max-position-embeddings 512 --tensor-model-parallel-size 2 --bf16\n",
    "# args: one per line\n--num-layers 4\n--hidden-size 256\n--num-attention-heads 4\n--seq-length 512\n"
    "--max-position-embeddings 512\n--tensor-model-parallel-size=2\n--bf16\n",
    "python pretrain_gpt.py --data-path /a:/b \\\n  --num-layers 4 --hidden-size 256 --num-attention-heads 4 \\\n"
    "  --seq-length 512 --max-position-embeddings 512 --tensor-model-parallel-size 2 --bf16\n",
], ids=["yaml-flags", "yaml-comment-first", "yaml-document-start", "yaml-directive-underscores", "json",
        "json-model-args", "yaml-token-list", "json-token-list", "command-line", "one-flag-per-line",
        "continued-command"])
def test_every_file_form_is_detected_from_its_content(tmp_path, text):
    path = tmp_path / "args.txt"
    path.write_text(text)
    model, job = load_megatron_args(path, gpus=4)
    assert (model.num_layers, model.hidden_size, job.parallel.tp, job.batch.seq_length) == (4, 256, 2, 512)
    assert job.precision.name == "bf16-mixed"


LAUNCH_SCRIPT = """#!/bin/bash
set -euo pipefail
# Runs a small GPT model
GPUS_PER_NODE=8
TP=2
export SEQ=4096
GPT_ARGS="--num-layers 24 --hidden-size 1024 --num-attention-heads 16"
DISTRIBUTED_ARGS=(--nproc_per_node $GPUS_PER_NODE --nnodes 1)
declare -a TRAINING_ARGS=(
    --micro-batch-size ${MBS:-2}     # per GPU
    --global-batch-size $(( ${MBS:-2} * 8 ))
)
TRAINING_ARGS+=(--bf16)
if [ -z "$CHECKPOINT_PATH" ]; then echo "no checkpoint"; fi
torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \\
    $GPT_ARGS "${TRAINING_ARGS[@]}" \\
    --seq-length ${SEQ} --max-position-embeddings "$SEQ" \\
    --tensor-model-parallel-size $TP --vocab-size 32000 \\
    --save $CHECKPOINT_PATH --data-path $1 2>&1 | tee train.log
"""


def test_launch_script_variables_are_expanded(tmp_path):
    path = tmp_path / "train.sh"
    path.write_text(LAUNCH_SCRIPT)
    model, job = load_megatron_args(path, gpus=8)
    assert (model.num_layers, model.hidden_size, model.layers[0].attention.num_heads) == (24, 1024, 16)
    assert (job.parallel.tp, job.batch.seq_length) == (2, 4096)
    assert (job.batch.micro_batch_size, job.batch.global_batch_size) == (2, 16)
    assert job.precision.name == "bf16-mixed"


def test_unassigned_variable_is_reported_not_dropped(tmp_path):
    path = tmp_path / "train.sh"
    path.write_text("python pretrain_gpt.py $GPT_ARGS --tensor-model-parallel-size 2\n")
    with pytest.raises(ConfigError, match=r"--megatron-args: uses \$GPT_ARGS where flags are expected") as info:
        load_megatron_args(path, gpus=8)
    assert str(path) in str(info.value)
    path.write_text("$GPT_ARGS --num-layers 2\n")
    with pytest.raises(ConfigError, match=r"uses \$GPT_ARGS where flags are expected"):
        load_megatron_args(path, gpus=8)
    path.write_text("$LAUNCHER pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
                    "--tensor-model-parallel-size ${TP}\n")
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size: must be an integer .*never assigns"):
        load_megatron_args(path, gpus=8)


def test_script_starting_with_a_test_command_is_a_script(tmp_path):
    path = tmp_path / "train.sh"
    path.write_text('[ -n "$DEBUG" ] && set -x\nTP=2\npython pretrain_gpt.py --num-layers 2 --hidden-size 64 '
                    "--num-attention-heads 4 --tensor-model-parallel-size $TP\n")
    model, job = load_megatron_args(path, gpus=2)
    assert (model.num_layers, job.parallel.tp) == (2, 2)


def test_bracketed_values_of_the_functional_tests_are_several_arguments() -> None:
    """Megatron's functional tests write ``--recompute-modules: "[layernorm mlp]"``; their launcher strips the
    brackets and passes the words as separate arguments (tests/functional_tests/shell_test_utils/_run_training.sh)."""
    from memplan.frameworks.megatron_launch import parse_megatron_args

    args = parse_megatron_args({"--recompute-modules": "[layernorm mlp moe_act]", "--offload-modules": "[core_attn]",
                                "--moe-layer-freq": "([0]*3+[1]*12)", "--pipeline-model-parallel-layout": "Et*3|mL"})
    assert args["--recompute-modules"] == ["layernorm", "mlp", "moe_act"]
    assert args["--offload-modules"] == "core_attn"
    assert args["--moe-layer-freq"] == "([0]*3+[1]*12)"  # a Python expression, passed as one value
    assert args["--pipeline-model-parallel-layout"] == "Et*3|mL"
