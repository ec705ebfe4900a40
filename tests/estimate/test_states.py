"""Model states: bytes per parameter for each precision x framework, sharding, vocab padding, ties.

Expected bytes per parameter (weights + gradients + master + moments), Adam unless stated:

* megatron ``*-mixed``: 2 + 4 (fp32 main-grad buffer) + 4 (fp32 master) + 8 (fp32 m, v) = 18;
  distributed optimizer: 6 + 12 / (DP x CP) (Megatron's ``theoretical_memory_usage.py``);
* deepspeed ``*-mixed``: 2 + 2 + 4 + 8 = 16 (ZeRO paper); ZeRO-3 too (DeepSpeed 0.19.8 keeps 16-bit gradient partitions; its fp32 copy is one sub-group at the step);
* hf ``*-mixed`` (torch.autocast): fp32 weights are the master: 4 + 4 + 8 = 16, and the 2-byte
  weight copies autocast makes are saved for backward (counted as activations);
* torchtitan ``*-mixed`` (FSDP2 MixedPrecisionPolicy): fp32 sharded weights, 4 + 4 + 8 = 16;
* pure ``bf16``/``fp16``: 2 + 2 + 4 (16-bit moments), no master; ``fp32``: 4 + 4 + 8.
"""

from __future__ import annotations

import dataclasses

import pytest

from memplan.estimate import estimate
from memplan.estimate.layout import pipeline_layout
from memplan.estimate.optimizers import small_tensors
from memplan.estimate.states import ADAM8BIT_BLOCK, padded_vocab, stage_params
from memplan.job import Batch, Job, Optimizer, Parallelism, Precision, PrecisionName, Sharding
from memplan.model.params import embedding_params, final_norm_params, head_params, total_params
from memplan.model.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec

HIDDEN = 256
#: Vocabulary already a multiple of 128 x 8, so no framework pads it and numel stays exact.
VOCAB = 1024


