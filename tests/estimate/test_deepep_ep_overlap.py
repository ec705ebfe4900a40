"""Megatron's flex dispatcher with DeepEP (its buffer, outside the allocator) and the combined 1F1B
schedule of --overlap-moe-expert-parallel-comm (the next micro-batch's layer beside each backward layer)."""

from __future__ import annotations

import pytest

from memplan.errors import ConfigError
from memplan.estimate import estimate
from memplan.estimate.engine import layer_activation_costs
from memplan.frameworks.megatron_args import from_megatron_args
from memplan.frameworks.megatron_flags import classify

H, S, B = 512, 1024, 2
ARGS = {"--num-layers": 2, "--hidden-size": H, "--num-attention-heads": 8, "--seq-length": S,
        "--max-position-embeddings": S, "--micro-batch-size": B, "--global-batch-size": 16,
        "--num-experts": 16, "--moe-router-topk": 2, "--expert-model-parallel-size": 4,
        "--expert-tensor-parallel-size": 1, "--bf16": True, "--vocab-size": 128,
        "--hidden-dropout": 0.0, "--attention-dropout": 0.0, "--moe-token-dispatcher-type": "alltoall"}
FLEX = {**ARGS, "--moe-token-dispatcher-type": "flex"}
#: DeepEP's legacy buffer: 32 MiB workspace and 8 NVLink peers' barrier signal (int) and two pointers.
WORKSPACE, METADATA = 32 * 2**20, 8 * (4 + 8 + 8)
#: One token slot: bf16 hidden, SourceMeta (2 ints), 128 int64 top-k indices, 128 fp32 weights, 128 fp32 scales.
SLOT = H * 2 + 8 + 128 * 8 + 128 * 4 + 128 * 4


def _round128(n: int) -> int:
    return (n + 127) // 128 * 128


def _outside(args: dict, gpus: int = 8) -> int:
    model, job = from_megatron_args(args, gpus=gpus)
    return estimate(model, job).stages[0].outside_allocator_bytes


def test_deepep_buffer_within_one_nvlink_domain() -> None:
    # EP 4: 10 channels (20 SMs / 2) x 4 peers x 256 receive slots (dispatch and combine configs),
    # plus (2 x 1 RDMA rank + 3) int counters per channel and peer; no RDMA buffer
    nvl = _round128(10 * 4 * (2 * 1 + 3) * 4 + 10 * 4 * 256 * SLOT)
    assert _outside(FLEX) == nvl + METADATA + WORKSPACE
    assert _outside(ARGS) == 0  # the all-to-all dispatcher has no such buffer
    # 24 SMs: 12 channels
    nvl24 = _round128(12 * 4 * 5 * 4 + 12 * 4 * 256 * SLOT)
    assert _outside({**FLEX, "--moe-flex-dispatcher-num-sms": 24}) == nvl24 + METADATA + WORKSPACE


def test_deepep_buffer_across_two_nvlink_domains() -> None:
    args = {**FLEX, "--expert-model-parallel-size": 16, "--global-batch-size": 32}
    nvl = _round128(10 * 8 * (2 * 2 + 3) * 4 + 10 * 8 * 288 * SLOT)
    # RDMA: 2 ranks, send+receive copies of 128 slots rounded up to the send chunk (dispatch: 20 -> 140)
    # with an int4 more per slot, and (8 * 2 + 2) * 2 int counters per channel and rank
    rdma = _round128(10 * 2 * 18 * 2 * 4 + 10 * 2 * 140 * (SLOT + 16) * 2)
    assert _outside(args, gpus=16) == nvl + METADATA + WORKSPACE + rdma


