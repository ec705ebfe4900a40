"""Megatron keeps two PyTorch cuBLAS workspaces (forward thread, autograd backward thread) and TE's own."""

from __future__ import annotations

from memplan.estimate import estimate
from memplan.frameworks.megatron_args import from_megatron_args
from memplan.frameworks.profiles import MEGATRON, TORCH_CUBLAS_WORKSPACE_BYTES, TORCH_CUBLAS_WORKSPACE_THREADS

MiB = 2**20

ARGS = {"--num-layers": 4, "--hidden-size": 512, "--num-attention-heads": 8, "--seq-length": 1024,
        "--max-position-embeddings": 1024, "--micro-batch-size": 2, "--global-batch-size": 16,
        "--bf16": True, "--vocab-size": 32000}


def test_two_torch_workspaces_of_32_mib_on_hopper() -> None:
    assert TORCH_CUBLAS_WORKSPACE_THREADS * TORCH_CUBLAS_WORKSPACE_BYTES == 64 * MiB


def test_megatron_profile_holds_forward_backward_and_te_workspaces() -> None:
    assert MEGATRON.workspace_bytes == 96 * MiB


def test_a_megatron_stage_carries_the_96_mib_in_its_peak() -> None:
    model, job = from_megatron_args(ARGS, gpus=8)
    stage = estimate(model, job).stages[0]
    assert stage.workspace_bytes == 96 * MiB
    states = stage.parameters_bytes + stage.gradients_bytes + stage.optimizer_bytes
    assert stage.peak_allocated_bytes >= states + 96 * MiB
