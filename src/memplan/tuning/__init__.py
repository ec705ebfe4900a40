"""Fine-tuning variants as registries: PEFT methods (:mod:`memplan.tuning.peft_methods`) and
quantized-base formats (:mod:`memplan.tuning.quant_formats`).

Each ``--peft`` / ``--quantize-base`` value is one entry carrying what the estimator prices (adapter
tensors, weight bytes, what a layer keeps), what the tracer builds (the peft ``LoraConfig`` options,
the bitsandbytes layer and ``BitsAndBytesConfig``), the words the dialects use, and its sentence.
Entries receive plain values, so the job (:mod:`memplan.job`) can check its choices against them.
Adding a method or a format is one entry in its module, plus its tests and docs.
"""

from memplan.tuning.peft_methods import PEFT_METHODS, PeftMethodKind, peft_method, peft_method_of_config
from memplan.tuning.quant_formats import QUANT_FORMATS, QuantFormat, quant_format, quant_format_of_bnb

__all__ = ["ADAPTER_METHODS", "FOUR_BIT_FORMATS", "PEFT_METHODS", "QUANTIZING_FORMATS", "QUANT_FORMATS",
           "PeftMethodKind", "QuantFormat", "either", "peft_method", "peft_method_of_config", "quant_format",
           "quant_format_of_bnb"]

#: The ``--peft`` values that add adapters, the ``--quantize-base`` values that quantize, the 4-bit ones.
ADAPTER_METHODS: tuple[str, ...] = tuple(k.name for k in PEFT_METHODS.values() if k.adapters)
QUANTIZING_FORMATS: tuple[str, ...] = tuple(k.name for k in QUANT_FORMATS.values() if k.quantizes)
FOUR_BIT_FORMATS: tuple[str, ...] = tuple(k.name for k in QUANT_FORMATS.values() if k.four_bit)


def either(names: tuple[str, ...]) -> str:
    """``a, b or c``: choices in a sentence."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
