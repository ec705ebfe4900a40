"""What trains and what is frozen under a fine-tuning job: adapters, fully trained and frozen weights.

A pure function of the model's named modules (:mod:`memplan.model.linears`) and the job's
:class:`~memplan.job.FineTuning`, following peft 0.21 (tested for exact equality with
``get_nb_trainable_parameters()`` of real peft models):

* LoRA on a linear layer adds ``lora_A`` (``r x in``) and ``lora_B`` (``out x r``), no bias; on an
  embedding ``lora_embedding_A`` (``r x vocab``) and ``lora_embedding_B`` (``hidden x r``). DoRA adds a
  magnitude vector of ``out`` entries. Targets match peft's ``target_modules`` rule (the whole dotted
  name or its last components); ``all-linear`` is every ``nn.Linear``/``Conv1D`` but the output head;
  ``rank_pattern`` keys match as peft's ``get_pattern_key`` (a regex on the last components).
* ``modules_to_save`` matches as peft's ``_set_trainable`` (``name.endswith(key)``): each matching
  module gets a trainable copy beside its frozen original.
* ``--trainable`` names (memplan's own) train every parameter of each matching module fully.
"""

from __future__ import annotations

import re
from dataclasses import field
from functools import lru_cache
from typing import TYPE_CHECKING

from memplan.frozen import frozen_dataclass
from memplan.job import ALL_LINEAR
from memplan.model.linears import LinearModule, layer_prefix, matches, model_linears, model_parameters
from memplan.peft.default_targets import auto_targets

if TYPE_CHECKING:
    from memplan.job import FineTuning
    from memplan.model.spec import ModelSpec


@frozen_dataclass
class Adapter:
    """One LoRA/DoRA adapter: the module (or fused expert parameter) it wraps and its rank.

    A fused expert parameter ``(E, out, in)`` gets peft's ``ParamWrapper`` adapters ``lora_A``
    ``(E*r, in)`` and ``lora_B`` ``(out, E*r)``: ``experts = E``.
    """

    module: LinearModule
    rank: int
    dora: bool
    experts: int = 1

    @property
    def numel(self) -> int:
        m = self.module
        magnitude = m.out_features if self.dora else 0
        return self.experts * self.rank * (m.in_features + m.out_features) + magnitude


@frozen_dataclass
class PartCounts:
    """Parameters (numel) of one part of the model (a decoder layer, or the embedding/head/final norm)."""

    #: Base parameters trained fully (``--trainable`` names, or everything without --peft).
    trained: int = 0
    #: Frozen base parameters kept unquantized.
    frozen: int = 0
    #: Frozen linear weights replaced by bitsandbytes quantized weights (numel of each tensor).
    quantized: tuple[int, ...] = ()
    #: Adapter parameters (fp32 by peft's default).
    adapter: int = 0
    #: Trainable ``modules_to_save`` copies.
    copies: int = 0
    #: Output features (rows) of each quantized weight, in the order of ``quantized``.
    quantized_rows: tuple[int, ...] = ()

    @property
    def trainable(self) -> int:
        return self.trained + self.adapter + self.copies

    @property
    def frozen_total(self) -> int:
        return self.frozen + sum(self.quantized)


@frozen_dataclass
class FinetuneParams:
    """Trainable and frozen parameters of a model under a fine-tuning job, per decoder layer."""

    layers: tuple[PartCounts, ...]
    #: Embedding, position table, final norm and output head (and their copies/adapters).
    root: PartCounts
    adapters: tuple[Adapter, ...]
    #: Derived once (the estimator reads them per layer): each decoder layer's adapters.
    layer_adapters: tuple[tuple[Adapter, ...], ...] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        by_layer: list[list[Adapter]] = [[] for _ in self.layers]
        for a in self.adapters:
            if a.module.layer is not None:
                by_layer[a.module.layer].append(a)
        object.__setattr__(self, "layer_adapters", tuple(tuple(a) for a in by_layer))

    @property
    def trainable(self) -> int:
        return self.root.trainable + sum(p.trainable for p in self.layers)

    @property
    def frozen(self) -> int:
        return self.root.frozen_total + sum(p.frozen_total for p in self.layers)


def rank_of(name: str, default: int, pattern: dict[str, int]) -> int:
    for key, rank in pattern.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return rank
    return default


