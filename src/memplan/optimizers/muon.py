"""Megatron-LM's Muon (``--optimizer muon``, Emerging-Optimizers' ``OrthogonalizedOptimizer``).

One ``momentum_buffer`` (``zeros_like`` of the fp32 main parameter) per 2-D weight; its scalar
optimizer (Adam, ``--muon-scalar-optimizer``) keeps two moments for the embedding, output layer and
1-D tensors (``_is_muon_excluded``). Its Newton-Schulz step over one weight at a time is priced by
:func:`memplan.estimate.optimizers.muon_step_bytes` from the layer shapes.
"""

from __future__ import annotations

from memplan.optimizers.kind import (
    DialectNames,
    MegatronFlag,
    OptimizerKind,
    OptimizerSettings,
    OptimizerStates,
    StateQuery,
    StepQuery,
)

__all__ = ["MUON"]


def _states(query: StateQuery) -> OptimizerStates:
    scalar = min(query.numel, query.muon_scalar)
    return OptimizerStates(device_bytes=(query.numel - scalar) * query.state_bytes + 2 * scalar * query.state_bytes)


def _scalar_adam_step(query: StepQuery) -> int:
    """Its scalar Adam (embedding, output layer, 1-D tensors) steps tensor by tensor unless fused."""
    return 0 if query.implementation == "fused" else query.largest_tensor * query.state_bytes


def _describe(settings: OptimizerSettings) -> str:
    return ("muon: one fp32 momentum per 2-D weight; Adam moments for the embedding, output layer, norms and "
            f"biases; Newton-Schulz on one weight at a time ({settings.muon_tp_mode} TP mode)")


MUON = OptimizerKind(
    name="muon", summary="Megatron's Muon: a momentum per 2-D weight, Adam for the rest",
    states=_states, step_temporaries=_scalar_adam_step, describe=_describe,
    # Its framework (Megatron-LM) and full-training rules are the Megatron profile's feature
    # (memplan.profiles.rules.FEATURES "muon"), checked before the registry's.
    dialects=DialectNames(
        megatron=("muon", "dist_muon"),  # dist_muon: the deprecated spelling with the layer-wise distributed optimizer
        megatron_flags=(MegatronFlag("--muon-scalar-optimizer", "", "str", "adam", modelled=("adam",)),
                        MegatronFlag("--muon-tp-mode", "muon_tp_mode", "str", "duplicated"),
                        MegatronFlag("--muon-nesterov", "muon_nesterov", "flag", False))),
    untraceable="Megatron's Muon runs inside Megatron-LM, which memplan trace does not run (memplan estimate prices it)",
)
