"""Megatron's all-gather dispatcher keeps its gathered tokens in the persistent global memory buffer."""

from __future__ import annotations

from memplan.estimate import estimate
from memplan.frameworks.megatron_args import from_megatron_args

MiB = 2**20
S, B, H = 1024, 4, 512
ARGS = {"--num-layers": 2, "--hidden-size": H, "--num-attention-heads": 8, "--seq-length": S,
        "--max-position-embeddings": S, "--micro-batch-size": B, "--global-batch-size": 32,
        "--num-experts": 8, "--moe-router-topk": 2, "--tensor-model-parallel-size": 2, "--sequence-parallel": True,
        "--expert-model-parallel-size": 4, "--expert-tensor-parallel-size": 1, "--bf16": True,
        "--vocab-size": 32000}


def _workspace(**overrides: object) -> int:
    model, job = from_megatron_args({**ARGS, **overrides}, gpus=8)
    return estimate(model, job).stages[0].workspace_bytes


def test_the_buffer_holds_the_tokens_of_the_expert_tp_x_ep_group() -> None:
    # S*B/TP tokens per rank under SP, gathered over ETP*EP = 4 ranks, bf16 hidden states
    gathered = S * B // 2 * 4 * H * 2
    assert gathered == 8 * MiB
    assert _workspace() - _workspace(**{"--moe-token-dispatcher-type": "alltoall"}) == gathered


def test_context_parallel_splits_the_gathered_sequence() -> None:
    cp2 = {"--context-parallel-size": 2, "--tensor-model-parallel-size": 1, "--sequence-parallel": False,
           "--expert-model-parallel-size": 2}
    gathered = S // 2 * B * 2 * H * 2
    assert _workspace(**cp2) - _workspace(**cp2, **{"--moe-token-dispatcher-type": "alltoall"}) == gathered


def test_no_gather_without_expert_or_tensor_parallelism() -> None:
    solo = {"--tensor-model-parallel-size": 1, "--sequence-parallel": False, "--expert-model-parallel-size": 1}
    assert _workspace(**solo) == _workspace(**solo, **{"--moe-token-dispatcher-type": "alltoall"})