#: peft 0.21's conversion of MoE targets for transformers 5 (``utils/transformers_weight_conversion.py``,
#: ``_MOE_TARGET_MODULE_MAPPING``): the v4 expert and router names a target list may use, and the
#: fused parameter each now targets; the router ``gate`` becomes its ``gate.weight`` parameter.
_MOE_MAPPING = {
    "mixtral": {"gate": "gate.weight", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"},
    "qwen2_moe": {"gate": "gate.weight", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
                  "down_proj": "down_proj"},
}
#: Model types converted with each mapping (transformers' ``_MODEL_TO_CONVERSION_PATTERN`` as peft
#: extends it; ``qwen2_moe`` itself is not a key there, so peft leaves its targets alone).
_MOE_PATTERN = {"mixtral": "mixtral", "qwen3_moe": "qwen2_moe",
                "deepseek_v2": "qwen2_moe", "deepseek_v3": "qwen2_moe"}
_FUSED = "gate_up_proj"


def converts_moe_targets(model_type: str) -> bool:
    """Whether peft rewrites the target list of ``model_type`` for transformers 5's fused experts. peft 0.21
    does so before it looks up its default targets, and turns a missing list into an empty one: for such a type
    ``LoraConfig(target_modules=None)`` is refused even where its table has a default (Mixtral)."""
    return model_type in _MOE_PATTERN


def target_names(model_type: str, ft: FineTuning) -> tuple[str, ...] | None:
    """The adapter targets ``--lora-targets`` names on a model of ``model_type``: None for ``all-linear``,
    peft's default for the type for ``auto`` (:mod:`memplan.peft.default_targets`)."""
    if ft.lora_targets == ALL_LINEAR:
        return None
    if ft.lora_targets == "auto":
        return auto_targets(model_type)
    return tuple(ft.lora_targets.split(","))


def split_targets(model: ModelSpec, ft: FineTuning) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """(module target names, or None for every linear but the head; fused parameter targets).

    For MoE models peft converts the target list first: names of the v4 experts and router (``gate_proj``,
    ``up_proj``, ``down_proj``, ``gate``; Mixtral ``w1``/``w2``/``w3``) leave the module targets and target
    the fused parameters instead, in every layer (so a dense layer's ``down_proj`` is no longer targeted);
    ``all-linear`` first resolves to the leaf names of the linear layers plus those v4 names.
    """
    names = target_names(model.model_type, ft)
    mapping = _MOE_MAPPING.get(_MOE_PATTERN.get(model.model_type, ""), {})
    if not mapping:
        return names, ()
    if names is None:
        leaves = {m.name.rpartition(".")[2] for m in model_linears(model)
                  if m.kind != "embedding" and m.name != "lm_head"}
        names = tuple(sorted(leaves | set(mapping)))
    modules: list[str] = []
    params: dict[str, None] = {}
    for target in names:
        new = next((v for k, v in mapping.items() if target == k or target.endswith("." + k)), None)
        if new is None:
            modules.append(target)
        else:
            params.setdefault(new, None)
    return tuple(modules), tuple(params)


def fused_gate_up_complete(model: ModelSpec, ft: FineTuning) -> bool | None:
    """For MoE models: whether both v4 names fused into ``gate_up_proj`` are targeted (peft doubles the
    rank), None when neither is, False when only one is (peft refuses it)."""
    mapping = _MOE_MAPPING.get(_MOE_PATTERN.get(model.model_type, ""), {})
    olds = [k for k, v in mapping.items() if v == _FUSED]
    names = target_names(model.model_type, ft)
    if not olds or names is None:
        return True if olds else None
    present = {k for k in olds for t in names if t == k or t.endswith("." + k)}
    return None if not present else len(present) == len(olds)


def adapter_targets(model: ModelSpec, ft: FineTuning) -> tuple[LinearModule, ...]:
    """Linear modules that get an adapter (none without --peft); fused expert parameters apart."""
    if not ft.peft_kind.adapters:
        return ()
    names, _ = split_targets(model, ft)
    linears = model_linears(model)
    if names is None:
        return tuple(m for m in linears if m.kind != "embedding" and m.name != "lm_head")
    return tuple(m for m in linears if any(matches(m.name, t) for t in names))


def _parameter_adapters(model: ModelSpec, ft: FineTuning) -> list[Adapter]:
    """peft ``ParamWrapper`` adapters on fused expert parameters and routers (MoE models)."""
    if not ft.peft_kind.adapters:
        return []
    _, params = split_targets(model, ft)
    if not params:
        return []
    pattern = dict(ft.rank_pattern)
    if fused_gate_up_complete(model, ft):
        pattern.setdefault(rf".*\.{_FUSED}", 2 * ft.lora_rank)
    prefix, h, out = layer_prefix(model), model.hidden_size, []
    for i, layer in enumerate(model.layers):
        moe = layer.moe
        if moe is None:
            continue
        f, e = moe.expert.intermediate_size, moe.num_experts
        shapes = {"gate.weight": ("mlp.gate.weight", h, e, 1),
                  _FUSED: ("mlp.experts.gate_up_proj", h, 2 * f if moe.expert.gated else f, e),
                  "down_proj": ("mlp.experts.down_proj", f, h, e)}
        for target in params:
            name, n_in, n_out, experts = shapes[target]
            full = f"{prefix}.{i}.{name}"
            module = LinearModule(full, n_in, n_out, layer=i)
            out.append(Adapter(module, rank_of(full, ft.lora_rank, pattern), False, experts))
    return out


def saved_modules(model: ModelSpec, ft: FineTuning) -> tuple[str, ...]:
    """Modules ``modules_to_save`` wraps (outermost matches only)."""
    keys = [k for k in ft.modules_to_save.split(",") if k]
    if not keys:
        return ()
    out: list[str] = []
    for name in module_names(model):
        if any(name.endswith(k) for k in keys) and not any(name.startswith(p + ".") for p in out):
            out.append(name)
    return tuple(out)


def trained_modules(model: ModelSpec, ft: FineTuning) -> tuple[str, ...]:
    """Modules ``--trainable NAMES`` trains fully (empty for all/adapters)."""
    what = ft.resolved_trainable
    if what in ("all", "adapters"):
        return ()
    keys = what.split(",")
    return tuple(n for n in module_names(model) if any(matches(n, k) for k in keys))


@lru_cache(maxsize=64)
def module_names(model: ModelSpec) -> tuple[str, ...]:
    """Every module that owns parameters, directly or below it, in model order (parents first)."""
    seen: dict[str, None] = {}
    for p in model_parameters(model):
        parts = p.name.split(".")[:-1]
        for i in range(1, len(parts) + 1):
            seen.setdefault(".".join(parts[:i]), None)
    if model.tie_word_embeddings:
        seen.setdefault("lm_head", None)
    return tuple(seen)


def _under(param_module: str, modules: tuple[str, ...]) -> bool:
    return any(param_module == m or param_module.startswith(m + ".") for m in modules)


def finetune_params(model: ModelSpec, ft: FineTuning) -> FinetuneParams:
    """Trainable and frozen parameters of ``model`` under ``ft`` (see the module docstring)."""
    return _finetune_params(model, ft)


@lru_cache(maxsize=64)
def _finetune_params(model: ModelSpec, ft: FineTuning) -> FinetuneParams:
    n = model.num_layers
    trained = [0] * (n + 1)
    frozen = [0] * (n + 1)
    quantized: list[list[int]] = [[] for _ in range(n + 1)]
    rows: list[list[int]] = [[] for _ in range(n + 1)]
    adapter = [0] * (n + 1)
    copies = [0] * (n + 1)
    everything = ft.resolved_trainable == "all"
    full = trained_modules(model, ft)
    saved = saved_modules(model, ft)
    quantizable = {f"{m.name}.weight": m.out_features for m in model_linears(model)
                   if m.kind != "embedding" and m.name != "lm_head"} if ft.quant_kind.quantizes else {}
    for p in model_parameters(model):
        slot = n if p.layer is None else p.layer
        if everything or _under(p.module, full):
            trained[slot] += p.numel
        elif p.name in quantizable:
            quantized[slot].append(p.numel)
            rows[slot].append(quantizable[p.name])
        else:
            frozen[slot] += p.numel
    for name in saved:
        size = _module_numel(model, name)
        copies[_slot(model, name)] += size
    adapters = tuple(Adapter(m, rank_of(m.name, ft.lora_rank, ft.rank_pattern), ft.peft_kind.magnitude)
                     for m in adapter_targets(model, ft)) + tuple(_parameter_adapters(model, ft))
    for a in adapters:
        adapter[n if a.module.layer is None else a.module.layer] += a.numel
    parts = [PartCounts(trained[i], frozen[i], tuple(quantized[i]), adapter[i], copies[i], tuple(rows[i]))
             for i in range(n + 1)]
    return FinetuneParams(layers=tuple(parts[:n]), root=parts[n], adapters=adapters)


def _module_numel(model: ModelSpec, module: str) -> int:
    if module == "lm_head" and model.tie_word_embeddings:
        return model.vocab_size * model.hidden_size
    return sum(p.numel for p in model_parameters(model) if _under(p.module, (module,)))


def _slot(model: ModelSpec, module: str) -> int:
    for p in model_parameters(model):
        if _under(p.module, (module,)):
            return model.num_layers if p.layer is None else p.layer
    return model.num_layers


