"""Megatron's expert-parallel overlap options: the combined 1F1B step's moments, delayed weight
gradients, early attention release, the experts' wgrad beside the dispatch backward, and the
overlapped shared expert. Expected bytes are worked out here from the shapes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import ConfigError
from memplan.estimate import estimate
from memplan.estimate.activations import ActivationShape
from memplan.estimate.engine import layer_activation_costs
from memplan.estimate.ep_overlap import (
    LayerParts,
    attention_wgrad_held,
    combined_step_extra,
    dispatch_backward_extra,
    expert_wgrad_held,
)
from memplan.frameworks.megatron_args import from_megatron_args
from memplan.frameworks.megatron_flags import classify

C, H, S, B, HEADS = 2, 512, 1024, 2, 8
T = S * B  # tokens of a micro-batch (tp 1, cp 1)
F_DENSE, F_EXPERT, TOPK, EXPERTS = 1024, 256, 2, 16
ROWS = T * TOPK  # the experts' rows on a rank (balanced routing, etp 1)
#: A dense layer then an MoE layer, SwiGLU, LayerNorm, flash attention, bf16, no dropout.
MIXED = {"--num-layers": 2, "--hidden-size": H, "--num-attention-heads": HEADS, "--seq-length": S,
         "--max-position-embeddings": S, "--micro-batch-size": B, "--global-batch-size": 16,
         "--num-experts": EXPERTS, "--moe-router-topk": TOPK, "--expert-model-parallel-size": 4,
         "--expert-tensor-parallel-size": 1, "--bf16": True, "--vocab-size": 128, "--hidden-dropout": 0.0,
         "--attention-dropout": 0.0, "--moe-token-dispatcher-type": "alltoall", "--swiglu": True,
         "--moe-layer-freq": "([0]*1+[1]*1)", "--ffn-hidden-size": F_DENSE, "--moe-ffn-hidden-size": F_EXPERT,
         "--overlap-moe-expert-parallel-comm": True}
EARLY, DELAY = "--ep-overlap-early-attn-memory-release", "--delay-wgrad-compute"

# What each layer keeps, by the combined 1F1B schedule's node.
ATTENTION = C * T * H * 6 + 4 * HEADS * T  # norm in/out, q k v (3h), proj input; fp32 log-sum-exp
P_DENSE, M_DENSE = ATTENTION, C * T * H * 2 + C * T * 2 * F_DENSE + C * T * F_DENSE  # fused-LN fc1, fc1 out, fc2 in
# MoE pre-dispatch: the attention, the pre-MLP norm (in/out), fp32 logits + scores + bool map, int64 index + fp32 prob
P_MOE = ATTENTION + C * T * H * 2 + T * EXPERTS * 9 + ROWS * 12
D_MOE, M_MOE = C * ROWS * H, C * ROWS * 2 * F_EXPERT + C * ROWS * F_EXPERT
X_MOE = C * H * (ROWS + ROWS)  # the dispatch's permuted send and received tokens
G_DENSE, G_MOE = C * T * H, C * ROWS * H  # the MLP node's input gradient
# --delay-wgrad-compute: each GEMM's input and output gradient (tp 1: nothing divided)
HELD_ATTN = C * T * (H + 3 * H) + C * T * (H + H)  # qkv: input, grad (3h); proj: input, grad
HELD_DENSE = C * T * (H + 2 * F_DENSE) + C * T * (F_DENSE + H)
HELD_MOE = C * ROWS * (H + 2 * F_EXPERT) + C * ROWS * (F_EXPERT + H)


def _build(args: dict):  # type: ignore[no-untyped-def]
    return from_megatron_args(args, gpus=8)


def _stage(args: dict):  # type: ignore[no-untyped-def]
    model, job = _build(args)
    return model, job, estimate(model, job).stages[0]


def _layers(args: dict) -> list[tuple[int, int]]:  # type: ignore[type-arg]
    model, job = _build(args)
    return [layer_activation_costs(model, job, i)[::2] for i in range(2)]


def test_layer_split_matches_the_shapes() -> None:
    (kept_d, t_d), (kept_m, t_m) = _layers(MIXED)
    assert kept_d == P_DENSE + M_DENSE and kept_m == P_MOE + D_MOE + M_MOE
    assert t_d == 2 * C * T * 2 * F_DENSE and t_m == 2 * X_MOE  # twice the largest term / the dispatch buffers


def _expected_extra(*, early: bool, delay: bool) -> int:
    (kept_d, t_d), (kept_m, t_m) = _layers(MIXED)
    dense = {"kept": kept_d, "p": P_DENSE, "d": 0, "m": M_DENSE, "t": t_d, "x": 0, "g": G_DENSE,
             "w": HELD_DENSE * delay, "a": HELD_ATTN * delay}
    moe = {"kept": kept_m, "p": P_MOE, "d": D_MOE, "m": M_MOE, "t": t_m, "x": X_MOE, "g": G_MOE,
           "w": HELD_MOE * delay, "a": HELD_ATTN * delay}
    both = (dense, moe)
    extra = []  # each moment beyond what b keeps and its worst backward step (priced already)
    for b in both:
        for f in both:
            moments = (b["kept"] + b["t"] + f["p"],  # b's MLP backward beside f's attention
                       b["p"] + b["g"] + b["w"] + f["p"] + f["d"] + f["x"],  # f's dispatch
                       # b's attention backward before f's MLP (early) or after f's combine
                       b["p"] + b["t"] + f["p"] + f["d"] + (0 if early else f["m"]),
                       b["a"] + f["kept"])  # b gone but its delayed attention GEMMs' operands, f's layer
            extra += [moment - b["kept"] - b["t"] for moment in moments]
    return max(extra)


def test_combined_1f1b_prices_the_layer_pairs_worst_moment() -> None:
    plain = {k: v for k, v in MIXED.items() if k != "--overlap-moe-expert-parallel-comm"}
    _, _, without = _stage(plain)
    _, _, step = _stage(MIXED)
    assert without.peak_phase == step.peak_phase == "backward"
    batch = (3 * 8 + 4) * S * B + B * S * S  # int64 tokens, labels, positions; fp32 loss mask; bool s x s mask
    assert step.peak_allocated_bytes - without.peak_allocated_bytes == _expected_extra(early=False, delay=False) + batch


@pytest.mark.parametrize(("flags", "early", "delay"), [({EARLY: True}, True, False), ({DELAY: True}, False, True),
                                                       ({EARLY: True, DELAY: True}, True, True)])
def test_early_release_and_delayed_wgrad(flags: dict, early: bool, delay: bool) -> None:  # type: ignore[type-arg]
    _, _, base = _stage(MIXED)
    _, _, on = _stage({**MIXED, **flags})
    change = _expected_extra(early=early, delay=delay) - _expected_extra(early=False, delay=False)
    assert on.peak_allocated_bytes - base.peak_allocated_bytes == change
    # early release: the MoE layer's attention no longer meets the dense layer's MLP forward; delayed
    # wgrad: the experts' operands meet the dense layer's dispatch-free forward
    assert (change > 0) if delay else (change < 0)


def test_combined_step_moments_unit() -> None:
    same = LayerParts(kept=100, dispatched=20, mlp=50, transient=40, dispatch=30, input_grad=10)
    # homogeneous layers: the backward layer's MLP backward beside the forward layer's attention (30)
    assert combined_step_extra([same], early_release=False) == 30
    assert combined_step_extra([same], early_release=True) == 30
    big_mlp = LayerParts(kept=200, dispatched=20, mlp=150, transient=40, dispatch=30, input_grad=10)
    # b = same, f = big_mlp: b's attention backward after f's combine meets f's whole layer
    assert combined_step_extra([same, big_mlp], early_release=False) == 30 - 100 + 200
    # early: b's attention meets only f's attention and dispatched tokens (-70 + 50); once b is gone,
    # f's whole layer (200) exceeds b's kept bytes and worst step (140)
    assert combined_step_extra([same, big_mlp], early_release=True) == 200 - 140
    held = LayerParts(kept=100, dispatched=20, mlp=50, transient=40, dispatch=30, input_grad=10, held_mlp=200)
    assert combined_step_extra([held], early_release=False) == 30 + 10 + 200 - 140 + 30 + 20 + 30
    assert dispatch_backward_extra(held) == 30 + 200 + 30 - 140
    assert dispatch_backward_extra(same) == 0


def test_experts_wgrad_beside_dispatch_backward_stays_within_the_worst_step() -> None:
    plain = {k: v for k, v in MIXED.items() if k != "--overlap-moe-expert-parallel-comm"}
    plain["--moe-grouped-gemm"] = True
    _, _, off = _stage(plain)
    _, job, on = _stage({**plain, "--overlap-dispatch-backward-with-experts-wgrad": True})
    assert job.overlap.experts_wgrad_overlap
    # held operands and the exchange's buffers: P + D + fc1 grad + fc2 input + fc2 grad + X, below the
    # layer's kept bytes plus its worst step (2 x the dispatch buffers)
    (_, _), (kept_m, t_m) = _layers(MIXED)
    assert P_MOE + HELD_MOE + X_MOE < kept_m + t_m
    assert on.peak_allocated_bytes == off.peak_allocated_bytes


def test_shared_expert_overlap_saves_the_gathered_input() -> None:
    args = {k: v for k, v in MIXED.items() if k not in ("--overlap-moe-expert-parallel-comm", "--moe-layer-freq")}
    args.update({"--moe-shared-expert-intermediate-size": 512, "--tensor-model-parallel-size": 2,
                 "--sequence-parallel": True})
    _, _, off = _stage(args)
    _, _, on = _stage({**args, "--moe-shared-expert-overlap": True})
    # two MoE layers, one micro-batch in flight: each keeps the [s*b, h] gathered input
    assert on.transformer_layer_activations_bytes - off.transformer_layer_activations_bytes == 2 * C * T * H
    no_sp = {**args, "--sequence-parallel": False}
    assert _stage({**no_sp, "--moe-shared-expert-overlap": True})[2].peak_allocated_bytes == \
        _stage(no_sp)[2].peak_allocated_bytes


@pytest.mark.parametrize(("flags", "needle"), [
    ({DELAY: True, "--overlap-moe-expert-parallel-comm": False}, DELAY),
    ({EARLY: True, "--overlap-moe-expert-parallel-comm": False}, EARLY),
    ({"--overlap-dispatch-backward-with-experts-wgrad": True}, "--overlap-dispatch-backward-with-experts-wgrad"),
    ({"--moe-shared-expert-overlap": True}, "--moe-shared-expert-overlap"),
    ({"--recompute-granularity": "selective", "--recompute-modules": "moe"}, "--overlap-moe-expert-parallel-comm"),
])
def test_megatron_refusals(flags: dict, needle: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError, match=needle):
        _build({**MIXED, **flags})


def test_shared_expert_overlap_refusals() -> None:
    shared = {k: v for k, v in MIXED.items() if k != "--overlap-moe-expert-parallel-comm"}
    shared.update({"--moe-shared-expert-intermediate-size": 512, "--moe-shared-expert-overlap": True})
    with pytest.raises(ConfigError, match="alltoall or flex"):
        _stage({**shared, "--moe-token-dispatcher-type": "allgather"})
    with pytest.raises(ConfigError, match="shared_experts"):
        _stage({**shared, "--recompute-granularity": "selective", "--recompute-modules": "shared_experts"})


def test_cli_exit_2(tmp_path: Path) -> None:
    args = tmp_path / "train.sh"
    plain = {k: v for k, v in MIXED.items() if k != "--overlap-moe-expert-parallel-comm"}
    words = [w for k, v in {**plain, DELAY: True}.items() for w in ((k,) if v is True else (k, str(v)))]
    args.write_text(" ".join(f"'{w}'" for w in words) + "\n")
    result = CliRunner().invoke(app, ["estimate", "--megatron-args", str(args), "--gpus", "8"],
                                env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert result.exit_code == 2, result.output
    assert DELAY in result.output and "--overlap-moe-expert-parallel-comm" in result.output


def test_flags_are_classified() -> None:
    for flag in (DELAY, EARLY, "--overlap-dispatch-backward-with-experts-wgrad", "--moe-shared-expert-overlap"):
        assert classify(flag, True)[0] == "modelled", flag  # type: ignore[index]
    assert classify("--high-priority-a2a-comm-stream", True)[0] == "no-memory-effect"  # type: ignore[index]


def test_assumption_lines() -> None:
    model, job = _build({**MIXED, DELAY: True, EARLY: True})
    text = "\n".join(estimate(model, job).assumptions)
    assert "combined 1F1B" in text and DELAY in text and EARLY in text


def test_delayed_operands_of_latent_attention_and_shared_expert() -> None:
    # MLA (q_lora 256, kv_lora 128, 8 heads of 64 + 32 rope, values 64) with a SwiGLU shared expert of
    # 512, tp 2 with sequence parallelism: 1024 local tokens, 2048 gathered
    args = {**MIXED, "--multi-latent-attention": True, "--q-lora-rank": 256, "--kv-lora-rank": 128,
            "--qk-head-dim": 64, "--qk-pos-emb-head-dim": 32, "--v-head-dim": 64,
            "--moe-shared-expert-intermediate-size": 512, "--moe-layer-freq": 1}
    model, _ = _build(args)
    shape = ActivationShape(seq=S, kv_seq=S, micro_batch=B, hidden=H, tp=2, sequence_parallel=True, act_bytes=C,
                            residual_bytes=C, attention="flash", dropout=False, kernels="fused", expert_tp=1)
    local = T // 2
    down = local * H + local * (128 + 32) + local * 256  # one shared input; kv latent + rope, q latent
    up = T * 256 + T * HEADS * 96 // 2 + T * 128 + T * HEADS * (64 + 64) // 2  # gathered latents, TP-split outputs
    proj = T * HEADS * 64 // 2 + T * H  # its input, its gathered output gradient
    shared = T * H + T * 2 * 512 // 2 + T * 512 // 2 + T * H
    assert attention_wgrad_held(model.layers[1], shape) == C * (down + up + proj + shared)
    # the routed experts' rows: s*b*top-k / tp, at full expert width (etp 1)
    rows = T * TOPK // 2
    assert expert_wgrad_held(model.layers[1], shape) == C * rows * (H + 2 * F_EXPERT + F_EXPERT + H)
    fp8 = replace(shape, fp8=True)  # Transformer Engine's quantized copies: one byte per element
    assert expert_wgrad_held(model.layers[1], fp8) * C == expert_wgrad_held(model.layers[1], shape)
