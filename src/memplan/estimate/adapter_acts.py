"""Activations of a fine-tuning job's decoder layers: frozen base linears and peft adapters.

* A frozen linear layer saves nothing new for the backward: its grad-input needs only its weight
  (autograd saves the input of ``linear``/``mm`` only when the weight requires grad), so the GEMM
  inputs the full-training terms count are dropped for frozen layers; bitsandbytes' ``MatMul4Bit``
  saves only the packed weight and dequantizes it again in the backward.
* A LoRA adapter (peft ``tuners/lora/layer.py`` ``Linear.forward``): peft casts the input to the fp32
  adapter dtype (``_cast_input_dtype``), applies ``lora_dropout`` (an ``nn.Identity`` at p = 0), then
  ``lora_B(lora_A(x)) * scaling``. Under ``torch.autocast`` (the hf profile's mixed precision)
  ``lora_A`` casts that input back to 16 bits and saves the copy, and both adapters save 16-bit copies
  of their weights; without autocast ``lora_A`` saves the fp32 input. ``lora_B`` saves ``lora_A``'s
  output (rank wide). Dropout adds its mask (1 byte per element) and, without autocast, its output.
* peft's ``ParamWrapper`` adapters on fused MoE expert parameters and routers (peft's conversion of
  MoE targets for transformers 5) add ``B @ A`` to the weight itself; they are not priced here.
* DoRA (``tuners/lora/dora.py``): ``(m/||W + BA|| - 1) * base_result + m/||W + BA|| * lora_result``
  also saves the base result and the LoRA result (``out`` wide) for the magnitude's gradient.
"""

from __future__ import annotations

from memplan.estimate.activations import DROPOUT_MASK_BYTES, ActivationShape, Term
from memplan.model.peft_params import Adapter

#: Adapter weights' dtype (peft ``autocast_adapter_dtype=True``).
ADAPTER_BYTES = 4


def adapter_terms(adapters: tuple[Adapter, ...], shape: ActivationShape, *, autocast: bool, dropout: bool,
                  compute_bytes: int) -> list[Term]:
    """What the adapters of one decoder layer save for one micro-batch (undivided: TP = 1 assumed)."""
    tokens = shape.seq * shape.micro_batch
    terms: list[Term] = []
    lora_bytes = compute_bytes if autocast else ADAPTER_BYTES
    for a in adapters:
        if a.experts > 1 or m_is_parameter(a):
            continue  # peft ParamWrapper: adds B @ A to the weight; not priced (stated in the assumptions)
        m, r, rows = a.module, a.rank, tokens
        name = m.name.rpartition(".")[2]
        terms.append(Term(f"{name} lora_A input ({'16-bit autocast copy' if autocast else 'fp32 copy'})",
                          int(lora_bytes * rows * m.in_features), "rep", "body"))
        if dropout:
            terms.append(Term(f"{name} lora dropout mask", int(DROPOUT_MASK_BYTES * rows * m.in_features), "rep", "body"))
        terms.append(Term(f"{name} lora_B input (lora_A output)", int(lora_bytes * rows * r), "rep", "body"))
        if autocast:
            terms.append(Term(f"{name} lora_A/lora_B 16-bit weight copies",
                              compute_bytes * a.experts * a.rank * (m.in_features + m.out_features), "rep", "body"))
        if a.dora:
            terms.append(Term(f"{name} DoRA base and LoRA results (magnitude gradient)",
                              int((compute_bytes + lora_bytes) * rows * m.out_features), "rep", "body"))
    return terms


def m_is_parameter(adapter: Adapter) -> bool:
    """The adapter wraps a parameter (a router's ``gate.weight``), not a module."""
    return adapter.module.name.endswith(".weight")
