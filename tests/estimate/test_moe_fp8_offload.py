"""MoE routing, multi-token prediction, FP8 and offload in the estimator, and their bad inputs."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from memplan import Batch, Job, MoEOptions, Offload, Parallelism, Precision, Sharding, estimate, load_model
from memplan.cli import app
from memplan.errors import ConfigError
from memplan.estimate.activations import ActivationShape, divided, layer_terms
from memplan.frameworks.megatron_args import from_megatron_args
from memplan.frameworks.megatron_model import moe_layer_pattern, pipeline_layout_chunks

GiB = 2**30


def _shape(**kw) -> ActivationShape:
    base = dict(seq=4096, kv_seq=4096, micro_batch=1, hidden=4096, tp=2, sequence_parallel=True, act_bytes=2,
                residual_bytes=2, attention="flash", dropout=False, kernels="fused")
    base.update(kw)
    return ActivationShape(**base)


def _term(layer, shape, name):
    return sum(divided(t, shape) for t in layer_terms(layer, shape) if t.name.startswith(name))


def test_expert_rows_scale_with_etp_and_imbalance():
    layer = load_model("mixtral-8x7b").layers[0]
    base = _shape()
    tokens_per_rank = 4096 // 2
    # Balanced: s*b/tp tokens x top-2 rows of h on each rank, at ETP 1.
    assert _term(layer, base, "dispatched tokens") == 2 * tokens_per_rank * 2 * 4096
    # ETP 2: every rank of an expert's ETP pair receives all of its rows.
    assert _term(layer, _shape(expert_tp=2), "dispatched tokens") == 2 * _term(layer, base, "dispatched tokens")
    # ...but keeps its FFN activations at f/etp width: the same bytes.
    assert _term(layer, _shape(expert_tp=2), "experts fc1") == _term(layer, base, "experts fc1")
    skew = _shape(routed_factor=1.5)
    assert _term(layer, skew, "experts fc2") == int(1.5 * _term(layer, base, "experts fc2"))
    # The combine keeps one row per routed copy on the source rank, whatever the skew.
    assert _term(layer, skew, "expert outputs") == _term(layer, base, "expert outputs")


def test_capacity_factor_caps_the_busiest_expert():
    assert MoEOptions(imbalance=3.0, capacity_factor=1.25).routed_token_factor == 1.25
    assert MoEOptions(imbalance=1.1, capacity_factor=1.25).routed_token_factor == pytest.approx(1.1)
    assert MoEOptions(imbalance=1.0, capacity_factor=2.0, pad_to_capacity=True).routed_token_factor == 2.0
    model = load_model("mixtral-8x7b")
    job = Job(parallel=Parallelism(world_size=8, ep=8), batch=Batch(seq_length=4096))
    skewed = dataclasses.replace(job, moe=MoEOptions(imbalance=2.0))
    capped = dataclasses.replace(job, moe=MoEOptions(imbalance=2.0, capacity_factor=1.0))
    acts = [estimate(model, j).stages[0].transformer_layer_activations_bytes for j in (job, skewed, capped)]
    assert acts[0] < acts[1] and acts[2] == acts[0]


def test_fp8_saves_gemm_inputs_in_one_byte_and_adds_weight_copies():
    model = load_model("llama-3.1-8b")
    job = Job(parallel=Parallelism(world_size=8, tp=8, sequence_parallel=True))
    fp8 = dataclasses.replace(job, precision=Precision(fp8="hybrid"))
    base, low = estimate(model, job).stages[0], estimate(model, fp8).stages[0]
    assert low.transformer_layer_activations_bytes < base.transformer_layer_activations_bytes
    assert low.fp8_weights_bytes > 0 and low.parameters_bytes == base.parameters_bytes + low.fp8_weights_bytes
    # FP8 weights + transpose replace the 16-bit weight instead of adding to it.
    params8 = dataclasses.replace(job, precision=Precision(fp8="hybrid", fp8_params=True))
    assert estimate(model, params8).stages[0].parameters_bytes == base.parameters_bytes


@pytest.mark.parametrize("fp8_params", [False, True])
def test_fp8_expert_weights_shard_over_the_expert_data_parallel_group(fp8_params):
    """Under FSDP the routed experts' FP8 copies shard as their weights do, over the expert data-parallel group
    (here 8 ranks, the dense group 4): they were divided by the dense group only, so on DeepSeek-V3 (64 GPUs,
    tp 8, pp 2, ep 1) the FP8 weights were 79 GB against 20 GB of parameters, and offloading the parameters
    left -59 GB of them in CPU memory."""
    model = load_model("mixtral-8x7b")
    job = Job(parallel=Parallelism(world_size=8, tp=2, ep=1, etp=1), sharding=Sharding(fsdp="full"),
              precision=Precision(fp8="hybrid", fp8_params=fp8_params))
    bf16 = estimate(model, dataclasses.replace(job, precision=Precision())).stages[0]
    stage = estimate(model, job).stages[0]
    # the GEMM weights (all but norms, routers, embeddings), as many as the sharded 16-bit ones hold:
    # reported as one byte each with --fp8-params (the FP8 weight replaces the 16-bit one), two without (an
    # FP8 copy and its transpose beside the 16-bit weight)
    gemm_numel = stage.fp8_weights_bytes if fp8_params else stage.fp8_weights_bytes // 2
    assert 0.97 * bf16.parameters_bytes < 2 * gemm_numel <= bf16.parameters_bytes
    offloaded = estimate(model, dataclasses.replace(job, offload=Offload(params=True))).stages[0]
    assert offloaded.cpu_parameters_bytes >= 0
    assert offloaded.parameters_bytes + offloaded.cpu_parameters_bytes == stage.parameters_bytes


def test_offload_moves_states_to_cpu_and_reports_them():
    model = load_model("llama-3.1-8b")
    job = Job(parallel=Parallelism(world_size=8), sharding=Sharding(zero=2), framework="deepspeed")
    gpu_only = estimate(model, job).stages[0]
    off = estimate(model, dataclasses.replace(job, offload=Offload(optimizer=True))).stages[0]
    assert off.optimizer_bytes == 0 and off.cpu_optimizer_bytes == gpu_only.optimizer_bytes
    assert off.gradients_bytes == 0 and off.cpu_gradients_bytes > 0  # ZeRO-Offload keeps fp32 grads on CPU
    assert off.peak_allocated_bytes < gpu_only.peak_allocated_bytes
    z3 = Job(parallel=Parallelism(world_size=8), sharding=Sharding(zero=3), framework="deepspeed",
             offload=Offload(optimizer=True, params=True))
    both = estimate(model, z3)
    assert both.stages[0].cpu_parameters_bytes > 0 and both.peak_cpu_bytes == both.stages[0].cpu_bytes
    acts = Job(parallel=Parallelism(world_size=1), batch=Batch(seq_length=8192), offload=Offload(activations=True))
    kept = estimate(model, acts).stages[0]
    assert kept.cpu_activations_bytes > 0
    assert kept.transformer_layer_activations_bytes < estimate(model, Job(batch=Batch(seq_length=8192))).stages[0].transformer_layer_activations_bytes


def test_megatron_keeps_its_gradient_buffer_on_gpu_when_offloading():
    model = load_model("llama-3.1-8b")
    job = Job(parallel=Parallelism(world_size=8), sharding=Sharding(distributed_optimizer=True),
              offload=Offload(optimizer=True, optimizer_fraction=0.5))
    stage = estimate(model, job).stages[0]
    assert stage.gradients_bytes > 0 and stage.cpu_optimizer_bytes == pytest.approx(stage.optimizer_bytes, rel=1e-6)


def test_mtp_adds_a_layer_and_logits_on_the_last_stage():
    model = load_model("deepseek-v2-lite")
    job = Job(parallel=Parallelism(world_size=9, pp=3), batch=Batch(seq_length=2048))
    with_mtp = dataclasses.replace(job, mtp_layers=1)
    a, b = estimate(model, job).stages, estimate(model, with_mtp).stages
    assert a[0].parameters_numel == b[0].parameters_numel
    assert b[-1].mtp_parameters_numel > 0
    assert b[-1].parameters_numel - a[-1].parameters_numel == b[-1].mtp_parameters_numel + model.vocab_size * model.hidden_size
    assert b[-1].logits_bytes == 2 * a[-1].logits_bytes


def test_megatron_moe_arguments():
    args = {"--num-layers": 4, "--hidden-size": 256, "--num-attention-heads": 4, "--num-experts": 8,
            "--moe-router-topk": 2, "--moe-ffn-hidden-size": 128, "--moe-shared-expert-intermediate-size": 256,
            "--moe-layer-freq": "([0]*1+[1]*3)", "--swiglu": True, "--disable-bias-linear": True,
            "--expert-model-parallel-size": 2, "--mtp-num-layers": 1, "--fp8-format": "hybrid", "--bf16": True,
            "--moe-token-dispatcher-type": "alltoall", "--vocab-size": 1000, "--tokenizer-type": "HuggingFaceTokenizer"}
    model, job = from_megatron_args(args, gpus=4)
    assert [layer.is_moe for layer in model.layers] == [False, True, True, True]
    moe = model.layers[1].moe
    assert (moe.num_experts, moe.top_k, moe.expert.intermediate_size, moe.shared_expert.intermediate_size) == (8, 2, 128, 256)
    assert job.parallel.ep == 2 and job.parallel.expert_tp == 1 and job.mtp_layers == 1
    assert job.precision.fp8 == "hybrid" and job.moe.dispatcher == "alltoall"
    assert moe_layer_pattern({"--moe-layer-freq": 2}, 4) == (True, False, True, False)
    assert pipeline_layout_chunks("Et*2|(tt|)*5t|tmL") == ((2, 2, 2, 2, 2, 2, 1, 1), True)


@pytest.mark.parametrize("args, field", [
    ({"--moe-layer-freq": "__import__('os')"}, "--moe-layer-freq"),
    ({"--moe-layer-freq": "[1]*3"}, "--moe-layer-freq"),
    ({"--moe-router-topk": 9}, "--moe-router-topk"),
    ({"--pipeline-model-parallel-layout": "Et|x|L", "--pipeline-model-parallel-size": 2}, "--pipeline-model-parallel-layout"),
])
def test_bad_megatron_moe_arguments(args, field):
    base = {"--num-layers": 4, "--hidden-size": 256, "--num-attention-heads": 4, "--num-experts": 8,
            "--vocab-size": 1000, "--tokenizer-type": "HuggingFaceTokenizer"}
    with pytest.raises(ConfigError, match=field):
        from_megatron_args({**base, **args}, gpus=2)


_BAD = [
    (["mixtral-8x7b", "--gpus", "6", "--ep", "3"], "--ep"),
    (["mixtral-8x7b", "--gpus", "8", "--ep", "4", "--etp", "4"], "--ep"),
    (["qwen3-30b-a3b", "--gpus", "8", "--ep", "16"], "--ep"),
    (["llama-3.1-8b", "--fp8", "hybrid", "--precision", "fp32"], "--fp8"),
    (["llama-3.1-8b", "--fp8", "e5m2"], "--fp8"),
    (["llama-3.1-8b", "--fp8-params"], "--fp8-params"),
    (["llama-3.1-8b", "--fp8", "hybrid", "--grad-dtype", "fp8"], "--grad-dtype"),
    (["llama-3.1-8b", "--offload-optimizer"], "--offload-optimizer"),
    (["llama-3.1-8b", "--gpus", "8", "--zero", "2", "--offload-params"], "--offload-params"),
    (["mixtral-8x7b", "--moe-imbalance", "0.5"], "--moe-imbalance"),
    (["mixtral-8x7b", "--capacity-factor", "-1"], "--capacity-factor"),
    (["mixtral-8x7b", "--pad-to-capacity"], "--pad-to-capacity"),
    (["mixtral-8x7b", "--moe-dispatcher", "magic"], "--moe-dispatcher"),
    (["llama-3.1-8b", "--gpus", "8", "--distributed-optimizer", "--offload-optimizer", "--optimizer-offload-fraction",
      "1.5"], "--optimizer-offload-fraction"),
]


@pytest.mark.parametrize("args, field", _BAD)
def test_bad_moe_fp8_offload_flags_exit_2(args, field):
    result = CliRunner().invoke(app, ["estimate", *args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0]


def test_config_with_top_k_above_experts_and_missing_mla_ranks(tmp_path):
    from importlib import resources

    folder = resources.files("memplan.model").joinpath("presets")
    mixtral = json.loads(folder.joinpath("mixtral-8x7b.json").read_text())
    mixtral["num_experts_per_tok"] = 9
    bad = tmp_path / "topk.json"
    bad.write_text(json.dumps(mixtral))
    result = CliRunner().invoke(app, ["estimate", str(bad)])
    assert result.exit_code == 2 and "num_experts_per_tok" in result.stderr
    deepseek = json.loads(folder.joinpath("deepseek-v2-lite.json").read_text())
    del deepseek["kv_lora_rank"]
    bad = tmp_path / "mla.json"
    bad.write_text(json.dumps(deepseek))
    result = CliRunner().invoke(app, ["estimate", str(bad)])
    assert result.exit_code == 2 and "kv_lora_rank" in result.stderr


def test_imbalance_is_per_expert_and_spreads_over_the_rank():
    from memplan.estimate.engine import rank_routed_factor

    model = load_model("deepseek-v2-lite")  # 64 routed experts
    job = Job(parallel=Parallelism(world_size=8, ep=8), moe=MoEOptions(imbalance=2.0))
    assert rank_routed_factor(model, job) == pytest.approx((2.0 + 7) / 8)
    assert rank_routed_factor(model, dataclasses.replace(job, parallel=Parallelism(world_size=8))) == 1.0
    padded = dataclasses.replace(job, moe=MoEOptions(capacity_factor=1.5, pad_to_capacity=True))
    assert rank_routed_factor(model, padded) == 1.5
    assert rank_routed_factor(load_model("llama-3.1-8b"), job) == 1.0


def test_dispatch_buffers_follow_the_dispatcher():
    from memplan.estimate.activations import dispatch_buffer_bytes

    layer = load_model("mixtral-8x7b").layers[0]
    a2a = dispatch_buffer_bytes(layer, _shape(ep=8))
    # all-to-all: send + receive buffers of tokens x top-k rows
    assert a2a == 2 * 4096 * (4096 // 2) * 2 * 2
    gathered = dispatch_buffer_bytes(layer, _shape(ep=8, dispatcher="allgather"))
    assert gathered == (4096 // 2) * 2 * 8 * (2 * 4096 + 8 * 5)
    assert dispatch_buffer_bytes(load_model("llama-3.1-8b").layers[0], _shape()) == 0


@pytest.mark.parametrize("extra, expected", [
    ({}, False),
    ({"--cpu-offloading": True}, True),
    ({"--cpu-offloading": True, "--cpu-offloading-activations": "false"}, False),
    ({"--cpu-offloading-activations": True}, False),
])
def test_megatron_activation_offload_flags(extra, expected):
    base = {"--num-layers": 2, "--hidden-size": 256, "--num-attention-heads": 4, "--vocab-size": 1000,
            "--tokenizer-type": "HuggingFaceTokenizer", "--bf16": True}
    _, job = from_megatron_args({**base, **extra}, gpus=1)
    assert job.offload.activations is expected


def test_moe_settings_on_a_dense_model_are_said_to_have_no_effect():
    """Never silent: MoE options a dense model cannot use are named in the assumptions (--ep, which changes the
    layout, is refused instead); an MoE model and a dense job without them get no such sentence."""
    dense = load_model("llama-3.2-1b")
    job = Job(parallel=Parallelism(world_size=2, tp=2, etp=2), moe=MoEOptions(capacity_factor=2.0, grouped_gemm=True))
    notes = [a for a in estimate(dense, job).assumptions if "no effect" in a]
    assert notes == ["--capacity-factor 2.0, --moe-grouped-gemm, --etp 2: no effect, llama-3.2-1b has no MoE layers "
                     "(the settings of routed experts)"]
    assert not [a for a in estimate(dense, Job()).assumptions if "no effect" in a]
    moe = load_model("mixtral-8x7b")
    assert not [a for a in estimate(moe, Job(parallel=Parallelism(world_size=8, ep=8), moe=MoEOptions(
        capacity_factor=2.0))).assumptions if "no effect" in a]
