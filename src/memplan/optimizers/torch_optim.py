"""torch.optim's Adam, AdamW, SGD and Adafactor (and the frameworks' fused Adam, which keeps the same states)."""

from __future__ import annotations

from typing import Any

from memplan.optimizers.kind import (
    DialectNames,
    MegatronFlag,
    OptimizerKind,
    OptimizerSettings,
    OptimizerStates,
    StateQuery,
    StepQuery,
    TraceRequest,
    torch_step_bytes,
)

__all__ = ["ADAFACTOR", "ADAM", "ADAMW", "SGD"]


def _impl_kwargs(request: TraceRequest) -> dict[str, Any]:
    impl = request.implementation
    return {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}


def _build_adamw(request: TraceRequest) -> Any:
    import torch

    return torch.optim.AdamW(request.groups, lr=request.learning_rate, **_impl_kwargs(request))


def _build_adam(request: TraceRequest) -> Any:
    import torch

    return torch.optim.Adam(request.groups, lr=request.learning_rate, **_impl_kwargs(request))


def _build_sgd(request: TraceRequest) -> Any:
    import torch

    return torch.optim.SGD(request.groups, lr=request.learning_rate, momentum=request.settings.momentum,
                           **_impl_kwargs(request))


def _two_moments(query: StateQuery) -> OptimizerStates:
    """``exp_avg`` and ``exp_avg_sq``, each like the parameter."""
    return OptimizerStates(device_bytes=2 * query.numel * query.state_bytes)


def _sgd_states(query: StateQuery) -> OptimizerStates:
    """One ``momentum_buffer`` like the parameter, none without momentum."""
    return OptimizerStates(device_bytes=query.numel * query.state_bytes if query.settings.momentum > 0 else 0)


def _adafactor_states(query: StateQuery) -> OptimizerStates:
    """Factored second moment (torch.optim.Adafactor, transformers' Adafactor, no first moment by default): a
    row and a column vector per matrix, about numel/cols + numel/rows; with one side of every matrix the hidden
    size this is about 2 * numel / hidden. 1-D tensors keep an unfactored second moment."""
    vectors = min(query.numel, query.small.vectors)
    return OptimizerStates(device_bytes=(2 * ((query.numel - vectors) // query.hidden) + vectors) * query.state_bytes)


def _unfused_step(query: StepQuery) -> int:
    """SGD and Adafactor have no foreach path worth pricing apart: a for-loop step unless fused."""
    impl = query.implementation if query.implementation == "fused" else "for-loop"
    return torch_step_bytes(StepQuery(impl, query.stepped_numel, query.largest_tensor, query.state_bytes,
                                      query.in_backward))


def _describe_adafactor(settings: OptimizerSettings) -> str:
    return "adafactor: factored second moment (a row and a column vector per matrix), no first moment"


ADAMW = OptimizerKind(
    name="adamw", summary="torch.optim.AdamW (and every framework's fused AdamW): two moments like the parameter",
    states=_two_moments, step_temporaries=torch_step_bytes, fused_step_counters=True,
    dialects=DialectNames(megatron=("adam", "adamw"), deepspeed=("adamw", "fusedadam"),
                          hf=(("adamw_torch", "foreach"), ("adamw_torch_fused", "fused")), torchtitan=("AdamW",)),
    build=_build_adamw, eight_bit_variant="adamw8bit",
)
ADAM = OptimizerKind(
    name="adam", summary="torch.optim.Adam: two moments like the parameter",
    states=_two_moments, step_temporaries=torch_step_bytes, fused_step_counters=True,
    dialects=DialectNames(deepspeed=("adam", "onebitadam"), torchtitan=("Adam",)),
    build=_build_adam, eight_bit_variant="adamw8bit",
)
ADAFACTOR = OptimizerKind(
    name="adafactor", summary="Adafactor: factored second moment, no first moment",
    states=_adafactor_states, step_temporaries=_unfused_step, describe=_describe_adafactor, small_tensors=True,
    dialects=DialectNames(hf=(("adafactor", "auto"),)),
    untraceable="PyTorch's Adafactor reads its step counter with .item(), which fake tensors cannot answer; "
                "memplan trace runs adamw, adam and sgd (memplan estimate prices adafactor)",
)
SGD = OptimizerKind(
    name="sgd", summary="torch.optim.SGD: one momentum buffer (none with --momentum 0)",
    states=_sgd_states, step_temporaries=_unfused_step, knobs=("momentum",),
    dialects=DialectNames(megatron=("sgd",), megatron_flags=(MegatronFlag("--sgd-momentum", "momentum", "float", 0.9),),
                          deepspeed=("sgd",), deepspeed_params=(("momentum", "momentum", 0.0),),
                          hf=(("sgd", "foreach"),)),
    build=_build_sgd,
)
