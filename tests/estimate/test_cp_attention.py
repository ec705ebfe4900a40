"""Transformer Engine's context-parallel attention: the same saved numel for every --cp-comm-type, and
the backward buffers of each (p2p ring buffers, all-gathered K/V, all-to-all copies)."""

from __future__ import annotations

import pytest

from memplan.errors import ConfigError
from memplan.estimate import estimate
from memplan.estimate.cp_attention import cp_backward_extra_bytes
from memplan.frameworks.megatron_args import from_megatron_args
from memplan.frameworks.megatron_flags import classify

KiB, MiB = 2**10, 2**20
S, B, CP = 1024, 2, 2
ARGS = {"--num-layers": 2, "--hidden-size": 512, "--num-attention-heads": 8, "--group-query-attention": True,
        "--num-query-groups": 2, "--seq-length": S, "--max-position-embeddings": S, "--micro-batch-size": B,
        "--global-batch-size": 8, "--context-parallel-size": CP, "--bf16": True, "--vocab-size": 128,
        "--hidden-dropout": 0.0, "--attention-dropout": 0.0}
# local tokens 512 x 2; bf16 q: 8 heads x 64, k and v: 2 heads x 64
Q = S // CP * B * 8 * 64 * 2
K = S // CP * B * 2 * 64 * 2
KV, OUT = 2 * K, Q


def _extra(kind: str, cp: int = CP) -> int:
    model, _ = from_megatron_args(ARGS, gpus=8)
    return cp_backward_extra_bytes(model.layers[0].attention, kind, cp=cp, tokens=S // CP * B, tp=1, act_bytes=2)


def test_sizes() -> None:
    assert (Q, K) == (1 * MiB, 256 * KiB)
    # p2p: dq accumulator + two [kv, dkv] ring buffers
    assert _extra("p2p") == Q + 4 * KV == 3 * MiB
    # allgather: dq, gathered k/v, full-sequence dk/dv, the reordered copy of dk
    assert _extra("allgather") == Q + CP * KV + CP * KV + CP * K
    # a2a: dout after its all-to-all, dq/dk/dv before the all-to-all back
    assert _extra("a2a") == OUT + Q + KV
    assert _extra("a2a+p2p") == _extra("a2a") + _extra("p2p")
    assert _extra("p2p", cp=1) == 0


def _stage(**overrides: object):  # type: ignore[no-untyped-def]
    model, job = from_megatron_args({**ARGS, **overrides}, gpus=8)
    return estimate(model, job).stages[0]


def test_the_comm_type_changes_only_the_backward_working_set() -> None:
    p2p, a2a = _stage(), _stage(**{"--cp-comm-type": "a2a"})
    assert p2p.peak_phase == a2a.peak_phase == "backward"
    assert p2p.transformer_layer_activations_bytes == a2a.transformer_layer_activations_bytes
    assert p2p.temporary_bytes - a2a.temporary_bytes == (Q + 4 * KV) - (OUT + Q + KV)


def test_per_layer_types_take_each_layers_own() -> None:
    pp2 = {"--pipeline-model-parallel-size": 2}
    mixed = _stage(**pp2, **{"--cp-comm-type": ["a2a", "allgather"]})  # stage 0 holds layer 0 (a2a)
    assert mixed.temporary_bytes == _stage(**pp2, **{"--cp-comm-type": "a2a"}).temporary_bytes
    assert mixed.temporary_bytes < _stage(**pp2, **{"--cp-comm-type": "allgather"}).temporary_bytes


def test_reader_and_flags() -> None:
    with pytest.raises(ConfigError, match="--cp-comm-type"):
        from_megatron_args({**ARGS, "--cp-comm-type": "ring"}, gpus=8)
    for value in ("p2p", "a2a", "allgather", "a2a+p2p"):
        assert classify("--cp-comm-type", value)[0] == "modelled"  # type: ignore[index]
    assert classify("--hierarchical-context-parallel-sizes")[0] == "no-memory-effect"  # type: ignore[index]


def test_the_mask_keeps_its_full_key_dimension() -> None:
    # int64 tokens, labels and position ids, fp32 loss mask on s/cp tokens; bool mask [b, 1, s/cp, s]
    local = S // CP
    assert _stage().input_bytes == (3 * 8 + 4) * local * B + B * local * S
