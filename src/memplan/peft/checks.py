"""Checks of the fine-tuning flags against a model: names that match no module, ranks too large.

Called by :func:`memplan.jobcheck.validate_job_for_model`; each failure is one
:class:`~memplan.errors.JobConfigError` naming the flag, the rule and the value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.errors import JobConfigError
from memplan.model.linears import matches, model_linears
from memplan.peft.default_targets import auto_targets, peft_has_default
from memplan.peft.params import (
    adapter_targets,
    fused_gate_up_complete,
    module_names,
    rank_of,
    split_targets,
    target_names,
)

if TYPE_CHECKING:
    from memplan.job import FineTuning
    from memplan.model.spec import ModelSpec


def check_finetune_names(model: ModelSpec, ft: FineTuning) -> None:
    """Module names the fine-tuning flags give must exist in ``model`` and ranks must fit the layers
    they target; raise :class:`~memplan.errors.JobConfigError` naming the flag."""
    if not ft.peft_kind.adapters and not ft.modules_to_save and ft.resolved_trainable in ("all", "adapters"):
        return  # full training names nothing (the common case: no walk over the model's linears)
    linears = list(model_linears(model))

    def listing() -> str:  # for the error messages only
        return ", ".join(sorted({m.name.rpartition(".")[2] for m in linears}))

    modules, _ = split_targets(model, ft) if ft.peft_kind.adapters else ((), ())
    for target in modules or ():
        if not any(matches(m.name, target) for m in linears):
            if ft.lora_targets == "auto":
                raise JobConfigError("--lora-targets", f"auto stands for {_auto_source(model.model_type)}, which "
                                     f"this model lacks: name the modules to adapt (its linear layers: {listing()})",
                                     f"auto -> {target}")
            raise JobConfigError("--lora-targets", f"must name modules of the model (its linear layers: {listing()})",
                                 target)
    if ft.peft_kind.adapters and fused_gate_up_complete(model, ft) is False:
        raise JobConfigError("--lora-targets", "must name both expert projections fused into gate_up_proj "
                             "(peft refuses one alone)", ft.lora_targets)
    if ft.peft_kind.adapters and target_names(model.model_type, ft) is not None:
        for a in adapter_targets(model, ft):
            rank = rank_of(a.name, ft.lora_rank, ft.rank_pattern)
            if rank > min(a.in_features, a.out_features):
                flag = "--lora-rank-pattern" if rank != ft.lora_rank else "--lora-rank"
                raise JobConfigError(flag, f"must not exceed min(in, out) = {min(a.in_features, a.out_features)} "
                                     f"of the targeted layer {a.name}", rank)
    for flag, text in (("--modules-to-save", ft.modules_to_save),
                       ("--trainable", "" if ft.resolved_trainable in ("all", "adapters") else ft.resolved_trainable)):
        for key in filter(None, text.split(",")):
            names = module_names(model)
            hit = (any(n.endswith(key) for n in names) if flag == "--modules-to-save"
                   else any(matches(n, key) for n in names))
            if not hit:
                raise JobConfigError(flag, f"must name modules of the model (its linear layers: {listing()}; "
                                     "or embed_tokens, norm, layers.N)", key)


def _auto_source(model_type: str) -> str:
    """Where ``--lora-targets auto``'s modules come from, for an error sentence."""
    names = ",".join(auto_targets(model_type))
    if peft_has_default(model_type):
        return f"peft's default target modules for {model_type} ({names})"
    return f"{names} (peft has no default target modules for {model_type})"
