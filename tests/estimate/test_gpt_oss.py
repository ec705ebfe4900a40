"""gpt-oss in the estimator: its config read, the terms of its attention sinks, clamped SwiGLU and top-k router
(memplan.estimate.gpt_oss_terms; the trace agreement is tests/trace/test_agreement_grid.py's gpt_oss cells), the
MXFP4 checkpoint's sentence and the refusal of SDPA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import ConfigError, ModelConfigError
from memplan.estimate import estimate
from memplan.estimate.activations import layer_terms
from memplan.estimate.context import activation_shape
from memplan.estimate.precision import resolve_precision
from memplan.estimate.run_notes import DEQUANTIZED_AT_LOAD
from memplan.jobflags import build_job
from memplan.model import model_from_hf_config
from memplan.model.hf import load_hf_config
from memplan.model.spec import CLAMPED_SWIGLU
from memplan.profiles import get_profile

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
SMALL = {"model_type": "gpt_oss", "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 2048,
         "num_local_experts": 8, "num_experts_per_tok": 2}


def _terms(precision: str, seq: int = 256) -> dict[str, int]:
    model = model_from_hf_config(SMALL, name="toy")
    job = build_job({"seq": seq, "mbs": 2, "precision": precision, "attention": "eager", "framework": "hf"})
    profile = get_profile("hf")
    shape = activation_shape(model, job, profile, resolve_precision(job, profile))
    return {t.name: t.bytes for t in layer_terms(model.layers[0], shape)}


def test_the_published_config_reads_as_gpt_oss():
    spec = load_hf_config(CONFIGS / "gpt-oss-20b.json")
    layer = spec.layers[0]
    assert spec.num_layers == 24 and spec.vocab_size == 201088 and not spec.tie_word_embeddings
    assert layer.attention.sinks and layer.attention.qkv_bias and layer.attention.out_bias
    assert [lay.attention.sliding_window for lay in spec.layers[:3]] == [128, None, 128]
    moe = layer.moe
    assert moe is not None and (moe.num_experts, moe.top_k) == (32, 4)
    assert moe.router_bias and moe.router_name == "router" and moe.softmax_after_topk
    assert moe.expert.bias and moe.expert.activation == CLAMPED_SWIGLU
    assert spec.checkpoint_quantization == "mxfp4" and spec.norm_fp32_scale


def test_a_bad_quantization_config_is_named():
    with pytest.raises(ModelConfigError, match="quantization_config.quant_method"):
        model_from_hf_config({**SMALL, "quantization_config": {"modules_to_not_convert": []}}, name="bad")


def test_the_sink_softmax_has_one_more_column_in_the_weights_dtype():
    seq, rows = 256, 8 * 2 * 256  # heads x micro-batch x queries
    mixed, pure = _terms("bf16-mixed", seq), _terms("bf16", seq)
    sink = "softmax over scores and the sink column (attention sinks)"
    cast = "softmax output cast to the compute dtype (PV matmul input)"
    assert mixed[sink] == 4 * rows * (seq + 1) and mixed[cast] == 2 * rows * seq  # fp32 sinks under autocast
    assert pure[sink] == 2 * rows * (seq + 1) and cast not in pure  # bf16 sinks: no wider softmax, no cast
    assert mixed["row maxima's indices (int64, max before the sink softmax)"] == 8 * rows


def test_the_clamped_swiglu_keeps_four_tensors_per_routed_row():
    terms = _terms("bf16-mixed")
    routed, f = 2 * 256 * 2, 256  # tokens x top-k rows of f, fp32 experts under autocast
    clamped = [size for name, size in terms.items() if name.startswith("experts clamped SwiGLU")]
    assert clamped == [4 * routed * f] * 4
    assert "experts activation of the gate half (eager gated activation)" not in terms
    assert terms["sorted expert ids indexing the experts' bias rows (int64)"] == 8 * routed


def test_the_estimate_says_how_the_mxfp4_checkpoint_is_priced():
    spec = load_hf_config(CONFIGS / "gpt-oss-20b.json")
    job = build_job({"framework": "hf", "attention": "eager", "seq": 1024})
    notes = estimate(spec, job).assumptions
    assert DEQUANTIZED_AT_LOAD["mxfp4"] in notes
    assert any(note.startswith("attention sinks (gpt-oss)") for note in notes)
    plain = model_from_hf_config(SMALL, name="toy")
    assert DEQUANTIZED_AT_LOAD["mxfp4"] not in estimate(plain, job).assumptions


def test_sdpa_is_refused_with_one_sentence(tmp_path: Path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL), encoding="utf-8")
    with pytest.raises(ConfigError, match="--attention"):
        estimate(model_from_hf_config(SMALL, name="toy"), build_job({"attention": "sdpa", "framework": "hf"}))
    result = CliRunner().invoke(app, ["estimate", str(path), "--attention", "sdpa"])
    assert result.exit_code == 2 and "attention sinks" in result.output and "Traceback" not in result.output


def test_the_tracer_refuses_sdpa_for_gpt_oss_with_one_sentence(tmp_path: Path):
    pytest.importorskip("transformers")
    from memplan.trace import trace

    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL), encoding="utf-8")
    with pytest.raises(ConfigError, match="no SDPA path for gpt_oss"):
        trace(str(path), seq=64, mbs=1, attention="flash", device="cuda", iterations=1)


#: The grid's gpt_oss toy (tests/trace/test_agreement_grid.py: a 128-token window, 1,024 tokens x 2, AdamW foreach).
GRID = {**SMALL, "sliding_window": 128, "max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 0,
        "rms_norm_eps": 1e-6}


@pytest.mark.parametrize("flags, traced, before, tolerance", [
    ({"recompute": "full"}, 334_852_608, -0.0245, 0.005),
    ({"recompute": "none"}, 480_281_088, -0.0099, 0.005),
    # the embedding's output, bound by the model's forward, which the frozen layer 0 does not save (helper gptoss15)
    ({"recompute": "none", "trainable": "layers.1"}, 245_744_640, -0.0099, 0.001),
])
def test_the_sink_forward_holds_the_rotated_projections_and_the_combine_gradient(
        tmp_path: Path, flags: dict[str, object], traced: int, before: float, tolerance: float) -> None:
    """The peak is layer 1's sink softmax cast, in its forward or recomputed in its backward (traced peaks): beside
    the masked scores and max-subtracted logits, the fp32 rotated q and k and ``repeat_kv``'s fp32 copy of k with the
    projected v (all bound to local names, not saved); the output projection's input is not made yet; recomputed,
    the grouped experts' combine gradient expanded to routed rows (made before the first saved tensor is unpacked)
    and the layer's output gradient; on a frozen base the trained layer's input, which no node saves (helper
    rcmerge13; ``before``: the error at main 0ab3ad6)."""
    path = tmp_path / "gpt_oss.json"
    path.write_text(json.dumps(GRID), encoding="utf-8")
    job = build_job({"seq": 1024, "mbs": 2, "precision": "bf16-mixed", "attention": "eager", "optimizer": "adamw",
                     "optimizer_impl": "foreach", "framework": "hf", **flags})
    stage = estimate(load_hf_config(path), job).stages[0]
    assert abs((stage.peak_allocated_bytes - stage.workspace_bytes) / traced - 1) <= tolerance, before


@pytest.mark.parametrize("flags, traced, tolerance, before", [
    # peak in layer 1's sink forward: the attention module's fp32 input (the pre-norm's output under autocast, apart
    # from the projections' 16-bit copies) is alive; the head's autocast copy is not made yet (the loss makes it)
    ({"seq": 1024}, 480_281_088, 0.001, -0.00167),
    # a trained layer on a frozen bf16 base: its input norm's fp32 ``weight * x_normed`` saves x_normed whole (the
    # peak: layer 1's sink forward at 1,024 tokens, the loss at 256)
    # (and the embedding's output, bound by ``GptOssModel.forward``, which the frozen layer 0 saves none of: -0.351% at
    # 36c517b, helper gptoss15)
    ({"seq": 1024, "trainable": "layers.1"}, 245_744_640, 0.001, -0.00778),
    ({"seq": 256, "trainable": "layers.1"}, 58_987_520, 0.001, -0.00427),
    # LoRA on every linear (helper gptoss15): the output projection's adapter is not made yet (its terms were counted
    # at that moment, +1,089,536 B), the embedding's bf16 output is bound by the model's forward (-1,048,576 B):
    # +0.043% at 36c517b
    ({"seq": 1024, "peft": "lora", "lora_targets": "all-linear"}, 189_126_656, 0.0003, 0.00043),
    # Hugging Face's selective (the attention module checkpointed): the peak is layer 1's attention module made again
    # at its sink softmax's cast, the MLP block's saved tensors freed and its gradients made
    ({"seq": 256, "recompute": "selective"}, 96_516_096, 0.001, -0.01254),
    # ... with LoRA on every linear of the 16-bit base (helper gptoss15): the q/k/v adapters' input copies, lora_A
    # outputs and weight copies are made again with their projections, before the core (3,261,440 B at 1,024 tokens;
    # the s256 witness cell peaks at the loss)
    ({"seq": 1024, "recompute": "selective", "peft": "lora", "lora_targets": "all-linear"}, 148_960_256, 0.001,
     -0.02156),
])
def test_the_last_sink_layers_forward_first_or_again(tmp_path: Path, flags: dict[str, object], traced: int,
                                                     tolerance: float, before: float) -> None:
    """The grid's gpt_oss bf16-mixed ``none`` and ``selective`` cells against their traced peaks (helper gptoss14;
    ``before``: 8c89106)."""
    path = tmp_path / "gpt_oss.json"
    path.write_text(json.dumps(GRID), encoding="utf-8")
    job = build_job({"mbs": 2, "precision": "bf16-mixed", "attention": "eager", "recompute": "none",
                     "optimizer": "adamw", "optimizer_impl": "foreach", "framework": "hf", **flags})
    stage = estimate(load_hf_config(path), job).stages[0]
    assert abs((stage.peak_allocated_bytes - stage.workspace_bytes) / traced - 1) <= tolerance, before


@pytest.mark.parametrize("flags, traced, before", [
    # pure bf16: the checkpointed input is not what the 16-bit RMSNorm saves (its norm-input term stands for the
    # normalized tensor, made again): nothing netted (peak: layer 1's sink softmax backward)
    ({}, 152_565_248, -0.00455),
    # LoRA on every linear of the 16-bit base (peak: layer 1's recomputed sink forward): the q/k/v adapters' fp32
    # input copies are made before the core, and the attention module's input, which the frozen projections do not
    # save, is bound by the decoder layer's forward until the module returns
    ({"peft": "lora", "lora_targets": "all-linear"}, 137_349_632, -0.01465),
])
def test_a_recomputed_pure_bf16_sink_layer(tmp_path: Path, flags: dict[str, object], traced: int,
                                           before: float) -> None:
    """The grid's gpt_oss s1024 bf16 full cells against their traced peaks (helper gemgpt14; ``before``: fe33f35)."""
    path = tmp_path / "gpt_oss.json"
    path.write_text(json.dumps(GRID), encoding="utf-8")
    job = build_job({"seq": 1024, "mbs": 2, "precision": "bf16", "attention": "eager", "recompute": "full",
                     "optimizer": "adamw", "optimizer_impl": "foreach", "framework": "hf", **flags})
    stage = estimate(load_hf_config(path), job).stages[0]
    assert abs((stage.peak_allocated_bytes - stage.workspace_bytes) / traced - 1) <= 0.0025, before


