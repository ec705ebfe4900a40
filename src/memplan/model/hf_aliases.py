"""The other names a ``config.json`` may give a field: transformers' ``attribute_map`` per config class.

transformers reads an aliased key as its canonical field and writes the canonical name back, and the
canonical name has changed between releases: transformers 5 saves a Qwen3-MoE config with
``num_local_experts`` where the published Qwen3-MoE configs (written by 4.x) say ``num_experts``. The
builders read one name per field; :func:`canonical_config` renames the alias a config uses to that name
before the family's defaults fill in what it lacks (a default must never shadow the file's own value).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memplan.errors import ModelConfigError

__all__ = ["CONFIG_ALIASES", "canonical_config"]

#: Per ``model_type``: {the alias a file may use: the name memplan's builder reads} (from transformers 5's
#: ``attribute_map`` of MixtralConfig, Qwen3MoeConfig, GptOssConfig, DeepseekV2Config, DeepseekV3Config and
#: GPT2Config, and the 4.x names they replaced).
CONFIG_ALIASES: dict[str, dict[str, str]] = {
    "mixtral": {"num_experts": "num_local_experts"},
    "gpt_oss": {"num_experts": "num_local_experts"},
    "qwen3_moe": {"num_local_experts": "num_experts"},
    "deepseek_v2": {"num_experts": "n_routed_experts"},
    "deepseek_v3": {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"},
    "gpt2": {"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
             "num_hidden_layers": "n_layer"},
}


def canonical_config(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """``config`` with every alias of ``model_type`` renamed to the name the builder reads; a file that gives
    both names with different values is refused (which one transformers would use depends on its version)."""
    out = dict(config)
    for alias, name in CONFIG_ALIASES.get(model_type, {}).items():
        if out.get(alias) is None:
            continue
        value = out.pop(alias)
        if out.get(name) is not None and out[name] != value:
            raise ModelConfigError(alias, f"names the same field as {name} (transformers' attribute_map), which "
                                   f"the config gives as {out[name]!r}; keep one", value)
        out[name] = value
    return out
