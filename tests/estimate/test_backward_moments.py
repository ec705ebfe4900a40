"""Two moments of the backward (helper backmom12, session 12; ported onto main by helper fnorm12): the final norm's
backward (:mod:`memplan.estimate.final_norm_backward`), and the weight gradients a layer's backward has made when it
reaches an eager softmax (:mod:`memplan.estimate.made_gradients`, helper mixtral12) under tensor parallelism. What they
price, where they do not apply, and the final norm's --explain sentence. Against the trace:
tests/trace/test_backward_moments_vs_trace.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan import estimate, load_model
from memplan.estimate import final_norm_backward
from memplan.estimate.activations import output_gradient_bytes, softmax_backward_bytes
from memplan.estimate.context import run_context, stage_context
from memplan.estimate.final_norm_backward import final_norm_backward_bytes
from memplan.estimate.layer_costs import layer_blocks
from memplan.estimate.layout import pipeline_layout
from memplan.estimate.made_gradients import early_gradients
from memplan.jobflags import build_job

_COMMON = {"max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 0, "rms_norm_eps": 1e-6}
#: Toys with a 256-token vocabulary, where a backward moment sets the peak.
CONFIGS = {
    "llama_v256": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8,
                   "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "tie_word_embeddings": False},
    "qwen3_moe_v256": {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 768,
                       "moe_intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2,
                       "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 256, "num_experts": 8,
                       "num_experts_per_tok": 2, "norm_topk_prob": True},
}
_EAGER = {"seq": 512, "mbs": 2, "precision": "bf16-mixed", "attention": "eager", "recompute": "none",
          "framework": "hf", "optimizer": "adamw", "optimizer_impl": "foreach"}


def written(folder: Path, name: str) -> str:
    """The path of toy ``name``'s config.json, written in ``folder``."""
    path = folder / f"{name}.json"
    path.write_text(json.dumps({**_COMMON, **CONFIGS[name]}), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = Path(tmp_path_factory.mktemp("backward_moments"))
    return {name: written(folder, name) for name in CONFIGS}


def _stage(path: str, **flags: object):  # type: ignore[no-untyped-def]
    model = load_model(path)
    job = build_job({**_EAGER, **flags})
    run = run_context(model, job, 0.0)
    layout = pipeline_layout(model.num_layers, job.parallel, job.num_microbatches, run.profile.pipeline_split)[0]
    return run, stage_context(run, layout)


def test_final_norm_backward_six_fp32_hidden_tensors(configs: dict[str, str]) -> None:
    # a trace of the llama toy (1,024 tokens x 256): 6,291,456 bytes above its layers' saved tensors and the head's
    # gradient at the square's backward (its fp32 input and five fp32 gradients), in bf16-mixed and pure bf16
    for precision in ("bf16-mixed", "bf16"):
        _, ctx = _stage(configs["llama_v256"], precision=precision, attention="sdpa")
        assert final_norm_backward_bytes(ctx) == 6 * 4 * 1024 * 256


@pytest.mark.parametrize("flags", [{"framework": "megatron"}, {"fsdp": "full", "gpus": 2}])
def test_no_final_norm_moment_for_fused_norms_or_fsdp2(configs: dict[str, str], flags: dict[str, object]) -> None:
    _, ctx = _stage(configs["llama_v256"], attention="sdpa", **flags)
    assert final_norm_backward_bytes(ctx) == 0


def test_final_norm_moment_sets_the_peak_with_its_sentence(configs: dict[str, str]) -> None:
    job = build_job({**_EAGER, "attention": "sdpa", "peft": "lora", "lora_targets": "q_proj,v_proj"})
    result = estimate(load_model(configs["llama_v256"]), job)
    assert result.stages[0].peak_phase == "backward"
    assert final_norm_backward.NOTE in result.assumptions


def test_gradients_before_the_softmax_under_tensor_parallelism(configs: dict[str, str]) -> None:
    # a trace of the llama toy at tp 2, at the last layer's softmax backward: down/up/gate (3 x 393,216 bytes in
    # fp32, half of each weight's), o_proj (131,072) and post_attention_layernorm (1,024, whole on every rank);
    # beside them the residual stream's fp32 gradient (whole: no sequence parallelism, 1,048,576), and the autocast
    # copies of those four linears' rank shares freed (3 x 196,608 + 65,536 bytes; helper gpt2bwd12)
    run, _ = _stage(configs["llama_v256"], tp=2, gpus=2)
    layer = run.model.layers[1]
    found = layer_blocks(run, layer, 1)
    assert found is not None
    shape, blocks = found
    made = softmax_backward_bytes(layer, shape, blocks) + 1_311_744 + 1_048_576 - (3 * 196_608 + 65_536)
    assert early_gradients(run, layer, 1, 0) == made


def test_sdpa_layer_makes_down_projs_gradient_before_the_mlp_product(configs: dict[str, str]) -> None:
    """Under a fused core the MLP backward's product node (memplan.estimate.mlp_backward_nodes) comes after
    down_proj's weight gradient (768 x 256, fp32)."""
    run, _ = _stage(configs["llama_v256"], attention="sdpa")
    assert early_gradients(run, run.model.layers[1], 1, 0) == 768 * 256 * 4


@pytest.mark.parametrize("flags", [
    {"optimizer_in_backward": True, "optimizer": "adam"}, {"fsdp": "full", "gpus": 2},
])
def test_no_gradients_before_the_softmax_where_not_made_beside_it(configs: dict[str, str],
                                                                   flags: dict[str, object]) -> None:
    run, _ = _stage(configs["llama_v256"], **flags)
    assert early_gradients(run, run.model.layers[1], 1, 0) == 0


@pytest.mark.parametrize("targets, made", [("q_proj,v_proj", 0), ("o_proj", 16 * (256 + 256))])
def test_an_adapter_layers_softmax_holds_the_residual_gradient(configs: dict[str, str], targets: str,
                                                               made: int) -> None:
    """LoRA (r 16, fp32) on layer 0 too, so layer 1's input needs a gradient: beside the softmax's two gradients the
    residual stream's waits (fp32 under autocast) with the gradients of the adapters made by then (o_proj's, not
    q's or v's: after the core); no base weight's."""
    run, _ = _stage(configs["llama_v256"], peft="lora", lora_rank=16, lora_targets=targets)
    layer = run.model.layers[1]
    found = layer_blocks(run, layer, 1)
    assert found is not None
    shape, blocks = found
    expected = softmax_backward_bytes(layer, shape, blocks) + output_gradient_bytes(shape, 256) + 4 * made
    assert early_gradients(run, layer, 1, 0) == expected
