"""Megatron's Muon (``--optimizer muon``): which parameters it steps, its states, its step's temporaries.

Megatron routes 2-D weights to Muon (one fp32 ``momentum_buffer`` each, Emerging-Optimizers'
``OrthogonalizedOptimizer``) and the embedding, output layer and 1-D tensors to Adam (two fp32
moments); bf16 training keeps an fp32 master copy of every parameter for both.
"""

from __future__ import annotations

import pytest

from memplan.errors import JobConfigError, UnsupportedError
from memplan.estimate import estimate
from memplan.estimate.optimizers import muon_step_bytes
from memplan.frameworks.megatron_args import from_megatron_args
from memplan.job import Batch, FineTuning, Job, Optimizer, Parallelism, Sharding
from memplan.model.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec

H, VOCAB, LAYERS = 256, 1024, 4


def _model() -> ModelSpec:
    attn = AttentionSpec(num_heads=4, num_kv_heads=4, head_dim=H // 4, v_head_dim=H // 4)
    layer = LayerSpec(attention=attn, mlp=MLPSpec(intermediate_size=4 * H))
    return ModelSpec(name="small", model_type="llama", hidden_size=H, vocab_size=VOCAB, layers=(layer,) * LAYERS)


def _job(**optimizer: object) -> Job:
    return Job(framework="megatron", batch=Batch(micro_batch_size=1, seq_length=64),
               optimizer=Optimizer(name="muon", **optimizer))  # type: ignore[arg-type]


#: q, k, v, o (4 h^2) and gate, up, down (3 x h x 4h) per layer: Muon's 2-D weights.
MUON_NUMEL = LAYERS * (4 * H * H + 3 * H * 4 * H)
#: Embedding and untied output layer (vocab x h), final norm, two RMSNorms per layer: Adam's.
ADAM_NUMEL = 2 * VOCAB * H + H + LAYERS * 2 * H


def test_states_split_between_muon_and_adam() -> None:
    s = estimate(_model(), _job()).stages[0]
    assert s.parameters_numel == MUON_NUMEL + ADAM_NUMEL
    assert s.optimizer_moments_bytes == 4 * MUON_NUMEL + 2 * 4 * ADAM_NUMEL
    assert s.master_weights_bytes == 4 * (MUON_NUMEL + ADAM_NUMEL)


def test_distributed_optimizer_shards_both_over_data_parallel() -> None:
    job = Job(framework="megatron", batch=Batch(micro_batch_size=1, seq_length=64), optimizer=Optimizer(name="muon"),
              parallel=Parallelism(world_size=2), sharding=Sharding(distributed_optimizer=True))
    s = estimate(_model(), job).stages[0]
    total = MUON_NUMEL + ADAM_NUMEL
    assert s.optimizer_moments_bytes == 4 * (total // 2 - ADAM_NUMEL // 2) + 2 * 4 * (ADAM_NUMEL // 2)


def test_step_peak_is_the_largest_matrix_one_gpu() -> None:
    # fc1 (gate+up) is 2048 x 256: normalized fp32 copy -> bf16 iterates -> fp32 result scaled twice:
    # three fp32 copies at once at the end.
    assert muon_step_bytes(_model(), _job(), (0,)) == 3 * 4 * (2 * 4 * H * H)
    nesterov = muon_step_bytes(_model(), _job(muon_nesterov=True), (0,))
    assert nesterov == 4 * 4 * (2 * 4 * H * H)


@pytest.mark.parametrize("mode, expected", [
    # all-gathered shards + their concatenation (two fp32 full matrices), the normalized fp32 copy and its bf16 cast
    ("duplicated", 2 * 4 * 2048 * H + 4 * 2048 * H + 2 * 2048 * H),
    # the local 1024 x 256 shard alone
    ("blockwise", 3 * 4 * 1024 * H),
    ("distributed", 3 * 4 * 1024 * H),
])
def test_tensor_parallel_modes(mode: str, expected: int) -> None:
    job = Job(framework="megatron", batch=Batch(micro_batch_size=1, seq_length=64),
              optimizer=Optimizer(name="muon", muon_tp_mode=mode),  # type: ignore[arg-type]
              parallel=Parallelism(world_size=2, tp=2))
    assert muon_step_bytes(_model(), job, (0,)) == expected


def test_distributed_mode_gram_matrix_of_the_unsplit_side() -> None:
    # Narrow attention (2 heads of 32: q is 64 x 256) split on rows over tp 2: the local 32 x 256 shard's
    # Gram matrix is 256 x 256 (its unsplit columns, all-reduced), larger than the shard; blockwise
    # orthogonalizes the shard alone, Gram matrix 32 x 32. Both follow fp32 copies of the local q, k, v.
    attn = AttentionSpec(num_heads=2, num_kv_heads=2, head_dim=32, v_head_dim=32)
    narrow = LayerSpec(attention=attn, mlp=MLPSpec(intermediate_size=64, gated=False))
    model = ModelSpec(name="n", model_type="llama", hidden_size=H, vocab_size=VOCAB, layers=(narrow,))
    local_q, qkv_copies = 32 * H, 4 * 3 * 32 * H

    def peak(mode: str) -> int:
        job = Job(framework="megatron", batch=Batch(micro_batch_size=1, seq_length=64),
                  optimizer=Optimizer(name="muon", muon_tp_mode=mode),  # type: ignore[arg-type]
                  parallel=Parallelism(world_size=2, tp=2))
        return muon_step_bytes(model, job, (0,))

    assert peak("distributed") == qkv_copies + 4 * local_q + 4 * H * H
    assert peak("blockwise") == qkv_copies + 12 * local_q


def test_megatron_args_map_muon() -> None:
    base = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 128 "
            "--max-position-embeddings 128 --micro-batch-size 1 --bf16 --vocab-size 1024 ")
    _, job = from_megatron_args(base + "--optimizer muon --muon-tp-mode blockwise --muon-nesterov", gpus=1)
    assert job.optimizer == Optimizer(name="muon", muon_tp_mode="blockwise", muon_nesterov=True)
    assert not job.sharding.distributed_optimizer
    _, job = from_megatron_args(base + "--optimizer dist_muon", gpus=2)
    assert job.optimizer.name == "muon" and job.sharding.distributed_optimizer
    with pytest.raises(UnsupportedError, match="--muon-scalar-optimizer"):
        from_megatron_args(base + "--optimizer muon --muon-scalar-optimizer lion", gpus=1)


def test_muon_is_megatrons_and_full_training() -> None:
    with pytest.raises(JobConfigError, match="--optimizer"):
        Job(framework="hf", optimizer=Optimizer(name="muon"))
    with pytest.raises(JobConfigError, match="full training"):
        Job(framework="megatron", optimizer=Optimizer(name="muon"), finetune=FineTuning(peft="lora"))


def test_learned_position_table_is_muons() -> None:
    """Megatron flags only the word embedding and output layer as embeddings: a learned position table
    (2-D) is stepped by Muon, and its Newton-Schulz step counts on the embedding stage."""
    attn = AttentionSpec(num_heads=4, num_kv_heads=4, head_dim=H // 4, v_head_dim=H // 4)
    layer = LayerSpec(attention=attn, mlp=MLPSpec(intermediate_size=H, gated=False))
    positions = 4096
    model = ModelSpec(name="p", model_type="gpt2", hidden_size=H, vocab_size=VOCAB, layers=(layer,),
                      tie_word_embeddings=True, position_embedding="learned", max_position_embeddings=positions)
    s = estimate(model, _job()).stages[0]
    muon = 4 * H * H + 2 * H * H + positions * H
    adam = VOCAB * H + H + 2 * H
    assert s.parameters_numel == muon + adam
    assert s.optimizer_moments_bytes == 4 * muon + 8 * adam
    assert muon_step_bytes(model, _job(), (0,), has_embedding=True) == 12 * positions * H
    assert muon_step_bytes(model, _job(), (0,)) < 12 * positions * H


def test_mla_projections_and_latent_norms() -> None:
    """MLA (no fused QKV to split): replicated down projections, column-parallel up projections; its
    two latent norms are 1-D, stepped by Adam."""
    attn = AttentionSpec(kind="mla", num_heads=4, num_kv_heads=4, head_dim=48, v_head_dim=32, q_lora_rank=96,
                         kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32)
    layer = LayerSpec(attention=attn, mlp=MLPSpec(intermediate_size=64, gated=False))
    model = ModelSpec(name="m", model_type="deepseek_v3", hidden_size=H, vocab_size=VOCAB, layers=(layer,))
    muon = (96 * H + 4 * 48 * 96 + (64 + 16) * H + 4 * (32 + 32) * 64 + H * 4 * 32  # MLA
            + 2 * 64 * H)  # MLP
    adam = 2 * VOCAB * H + H + 2 * H + 96 + 64
    s = estimate(model, _job()).stages[0]
    assert s.parameters_numel == muon + adam
    assert s.optimizer_moments_bytes == 4 * muon + 8 * adam
    # The largest matrix is the output projection (256 x 128), not a 192 x 256 direct query projection
    # (the query goes through its 96-rank latent); no QKV split copies.
    assert muon_step_bytes(model, _job(), (0,)) == 12 * H * 4 * 32


def test_tensor_parallel_biases_are_adams_on_their_rank() -> None:
    """GPT-2-like biases with tp 2: the QKV and fc1 biases are split, the output ones whole."""
    attn = AttentionSpec(num_heads=4, num_kv_heads=4, head_dim=H // 4, v_head_dim=H // 4, qkv_bias=True,
                         out_bias=True)
    layer = LayerSpec(attention=attn, mlp=MLPSpec(intermediate_size=4 * H, gated=False, bias=True))
    model = ModelSpec(name="b", model_type="gpt2", hidden_size=H, vocab_size=VOCAB, layers=(layer,),
                      norm="layernorm", norm_bias=True, tie_word_embeddings=True)
    job = Job(framework="megatron", batch=Batch(micro_batch_size=1, seq_length=64), optimizer=Optimizer(name="muon"),
              parallel=Parallelism(world_size=2, tp=2))
    s = estimate(model, job).stages[0]
    muon = (4 * H * H + 2 * 4 * H * H) // 2
    adam = VOCAB * H // 2 + 2 * H + 2 * 2 * H + 3 * H // 2 + H + 4 * H // 2 + H
    assert s.parameters_numel == muon + adam
    assert s.optimizer_moments_bytes == 4 * muon + 8 * adam
