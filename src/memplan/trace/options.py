"""What to trace: :class:`TraceOptions`, the job of one traced training step (no torch import).

The words are the ones ``memplan estimate`` uses (see :mod:`memplan.job`), so a traced job and an
estimated job can be compared field by field (:mod:`memplan.trace.compare`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from memplan.errors import ConfigError
from memplan.job import OptimizerImpl, OptimizerName, PrecisionName, RecomputeMode

__all__ = ["MoeRouting", "TraceAttention", "TraceDevice", "TraceOptions"]

TraceDevice = Literal["cuda", "cpu"]
TraceAttention = Literal["sdpa", "eager"]
#: ``balanced``: replace data-dependent MoE routing by a static, evenly balanced assignment.
MoeRouting = Literal["error", "balanced"]

_MAX_RANKS = 1 << 16


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(name, f"must be one of {', '.join(choices)}", value)


def _positive(name: str, value: object, maximum: int = 10**8) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ConfigError(name, f"must be an integer in [1, {maximum}]", value)


@dataclass(frozen=True, kw_only=True)
class TraceOptions:
    """The training job a trace runs: batch, precision, optimizer, recompute, device, ranks."""

    #: ``--seq``: tokens per sequence.
    seq: int = 1024
    #: ``--mbs``: sequences per micro-batch.
    mbs: int = 1
    #: ``--precision``: ``fp32``/``bf16``/``fp16`` keep weights, gradients and optimizer states in
    #: that dtype; ``*-mixed`` keeps fp32 weights and runs the forward under ``torch.autocast``
    #: (the ``hf`` framework profile of the estimator).
    precision: PrecisionName = "bf16-mixed"
    #: ``--optimizer``: adamw, adam or sgd (adafactor reads its step with ``.item()`` and adam8bit
    #: needs bitsandbytes: both refused with a clear error).
    optimizer: OptimizerName = "adamw"
    #: SGD momentum; 0 keeps no momentum buffer.
    momentum: float = 0.0
    #: ``auto``: foreach on CUDA, for-loop on CPU (PyTorch's defaults); or force one.
    optimizer_impl: OptimizerImpl = "auto"
    #: ``--recompute``: none, selective (each attention module is checkpointed) or full (each
    #: decoder layer is checkpointed, non-reentrant).
    recompute: RecomputeMode = "none"
    #: ``--attention``: PyTorch SDPA or the eager softmax(QK^T)V path of transformers.
    attention: TraceAttention = "sdpa"
    #: Dropout probability set on every dropout of the model config (masks are then allocated).
    dropout: float = 0.0
    #: ``--device``: ``cuda`` accounts as the CUDA caching allocator would (512-byte rounding,
    #: foreach optimizer, step counters on the host); ``cpu`` exactly as a CPU run allocates.
    device: TraceDevice = "cuda"
    #: ``--fsdp N``: simulated FSDP2 ranks (1 = no FSDP).
    fsdp: int = 1
    #: ``--tp N``: simulated tensor-parallel ranks (1 = no TP).
    tp: int = 1
    #: Training iterations to run (2: the second one has its optimizer states).
    iterations: int = 2
    #: ``--moe-routing``: what to do with data-dependent MoE routing under fake tensors.
    moe_routing: MoeRouting = "balanced"

    def __post_init__(self) -> None:
        _positive("--seq", self.seq)
        _positive("--mbs", self.mbs, 1 << 20)
        _positive("--fsdp", self.fsdp, _MAX_RANKS)
        _positive("--tp", self.tp, _MAX_RANKS)
        _positive("--iterations", self.iterations, 100)
        _choice("--precision", self.precision, get_args(PrecisionName))
        _choice("--optimizer", self.optimizer, get_args(OptimizerName))
        _choice("--optimizer-impl", self.optimizer_impl, get_args(OptimizerImpl))
        _choice("--recompute", self.recompute, get_args(RecomputeMode))
        _choice("--attention", self.attention, get_args(TraceAttention))
        _choice("--device", self.device, get_args(TraceDevice))
        _choice("--moe-routing", self.moe_routing, get_args(MoeRouting))
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("--dropout", "must be in [0, 1)", self.dropout)
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError("--momentum", "must be in [0, 1)", self.momentum)
        if self.optimizer == "adam8bit":
            raise ConfigError("--optimizer", "adam8bit needs bitsandbytes and a GPU; trace supports "
                              "adamw, adam, sgd, adafactor", self.optimizer)

    @property
    def world_size(self) -> int:
        """Simulated ranks: fsdp x tp."""
        return self.fsdp * self.tp

    @property
    def mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    @property
    def compute_dtype(self) -> str:
        """``fp32``, ``bf16`` or ``fp16``: the dtype matmuls run in."""
        return self.precision.removesuffix("-mixed")

    @property
    def resolved_optimizer_impl(self) -> str:
        """``foreach``, ``fused`` or ``for-loop``: what PyTorch runs on ``device`` for ``auto``."""
        if self.optimizer_impl != "auto":
            return self.optimizer_impl
        return "foreach" if self.device == "cuda" else "for-loop"
