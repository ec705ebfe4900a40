"""memplan's parameter counts equal what ``transformers`` builds from the same config, exactly.

Every shipped preset is built full size on the meta device (no memory, a fraction of a second
each) and compared in total, layer by layer, and for embedding, position table, head and final
norm. Variant configs cover the flags no preset exercises (biases, untied heads, Phi-3, GPT-NeoX,
Qwen2-MoE dense layers, DeepSeek without q-compression).
"""

from __future__ import annotations

import json
import warnings
from functools import cache
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from memplan.model import model_from_hf_config, per_layer_param_counts, total_params
from memplan.model.params import (
    embedding_params,
    final_norm_params,
    head_params,
    position_embedding_params,
)
from memplan.model.presets import preset_config, preset_names
from memplan.model.tensors import model_tensors

#: Keys that would make transformers do more than build the architecture (remote code, fp8).
_NOT_ARCHITECTURE = ("auto_map", "quantization_config")


def _numel(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def _build(config: dict[str, Any]) -> Any:
    cfg = {k: v for k, v in config.items() if k not in _NOT_ARCHITECTURE}
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_config = transformers.AutoConfig.for_model(**cfg)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(hf_config)


@cache
def _hf_preset(name: str) -> Any:
    return _build(preset_config(name))


def _parts(model: Any) -> dict[str, Any]:
    """The pieces of a causal LM, whatever the family names them."""
    base = model.base_model
    layers = base.layers if hasattr(base, "layers") else base.h
    norm = next(getattr(base, n) for n in ("norm", "ln_f", "final_layer_norm") if hasattr(base, n))
    embed, out = model.get_input_embeddings(), model.get_output_embeddings()
    head = 0 if out.weight is embed.weight else _numel(out)
    position = base.wpe.weight.numel() if hasattr(base, "wpe") else 0
    return {"layers": [_numel(layer) for layer in layers], "norm": _numel(norm),
            "embed": embed.weight.numel(), "head": head, "position": position}


def _assert_same(config: dict[str, Any], model: Any, name: str = "variant") -> None:
    spec = model_from_hf_config(config, name=name)
    parts = _parts(model)
    assert list(per_layer_param_counts(spec)) == parts["layers"]
    assert embedding_params(spec) == parts["embed"]
    assert position_embedding_params(spec) == parts["position"]
    assert head_params(spec) == parts["head"]
    assert final_norm_params(spec) == parts["norm"]
    assert total_params(spec) == _numel(model)
    assert model_tensors(spec) == len(list(model.parameters()))  # per-tensor optimizer state (fused step)


@pytest.mark.parametrize("name", preset_names())
def test_preset_matches_transformers(name: str) -> None:
    _assert_same(preset_config(name), _hf_preset(name), name)


def _variant(base: str, **changes: Any) -> dict[str, Any]:
    config = preset_config(base)
    config.update(changes)
    return config


#: Published configs of families without a preset (benchmarks/configs/, ``_memplan`` says where from).
_CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def _published(name: str) -> dict[str, Any]:
    config = json.loads((_CONFIGS / f"{name}.json").read_text(encoding="utf-8"))
    config.pop("_memplan", None)
    return config


# --- gpt-oss (helper gptoss8): the published configs live in benchmarks/configs (not presets: a preset
# would shift the golden record's random jobs, which cycle over the preset list)
#: Published totals (OpenAI's model card: 20.91 B and 116.83 B), to the stated precision.
GPT_OSS_PUBLISHED = {"gpt-oss-20b": 20.91, "gpt-oss-120b": 116.83}


@pytest.mark.parametrize("name", sorted(GPT_OSS_PUBLISHED))
def test_gpt_oss_published_config_matches_transformers(name: str) -> None:
    config = _published(name)
    _assert_same(config, _build(config), name)
    spec = model_from_hf_config(config, name=name)
    assert round(total_params(spec) / 1e9, 2) == GPT_OSS_PUBLISHED[name]
# --- gpt-oss end


_SMALL_LLAMA = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000}

