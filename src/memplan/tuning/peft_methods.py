"""The PEFT-method registry: one :class:`PeftMethodKind` per ``--peft`` value.

``none`` trains no adapters; ``lora`` adds ``lora_A`` (r x in) and ``lora_B`` (out x r) beside each
targeted linear layer (peft ``LoraLayer``); ``dora`` adds to them a magnitude vector per output
feature (peft ``use_dora=True``, ``DoraLinearLayer``), which also keeps the base and LoRA results
for its backward. The estimator, the tracer and the dialect readers ask the entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from typing import Any

from memplan.frozen import frozen_dataclass

__all__ = ["DORA", "LORA", "NONE", "PEFT_METHODS", "PeftMethodKind", "peft_method", "peft_method_of_config"]


@frozen_dataclass
class PeftMethodKind:
    """One PEFT method: its adapters and what the tracer asks peft for."""

    name: str
    description: str
    #: The method adds adapters (``lora_A``/``lora_B``) to the targeted modules.
    adapters: bool = True
    #: A magnitude vector per output feature (DoRA): a third adapter tensor, fp32 scales, and the base
    #: and LoRA results kept for its backward.
    magnitude: bool = False
    #: Options of ``peft.LoraConfig`` that select this method (the tracer passes them).
    lora_config: Mapping[str, Any] = field(default_factory=dict)
    #: The key of a peft / TRL config whose truth selects this method over plain LoRA.
    config_flag: str | None = None

    @property
    def tensors_per_adapter(self) -> int:
        """Parameter tensors one adapted module gets: lora_A, lora_B (and the magnitude)."""
        return (3 if self.magnitude else 2) if self.adapters else 0


NONE = PeftMethodKind(name="none", description="no adapters", adapters=False)
LORA = PeftMethodKind(name="lora", description="LoRA adapters (lora_A, lora_B) beside each targeted linear",
                      lora_config={"use_dora": False})
DORA = PeftMethodKind(name="dora", description="DoRA: LoRA plus a magnitude vector per output feature",
                      magnitude=True, lora_config={"use_dora": True}, config_flag="use_dora")

PEFT_METHODS: dict[str, PeftMethodKind] = {k.name: k for k in (NONE, LORA, DORA)}


def peft_method(name: str) -> PeftMethodKind:
    """The entry of a ``--peft`` value (checked by the job)."""
    return PEFT_METHODS[name]


def peft_method_of_config(config: Mapping[str, Any], has: Any = None) -> PeftMethodKind:
    """The adapter method a peft ``LoraConfig`` / TRL ``ModelConfig`` mapping selects: the entry whose
    :attr:`~PeftMethodKind.config_flag` is set (``has(key)`` decides, default the key's truth), else LoRA."""
    is_set = has or (lambda key: bool(config.get(key)))
    return next((k for k in PEFT_METHODS.values() if k.config_flag and is_set(k.config_flag)), LORA)
