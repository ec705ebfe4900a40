"""Reading Hugging Face configs: the structure memplan derives, and errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memplan.errors import ModelConfigError
from memplan.model import SUPPORTED_MODEL_TYPES, load_hf_config, load_preset, model_from_hf_config
from memplan.model.presets import preset_config

LLAMA: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000,
}


def _error(config: Any) -> ModelConfigError:
    with pytest.raises(ModelConfigError) as info:
        model_from_hf_config(config, name="bad")
    return info.value


# ----------------------------------------------------------------------------- structure
def test_deepseek_v3_layers_dense_then_moe_and_reused() -> None:
    spec = load_preset("deepseek-v3")
    assert [layer.is_moe for layer in spec.layers[:4]] == [False, False, False, True]
    assert spec.num_moe_layers == 58 and spec.mtp_layers == 1
    assert len({id(layer) for layer in spec.layers}) == 2
    moe = spec.layers[3].moe
    assert moe is not None and moe.shared_expert is not None
    assert moe.shared_expert.intermediate_size == 2048 and moe.num_experts == 256 and moe.top_k == 8
    attn = spec.layers[0].attention
    assert (attn.kind, attn.q_lora_rank, attn.kv_lora_rank, attn.head_dim) == ("mla", 1536, 512, 192)


def test_deepseek_v2_lite_has_no_query_compression() -> None:
    spec = load_preset("deepseek-v2-lite")
    assert spec.layers[0].attention.q_lora_rank is None
    assert spec.layers[1].moe is not None and spec.layers[1].moe.shared_expert is not None
    assert spec.layers[1].moe.shared_expert.intermediate_size == 2 * 1408
    assert not spec.layers[1].moe.router_bias and spec.mtp_layers == 0


def test_gemma2_alternates_sliding_window_and_has_four_norms() -> None:
    spec = load_preset("gemma-2-9b")
    windows = [layer.attention.sliding_window for layer in spec.layers[:4]]
    assert windows == [4096, None, 4096, None]
    assert spec.layers[0].num_hidden_norms == 4 and spec.tie_word_embeddings
    assert spec.layers[0].attention.head_dim == 256
    assert len({id(layer) for layer in spec.layers}) == 2


_CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def test_gemma3_five_sliding_layers_of_six_qk_norm_without_softcap() -> None:
    spec = load_hf_config(_CONFIGS / "gemma-3-1b.json")
    windows = [layer.attention.sliding_window for layer in spec.layers[:12]]
    assert windows == [512] * 5 + [None] + [512] * 5 + [None]
    attn = spec.layers[0].attention
    assert attn.qk_norm and attn.qk_norm_per_head and attn.logit_softcap is None
    assert spec.final_logit_softcap is None and spec.norm_fp32_scale and spec.rope_per_layer_type
    assert spec.layers[0].num_hidden_norms == 4 and spec.tie_word_embeddings


def test_gemma3_text_config_takes_transformers_defaults() -> None:
    """gemma-3-4b's text_config lists only what differs from Gemma3TextConfig's defaults."""
    spec = load_hf_config(_CONFIGS / "gemma-3-4b-text.json")
    attn = spec.layers[0].attention
    assert (spec.vocab_size, attn.num_heads, attn.num_kv_heads, attn.head_dim) == (262_208, 8, 4, 256)
    assert spec.layers[0].attention.sliding_window == 1024 and spec.layers[5].attention.sliding_window is None
    assert _error({"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2}).field == "intermediate_size"


def test_gemma3_multimodal_is_refused_naming_text_config() -> None:
    config = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "hidden_size": 2560},
              "vision_config": {"model_type": "siglip_vision_model"}}
    error = _error(config)
    assert error.field == "model_type" and "vision" in str(error) and "text_config" in str(error)
    assert "gemma3_text" in str(error) and "gemma3" not in SUPPORTED_MODEL_TYPES


def test_gemma1_fp32_norm_without_softcap_or_windows() -> None:
    spec = load_hf_config(_CONFIGS / "gemma-7b.json")
    assert spec.norm_fp32_scale and spec.final_logit_softcap is None and spec.layers[0].num_hidden_norms == 2
    assert spec.layers[0].attention.head_dim == 256 and not spec.layers[0].attention.qk_norm


def test_olmo2_post_norms_and_whole_width_qk_norms() -> None:
    spec = load_hf_config(_CONFIGS / "olmo-2-1124-7b.json")
    layer = spec.layers[0]
    assert not layer.pre_norms and layer.num_post_norms == 2 and spec.norm_fp32_scale
    assert layer.attention.qk_norm_widths == (4096, 4096) and layer.attention.qk_norm_rows == 2
    olmo3 = model_from_hf_config({**LLAMA, "model_type": "olmo3", "num_hidden_layers": 8}, name="o3")
    assert [layer.attention.sliding_window for layer in olmo3.layers] == [4096, 4096, 4096, None] * 2
    assert olmo3.layers[0].attention.qk_norm_widths == (256, 64) and olmo3.rope_per_layer_type


def test_smollm3_nope_layers_and_their_windows() -> None:
    spec = load_hf_config(_CONFIGS / "smollm3-3b.json")
    assert [layer.attention.rotary_fraction for layer in spec.layers[:4]] == [1.0, 1.0, 1.0, 0.0]
    assert all(layer.attention.sliding_window is None for layer in spec.layers)
    windows = model_from_hf_config({**LLAMA, "model_type": "smollm3", "use_sliding_window": True,
                                    "sliding_window": 64}, name="s")
    assert [layer.attention.sliding_window for layer in windows.layers] == [None, None, None, 64]
    error = _error({**LLAMA, "model_type": "smollm3", "no_rope_layers": [1, 1]})
    assert error.field == "no_rope_layers"


def test_granite_is_llama_shaped() -> None:
    spec = load_hf_config(_CONFIGS / "granite-3.3-8b-base.json")
    assert spec.tie_word_embeddings and spec.num_kv_heads == 8 and not spec.norm_fp32_scale


@pytest.mark.parametrize("model_type", ["gemma", "gemma3_text", "olmo2", "olmo3", "granite", "smollm3"])
def test_new_family_missing_field_is_named(model_type: str) -> None:
    error = _error({k: v for k, v in {**LLAMA, "model_type": model_type}.items() if k != "num_hidden_layers"})
    assert error.field == "num_hidden_layers" and "required" in str(error)


def test_gpt2_learned_positions_layernorm_biases_tied() -> None:
    spec = load_preset("gpt2")
    assert (spec.position_embedding, spec.max_position_embeddings) == ("learned", 1024)
    assert spec.norm == "layernorm" and spec.norm_bias and spec.tie_word_embeddings
    layer = spec.layers[0]
    assert layer.mlp is not None and not layer.mlp.gated and layer.mlp.intermediate_size == 4 * 768
    assert layer.attention.qkv_bias and layer.attention.out_bias


def test_qwen_families() -> None:
    qwen2 = load_preset("qwen2.5-7b").layers[0].attention
    assert qwen2.qkv_bias and not qwen2.out_bias and qwen2.sliding_window is None
    qwen3 = load_preset("qwen3-8b").layers[0].attention
    assert qwen3.qk_norm and qwen3.head_dim == 128
    moe = load_preset("qwen3-30b-a3b").layers[0].moe
    assert moe is not None and moe.shared_expert is None and moe.expert.intermediate_size == 768


def test_qwen2_moe_sparse_step_and_dense_layers() -> None:
    config = {**LLAMA, "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128,
              "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    spec = model_from_hf_config(config, name="q")
    assert [layer.is_moe for layer in spec.layers] == [False, True, False, False]
    moe = spec.layers[1].moe
    assert moe is not None and moe.shared_expert_gate and moe.shared_expert is not None


def test_gpt_neox_parallel_residual_and_rotary_pct() -> None:
    config = {"model_type": "gpt_neox", "hidden_size": 128, "intermediate_size": 512,
              "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 500, "rotary_pct": 0.5}
    spec = model_from_hf_config(config, name="neox")
    assert spec.layers[0].parallel_residual and spec.layers[0].attention.rotary_fraction == 0.5
    assert not spec.tie_word_embeddings and spec.norm_bias


def test_defaults_and_unknown_keys() -> None:
    config = {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"}
    spec = model_from_hf_config({**config, "_memplan": {"x": 1}, "some_future_key": [1]}, name="x")
    assert spec.num_kv_heads == spec.num_heads == 8
    assert not spec.tie_word_embeddings and spec.layers[0].attention.head_dim == 32


def test_load_hf_config_from_file_and_directory(tmp_path: Path) -> None:
    folder = tmp_path / "Llama-3.1-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(preset_config("llama-3.1-8b")))
    assert load_hf_config(folder / "config.json").name == "Llama-3.1-8B"
    assert load_hf_config(folder).num_layers == 32
    assert load_hf_config(folder, name="mine").name == "mine"


# ----------------------------------------------------------------------------- errors
def test_truncated_json_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    text = json.dumps(preset_config("qwen3-8b"), indent=2)
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ModelConfigError) as info:
        load_hf_config(path)
    assert str(path) in str(info.value) and "not valid JSON" in str(info.value)


def test_top_level_must_be_object(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="JSON object"):
        load_hf_config(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="no such file"):
        load_hf_config(tmp_path / "nope.json")


def test_unknown_model_type_lists_supported() -> None:
    message = str(_error({**LLAMA, "model_type": "bert"}))
    assert "model_type" in message and "'bert'" in message
    assert all(model_type in message for model_type in SUPPORTED_MODEL_TYPES)
    assert "model_type" in str(_error({k: v for k, v in LLAMA.items() if k != "model_type"}))


def test_missing_hidden_size() -> None:
    error = _error({k: v for k, v in LLAMA.items() if k != "hidden_size"})
    assert error.field == "hidden_size" and "required" in str(error)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_hidden_layers": -2}, "num_hidden_layers"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"hidden_size": "4096"}, "hidden_size"),
        ({"intermediate_size": 1.5}, "intermediate_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"head_dim": -1}, "head_dim"),
        ({"num_attention_heads": 7, "num_key_value_heads": 7}, "num_attention_heads"),
    ],
)
def test_invalid_field_is_named(change: dict[str, Any], field: str) -> None:
    error = _error({**LLAMA, **change})
    assert error.field == field and field in str(error)
    bad = next(iter(change.values())) if len(change) == 1 else None
    if bad is not None:
        assert repr(bad) in str(error)


def test_non_mapping_config() -> None:
    assert _error([1, 2]).field == "config"


def test_deepseek_requires_q_lora_rank_key() -> None:
    config = preset_config("deepseek-v2-lite")
    del config["q_lora_rank"]
    assert _error(config).field == "q_lora_rank"


def test_moe_top_k_above_experts() -> None:
    config = {**preset_config("mixtral-8x7b"), "num_experts_per_tok": 9}
    assert _error(config).field == "num_experts_per_tok"