VARIANTS: dict[str, dict[str, Any]] = {
    "llama-biases-untied": {**_variant("llama-3.2-1b", **_SMALL_LLAMA, head_dim=None),
                            "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False},
    "llama-no-kv-heads": {k: v for k, v in _variant("llama-3.1-8b", **_SMALL_LLAMA).items()
                          if k != "num_key_value_heads"},
    "gpt2-untied-n_inner": _variant("gpt2", n_layer=2, n_inner=1000, tie_word_embeddings=False),
    "gemma2-layer-types": _variant("gemma-2-9b", **{**_SMALL_LLAMA, "num_hidden_layers": 3},
                                   layer_types=["full_attention", "sliding_attention", "full_attention"]),
    "qwen3-head-dim-default": {k: v for k, v in _variant("qwen3-8b", **_SMALL_LLAMA).items()
                               if k != "head_dim"},
    # Phi-3-mini-4k-instruct's shape, fused qkv and gate_up projections.
    "phi3": {"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
             "sliding_window": 2047, "tie_word_embeddings": False, "max_position_embeddings": 4096},
    # Pythia-160m's shape; then untied biases off and sequential residual.
    "gpt_neox": {"model_type": "gpt_neox", "hidden_size": 768, "intermediate_size": 3072,
                 "num_hidden_layers": 12, "num_attention_heads": 12, "vocab_size": 50304,
                 "rotary_pct": 0.25, "use_parallel_residual": True, "tie_word_embeddings": False},
    "gpt_neox-no-bias-tied": {"model_type": "gpt_neox", "hidden_size": 128, "intermediate_size": 512,
                              "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 500,
                              "attention_bias": False, "use_parallel_residual": False,
                              "tie_word_embeddings": True},
    # Qwen1.5-MoE-A2.7B's shape, shrunk to 4 layers with a dense layer and a sparse step.
    "qwen2_moe": {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
                  "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 16,
                  "vocab_size": 151936, "num_experts": 60, "num_experts_per_tok": 4,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                  "decoder_sparse_step": 1, "mlp_only_layers": [2], "tie_word_embeddings": False},
    "qwen2_moe-step2": {"model_type": "qwen2_moe", "hidden_size": 128, "intermediate_size": 512,
                        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "vocab_size": 500, "num_experts": 4, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 64, "shared_expert_intermediate_size": 256,
                        "decoder_sparse_step": 2},
    "qwen3_moe-dense-layer": _variant("qwen3-30b-a3b", num_hidden_layers=3, mlp_only_layers=[0]),
    "deepseek_v3-no-q-lora": _variant("deepseek-v3", num_hidden_layers=4, q_lora_rank=None,
                                      first_k_dense_replace=1, attention_bias=True),
    # Gemma 3 with soft-capping, biases and an explicit layer_types list; Gemma 1 with grouped heads.
    "gemma3_text-capped-biased": {**_published("gemma-3-1b"), **_SMALL_LLAMA, "head_dim": 32,
                                  "attention_bias": True, "attn_logit_softcapping": 50.0,
                                  "final_logit_softcapping": 30.0,
                                  "layer_types": ["sliding_attention", "full_attention"]},
    "gemma-gqa-untied": {**_published("gemma-7b"), **_SMALL_LLAMA, "tie_word_embeddings": False},
    # Granite with biases; SmolLM3 untied, with an explicit NoPE list and sliding windows on NoPE layers.
    "granite-biases": {**_published("granite-3.3-8b-base"), **_SMALL_LLAMA, "attention_bias": True,
                       "mlp_bias": True},
    "smollm3-windows": {**_published("smollm3-3b"), **_SMALL_LLAMA, "num_hidden_layers": 3,
                        "no_rope_layers": [1, 0, 0], "use_sliding_window": True, "sliding_window": 64,
                        "tie_word_embeddings": False, "pad_token_id": 0},
    # OLMo 2 with biases and grouped heads (whole-projection q/k norms of different widths); OLMo 3 windows.
    "olmo2-biases-gqa": {**_published("olmo-2-1124-7b"), **_SMALL_LLAMA, "attention_bias": True, "pad_token_id": 0},
    "olmo3": {**_published("olmo-2-1124-7b"), **_SMALL_LLAMA, "model_type": "olmo3", "num_hidden_layers": 4,
              "pad_token_id": 0, "sliding_window": 64},
    "deepseek_v2-mlp-bias": _variant("deepseek-v2-lite", num_hidden_layers=3, mlp_bias=True,
                                     q_lora_rank=512, attention_bias=True),
    # --- gpt-oss (helper gptoss8) begin: no attention biases, no layer_types, head_dim and
    # sliding_window left to GptOssConfig's defaults (64, 128), odd expert count
    "gpt_oss-defaults-no-bias": {"model_type": "gpt_oss", "hidden_size": 256, "intermediate_size": 192,
                                 "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
                                 "num_local_experts": 5, "num_experts_per_tok": 2, "vocab_size": 1000,
                                 "attention_bias": False},
    "gpt_oss-layer-types": {**_published("gpt-oss-20b"), "num_hidden_layers": 3, "num_local_experts": 4,
                            "layer_types": ["full_attention", "full_attention", "sliding_attention"]},
    # --- gpt-oss end
}


#: Every shipped benchmark config (docs/model-sources.md says where each comes from).
PUBLISHED = tuple(sorted(path.stem for path in _CONFIGS.glob("*.json") if path.name != "published_finetune.json"))


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_config_matches_transformers(name: str) -> None:
    _assert_same(_published(name), _build(_published(name)), name)


def test_gemma3_1b_total_is_the_published_count() -> None:
    """999,885,952: the count Keras-Hub publishes for its gemma3_1b preset, from the same weights."""
    assert total_params(model_from_hf_config(_published("gemma-3-1b"), name="g")) == 999_885_952


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_matches_transformers(name: str) -> None:
    _assert_same(VARIANTS[name], _build(VARIANTS[name]), name)


def test_deepseek_v3_score_correction_bias_is_a_buffer() -> None:
    """transformers registers ``e_score_correction_bias`` as an nn.Buffer, so it is not trainable."""
    model = _build(VARIANTS["deepseek_v3-no-q-lora"])
    params = {n for n, _ in model.named_parameters()}
    buffers = {n for n, _ in model.named_buffers()}
    assert not any(n.endswith("e_score_correction_bias") for n in params)
    assert any(n.endswith("e_score_correction_bias") for n in buffers)
    spec = model_from_hf_config(VARIANTS["deepseek_v3-no-q-lora"], name="v3")
    moe = spec.layers[-1].moe
    assert moe is not None and moe.router_bias and moe.router_bias_is_buffer


#: google/gemma-3-4b-pt's vision_config (the SigLIP tower the multimodal checkpoints share).
_GEMMA3_VISION = {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896,
                  "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14,
                  "vision_use_head": False}
_TINY_TEXT = {"model_type": "gemma3_text", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 512}


@pytest.mark.parametrize("vision", [
    _GEMMA3_VISION,
    {**_GEMMA3_VISION, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
     "image_size": 56, "vision_use_head": True},
], ids=["gemma-3-4b", "tiny-with-head"])
def test_gemma3_refusal_counts_the_vision_tower_exactly(vision: dict[str, Any]) -> None:
    """The refusal of a multimodal Gemma 3 config names what it leaves out: the tower and projector's count."""
    from memplan.errors import ModelConfigError

    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.for_model("gemma3", vision_config=vision, text_config=_TINY_TEXT,
                                               mm_tokens_per_image=4 if vision["image_size"] == 56 else 256)
    with torch.device("meta"):
        model = transformers.Gemma3ForConditionalGeneration(config)
    real = sum(p.numel() for n, p in model.named_parameters() if "vision_tower" in n or "multi_modal_projector" in n)
    with pytest.raises(ModelConfigError) as info:
        model_from_hf_config({"model_type": "gemma3", "vision_config": vision, "text_config": _TINY_TEXT}, name="g")
    assert f"({real:,} parameters)" in str(info.value)


#: Tiny configs of the families whose config class aliases a field (transformers' ``attribute_map``).
_ALIASED = {
    "qwen3_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300, num_experts=8, num_experts_per_tok=2),
    "mixtral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=300, num_local_experts=4),
    "gpt_oss": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=300, num_local_experts=4, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "full_attention"]),
    "deepseek_v3": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, vocab_size=300, n_routed_experts=8,
                        num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=2, topk_group=1),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=128),
}


