"""Megatron-LM argument mapping, and accuracy against the Megatron CI measurements."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

from memplan.errors import ConfigError, ModelConfigError, UnsupportedError
from memplan.estimate import estimate
from memplan.frameworks.megatron_args import from_megatron_args, load_megatron_args, parse_megatron_args
from memplan.model.params import total_params

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO.parent / "shared" / "reference" / "megatron_ci_h100.json"

GPT_SMALL = """
python pretrain_gpt.py \\
  --num-layers 12 --hidden-size 512 --num-attention-heads 8 \\
  --seq-length 1024 --max-position-embeddings 1024 \\
  --micro-batch-size 4 --global-batch-size 32 \\
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
  --vocab-file vocab.json --merge-file merges.txt \\
  --bf16 --use-distributed-optimizer --sequence-parallel
"""


def test_command_line_parsing_handles_switches_values_and_continuations():
    args = parse_megatron_args(GPT_SMALL)
    assert args["--num-layers"] == "12"
    assert args["--bf16"] is True
    assert args["--sequence-parallel"] is True
    assert parse_megatron_args(["--data-path", "a", "b", "--x=3"]) == {"--data-path": ["a", "b"], "--x": "3"}


def test_megatron_defaults_gpt2_vocab_learned_positions_and_biases():
    model, job = from_megatron_args(GPT_SMALL, gpus=8)
    assert model.vocab_size == 50257  # GPT2BPETokenizer
    assert model.position_embedding == "learned"
    assert model.tie_word_embeddings
    layer = model.layers[0]
    assert layer.mlp is not None and layer.mlp.intermediate_size == 4 * 512 and not layer.mlp.gated
    assert layer.attention.qkv_bias and layer.attention.out_bias
    # 12 layers of 12h^2 + 13h, embeddings, learned positions, final LayerNorm
    h = 512
    expected = 12 * (12 * h * h + 13 * h) + 50257 * h + 1024 * h + 2 * h
    assert total_params(model) == expected
    assert job.parallel.dp == 2 and job.parallel.sequence_parallel
    assert job.sharding.distributed_optimizer
    assert job.precision.name == "bf16-mixed"
    assert job.dropout == pytest.approx(0.1)  # Megatron's default hidden/attention dropout
    assert job.attention == "flash"


def test_vocab_is_padded_to_128_times_tp():
    model, job = from_megatron_args(GPT_SMALL, gpus=8)
    result = estimate(model, job)
    assert "padded to 50432 rows" in " ".join(result.assumptions)  # 50257 -> multiple of 256


def test_swiglu_default_ffn_and_null_tokenizer_vocab():
    model, _ = from_megatron_args(
        "--num-layers 2 --hidden-size 4096 --num-attention-heads 32 --swiglu "
        "--tokenizer-type NullTokenizer --vocab-size 131072 --seq-length 128",
        gpus=1,
    )
    assert model.layers[0].mlp.intermediate_size == 10880  # int(4h*2/3 / 64) * 64
    assert model.vocab_size == 131073  # NullTokenizer adds an end-of-document id


def test_unfused_backend_keeps_scores_and_interleaving_is_mapped():
    _, job = from_megatron_args(
        GPT_SMALL + " --attention-backend unfused --num-layers-per-virtual-pipeline-stage 3", gpus=8
    )
    assert job.attention == "eager"
    assert job.parallel.vpp == 2


@pytest.mark.parametrize(
    "extra, arch",
    [
        ("--encoder-num-layers 12", "T5"),
        ("--bert-no-binary-head", "BERT"),
        ("--hybrid-layer-pattern M*M*", "hybrid Mamba"),
        ("--vision-model-type clip", "multimodal"),
    ],
)
def test_unsupported_architectures_are_refused(extra, arch):
    with pytest.raises(UnsupportedError, match=arch):
        from_megatron_args(GPT_SMALL + " " + extra, gpus=8)


def test_missing_hidden_size_names_the_flag():
    with pytest.raises(ModelConfigError, match="--hidden-size"):
        from_megatron_args("--num-layers 2 --num-attention-heads 8", gpus=1)


def test_yaml_file_with_model_args_and_bad_yaml(tmp_path):
    good = tmp_path / "args.yaml"
    good.write_text("MODEL_ARGS:\n  --num-layers: 4\n  --hidden-size: 256\n  --num-attention-heads: 4\n  --bf16: true\n")
    model, job = load_megatron_args(good, gpus=2)
    assert model.num_layers == 4 and job.parallel.dp == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("MODEL_ARGS: {--num-layers: [4\n")
    with pytest.raises(ConfigError, match="--megatron-args"):
        load_megatron_args(bad, gpus=2)


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("accuracy_megatron", REPO / "benchmarks" / "accuracy_megatron.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not REFERENCE.exists(), reason="shared reference data not present beside the checkout")
def test_accuracy_on_dense_megatron_ci_cases():
    """Dense cases with a recorded world size: median |error| <= 1.5% (issue 13 asks 2.5%); no case
    worse than 12% (issue 13's target; the TP-comm-overlap FP8 case, -12.9% before TE's userbuffer
    workspace was priced, is -1.5%)."""
    bench = _load_benchmark()
    cases = [c for c in json.loads(REFERENCE.read_text())["cases"] if bench.in_scope(c)]
    rows = [bench.evaluate(c) for c in cases]
    compared = bench.compared_rows(rows, recorded=True)
    assert len(compared) >= 40
    errors = [abs(r["rel_error"]) for r in compared]
    assert statistics.median(errors) <= 0.015
    assert max(errors) <= 0.12


@pytest.mark.skipif(not REFERENCE.exists(), reason="shared reference data not present beside the checkout")
def test_accuracy_on_moe_megatron_ci_cases():
    """MoE cases with a recorded world size: median |error| <= 4% and no case worse than 10% (issue 13
    asks 4% and 15%)."""
    bench = _load_benchmark()
    cases = [c for c in json.loads(REFERENCE.read_text())["cases"] if bench.in_scope(c, "moe")]
    rows = [bench.evaluate(c) for c in cases]
    compared = bench.compared_rows(rows, recorded=True)
    assert len(cases) == 18 and len(compared) == 10
    errors = sorted(abs(r["rel_error"]) for r in compared)
    assert statistics.median(errors) <= 0.04
    assert errors[-1] <= 0.10


@pytest.mark.skipif(not REFERENCE.exists(), reason="shared reference data not present beside the checkout")
def test_recipes_without_a_recorded_world_size_are_apart_and_not_fitted_to_the_measurement():
    bench = _load_benchmark()
    cases = [c for c in json.loads(REFERENCE.read_text())["cases"] if bench.in_scope(c, "all")]
    for case in cases:
        if not case.get("nodes"):
            row = bench.evaluate(case)
            assert row["gpus_recorded"] is False and row["gpus"] == bench.world_size(case)

