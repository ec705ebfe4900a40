"""What ``--lora-targets auto`` adapts: peft's own default target modules for the model type.

``peft.LoraConfig(target_modules=None)`` looks the model's ``config.model_type`` up in its table
``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`` (``peft/utils/constants.py``; read in peft 0.21.2) and
raises "Please specify `target_modules`" for a type it does not list. The entries below are that table's for
the decoder families memplan reads (:data:`memplan.model.hf.SUPPORTED_MODEL_TYPES`) and their close relatives.

For a model type peft does not list, memplan prices ``q_proj,v_proj`` where the model has both (the choice
peft makes for Llama, Mistral, Qwen and Gemma) and says so in the estimate's assumptions; where the model
has no such modules the job is refused, naming the modules it has (:mod:`memplan.peft.checks`).
"""

from __future__ import annotations

#: peft's default LoRA target modules by ``model_type`` (decoder language models).
PEFT_DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    "gpt2": ("c_attn",),
    "gpt_bigcode": ("c_attn",),
    "gpt_neox": ("query_key_value",),
    "falcon": ("query_key_value",),
    "bloom": ("query_key_value",),
    "gptj": ("q_proj", "v_proj"),
    "gpt_neo": ("q_proj", "v_proj"),
    "opt": ("q_proj", "v_proj"),
    "codegen": ("qkv_proj",),
    "mpt": ("Wqkv",),
    "phi": ("q_proj", "v_proj", "fc1", "fc2"),
    "stablelm": ("q_proj", "v_proj"),
    "llama": ("q_proj", "v_proj"),
    "llama4": ("q_proj", "v_proj"),
    "mistral": ("q_proj", "v_proj"),
    "mixtral": ("q_proj", "v_proj"),
    "gemma": ("q_proj", "v_proj"),
    "gemma2": ("q_proj", "v_proj"),
    "gemma3_text": ("q_proj", "v_proj"),
    "qwen2": ("q_proj", "v_proj"),
    "qwen3": ("q_proj", "v_proj"),
}

#: What ``auto`` prices where peft has no default for the model type (said in the assumptions).
FALLBACK_TARGETS: tuple[str, ...] = ("q_proj", "v_proj")


def auto_targets(model_type: str) -> tuple[str, ...]:
    """The modules ``--lora-targets auto`` adapts on a model of ``model_type``."""
    return PEFT_DEFAULT_TARGETS.get(model_type, FALLBACK_TARGETS)


def peft_has_default(model_type: str) -> bool:
    """Whether peft itself picks target modules for ``model_type`` (else it asks for ``target_modules``)."""
    return model_type in PEFT_DEFAULT_TARGETS
