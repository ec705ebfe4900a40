"""Fine-tuning a built model: frozen base weights, real peft adapters, trainable modules.

What a fine-tuning script does after ``from_pretrained(..., torch_dtype=torch.bfloat16)``, run on
the model :mod:`memplan.trace.build` constructs:

1. the base is built in ``--frozen-dtype`` (default the compute dtype, as a 16-bit load does);
2. ``--quantize-base nf4|fp4`` swaps the decoder's linear layers for bitsandbytes stand-ins
   (:mod:`memplan.trace.standins.quantized`) before peft sees them;
3. ``--peft lora|dora`` wraps the model with ``peft.get_peft_model(model, LoraConfig(...))`` — real
   peft layers, adapters in ``--adapter-dtype`` (default fp32, peft's ``autocast_adapter_dtype=True``;
   the adapter parameters are cast after wrapping, as ``autocast_adapter_dtype=False`` on a base of
   that dtype, or torchtune's bf16 LoRA, leave them);
4. ``--trainable`` names modules trained fully; everything else has ``requires_grad=False``;
5. trainable full weights are stored as full training stores them (fp32 under ``*-mixed``).

peft moves adapters with ``Module.to``, which cannot swap fake parameters, so the fine-tuned model
is assembled on the ``meta`` device and its tensors are then made fake (:func:`materialize_fake`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from memplan.errors import ConfigError, MissingDependencyError
from memplan.job import ALL_LINEAR, FineTuning
from memplan.peft.params import target_names

__all__ = ["ParamCounts", "apply_finetune", "materialize_fake", "needs_finetune", "param_counts", "require_peft"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ParamCounts:
    """Parameter elements of the traced model: trained (``requires_grad``) and frozen."""

    trainable: int
    frozen: int


def needs_finetune(finetune: FineTuning) -> bool:
    """Whether the job freezes, quantizes or adapts anything (else the model trains as built)."""
    return finetune.partial


def frozen_dtype(finetune: FineTuning, compute_dtype: str) -> torch.dtype:
    """The dtype frozen, unquantized weights are built in."""
    return _DTYPES[finetune.frozen_dtype or compute_dtype]


def require_peft(finetune: FineTuning) -> None:
    """Refuse before a trace starts when the job needs peft and it is not installed."""
    if finetune.peft_kind.adapters:
        _peft()


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise MissingDependencyError("peft", feature="--peft (memplan trace)", extra="finetune") from None
    return peft


def lora_config(finetune: FineTuning, model_type: str) -> Any:
    """The ``peft.LoraConfig`` of the job's fine-tuning section for a model of ``model_type`` (``--lora-targets
    auto``: peft's default for the type, :func:`~memplan.peft.params.target_names`)."""
    peft = _peft()
    names = target_names(model_type, finetune)
    targets: Any = ALL_LINEAR if names is None else list(names)
    save = [name for name in finetune.modules_to_save.split(",") if name] or None
    config = peft.LoraConfig(r=finetune.lora_rank, lora_alpha=finetune.lora_alpha,
                             lora_dropout=finetune.lora_dropout, target_modules=targets,
                             **finetune.peft_kind.lora_config, use_rslora=finetune.rslora,
                             rank_pattern=finetune.rank_pattern, modules_to_save=save, task_type="CAUSAL_LM")
    if finetune.quant_kind.quantizes:
        config._register_custom_module(_bitsandbytes_lora_layers())
    return config


def _bitsandbytes_lora_layers() -> dict[type, type]:
    """peft's own LoRA layers for bitsandbytes weights (``peft/tuners/lora/bnb.py``), for the stand-ins.

    They differ from the ordinary ``lora.Linear`` in memory: under autocast they pass the input on
    without the fp32 cast (``lora_A`` keeps the 16-bit input itself, shared by q/k/v and gate/up) and
    the 4-bit layer clones the base output. peft defines them only when bitsandbytes imports.
    """
    from memplan.trace.standins.quantized import Linear4bitStandIn, Linear8bitStandIn

    try:
        from peft.tuners.lora import bnb
    except ImportError:
        bnb = None
    if bnb is None or not hasattr(bnb, "Linear4bit") or not hasattr(bnb, "Linear8bitLt"):
        raise MissingDependencyError("bitsandbytes", feature="--quantize-base (memplan trace: peft's "
                                     "bitsandbytes LoRA layers)", extra="qlora")
    return {Linear4bitStandIn: bnb.Linear4bit, Linear8bitStandIn: bnb.Linear8bitLt}


def _matches(path: str, name: str) -> bool:
    """``name`` is a dotted run of ``path``'s components (``layers.31`` in ``model.layers.31.mlp``)."""
    return f".{name}." in f".{path}."


def _train_named(model: torch.nn.Module, names: tuple[str, ...]) -> None:
    for name in names:
        hits = [p for path, p in model.named_parameters(remove_duplicate=False)
                if _matches(path.rsplit(".", 1)[0], name)]
        if not hits:
            raise ConfigError("--trainable", f"names no module of the model ({name!r} matches no parameter's "
                              "module path)", ",".join(names))
        hits = [p for p in hits if p.is_floating_point()]  # quantized weights cannot train
        if not hits:
            raise ConfigError("--trainable", f"{name!r} holds only quantized weights, which cannot train",
                              ",".join(names))
        for param in hits:
            param.requires_grad_(True)


