"""bitsandbytes' optimizers: 8-bit and paged AdamW, Lion (``bitsandbytes/optim/optimizer.py``).

* 8-bit states are ``uint8`` tensors of the parameter's shape plus one fp32 ``absmax`` per block of
  :data:`BNB_BLOCK` elements per state; a tensor with fewer than :data:`MIN_8BIT_NUMEL` elements
  (``min_8bit_size``) keeps fp32 states instead. Two shared 256-entry fp32 quantization maps (2 KiB)
  are not counted.
* Paged optimizers allocate the states of tensors with at least :data:`PAGED_MIN_NUMEL` elements
  with ``cudaMallocManaged`` (``get_state_buffer`` -> ``F.get_paged``): CUDA unified memory, outside
  PyTorch's caching allocator, so not in ``max_memory_allocated``/``reserved``; the driver pages
  them to CPU memory under GPU memory pressure. Smaller tensors' states, and every ``absmax``, are
  ordinary CUDA tensors.
* Their kernels update in place: no step temporaries. States are fp32 (or 8-bit) whatever the
  parameters' dtype. The tracer runs a stand-in (:mod:`memplan.optimizers.bnb_standin`) that allocates what
  ``init_state`` does, since the CUDA kernels cannot run on fake tensors.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from memplan.optimizers.kind import (
    DialectNames,
    OptimizerKind,
    OptimizerSettings,
    OptimizerStates,
    SmallTensors,
    StateQuery,
    StepQuery,
    TraceRequest,
)

__all__ = ["BNB_BLOCK", "BNB_KINDS", "MIN_8BIT_NUMEL", "PAGED_MIN_NUMEL"]

#: bitsandbytes quantizes 8-bit states block-wise, one fp32 absmax per 256 elements (``blocksize = 256``).
BNB_BLOCK = 256
#: bitsandbytes ``min_8bit_size`` default: smaller tensors keep fp32 states.
MIN_8BIT_NUMEL = 4096
#: bitsandbytes ``get_state_buffer``: only tensors of at least 1e5 elements get paged states.
PAGED_MIN_NUMEL = 100_000
_FP32 = 4


def _state_bytes(numel: int, small: SmallTensors, per_element: int, eight_bit: bool, paged: bool) -> OptimizerStates:
    """bitsandbytes states of ``numel`` elements: 8-bit plus absmax, or fp32; paged or not."""
    fp32_numel = min(numel, small.below_8bit) if eight_bit else numel
    quantized = numel - fp32_numel
    blocks = -(-quantized // BNB_BLOCK) if quantized else 0
    # Each state: one byte per element (8-bit) or four (fp32); 8-bit states add their absmax.
    state_of = {"q": per_element * quantized, "f": per_element * _FP32 * fp32_numel}
    absmax = per_element * _FP32 * blocks
    if not paged:
        return OptimizerStates(device_bytes=state_of["q"] + state_of["f"] + absmax)
    unpaged = min(numel, small.below_paged)
    # Tensors below the paging threshold: the smallest ones, fp32 for 8-bit optimizers up to min_8bit_size.
    unpaged_fp32 = min(unpaged, fp32_numel)
    unpaged_q = unpaged - unpaged_fp32
    device = per_element * (_FP32 * unpaged_fp32 + (unpaged_q if eight_bit else _FP32 * unpaged_q))
    total = state_of["q"] + state_of["f"]
    return OptimizerStates(device_bytes=device + absmax, paged_bytes=total - device)


def _states(per_element: int, eight_bit: bool, paged: bool, query: StateQuery) -> OptimizerStates:
    return _state_bytes(query.numel, query.small, per_element, eight_bit, paged)


def _in_place(query: StepQuery) -> int:
    return 0


def _describe(eight_bit: bool, paged: bool, settings: OptimizerSettings) -> str:
    name = settings.name
    if eight_bit:
        out = (f"{name}: bitsandbytes 8-bit states (uint8 + one fp32 absmax per {BNB_BLOCK} elements); tensors "
               f"under {MIN_8BIT_NUMEL} elements keep fp32 states")
    else:
        out = f"{name}: bitsandbytes fp32 states"
    if paged:
        out += (f"; paged: states of tensors of at least {PAGED_MIN_NUMEL:,} elements live in CUDA unified memory "
                "(cudaMallocManaged), outside PyTorch's allocator and not in its peaks (paged_optimizer_bytes); the "
                "driver pages them to CPU memory under GPU memory pressure")
    return out


def _build(per_element: int, eight_bit: bool, paged: bool, request: TraceRequest) -> Any:
    from memplan.optimizers.bnb_standin import BitsAndBytesStandIn  # imports torch: only when tracing

    return BitsAndBytesStandIn(request.params, states_per_param=per_element, bits=8 if eight_bit else 32,
                               paged=paged, paged_on_device=request.device == "cuda", lr=request.learning_rate)


def _kind(name: str, per_element: int, eight_bit: bool, paged: bool, hf: tuple[str, ...], summary: str,
          torchtune: str = "") -> OptimizerKind:
    shape = (per_element, eight_bit, paged)
    return OptimizerKind(
        name=name, summary=summary, states=partial(_states, *shape), step_temporaries=_in_place,
        describe=partial(_describe, eight_bit, paged), small_tensors=True, paged=paged,
        dialects=DialectNames(hf=tuple((optim, "auto") for optim in hf), torchtune=torchtune),
        build=partial(_build, *shape),
    )


#: In registry order (the order Hugging Face's ``optim`` names are listed in messages).
BNB_KINDS = (
    _kind("adam8bit", 2, True, False, (), "bitsandbytes Adam8bit: two 8-bit moments"),
    _kind("adamw8bit", 2, True, False, ("adamw_bnb_8bit", "adamw_8bit"), "bitsandbytes AdamW8bit: two 8-bit moments",
          torchtune="bitsandbytes.optim.AdamW8bit"),
    _kind("paged-adamw8bit", 2, True, True, ("paged_adamw_8bit",),
          "bitsandbytes PagedAdamW8bit: two 8-bit moments in CUDA unified memory"),
    _kind("paged-adamw", 2, False, True, ("paged_adamw_32bit",),
          "bitsandbytes PagedAdamW: two fp32 moments in CUDA unified memory"),
    _kind("lion", 1, False, False, ("lion_32bit",), "bitsandbytes Lion: one fp32 momentum"),
    _kind("lion8bit", 1, True, False, ("lion_8bit",), "bitsandbytes Lion8bit: one 8-bit momentum"),
    _kind("paged-lion8bit", 1, True, True, ("paged_lion_8bit",),
          "bitsandbytes PagedLion8bit: one 8-bit momentum in CUDA unified memory"),
)
