"""Transformer Engine's grouped GEMM keeps four extra cuBLAS workspaces (one per stream)."""

from __future__ import annotations

from memplan.estimate import estimate
from memplan.frameworks.megatron_args import from_megatron_args
from memplan.profiles.framework import TE_GROUPED_GEMM_WORKSPACE_BYTES, TE_GROUPED_GEMM_WORKSPACES
from memplan.job import Job, MoEOptions, Parallelism
from memplan.model import load_preset

FOUR_WORKSPACES = 4 * (32 * 2**20 + 256)

ARGS = {"--num-layers": 4, "--hidden-size": 512, "--num-attention-heads": 8, "--seq-length": 1024,
        "--max-position-embeddings": 1024, "--micro-batch-size": 2, "--global-batch-size": 16,
        "--num-experts": 8, "--moe-router-topk": 2, "--expert-model-parallel-size": 4, "--bf16": True,
        "--vocab-size": 32000}


def test_the_constant_is_four_hopper_workspaces() -> None:
    assert TE_GROUPED_GEMM_WORKSPACES * TE_GROUPED_GEMM_WORKSPACE_BYTES == FOUR_WORKSPACES


def test_grouped_gemm_adds_the_workspaces_to_a_moe_stage() -> None:
    model = load_preset("mixtral-8x7b")
    par = Parallelism(world_size=8, tp=2, ep=4)
    plain = estimate(model, Job(parallel=par)).stages[0]
    grouped = estimate(model, Job(parallel=par, moe=MoEOptions(grouped_gemm=True))).stages[0]
    assert grouped.workspace_bytes - plain.workspace_bytes == FOUR_WORKSPACES
    assert grouped.peak_allocated_bytes - plain.peak_allocated_bytes == FOUR_WORKSPACES


def test_a_dense_model_has_no_grouped_gemm() -> None:
    model = load_preset("llama-3.2-1b")
    plain = estimate(model, Job()).stages[0]
    flagged = estimate(model, Job(moe=MoEOptions(grouped_gemm=True))).stages[0]
    assert flagged.workspace_bytes == plain.workspace_bytes


def test_megatron_grouped_gemm_under_transformer_engine_only() -> None:
    _, te = from_megatron_args({**ARGS, "--moe-grouped-gemm": True}, gpus=8)
    _, local = from_megatron_args({**ARGS, "--moe-grouped-gemm": True, "--transformer-impl": "local"}, gpus=8)
    _, off = from_megatron_args(ARGS, gpus=8)
    assert te.moe.grouped_gemm and not local.moe.grouped_gemm and not off.moe.grouped_gemm
