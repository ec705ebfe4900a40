"""Megatron-LM's Muon (``--optimizer muon``, Emerging-Optimizers' ``OrthogonalizedOptimizer``).

One ``momentum_buffer`` (``zeros_like`` of the fp32 main parameter) per 2-D weight; its scalar
optimizer (Adam, ``--muon-scalar-optimizer``) keeps two moments for the embedding, output layer and
1-D tensors (``_is_muon_excluded``). Its Newton-Schulz step over one weight at a time is priced here
(:func:`muon_matrix_bytes`) over the stage's 2-D weights, which the estimator lists
(:func:`memplan.estimate.optimizers.muon_weight_matrices`). Megatron-LM runs it, for full training only.
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
    WeightMatrix,
)

__all__ = ["MUON", "muon_matrix_bytes"]

_FP32 = 4


def muon_matrix_bytes(m: WeightMatrix, mode: str, nesterov: bool) -> int:
    """Peak bytes one Muon step of ``m`` allocates on top of the states.

    Emerging-Optimizers' ``newton_schulz``: the fp32 momentum is normalized (fp32 copy), cast to bf16
    (``fp32_matmul_prec`` medium, Megatron's default), and each iteration makes the Gram matrix
    ``A = X X^T`` and ``B`` (min(m, n)^2 each, bf16) and a new bf16 iterate while the old one lives;
    the result is cast back to fp32 and scaled twice (``orth * scale * extra_scale``: two fp32
    copies). ``duplicated`` TP (``newton_schulz_tp``) first all-gathers the shards into a list and
    concatenates them: two fp32 copies of the full matrix alive through the iteration.
    ``distributed`` keeps the shard and all-reduces a Gram matrix of its unsplit dimension.
    Nesterov (``grad.lerp(momentum)``) adds one fp32 copy of the local gradient.
    """
    split = m.partition_dim is not None and m.tp > 1
    rows = m.rows // m.tp if split and m.partition_dim == 0 else m.rows
    cols = m.cols // m.tp if split and m.partition_dim == 1 else m.cols
    local = rows * cols
    if split and mode == "duplicated":
        full, side = m.rows * m.cols, min(m.rows, m.cols)
        peak = max(2 * _FP32 * full + _FP32 * full + 2 * full, 2 * _FP32 * full + 4 * full + 4 * side * side)
    else:
        side = (m.cols if m.partition_dim == 0 else m.rows) if split and mode == "distributed" else min(rows, cols)
        peak = max(3 * _FP32 * local, 4 * local + 4 * side * side)
    return peak + (_FP32 * local if nesterov else 0)


def _states(query: StateQuery) -> OptimizerStates:
    scalar = min(query.numel, query.muon_scalar)
    settings = query.settings
    # Muon steps one weight at a time: the largest step, after what precedes it
    step = max((m.before + muon_matrix_bytes(m, settings.muon_tp_mode, settings.muon_nesterov)
                for m in query.matrices), default=0)
    return OptimizerStates(device_bytes=(query.numel - scalar) * query.state_bytes + 2 * scalar * query.state_bytes,
                           step_bytes=step)


def _scalar_adam_step(query: StepQuery) -> int:
    """Its scalar Adam (embedding, output layer, 1-D tensors) steps tensor by tensor unless fused."""
    return 0 if query.implementation == "fused" else query.largest_tensor * query.state_bytes


def _describe(settings: OptimizerSettings) -> str:
    return ("muon: one fp32 momentum per 2-D weight; Adam moments for the embedding, output layer, norms and "
            f"biases; Newton-Schulz on one weight at a time ({settings.muon_tp_mode} TP mode)")


MUON = OptimizerKind(
    name="muon", summary="Megatron's Muon: a momentum per 2-D weight, Adam for the rest",
    states=_states, step_temporaries=_scalar_adam_step, describe=_describe, weight_matrices=True,
    frameworks=frozenset({"megatron"}),
    framework_rule="muon is priced as Megatron-LM's Muon (its parameter split and Newton-Schulz step); use "
                   "--framework megatron",
    full_training_rule="muon is priced for full training only (its Muon/Adam split of frozen or adapter "
                       "parameters is not modelled)",
    knobs=("muon_tp_mode", "muon_nesterov"),
    dialects=DialectNames(
        megatron=("muon", "dist_muon"),  # dist_muon: the deprecated spelling with the layer-wise distributed optimizer
        megatron_flags=(MegatronFlag("--muon-scalar-optimizer", "", "str", "adam", modelled=("adam",)),
                        MegatronFlag("--muon-tp-mode", "muon_tp_mode", "str", "duplicated"),
                        MegatronFlag("--muon-nesterov", "muon_nesterov", "flag", False))),
    untraceable="Megatron's Muon runs inside Megatron-LM, which memplan trace does not run (memplan estimate prices it)",
)
