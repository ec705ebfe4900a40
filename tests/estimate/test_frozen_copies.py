"""A frozen base stored in fp32 under bf16 autocast: every frozen linear whose input needs a gradient keeps the
16-bit copy of its weight that autocast made (autocast caches copies of trainable leaves only, so a frozen
weight is cast at each call and its matmul saves the copy for the input's gradient); no bias copy is kept."""

from __future__ import annotations

from memplan.estimate.engine import estimate
from memplan.job import Batch, FineTuning, Job, Precision, Recompute
from memplan.model import model_from_hf_config

GPT2 = {"model_type": "gpt2", "n_embd": 256, "n_head": 8, "n_layer": 2, "vocab_size": 2048, "n_positions": 1024}
H, F, V = 256, 1024, 2048


def _activations(frozen_dtype: str, targets: str, precision: str = "bf16-mixed") -> int:
    model = model_from_hf_config(GPT2, name="gpt2-toy")
    ft = FineTuning(peft="lora", lora_targets=targets, frozen_dtype=frozen_dtype)
    job = Job(framework="hf", precision=Precision(name=precision), batch=Batch(micro_batch_size=2, seq_length=256), finetune=ft)
    return estimate(model, job).stages[0].forward_activations_bytes


def test_frozen_fp32_linears_keep_their_weight_copy_where_their_input_needs_a_gradient() -> None:
    # layer 0's c_attn reads the frozen embedding's output (no gradient): no copy; its c_proj reads the adapted
    # c_attn's output, and everything after it needs a gradient: the MLP's c_fc and c_proj, layer 1's four
    # linears and the tied head
    layer0 = H * H + 2 * H * F
    layer1 = 3 * H * H + H * H + 2 * H * F
    copies = 2 * (layer0 + layer1 + V * H)
    assert _activations("fp32", "c_attn") - _activations("bf16", "c_attn") == copies


def test_a_16bit_base_in_another_dtype_is_cast_too() -> None:
    # autocast casts any floating weight not in its dtype: an fp16 base under bf16 autocast keeps the same copies
    # (its residual stream is 16-bit like a bf16 base's)
    copies = _activations("fp32", "c_attn") - _activations("bf16", "c_attn")
    assert copies > 0
    assert _activations("fp16", "c_attn") - _activations("bf16", "c_attn") == copies


def test_a_recomputed_layer_makes_its_frozen_copies_again() -> None:
    """Under full recompute nothing of a layer's forward is saved, and its recompute casts the frozen fp32 weights
    again, the checkpoint's input requiring grad: each of its four linears keeps its copy until its backward
    (helper rcmerge13; the grid toy's traced peak, the last layer's gelu_new backward, holds three of them, c_proj's
    gone: -4.5% before). The MLP's node walk (mlpbwd13) holds the layer's output gradient there and frees c_proj's
    copy at its node (merge of both: +1.47% until the walk freed the frozen copy)."""
    from memplan.estimate.context import run_context
    from memplan.estimate.frozen_copies import recomputed_frozen_copies

    model = model_from_hf_config(GPT2, name="gpt2-toy")
    jobs = {dtype: Job(framework="hf", precision=Precision(name="bf16-mixed"), batch=Batch(micro_batch_size=2,
                       seq_length=256), finetune=FineTuning(peft="lora", lora_targets="c_attn", frozen_dtype=dtype),
                       recompute=Recompute(mode="full")) for dtype in ("fp32", "bf16")}
    assert recomputed_frozen_copies(run_context(model, jobs["fp32"], 0.0), 1) == 3 * H * H + H * H + 2 * H * F
    assert recomputed_frozen_copies(run_context(model, jobs["bf16"], 0.0), 1) == 0
    from memplan.jobflags import build_job

    stage = estimate(model, build_job({"seq": 256, "mbs": 2, "precision": "bf16-mixed", "attention": "eager",
                                       "recompute": "full", "optimizer": "adamw", "optimizer_impl": "foreach",
                                       "framework": "hf", "peft": "lora", "lora_targets": "c_attn", "dropout": 0.0,
                                       "frozen_dtype": "fp32"})).stages[0]
    assert abs((stage.peak_allocated_bytes - stage.workspace_bytes) / 34_872_320 - 1) <= 0.002