def test_hybridep_buffer_within_one_nvlink_domain() -> None:
    # EP 4, 16 experts: 4 local. The dispatcher's input is S x B = 2048 tokens per rank; the buffer
    # holds every token of the 4-rank group landing on one rank: 8192 rows.
    rows = S * B * 4
    tokens = rows * H * 2  # 16-bit tokens, shared by dispatch and combine
    probs = rows * 4 * 4 * 4  # fp32, per local expert (4) and domain rank (4)
    scales = rows * (H // 128) * 4  # FP8 scales, allocated for 16-bit dispatch too
    flags = 2 * (S * B // 128) * 4 * 4  # per 128-token chunk and rank, dispatch and combine
    scratch = 108 * (4 + 4) * 8  # preprocessing states
    hybrid = {**FLEX, "--moe-flex-dispatcher-backend": "hybridep"}
    assert _outside(hybrid) == tokens + probs + scales + flags + scratch
    # At least 512 tokens per rank are provisioned
    short = {**hybrid, "--seq-length": 128, "--max-position-embeddings": 128, "--micro-batch-size": 1}
    assert _outside(short) == 512 * 4 * (H * 2 + 16 * 4 + (H // 128) * 4) + 2 * 4 * 4 * 4 + scratch


def test_other_flex_backends_and_bad_groups() -> None:
    assert _outside({**FLEX, "--moe-flex-dispatcher-backend": "ncclep"}) == 0  # not priced (reported)
    with pytest.raises(ConfigError, match="DeepEP"):
        _outside({**FLEX, "--expert-model-parallel-size": 1})


def _stage(args: dict):  # type: ignore[no-untyped-def]
    model, job = from_megatron_args(args, gpus=8)
    return model, job, estimate(model, job).stages[0]


def test_combined_1f1b_keeps_the_next_layers_attention_and_batch() -> None:
    model, job, plain = _stage(ARGS)
    _, _, overlap = _stage({**ARGS, "--overlap-moe-expert-parallel-comm": True})
    assert plain.peak_phase == overlap.peak_phase == "backward"
    layer = max(layer_activation_costs(model, job, i)[0] for i in range(2))
    # Identical layers: the worst moment is a layer's MLP backward beside the next micro-batch's
    # attention (its pre-dispatch part: the layer less its dispatched tokens and its GELU experts'
    # fc1 output, fc2 input and probability-weighted output, 4h wide; tp 1, ep 4, top-2)
    rows = S * B * 2
    attention_part = layer - 2 * rows * H - 3 * 2 * rows * 4 * H
    # int64 tokens, labels, position ids, an fp32 loss mask and a bool s x s mask
    batch = (3 * 8 + 4) * S * B + B * S * S
    assert overlap.peak_allocated_bytes - plain.peak_allocated_bytes == attention_part + batch
    assert overlap.input_bytes - plain.input_bytes == batch


def test_megatron_refusals() -> None:
    with pytest.raises(ConfigError, match="--overlap-moe-expert-parallel-comm"):
        from_megatron_args({**ARGS, "--overlap-moe-expert-parallel-comm": True,
                            "--moe-token-dispatcher-type": "allgather"}, gpus=8)
    with pytest.raises(ConfigError, match="--overlap-moe-expert-parallel-comm"):
        from_megatron_args({**ARGS, "--overlap-moe-expert-parallel-comm": True, "--expert-model-parallel-size": 1},
                           gpus=8)


def test_flags_are_classified() -> None:
    assert classify("--overlap-moe-expert-parallel-comm")[0] == "modelled"  # type: ignore[index]
    assert classify("--moe-token-dispatcher-type", "flex")[0] == "modelled"  # type: ignore[index]
    assert classify("--moe-flex-dispatcher-backend", "deepep")[0] == "modelled"  # type: ignore[index]
    assert classify("--moe-flex-dispatcher-backend", "hybridep")[0] == "modelled"  # type: ignore[index]
    assert classify("--moe-flex-dispatcher-backend", "ncclep")[0] == "not-modelled"  # type: ignore[index]
    assert classify("--moe-flex-dispatcher-num-sms", 24)[0] == "modelled"  # type: ignore[index]