@pytest.mark.parametrize("model_type", sorted(_ALIASED))
def test_a_config_saved_by_this_transformers_is_read(model_type: str, tmp_path: Path) -> None:
    """The config.json transformers itself writes (``save_pretrained``), whatever name its release gives an
    aliased field: transformers 5 writes Qwen3-MoE's ``num_experts`` as ``num_local_experts``, which memplan
    refused ("num_experts: is required")."""
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.for_model(model_type, **_ALIASED[model_type])
        config.save_pretrained(tmp_path)
        with torch.device("meta"):
            expected = _numel(transformers.AutoModelForCausalLM.from_config(config))
    written = json.loads((tmp_path / "config.json").read_text())
    assert total_params(model_from_hf_config(written, name=model_type)) == expected


def test_a_config_giving_both_names_of_a_field_differently_is_refused() -> None:
    from memplan.errors import ModelConfigError

    config = {"model_type": "qwen3_moe", **_ALIASED["qwen3_moe"], "num_local_experts": 4}
    with pytest.raises(ModelConfigError, match="num_local_experts: names the same field as num_experts"):
        model_from_hf_config(config, name="both")
    same = {"model_type": "qwen3_moe", **_ALIASED["qwen3_moe"], "num_local_experts": 8}
    assert model_from_hf_config(same, name="same").layers[0].moe.num_experts == 8
