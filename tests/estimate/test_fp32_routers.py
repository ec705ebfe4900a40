"""transformers keeps DeepSeek's router weights in fp32 (``_keep_in_fp32_modules_strict = ["gate.weight"]``):
under 16-bit weights on --framework hf their weights, gradients and AdamW moments are 4 bytes, and the router
saves an fp32 copy of its input. The tracer measures both (the agreement grid's pure-bf16 DeepSeek-V2-Lite cell)."""

from __future__ import annotations

from dataclasses import replace

from memplan import estimate, load_model
from memplan.jobflags import build_job

MODEL = load_model("deepseek-v2-lite")


def _without_fp32_routers():  # type: ignore[no-untyped-def]
    layers = tuple(layer if layer.moe is None else replace(layer, moe=replace(layer.moe, router_fp32=False))
                   for layer in MODEL.layers)
    return replace(MODEL, layers=layers)


def test_fp32_routers_cost_their_extra_bytes_in_every_state_under_pure_bf16() -> None:
    job = build_job({"framework": "hf", "precision": "bf16", "seq": 512})
    kept, plain = estimate(MODEL, job).stages[0], estimate(_without_fp32_routers(), job).stages[0]
    moe_layers = [layer.moe for layer in MODEL.layers if layer.moe is not None]
    routers = sum(MODEL.hidden_size * moe.num_experts for moe in moe_layers)
    assert kept.parameters_bytes - plain.parameters_bytes == 2 * routers
    assert kept.gradients_bytes - plain.gradients_bytes == 2 * routers
    assert kept.optimizer_bytes - plain.optimizer_bytes == 2 * 2 * routers  # two AdamW moments
    # the router's fp32 input copy: 4 bytes x tokens x hidden per MoE layer
    assert kept.forward_activations_bytes - plain.forward_activations_bytes == len(moe_layers) * 4 * 512 * MODEL.hidden_size


def test_nothing_changes_under_mixed_precision_or_another_framework() -> None:
    for flags in ({"framework": "hf", "precision": "bf16-mixed"}, {"framework": "megatron", "precision": "bf16"}):
        job = build_job({**flags, "seq": 512})
        kept, plain = estimate(MODEL, job).stages[0], estimate(_without_fp32_routers(), job).stages[0]
        assert kept.peak_allocated_bytes == plain.peak_allocated_bytes, flags
