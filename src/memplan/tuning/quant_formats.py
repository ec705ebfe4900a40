"""The quantized-base registry: one :class:`QuantFormat` per ``--quantize-base`` value.

bitsandbytes replaces the frozen decoder linear weights (embeddings, norms, routers, fused experts
and the output head stay unquantized):

* 4-bit (``nf4``, ``fp4``; ``Linear4bit``, ``BitsAndBytesConfig(load_in_4bit=True,
  bnb_4bit_quant_type=...)``): two weights per uint8 byte; one absmax per 64 weights, fp32, or under
  double quantization uint8 plus one fp32 absmax per 256 blocks, the 256-entry fp32 dynamic code and
  an fp32 offset; and the 16-entry fp32 code book (``bitsandbytes.functional.quantize_4bit``);
* 8-bit (``int8``, LLM.int8, ``Linear8bitLt``, ``load_in_8bit=True``): one byte per weight and one
  fp32 scale per output row (``Int8Params.SCB``); the layer keeps its 16-bit input for its backward.
"""

from __future__ import annotations

from memplan.frozen import frozen_dataclass

__all__ = ["FP4", "INT8", "NF4", "NONE", "QUANT_FORMATS", "QuantFormat", "quant_format", "quant_format_of_bnb"]

#: Weights per absmax block of bitsandbytes' 4-bit quantization (``Linear4bit`` ``blocksize=64``).
NF4_BLOCK = 64
#: Absmax values per second-level block under double quantization (``quantize_blockwise(blocksize=256)``).
NESTED_BLOCK = 256
#: The 4-bit code book: 16 fp32 values per weight (``QuantState.code``, ``get_4bit_type``).
FOUR_BIT_CODE_BYTES = 16 * 4
#: The 8-bit dynamic code of the nested state (``state2.code``: 256 fp32 values) and its fp32 offset.
NESTED_CODE_BYTES = 256 * 4 + 4


def four_bit_bytes(numel: int, double_quant: bool) -> int:
    """Bytes of one 4-bit weight of ``numel`` elements (module docstring)."""
    packed = -(-numel // 2)
    blocks = -(-numel // NF4_BLOCK)
    if double_quant:
        absmax = blocks + 4 * -(-blocks // NESTED_BLOCK) + NESTED_CODE_BYTES
    else:
        absmax = 4 * blocks
    return packed + absmax + FOUR_BIT_CODE_BYTES


def int8_bytes(numel: int, rows: int) -> int:
    """``Linear8bitLt``: an int8 weight and an fp32 scale per output row (``Int8Params.SCB``)."""
    return numel + 4 * rows


@frozen_dataclass
class QuantFormat:
    """One quantized-base format: its bytes, what its layers keep, its bitsandbytes names."""

    name: str
    #: The format quantizes anything (``none`` does not).
    quantizes: bool = True
    #: bitsandbytes 4-bit (``Linear4bit``): ``--double-quant`` applies.
    four_bit: bool = False
    #: ``BitsAndBytesConfig(bnb_4bit_quant_type=...)`` of a 4-bit format.
    bnb_4bit_quant_type: str | None = None
    #: The layers keep their 16-bit GEMM input for the backward (``Linear8bitLt``).
    keeps_gemm_inputs: bool = False
    #: HBM bytes one dequantization moves per weight: the packed weight and its scales read (4-bit:
    #: 0.5 B + absmax; int8: 1 B + a row scale) and the 16-bit weight written (2 B).
    dequant_bytes_per_weight: float = 0.0

    def weight_bytes(self, numel: int, rows: int, double_quant: bool) -> int:
        """Bytes bitsandbytes stores for one quantized weight of ``numel`` elements and ``rows`` rows."""
        if not self.quantizes:
            raise ValueError(f"{self.name} quantizes nothing")
        return four_bit_bytes(numel, double_quant) if self.four_bit else int8_bytes(numel, rows)

    def sentence(self, double_quant: bool) -> str:
        """The assumption line of the format."""
        if self.four_bit:
            return (f"bitsandbytes {self.name}: decoder linear weights packed 2 per byte with one "
                    + ("uint8 absmax per 64 weights, an fp32 absmax per 256 blocks and a 256-entry fp32 code"
                       if double_quant else "fp32 absmax per 64 weights")
                    + "; embeddings, norms, routers, fused experts and the head unquantized; the backward "
                    "dequantizes each weight again (one temporary of the largest)")
        return ("bitsandbytes LLM.int8: decoder linear weights int8 with an fp32 scale per output row; "
                "embeddings, norms and the head unquantized")


NONE = QuantFormat(name="none", quantizes=False)
NF4 = QuantFormat(name="nf4", four_bit=True, bnb_4bit_quant_type="nf4", dequant_bytes_per_weight=2.6)
FP4 = QuantFormat(name="fp4", four_bit=True, bnb_4bit_quant_type="fp4", dequant_bytes_per_weight=2.6)
INT8 = QuantFormat(name="int8", keeps_gemm_inputs=True, dequant_bytes_per_weight=3.0)

QUANT_FORMATS: dict[str, QuantFormat] = {k.name: k for k in (NONE, NF4, FP4, INT8)}
#: bitsandbytes' ``bnb_4bit_quant_type`` default (``BitsAndBytesConfig``).
DEFAULT_4BIT = NF4


def quant_format(name: str) -> QuantFormat:
    """The entry of a ``--quantize-base`` value (checked by the job)."""
    return QUANT_FORMATS[name]


def quant_format_of_bnb(*, load_in_8bit: bool, quant_type: str | None) -> QuantFormat | None:
    """The format a ``BitsAndBytesConfig`` (``load_in_8bit``, ``bnb_4bit_quant_type``) selects; None
    for a 4-bit type bitsandbytes does not have."""
    if load_in_8bit:
        return INT8
    word = str(quant_type).lower() if quant_type else DEFAULT_4BIT.bnb_4bit_quant_type
    return next((k for k in QUANT_FORMATS.values() if k.four_bit and k.bnb_4bit_quant_type == word), None)