def small_model(*, tied: bool = False, layers: int = 4, vocab: int = VOCAB, hidden: int = HIDDEN) -> ModelSpec:
    attn = AttentionSpec(num_heads=4, num_kv_heads=4, head_dim=hidden // 4, v_head_dim=hidden // 4)
    layer = LayerSpec(attention=attn, mlp=MLPSpec(intermediate_size=4 * hidden))
    return ModelSpec(name="small", model_type="llama", hidden_size=hidden, vocab_size=vocab,
                     layers=(layer,) * layers, tie_word_embeddings=tied)


def gpt2_small() -> ModelSpec:
    """GPT-2 (124M): 12 layers, h=768, 12 heads, vocab 50257, learned positions, tied head."""
    h = 768
    attn = AttentionSpec(num_heads=12, num_kv_heads=12, head_dim=64, v_head_dim=64, qkv_bias=True, out_bias=True)
    mlp = MLPSpec(intermediate_size=4 * h, gated=False, bias=True, activation="gelu_new")
    return ModelSpec(name="gpt2", model_type="gpt2", hidden_size=h, vocab_size=50257,
                     layers=(LayerSpec(attention=attn, mlp=mlp),) * 12, norm="layernorm", norm_bias=True,
                     tie_word_embeddings=True, position_embedding="learned", max_position_embeddings=1024)


def job(**kw: object) -> Job:
    kw.setdefault("batch", Batch(micro_batch_size=1, seq_length=64))
    return Job(**kw)  # type: ignore[arg-type]


def per_param(model: ModelSpec, j: Job, stage: int = 0) -> tuple[float, float, float, float]:
    """(weights, gradients, master, moments) bytes per parameter held before sharding.

    With the optimizer implementation left to the framework, foreach is used: torch.optim's fused
    Adam adds a step tensor per parameter tensor on the GPU, not per parameter (tested apart)."""
    if j.optimizer.implementation == "auto":
        j = dataclasses.replace(j, optimizer=dataclasses.replace(j.optimizer, implementation="foreach"))
    s = estimate(model, j).stages[stage]
    n = s.parameters_numel
    return (s.parameters_bytes / n, s.gradients_bytes / n, s.master_weights_bytes / n, s.optimizer_moments_bytes / n)


# --------------------------------------------------------------------------- precision x framework

_PURE16 = (2, 2, 0, 4)
_FP32 = (4, 4, 0, 8)
BYTES_PER_PARAM = {
    ("megatron", "bf16-mixed"): (2, 4, 4, 8),
    ("megatron", "fp16-mixed"): (2, 4, 4, 8),
    ("deepspeed", "bf16-mixed"): (2, 2, 4, 8),
    ("deepspeed", "fp16-mixed"): (2, 2, 4, 8),
    ("hf", "bf16-mixed"): (4, 4, 0, 8),
    ("hf", "fp16-mixed"): (4, 4, 0, 8),
    ("torchtitan", "bf16-mixed"): (4, 4, 0, 8),
    ("torchtitan", "fp16-mixed"): (4, 4, 0, 8),
    **{(fw, p): _PURE16 for fw in ("megatron", "deepspeed", "hf", "torchtitan") for p in ("bf16", "fp16")},
    **{(fw, "fp32"): _FP32 for fw in ("megatron", "deepspeed", "hf", "torchtitan")},
}


@pytest.mark.parametrize("framework, precision", list(BYTES_PER_PARAM))
def test_bytes_per_parameter(framework: str, precision: PrecisionName) -> None:
    got = per_param(small_model(), job(framework=framework, precision=Precision(name=precision)))
    assert got == BYTES_PER_PARAM[framework, precision]


@pytest.mark.parametrize("framework", ["hf", "torchtitan", "megatron", "deepspeed"])
def test_fused_torch_adam_keeps_a_step_tensor_per_parameter_on_the_gpu(framework: str) -> None:
    """torch.optim's fused AdamW: one fp32 ``step`` per parameter tensor on the device; Megatron's and
    DeepSpeed's fused Adam count steps on the host."""
    from memplan.model.tensors import model_tensors

    model = small_model()
    fused = estimate(model, job(framework=framework, optimizer=Optimizer(implementation="fused"))).stages[0]
    foreach = estimate(model, job(framework=framework, optimizer=Optimizer(implementation="foreach"))).stages[0]
    steps = 4 * model_tensors(model) if framework in ("hf", "torchtitan") else 0
    assert fused.optimizer_moments_bytes - foreach.optimizer_moments_bytes == steps


def test_megatron_mixed_is_18_bytes() -> None:
    assert sum(per_param(small_model(), job(framework="megatron"))) == 18


def test_deepspeed_zero3_keeps_16bit_gradient_partitions() -> None:
    """DeepSpeed 0.19.8's ZeRO-3 keeps its gradient partitions in the model's dtype (grad_accum_dtype's default);
    the fp32 copy is made one sub-group at a time at the step (tests/estimate/test_zero3_buffers.py)."""
    j = job(framework="deepspeed", parallel=Parallelism(world_size=1), sharding=Sharding(zero=3))
    assert per_param(small_model(), j) == (2, 2, 4, 8)


@pytest.mark.parametrize("world, cp", [(2, 1), (4, 1), (8, 1), (8, 2), (16, 4)])
def test_megatron_distributed_optimizer_6_plus_12_over_dp(world: int, cp: int) -> None:
    model = small_model()
    j = job(framework="megatron", parallel=Parallelism(world_size=world, cp=cp),
            sharding=Sharding(distributed_optimizer=True))
    s = estimate(model, j).stages[0]
    assert s.parameters_numel % world == 0  # shards are exact, no ceil
    assert (s.parameters_bytes + s.gradients_bytes + s.optimizer_bytes) / s.parameters_numel == 6 + 12 / world


def test_hf_autocast_weight_copies_are_activations() -> None:
    """HF bf16-mixed: fp32 weights; autograd saves the bf16 copy of every weight a linear layer
    reads (2 bytes each): the decoder's linear weights and the output head, not the token
    embedding table or the norms."""
    from memplan.model.params import layer_non_gemm_params

    model = small_model()
    seq = 4096  # long enough for the loss, not the optimizer step, to be the peak
    s = estimate(model, job(framework="hf", batch=Batch(seq_length=seq))).stages[0]
    assert s.peak_phase in ("loss", "backward") and s.gradients_absent_at_peak_bytes == s.gradients_bytes
    sbh = seq * 1 * HIDDEN
    # final norm's fp32 input, its 1/rms per token and its fp32 normalized tensor + the bf16 output-layer input
    head = 4 * sbh + 4 * seq + 4 * sbh + 2 * sbh
    attn = model.layers[0].attention
    rope = 2 * seq * attn.head_dim * 4  # RoPE's fp32 cos and sin tables, saved once
    linear = sum(g.total - layer_non_gemm_params(layer, HIDDEN, model.norm_bias)
                 for g, layer in zip(model.layer_param_groups, model.layers))
    linear += model.vocab_size * HIDDEN  # the output head
    assert s.activations_bytes == s.transformer_layer_activations_bytes + 2 * linear + head + rope
    assert s.parameters_numel == total_params(model)


# --------------------------------------------------------------------------- optimizers and overrides


@pytest.mark.parametrize(
    "precision, momentum, expected",
    [("fp32", 0.9, (4, 4, 0, 4)), ("fp32", 0.0, (4, 4, 0, 0)), ("bf16", 0.9, (2, 2, 0, 2)),
     ("bf16-mixed", 0.9, (2, 4, 4, 4)), ("bf16-mixed", 0.0, (2, 4, 4, 0))],
)
def test_sgd(precision: PrecisionName, momentum: float, expected: tuple[int, ...]) -> None:
    j = job(framework="megatron", precision=Precision(name=precision),
            optimizer=Optimizer(name="sgd", momentum=momentum))
    assert per_param(small_model(), j) == expected


def test_adam8bit_two_bytes_plus_block_scales() -> None:
    """bitsandbytes: two uint8 moments plus one fp32 absmax per 256-element block of each; tensors
    under min_8bit_size (the norms here) keep two fp32 moments."""
    model = small_model()
    s = estimate(model, job(framework="megatron", optimizer=Optimizer(name="adam8bit"))).stages[0]
    n = s.parameters_numel
    small = small_tensors(model, s.layer_indices, has_head=True).below_8bit
    assert 0 < small < n
    q = n - small
    assert s.optimizer_moments_bytes == 2 * (q + 4 * -(-q // ADAM8BIT_BLOCK)) + 2 * 4 * small
    assert s.optimizer_moments_bytes / n == pytest.approx(2 + 8 / 256, abs=2e-2)
    assert s.master_weights_bytes == 4 * n


@pytest.mark.parametrize(
    "framework, precision, overrides, expected",
    [
        ("megatron", "bf16-mixed", {"grad_dtype": "bf16"}, (2, 2, 4, 8)),
        ("megatron", "bf16-mixed", {"optimizer_state_dtype": "bf16"}, (2, 4, 4, 4)),
        ("megatron", "bf16-mixed", {"master_dtype": "bf16"}, (2, 4, 0, 8)),  # master == weights
        ("megatron", "bf16", {"master_dtype": "fp32"}, (2, 2, 4, 4)),
        ("megatron", "bf16", {"optimizer_state_dtype": "fp32"}, (2, 2, 0, 8)),
        ("hf", "bf16-mixed", {"grad_dtype": "bfloat16"}, (4, 2, 0, 8)),
        ("deepspeed", "fp16-mixed", {"grad_dtype": "fp32"}, (2, 4, 4, 8)),
        ("torchtitan", "bf16-mixed", {"optimizer_state_dtype": "bf16"}, (4, 4, 0, 4)),
    ],
)
def test_dtype_overrides(framework: str, precision: PrecisionName, overrides: dict[str, str],
                         expected: tuple[int, ...]) -> None:
    j = job(framework=framework, precision=Precision(name=precision, **overrides))
    assert per_param(small_model(), j) == expected


# --------------------------------------------------------------------------- ZeRO and FSDP


@pytest.mark.parametrize("zero, expected", [(0, 16), (1, 4 + 12 / 8), (2, 2 + 14 / 8), (3, 16 / 8)])
def test_deepspeed_zero_stages(zero: int, expected: float) -> None:
    j = job(framework="deepspeed", parallel=Parallelism(world_size=8), sharding=Sharding(zero=zero))
    s = estimate(small_model(), j).stages[0]
    assert s.parameters_numel % 8 == 0
    assert (s.parameters_bytes + s.gradients_bytes + s.optimizer_bytes) / s.parameters_numel == expected


def test_zero_partitions_round_up() -> None:
    """A partition is ceil(numel / dp) elements: no parameter is lost to integer division."""
    attn = AttentionSpec(num_heads=5, num_kv_heads=5, head_dim=50, v_head_dim=50)
    layer = LayerSpec(attention=attn, mlp=MLPSpec(intermediate_size=1001))
    model = ModelSpec(name="odd", model_type="llama", hidden_size=250, vocab_size=1001, layers=(layer,) * 3)
    j = job(framework="deepspeed", parallel=Parallelism(world_size=8), sharding=Sharding(zero=3))
    s = estimate(model, j).stages[0]
    assert s.parameters_numel % 8
    assert s.parameters_bytes == 2 * -(-s.parameters_numel // 8)


@pytest.mark.parametrize(
    "world, shard_size, fsdp, divisor",
    [(8, None, "full", 8), (16, None, "full", 16), (16, None, "hybrid", 8), (16, 4, "hybrid", 4),
     (4, None, "hybrid", 4), (32, 16, "hybrid", 16)],
)
def test_fsdp_full_and_hybrid(world: int, shard_size: int | None, fsdp: str, divisor: int) -> None:
    """torchtitan FSDP2 mixed: 16 bytes/param sharded over DP (full) or the shard group (hybrid)."""
    j = job(framework="torchtitan", parallel=Parallelism(world_size=world), optimizer=Optimizer(implementation="foreach"),
            sharding=Sharding(fsdp=fsdp, fsdp_shard_size=shard_size))  # type: ignore[arg-type]
    s = estimate(small_model(), j).stages[0]
    n = s.parameters_numel
    assert n % divisor == 0
    assert (s.parameters_bytes, s.gradients_bytes, s.optimizer_bytes) == (4 * n // divisor, 4 * n // divisor,
                                                                          8 * n // divisor)


# --------------------------------------------------------------------------- vocabulary padding


@pytest.mark.parametrize("tp, rows", [(1, 50304), (2, 50432), (4, 50688), (8, 51200)])
def test_megatron_pads_gpt2_vocab_to_128_times_tp(tp: int, rows: int) -> None:
    model = gpt2_small()
    assert padded_vocab(model, tp, 128) == rows
    assert rows % (128 * tp) == 0 and rows - model.vocab_size < 128 * tp
    if 12 % tp:
        return  # GPT-2's 12 heads do not split over tp=8; the padding rule alone is checked
    j = job(framework="megatron", parallel=Parallelism(world_size=tp, tp=tp))
    s = estimate(model, j).stages[0]
    # The tied embedding is held once (pp=1), with padded rows split over TP.
    unpadded = total_params(model) - embedding_params(model)
    assert s.parameters_numel == rows * 768 // tp + (unpadded - _replicated(model)) // tp + _replicated(model)


def _replicated(model: ModelSpec) -> int:
    """Parameters every TP rank holds whole: norms, row-parallel biases, the position table."""
    from memplan.model.params import layer_params, position_embedding_params

    per_layer = layer_params(model.layers[0], model.hidden_size, model.norm_bias).replicated
    return model.num_layers * per_layer + final_norm_params(model) + position_embedding_params(model)


@pytest.mark.parametrize("framework", ["hf", "deepspeed", "torchtitan"])
def test_other_frameworks_do_not_pad(framework: str) -> None:
    s = estimate(gpt2_small(), job(framework=framework)).stages[0]
    assert s.parameters_numel == total_params(gpt2_small()) == 124_439_808


def test_vocab_divisible_by_override() -> None:
    """``--make-vocab-size-divisible-by 256``: 50257 -> 50432 rows (197 x 256), not 50304."""
    s = estimate(gpt2_small(), job(framework="megatron", vocab_divisible_by=256)).stages[0]
    assert s.parameters_numel == total_params(gpt2_small()) + (50432 - 50257) * 768


# --------------------------------------------------------------------------- tied embeddings and pp


def test_tied_embedding_counted_on_first_and_last_stage() -> None:
    model = small_model(tied=True, layers=4)
    j = job(framework="megatron", parallel=Parallelism(world_size=2, pp=2), batch=Batch(seq_length=64,
            global_batch_size=2))
    stages = pipeline_layout(model.num_layers, j.parallel, j.num_microbatches)
    first, last = (stage_params(model, j, s, VOCAB) for s in stages)
    emb = embedding_params(model)
    assert first.root == emb
    assert last.root == emb + final_norm_params(model)
    assert first.total + last.total == total_params(model) + emb  # the shared copy on the last stage
    est = estimate(model, j)
    assert sum(s.parameters_numel for s in est.stages) == total_params(model) + emb


def test_tied_embedding_counted_once_without_pipeline() -> None:
    model = small_model(tied=True)
    assert estimate(model, job(framework="megatron")).stages[0].parameters_numel == total_params(model)


def test_untied_head_on_last_stage_only() -> None:
    model = small_model(tied=False)
    j = job(framework="megatron", parallel=Parallelism(world_size=4, pp=4))
    est = estimate(model, j)
    assert sum(s.parameters_numel for s in est.stages) == total_params(model)
    assert est.stages[-1].parameters_numel - est.stages[1].parameters_numel == head_params(model) + final_norm_params(model)
    assert est.stages[0].parameters_numel - est.stages[1].parameters_numel == embedding_params(model)