def apply_finetune(model: torch.nn.Module, finetune: FineTuning, *, storage_dtype: torch.dtype,
                   compute_dtype: str, adapter_dtype: str = "fp32") -> torch.nn.Module:
    """Freeze, quantize and wrap ``model`` (built on ``meta``) as the job says; returns the model to train."""
    trainable = finetune.resolved_trainable
    if trainable == "all" and not finetune.peft_kind.adapters:
        return model
    if finetune.quant_kind.quantizes:
        from memplan.trace.standins.quantized import quantize_linears

        quant = finetune.quant_compute_dtype or compute_dtype
        quantize_linears(model, finetune.quantize_base, double_quant=finetune.double_quant,
                         compute_dtype=_DTYPES[quant])
    for param in model.parameters():
        param.requires_grad_(trainable == "all")
    if trainable not in ("all", "adapters"):
        _train_named(model, tuple(trainable.split(",")))
    base_trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if finetune.peft_kind.adapters:
        model = _wrapped(model, finetune)
        if trainable == "all":
            for param in model.parameters():
                param.requires_grad_(True)
        for param in model.parameters():
            if id(param) in base_trainable:
                param.requires_grad_(True)
    adapters = _adapter_ids(model)
    _store_trainable(model, storage_dtype, adapters=adapters | _saved_copy_ids(model))
    _cast_adapters(model, _DTYPES[adapter_dtype], adapters)
    return model


def _cast_adapters(model: torch.nn.Module, dtype: torch.dtype, adapters: set[int]) -> None:
    """The adapter parameters (lora_A/B, DoRA magnitudes) in ``dtype`` (``--adapter-dtype``)."""
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is not None and id(param) in adapters and param.dtype != dtype:
                module._parameters[key] = torch.nn.Parameter(param.to(dtype), requires_grad=param.requires_grad)


def _wrapped(model: torch.nn.Module, finetune: FineTuning) -> torch.nn.Module:
    peft = _peft()
    try:
        with warnings.catch_warnings():  # peft's deprecation and modules_to_save chatter
            warnings.simplefilter("ignore")
            return peft.get_peft_model(model, lora_config(finetune, model.config.model_type))
    except ValueError as exc:
        lines = str(exc).strip().splitlines()
        raise ConfigError("--lora-targets", f"peft cannot wrap this model ({lines[0] if lines else exc!r})",
                          finetune.lora_targets) from None


def _adapter_ids(model: torch.nn.Module) -> set[int]:
    """Parameters peft created (lora_A/B, DoRA magnitudes): kept in the dtype peft gave them."""
    return {id(p) for path, p in model.named_parameters() if ".lora_" in path}


def _saved_copy_ids(model: torch.nn.Module) -> set[int]:
    """Parameters of peft's ``modules_to_save`` copies: peft deep-copies the frozen module and neither
    peft (``cast_adapter_dtype`` casts only tuner layers) nor the Trainer casts the copy, so it keeps
    the frozen module's dtype."""
    return {id(p) for path, p in model.named_parameters() if ".modules_to_save." in f".{path}"}


def _store_trainable(model: torch.nn.Module, dtype: torch.dtype, *, adapters: set[int]) -> None:
    """Trainable full weights (not adapters or ``modules_to_save`` copies) in the precision's storage
    dtype, as full training keeps them."""
    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is None or not param.requires_grad or id(param) in adapters or not param.is_floating_point():
                continue
            if param.dtype != dtype:
                if id(param) not in done:
                    done[id(param)] = torch.nn.Parameter(param.to(dtype), requires_grad=True)
                module._parameters[key] = done[id(param)]


def materialize_fake(model: torch.nn.Module) -> None:
    """Replace every ``meta`` parameter, buffer and tensor attribute by a fresh tensor of the same
    shape and dtype — a fake tensor when called inside a fake mode. Shared tensors stay shared."""
    memo: dict[int, torch.Tensor] = {}

    def fresh(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in memo:
            new = torch.empty(tensor.shape, dtype=tensor.dtype)
            if isinstance(tensor, torch.nn.Parameter):
                new = torch.nn.Parameter(new, requires_grad=tensor.requires_grad)
                for name, value in vars(tensor).items():
                    setattr(new, name, value)
            memo[id(tensor)] = new
        return memo[id(tensor)]

    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for key, value in list(store.items()):
                if value is not None and value.device.type == "meta":
                    store[key] = fresh(value)
        for key, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                setattr(module, key, fresh(value))


def _parameters(model: torch.nn.Module) -> Iterator[torch.nn.Parameter]:
    seen: set[int] = set()
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            yield param


def param_counts(model: torch.nn.Module) -> ParamCounts:
    """Trainable and frozen parameter elements; a quantized stand-in counts its unpacked weight, as
    peft's ``get_nb_trainable_parameters`` counts bitsandbytes' packed weights."""
    trainable = frozen = 0
    for param in _parameters(model):
        numel = int(getattr(param, "unpacked_numel", param.numel()))
        if param.requires_grad:
            trainable += numel
        else:
            frozen += numel
    return ParamCounts(trainable, frozen)
