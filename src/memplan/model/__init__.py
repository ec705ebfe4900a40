"""Model architecture facts: :class:`ModelSpec`, loaders for Hugging Face configs and presets."""

from memplan.model.hf import SUPPORTED_MODEL_TYPES, load_hf_config, model_from_hf_config
from memplan.model.params import ParamGroups, active_params, per_layer_param_counts, total_params
from memplan.model.presets import PresetInfo, list_presets, load_model, load_preset
from memplan.model.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, MoESpec

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "AttentionSpec",
    "LayerSpec",
    "MLPSpec",
    "MoESpec",
    "ModelSpec",
    "ParamGroups",
    "PresetInfo",
    "active_params",
    "list_presets",
    "load_hf_config",
    "load_model",
    "load_preset",
    "model_from_hf_config",
    "per_layer_param_counts",
    "total_params",
]
