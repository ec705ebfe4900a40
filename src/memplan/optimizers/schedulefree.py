"""Schedule-free AdamW (``--optimizer schedulefree-adamw``; package ``schedulefree``, ``AdamWScheduleFree``).

Schedule-free AdamW (Defazio et al., 2024) replaces the learning-rate schedule by averaging iterates.
``schedulefree/adamw_schedulefree.py`` (1.4) keeps two states per parameter, both ``*_like(p)`` (the
parameter's dtype): ``z`` (the base sequence, a clone of the parameter) and ``exp_avg_sq``; no first
moment. The model's parameter itself holds ``y`` (the gradient point) in train mode and ``x`` (the
average) in eval mode: ``optimizer.train()`` / ``.eval()`` move between them in place (``p.lerp_(z)``), so
``x`` costs no memory. ``k``, ``weight_sum`` and ``lr_max`` are Python numbers in the param group. The
optimizer must be in train mode to step (it raises otherwise), as the Hugging Face Trainer arranges.

Its step is ``foreach`` (the package's default where torch has ``_foreach_mul_``: ``denom`` for every
parameter at once, one state-sized temporary per group) or a for-loop (``exp_avg_sq.div(...)``: one of the
largest parameter). There is no fused kernel. Element-wise, so it shards like AdamW (ZeRO, FSDP).
"""

from __future__ import annotations

from typing import Any

from memplan.optimizers.kind import (
    DialectNames,
    OptimizerKind,
    OptimizerSettings,
    OptimizerStates,
    StateQuery,
    StepQuery,
    TraceRequest,
    import_package,
    torch_step_bytes,
)

__all__ = ["SCHEDULEFREE_ADAMW"]


def _states(query: StateQuery) -> OptimizerStates:
    """``z`` and ``exp_avg_sq``, each like the parameter."""
    return OptimizerStates(device_bytes=2 * query.numel * query.state_bytes)


def _step(query: StepQuery) -> int:
    """foreach unless the job asks for the for-loop (``auto`` resolves to the profile's ``fused``: foreach here)."""
    impl = "for-loop" if query.implementation == "for-loop" else "foreach"
    return torch_step_bytes(StepQuery(impl, query.stepped_numel, query.largest_tensor, query.state_bytes,
                                      query.in_backward))


def _describe(settings: OptimizerSettings) -> str:
    return ("schedulefree-adamw: z and exp_avg_sq like the parameter (no first moment; x and y share the "
            "parameter, moved in place by optimizer.train()/eval())")


def _build(request: TraceRequest) -> Any:
    """``AdamWScheduleFree`` in train mode (it refuses to step otherwise)."""
    package = import_package("schedulefree", package="schedulefree", optimizer="schedulefree-adamw",
                             extra="schedulefree")
    optimizer = package.AdamWScheduleFree(request.groups, lr=request.learning_rate,
                                  foreach=request.implementation != "for-loop")
    optimizer.train()
    return optimizer


SCHEDULEFREE_ADAMW = OptimizerKind(
    name="schedulefree-adamw", summary="schedule-free AdamW (schedulefree): z and exp_avg_sq, no first moment",
    states=_states, step_temporaries=_step, describe=_describe,
    frameworks=frozenset({"hf"}),
    framework_rule=("schedulefree-adamw cannot run under --framework {framework}: schedule-free AdamW runs where "
                    "Hugging Face's Trainer (optim schedule_free_adamw) or a plain PyTorch loop runs the schedulefree "
                    "package; Megatron-LM's --optimizer, DeepSpeed's optimizer.type and torchtitan's optimizer "
                    "registry have none (use --framework hf)"),
    implementations=("foreach", "for-loop"),
    dialects=DialectNames(hf=(("schedule_free_adamw", "auto"),)),
    build=_build,
)