def test_a_recomputed_fp32_lora_sink_layer_holds_its_module_input_once(tmp_path: Path) -> None:
    """The grid's gpt_oss s1024 fp32 full cell with LoRA on every linear against its traced peak (layer 1's recomputed
    sink forward): peft hands the fp32 pre-norm output to the q/k/v adapters' lora_A uncast, so the tensor they save
    is the attention module's input the decoder layer binds (not one apart), and the pre-norm reads the checkpoint's
    input, counted with what the layer keeps (helper gptoss15; +1.651% at 36c517b: both counted twice)."""
    path = tmp_path / "gpt_oss.json"
    path.write_text(json.dumps(GRID), encoding="utf-8")
    job = build_job({"seq": 1024, "mbs": 2, "precision": "fp32", "attention": "eager", "recompute": "full",
                     "optimizer": "adamw", "optimizer_impl": "foreach", "framework": "hf", "peft": "lora",
                     "lora_targets": "all-linear"})
    stage = estimate(load_hf_config(path), job).stages[0]
    assert abs((stage.peak_allocated_bytes - stage.workspace_bytes) / 257_220_608 - 1) <= 0.001


@pytest.mark.parametrize("seq, traced, before", [(256, 40_212_992, -0.00587), (1024, 187_493_376, -0.01091)])
def test_a_trained_norm_behind_a_trained_embedding_keeps_its_whole_fp32_x_normed(
        tmp_path: Path, seq: int, traced: int, before: float) -> None:
    """Pure bf16, the embedding and layer 1's input norm trained: the norm's input needs a gradient, its linears are
    frozen; ``GptOssRMSNorm``'s ``weight * x_normed`` runs in fp32 and saves the whole fp32 ``x_normed`` (the
    16-bit share was dropped on this path of partial_freeze.block_terms; session 14 mended the path where the input
    needs none). At 1,024 tokens the peak is layer 1's sink forward, with the embedding's output bound by the model's
    forward (the first layer's 16-bit RMSNorm saves its fp32 copy only). Helper gptoss15; ``before``: 36c517b."""
    path = tmp_path / "gpt_oss.json"
    path.write_text(json.dumps(GRID), encoding="utf-8")
    job = build_job({"seq": seq, "mbs": 2, "precision": "bf16", "attention": "eager", "recompute": "none",
                     "optimizer": "adamw", "optimizer_impl": "foreach", "framework": "hf",
                     "trainable": "embed_tokens,layers.1.input_layernorm"})
    stage = estimate(load_hf_config(path), job).stages[0]
    assert abs((stage.peak_allocated_bytes - stage.workspace_bytes) / traced - 1) <= 0.001, before


