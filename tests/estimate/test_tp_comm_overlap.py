"""Megatron --tp-comm-overlap: Transformer Engine's userbuffers (outside the allocator) and the
3-stream cuBLAS workspace of the overlapped GEMMs (inside it), per TE's initialize_ub."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.errors import ConfigError
from memplan.estimate import estimate
from memplan.frameworks.megatron_args import from_megatron_args
from memplan.frameworks.megatron_flags import classify
from memplan.gpus import get_gpu

MiB = 2**20
S, B, H, TP = 1024, 2, 512, 2
ARGS = {"--num-layers": 4, "--hidden-size": H, "--num-attention-heads": 8, "--seq-length": S,
        "--max-position-embeddings": S, "--micro-batch-size": B, "--global-batch-size": 16, "--bf16": True,
        "--tensor-model-parallel-size": TP, "--sequence-parallel": True, "--vocab-size": 32000}
OVERLAP = {**ARGS, "--tp-comm-overlap": True}

#: One [S*B, H] bf16 buffer.
BF16_BUFFER = S * B * H * 2
#: userbuffers.h: REG0_OFFSET = 2*32 regions*32 NVLink + 2*(2*32*32 + 32 ops) + 8192 peers;
#: REG0_FLAGS = 1024 * 5 op types + 8192 peers * 32 regions * 3; LOCALSIZE = 4 bytes each.
LOCALSIZE = 4 * ((2 * 32 * 32 + 2 * (2 * 32 * 32 + 32) + 8192) + (1024 * 5 + 8192 * 32 * 3))
#: ... plus two 64 KiB flag pages and int32 send ids (one per rank) and receive ids (32 regions per rank).
PER_COMMUNICATOR = LOCALSIZE + 2 * 65536 + 4 * 8 + 4 * 32 * 8


def _stage(args: dict, gpus: int = 8):  # type: ignore[no-untyped-def]
    model, job = from_megatron_args(args, gpus=gpus)
    return estimate(model, job).stages[0]


def test_twelve_bf16_buffers_by_default() -> None:
    # TE's defaults: four ring-exchange all-gathers, two pipelined reduce-scatters, four bulk and two
    # external: none is a ring-exchange reduce-scatter, so every buffer is [S*B, H].
    assert LOCALSIZE == 3_223_808
    assert _stage(OVERLAP).outside_allocator_bytes == 12 * (BF16_BUFFER + PER_COMMUNICATOR)
    assert _stage(ARGS).outside_allocator_bytes == 0


def test_the_overlapped_gemms_workspace_is_in_the_allocator() -> None:
    three = 3 * (32 * MiB + 1024)  # _NUM_MAX_UB_STREAMS x get_cublas_workspace_size_bytes() on Hopper
    plain, overlap = _stage(ARGS), _stage(OVERLAP)
    assert overlap.workspace_bytes - plain.workspace_bytes == three
    assert overlap.peak_allocated_bytes - plain.peak_allocated_bytes == three


def test_local_layers_get_the_buffers_but_run_no_overlapped_gemm() -> None:
    local = {"--transformer-impl": "local", "--use-flash-attn": True}
    assert _stage({**OVERLAP, **local}).workspace_bytes == _stage({**ARGS, **local}).workspace_bytes
    assert _stage({**OVERLAP, **local}).outside_allocator_bytes == _stage(OVERLAP).outside_allocator_bytes


def test_fp8_all_gather_buffers_are_uint8() -> None:
    fp8 = {**OVERLAP, "--fp8-format": "hybrid"}
    # 8 all-gather GEMMs (qkv_fprop/dgrad, proj_dgrad/wgrad, fc1_fprop/dgrad, fc2_dgrad/wgrad) in uint8,
    # 4 reduce-scatter GEMMs in bf16
    expected = 8 * BF16_BUFFER // 2 + 4 * BF16_BUFFER + 12 * PER_COMMUNICATOR
    assert _stage(fp8).outside_allocator_bytes == expected
    # --first-last-layers-bf16 adds a second, bf16 set (one bf16 layer at each end by default)
    both = _stage({**fp8, "--first-last-layers-bf16": True}).outside_allocator_bytes
    assert both == expected + 12 * (BF16_BUFFER + PER_COMMUNICATOR)


def test_a_ring_exchange_reduce_scatter_keeps_2tp_minus_1_chunks(tmp_path: Path) -> None:
    cfg = tmp_path / "ub.yaml"
    cfg.write_text("fc2_fprop:\n  method: ring_exchange\n  aggregate: 0\nproj_fprop:\n  method: pipeline\n"
                   "  num_sm: 4\n")
    default = _stage(OVERLAP).outside_allocator_bytes
    ring = _stage({**OVERLAP, "--tp-comm-overlap-cfg": str(cfg)}).outside_allocator_bytes
    assert ring - default == BF16_BUFFER // TP * (2 * TP - 1) - BF16_BUFFER


def test_a_dgrad_off_bulk_reduce_scatters_and_its_wgrad_gathers(tmp_path: Path) -> None:
    cfg = tmp_path / "ub.yaml"
    cfg.write_text("qkv_dgrad:\n  method: ring_exchange\n")
    fp8 = {**OVERLAP, "--fp8-format": "hybrid"}
    # qkv_dgrad: a uint8 all-gather buffer becomes a bf16 ring-exchange reduce-scatter (3 chunks of half);
    # qkv_wgrad: a bf16 reduce-scatter becomes a bf16 all-gather not in TE's FP8 list (same size)
    moved = _stage({**fp8, "--tp-comm-overlap-cfg": str(cfg)}).outside_allocator_bytes
    assert moved - _stage(fp8).outside_allocator_bytes == BF16_BUFFER // TP * 3 - BF16_BUFFER // 2


def test_te_refusals_are_errors(tmp_path: Path) -> None:
    cfg = tmp_path / "ub.yaml"
    cfg.write_text("fc1_dgrad:\n  method: pipeline\nfc1_wgrad:\n  method: bulk\n")
    with pytest.raises(ConfigError, match="--tp-comm-overlap-cfg"):
        from_megatron_args({**OVERLAP, "--tp-comm-overlap-cfg": str(cfg)}, gpus=8)
    cfg.write_text("qkv_fprop:\n  method: pipeline\n")
    with pytest.raises(ConfigError, match="all-gather"):
        from_megatron_args({**OVERLAP, "--tp-comm-overlap-cfg": str(cfg)}, gpus=8)
    with pytest.raises(ConfigError, match="--tp-comm-overlap"):
        from_megatron_args({**OVERLAP, "--sequence-parallel": False}, gpus=8)


def test_an_absent_yaml_is_said_and_defaults_priced() -> None:
    model, job = from_megatron_args({**OVERLAP, "--tp-comm-overlap-cfg": "tests/nowhere/ub.yaml"}, gpus=8)
    est = estimate(model, job)
    assert est.stages[0].outside_allocator_bytes == _stage(OVERLAP).outside_allocator_bytes
    line = next(a for a in est.assumptions if "userbuffers" in a)
    assert "tests/nowhere/ub.yaml not found" in line and "outside PyTorch's allocator" in line


def test_the_userbuffers_count_against_the_gpu() -> None:
    model, job = from_megatron_args(OVERLAP, gpus=8)
    gpu = get_gpu("h100-80gb")
    est = estimate(model, job, gpu=gpu)
    assert est.outside_allocator_bytes == est.stages[0].outside_allocator_bytes > 0
    assert est.headroom_bytes == gpu.usable_bytes - est.peak_reserved_bytes - est.outside_allocator_bytes


def test_flags_are_classified() -> None:
    assert classify("--tp-comm-overlap")[0] == "modelled"  # type: ignore[index]
    assert classify("--tp-comm-overlap-cfg", "x.yaml")[0] == "modelled"  # type: ignore[index]
    for flag in ("--disable-tp-comm-bulk-dgrad", "--disable-tp-comm-bulk-wgrad", "--tp-comm-overlap-rs-dgrad",
                 "--tp-comm-bootstrap-backend"):
        assert classify(flag)[0] == "no-memory-effect", flag  # type: ignore[index]
