"""Every PyTorch training step keeps two cuBLAS workspaces (forward thread, autograd backward thread);
Megatron also keeps Transformer Engine's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.alloc.snapshot import safe_loads
from memplan.estimate import estimate
from memplan.frameworks.megatron_args import from_megatron_args
from memplan.profiles.framework import (
    HF,
    MEGATRON,
    TORCH_CUBLAS_WORKSPACE_BYTES,
    TORCH_CUBLAS_WORKSPACE_THREADS,
    TORCHTITAN,
)

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


def test_every_pytorch_profile_holds_the_forward_and_backward_workspaces() -> None:
    assert HF.workspace_bytes == TORCHTITAN.workspace_bytes == 64 * MiB


#: A plain PyTorch training step recorded on a real (pre-Hopper) GPU by someone else.
SNAPSHOT = Path(__file__).resolve().parents[3] / "shared" / "reference" / "snapshots" / \
    "01_silmont2000_cs336_mem_snapshot.pickle"
#: The pre-Hopper default workspace, ``:4096:2:16:8`` (CublasHandlePool.cpp): 2 x 4 MiB + 8 x 16 KiB.
PRE_HOPPER_WORKSPACE = 2 * 4096 * 1024 + 8 * 16 * 1024


@pytest.mark.skipif(not SNAPSHOT.exists(), reason="no real snapshots in ../shared/reference/snapshots")
def test_a_real_step_allocates_one_workspace_per_thread() -> None:
    trace = safe_loads(SNAPSHOT.read_bytes())["device_traces"][0]
    workspaces = [event for event in trace if event["action"] == "alloc" and event["size"] == PRE_HOPPER_WORKSPACE]
    frames = [[frame["name"] for frame in event["frames"]] for event in workspaces]
    assert len(workspaces) == TORCH_CUBLAS_WORKSPACE_THREADS
    assert all("at::cuda::getCurrentCUDABlasHandle()" in names for names in frames)
    on_autograd_thread = ["torch::autograd::Engine::thread_main" in " ".join(names) for names in frames]
    assert on_autograd_thread == [False, True]  # the forward's, then the backward's
    assert not [event for event in trace if event["action"] == "free_requested" and event["size"] == PRE_HOPPER_WORKSPACE]
