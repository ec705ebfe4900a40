"""memplan's linear-layer names and shapes, and its parameter list, equal what ``transformers`` builds.

Each preset is built on the meta device with at most 2 decoder layers (DeepSeek: its leading dense
layers and one MoE layer) and compared module by module.
"""

from __future__ import annotations

import warnings
from functools import cache
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from memplan.model import model_from_hf_config
from memplan.model.linears import model_linears, model_parameters
from memplan.model.params import total_params
from memplan.model.presets import preset_config, preset_names

SMALL_LAYERS = 2
VARIANTS: dict[str, dict[str, Any]] = {
    "phi3": {"model_type": "phi3", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
             "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 33000},
    "gpt_neox": {"model_type": "gpt_neox", "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "vocab_size": 500},
    "qwen2_moe": {"model_type": "qwen2_moe", "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 256},
    # session 8's families: Gemma 3's q/k norms, OLMo 2's post-norms and whole-width q/k norms, ...
    **{model_type: {"model_type": model_type, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 500,
                    "pad_token_id": 0}
       for model_type in ("gemma", "gemma3_text", "olmo2", "olmo3", "granite", "smollm3")},
    "llama-biases": {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500, "attention_bias": True,
                     "mlp_bias": True},
    # gpt-oss (helper gptoss8): sinks, a biased router named ``router``, biased stacked experts
    "gpt_oss": {"model_type": "gpt_oss", "hidden_size": 128, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 500,
                "num_local_experts": 4, "num_experts_per_tok": 2},
}


def small_config(name: str) -> dict[str, Any]:
    """A preset's config (or a variant) with at most :data:`SMALL_LAYERS` decoder layers."""
    cfg = dict(VARIANTS[name]) if name in VARIANTS else preset_config(name)
    cfg = {k: v for k, v in cfg.items() if k not in ("auto_map", "quantization_config")}
    layers = max(SMALL_LAYERS, cfg.get("first_k_dense_replace", 0) + 1)
    for key in ("num_hidden_layers", "n_layer"):
        if key in cfg:
            cfg[key] = min(cfg[key], layers)
    return cfg


@cache
def meta_model(name: str) -> Any:
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.for_model(**small_config(name))
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)


ALL = [*preset_names(), *VARIANTS]


@pytest.mark.parametrize("name", ALL)
def test_linear_modules_match_transformers(name: str) -> None:
    spec = model_from_hf_config(small_config(name), name=name)
    model = meta_model(name)
    conv1d = transformers.pytorch_utils.Conv1D
    real = {}
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            real[module_name] = (module.in_features, module.out_features, module.bias is not None, "linear")
        elif isinstance(module, conv1d):
            real[module_name] = (module.weight.shape[0], module.nf, True, "conv1d")
        elif isinstance(module, torch.nn.Embedding) and module is model.get_input_embeddings():
            real[module_name] = (module.num_embeddings, module.embedding_dim, False, "embedding")
    ours = {m.name: (m.in_features, m.out_features, m.bias, m.kind) for m in model_linears(spec)}
    assert ours == real


@pytest.mark.parametrize("name", ALL)
def test_parameter_list_matches_transformers(name: str) -> None:
    spec = model_from_hf_config(small_config(name), name=name)
    real = {n: p.numel() for n, p in meta_model(name).named_parameters()}
    ours = {p.name: p.numel for p in model_parameters(spec)}
    assert ours == real
    assert sum(ours.values()) == total_params(spec)