def test_frozen_experts_behind_a_trained_embedding_run_in_their_own_dtype(tmp_path: Path) -> None:
    """bf16-mixed, the embedding trained (fp32: the residual stream is fp32), the base frozen in bf16: transformers'
    grouped experts cast their input to their weights' dtype, the frozen bf16 (they were priced in the fp32 trained
    dtype: +16.3% at 36c517b; +2.1% left, not the experts'). Helper gptoss15."""
    from memplan.estimate.context import run_context

    path = tmp_path / "gpt_oss.json"
    path.write_text(json.dumps(GRID), encoding="utf-8")
    job = build_job({"seq": 256, "mbs": 2, "precision": "bf16-mixed", "attention": "eager", "recompute": "none",
                     "optimizer": "adamw", "optimizer_impl": "foreach", "framework": "hf",
                     "trainable": "embed_tokens,layers.1.input_layernorm"})
    model = load_hf_config(path)
    assert run_context(model, job, 0.1).shape.expert_bytes == 2
    stage = estimate(model, job).stages[0]
    assert abs((stage.peak_allocated_bytes - stage.workspace_bytes) / 51_781_632 - 1) <= 0.025


def test_a_flash_core_recomputes_no_sink_scores() -> None:
    """HF selective on gpt-oss made again with a flash core: the checkpointed sink attention's moment prices no
    eager sink locals (the s x s scores), so doubling the sequence does not quadruple the moment (review, session
    14: the guard tested the layers' kernels, which are eager under flash too)."""
    from memplan import estimate
    from memplan.estimate.recomputed_backward import checkpointed_sink_forward

    model = model_from_hf_config(SMALL, name="toy")
    for attention, expected_zero in (("flash", True), ("eager", False)):
        job = build_job({"seq": 1024, "mbs": 2, "precision": "bf16-mixed", "attention": attention,
                         "framework": "hf", "recompute": "selective"})
        assert estimate(model, job).peak_allocated_bytes > 0
        from memplan.estimate.context import run_context

        run = run_context(model, job, 0.1)
        assert (checkpointed_sink_forward(run, 1, 0) == (0, 0)) is expected_zero, attention
