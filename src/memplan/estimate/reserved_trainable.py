"""A fine-tuning job's trainable tensors in the reserved-memory schedule (issue 25, item 8;
:mod:`memplan.estimate.reserved_sim`).

Gradients, optimizer moments and the optimizer step's temporaries exist only for trainable parameters,
one tensor each, as large as its parameter in its own dtype. Under PEFT those are not the base model's
tensors: a LoRA adapter's ``lora_A`` and ``lora_B`` (and a DoRA magnitude) in the adapter dtype, a
``modules_to_save`` copy's tensors in the frozen base's dtype (peft deep-copies the module: a copied
embedding and head are two vocabulary-sized tensors, as a trace of such a job allocates them), and
fully trained modules' tensors in the job's parameter dtype. Spreading the estimate's gradient bytes
over the base model's tensors instead cuts a vocabulary-sized gradient into small pieces in every layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType

from memplan.estimate.context import StageContext
from memplan.estimate.memo import Same
from memplan.estimate.finetune import adapter_bytes, frozen_bytes_per_element, is_finetune
from memplan.estimate.stage_states import adapter_tensor_sizes  # one definition of lora_A/lora_B/magnitude
from memplan.job import FineTuning
from memplan.model.linears import model_parameters
from memplan.model.spec import ModelSpec
from memplan.peft.params import finetune_params, saved_modules, trained_modules


def _under(module: str, names: tuple[str, ...]) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


def trainable_units(ctx: StageContext, layers: list[int]) -> list[list[int]] | None:
    """Per unit (the root, then the stage's ``layers`` in order) the weights (numel times bytes per
    element) of its trainable tensors, or None when everything trains (the base model's tensors)."""
    trained = _trained(ctx)
    if trained is None:
        return None
    by_unit = trained.by_unit
    root = list(by_unit.get(None, ())) if ctx.layout.has_embedding or ctx.layout.has_head else []
    return [root] + [list(by_unit.get(i, ())) for i in layers]


def trainable_lead(ctx: StageContext) -> int:
    """How many of the root unit's trainable tensors (:func:`trainable_units`) ``model.parameters()`` lists
    before the decoder layers (a trained or ``modules_to_save`` embedding's)."""
    trained = _trained(ctx)
    return 0 if trained is None else trained.lead


@dataclass(frozen=True)
class _Trainable:
    #: Per decoder layer (None: the root) its trainable tensors' bytes.
    by_unit: Mapping[int | None, tuple[int, ...]]
    #: The root's tensors listed before the decoder layers.
    lead: int


def _trained(ctx: StageContext) -> _Trainable | None:
    job = ctx.job
    if not is_finetune(job):
        return None
    return _by_unit(Same(ctx.model), job.finetune, max(ctx.run.prec.param_bytes, 1), frozen_bytes_per_element(job),
                    adapter_bytes(job), ctx.run.vocab_rows)


@lru_cache(maxsize=64)
def _by_unit(same: Same, ft: FineTuning, full_bytes: int, copy_bytes: int, adapter: int,
             vocab_rows: int) -> _Trainable:
    """The trainable tensors' bytes per decoder layer (None: the root), a pure function of its arguments
    (cached: every stage and every job of one model, by identity, and fine-tuning setup shares it)."""
    model: ModelSpec = same.obj  # type: ignore[assignment]
    everything = ft.resolved_trainable == "all"
    full, copies = trained_modules(model, ft), saved_modules(model, ft)
    by_unit: dict[int | None, list[int]] = {}
    lead: int | None = None  # the root's entries made before the first decoder-layer tensor
    for p in model_parameters(model):
        if p.layer is not None and lead is None:
            lead = len(by_unit.get(None, ()))
        if everything or _under(p.module, full):
            by_unit.setdefault(p.layer, []).append(p.numel * full_bytes)
        if _under(p.module, copies):
            by_unit.setdefault(p.layer, []).append(p.numel * copy_bytes)
    lead = len(by_unit.get(None, ())) if lead is None else lead
    if "lm_head" in copies and not any(p.module == "lm_head" for p in model_parameters(model)):
        # a tied head's copy has its own weight
        by_unit.setdefault(None, []).append(vocab_rows * model.hidden_size * copy_bytes)
    for a in finetune_params(model, ft).adapters:  # an embedding's adapters too after the root's (not modelled)
        by_unit.setdefault(a.module.layer, []).extend(n * adapter for n in adapter_tensor_sizes(a))
    return _Trainable(MappingProxyType({unit: tuple(sizes) for unit, sizes in by_unit.items()}), lead)
