"""Megatron's "mpu" global memory buffer under --transformer-impl local: one tensor as large as the
largest request (sequence-parallel gathers, unfused attention scores, the all-gather MoE dispatcher);
and no Transformer Engine workspace."""

from __future__ import annotations

from memplan.estimate import estimate
from memplan.frameworks.megatron_args import from_megatron_args

MiB = 2**20
S, H, HEADS = 1024, 512, 8
ARGS = {"--num-layers": 2, "--hidden-size": H, "--num-attention-heads": HEADS, "--seq-length": S,
        "--max-position-embeddings": S, "--micro-batch-size": 2, "--global-batch-size": 16, "--bf16": True,
        "--vocab-size": 32000}
LOCAL = {"--transformer-impl": "local"}
#: Transformer Engine's own cuBLAS workspace (get_workspace, 32 MiB on Hopper): local layers run torch
#: matmuls, so a local run never makes it.
TE_WORKSPACE = 32 * MiB


def _workspace(args: dict) -> int:
    model, job = from_megatron_args(args, gpus=8)
    return estimate(model, job).stages[0].workspace_bytes


def test_unfused_attention_scores_buffer() -> None:
    # local DotProductAttention: baddbmm into a [b * heads, s, s] bf16 view of the buffer
    te_unfused = {**ARGS, "--attention-backend": "unfused"}
    assert _workspace({**ARGS, **LOCAL}) - _workspace(te_unfused) == 2 * HEADS * S * S * 2 - TE_WORKSPACE
    # flash attention asks for none
    assert _workspace(ARGS) - _workspace({**ARGS, **LOCAL, "--use-flash-attn": True}) == TE_WORKSPACE


def test_sequence_parallel_gather_and_the_largest_request() -> None:
    tp2 = {**ARGS, "--tensor-model-parallel-size": 2, "--sequence-parallel": True}
    # flash: only the [s * b, h] bf16 gather of the QKV / FC1 input
    assert _workspace({**tp2, **LOCAL, "--use-flash-attn": True}) - _workspace(tp2) == S * 2 * H * 2 - TE_WORKSPACE
    # unfused: the scores of heads / tp (16 MiB) are larger than the gather (2 MiB); one buffer
    unfused = _workspace({**tp2, **LOCAL}) - _workspace({**tp2, "--attention-backend": "unfused"})
    assert unfused == 2 * (HEADS // 2) * S * S * 2 - TE_WORKSPACE == 16 * MiB - TE_WORKSPACE


def test_shared_with_the_allgather_moe_dispatcher() -> None:
    moe = {**ARGS, "--num-experts": 8, "--moe-router-topk": 2, "--tensor-model-parallel-size": 2,
           "--sequence-parallel": True, "--expert-model-parallel-size": 4, "--expert-tensor-parallel-size": 1,
           "--micro-batch-size": 4, "--global-batch-size": 32}
    te = _workspace(moe) - _workspace({**moe, "--moe-token-dispatcher-type": "alltoall"})
    assert te == S * 4 // 2 * 4 * H * 2 == 8 * MiB  # the dispatcher's gather over etp * ep = 4 ranks
    # local with flash: the 4 MiB SP gather fits in the dispatcher's 8 MiB buffer
    flash = {**moe, **LOCAL, "--use-flash-attn": True}
    assert _workspace(flash) - _workspace({**flash, "--moe-token-dispatcher-type": "alltoall"}) == 4 * MiB
    # local unfused: the 32 MiB scores buffer serves the dispatcher too (the largest, not the sum)
    both = _workspace({**moe, **LOCAL})
    assert both - _workspace({**moe, "--attention-backend": "unfused"}) == (
        4 * (HEADS // 2) * S * S * 2 - 8 * MiB - TE_WORKSPACE)
