"""Apply a PEFT adapter config (``adapter_config.json``, ``LoraConfig.save_pretrained``) to a Job.

Mapped (peft 0.21 ``LoraConfig``): ``peft_type`` LORA (``use_dora`` → dora), ``r``, ``lora_alpha``,
``lora_dropout``, ``target_modules`` (a list, ``"all-linear"``, or a regex string peft full-matches
against module names: expanded against the model's decoder linear names where memplan knows them),
``rank_pattern``, ``use_rslora``, ``modules_to_save``; ``base_model_name_or_path`` must name the
MODEL given. Every other key is classified as no memory effect or not modelled in the result
(:class:`~memplan.settings.InputSetting`). Other peft types (IA3, prefix tuning, LoHa...) are refused.

Example::

    >>> job, settings = peft_job({"peft_type": "LORA", "r": 16, "target_modules": ["q_proj", "v_proj"]}, Job())
    >>> job.finetune.peft, job.finetune.lora_rank
    ('lora', 16)
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memplan.errors import ConfigError, UnsupportedError
from memplan.job import ALL_LINEAR, Job
from memplan.settings import InputSetting
from memplan.bounds import parse_json
from memplan.textfile import read_text_file
from memplan.tuning import peft_method_of_config

if TYPE_CHECKING:
    from memplan.model.spec import ModelSpec

__all__ = ["apply_peft_config", "peft_job", "read_peft_config"]

_FLAG = "--peft-config"
#: Decoder linear modules (path under ``layers.N.``) by Hugging Face model type; others: Llama's.
_LINEAR_NAMES: dict[str, tuple[str, ...]] = {
    "gpt2": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
    "gpt_neox": ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
}
_LLAMA_LINEAR = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
#: Layer-list prefix of each model type's decoder blocks.
_LAYER_PREFIX = {"gpt2": "transformer.h", "gpt_neox": "gpt_neox.layers"}
#: Keys that never change training memory, with why.
_NO_EFFECT = {
    "task_type": "the task head is the model's own",
    "peft_version": "version stamp",
    "auto_mapping": "class lookup only",
    "revision": "which base revision to load",
    "inference_mode": "saved adapters say true; training loads them trainable (is_trainable=True)",
    "fan_in_fan_out": "weight layout (Conv1D), same bytes",
    "init_lora_weights": "initialisation only",
    "alpha_pattern": "per-module scaling only",
    "megatron_core": "import path for megatron_config",
    "loftq_config": "initialisation only",
    "eva_config": "initialisation only",
    "corda_config": "initialisation only",
    "lora_ga_config": "initialisation only",
    "qalora_group_size": "used only with use_qalora",
}
#: Keys that change memory when set and that memplan does not price.
_NOT_MODELLED = {
    "bias": "trained biases (bias != none) are not counted",
    "layers_to_transform": "adapters only on some layers: memplan puts them on every layer",
    "layers_pattern": "used with layers_to_transform",
    "exclude_modules": "excluded modules still get adapters in memplan's count",
    "megatron_config": "Megatron-parallel LoRA layers are not modelled",
    "trainable_token_indices": "trainable token rows are not counted",
    "use_qalora": "QA-LoRA pooling is not modelled",
    "layer_replication": "replicated layers are not counted",
    "lora_bias": "the lora_B bias is not counted",
    "target_parameters": "adapters on nn.Parameter targets are not counted",
    "ensure_weight_tying": "tied adapter copies are not modelled",
}


def read_peft_config(path: str | Path) -> dict[str, Any]:
    """Parse an ``adapter_config.json`` (or the folder holding one)."""
    file = Path(path)
    if file.is_dir():
        file = file / "adapter_config.json"
    text = read_text_file(file, field=_FLAG)
    try:
        data = parse_json(text, field=_FLAG)
    except json.JSONDecodeError as exc:
        raise ConfigError(_FLAG, f"is not valid JSON (line {exc.lineno}: {exc.msg})", str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError(_FLAG, "must hold a JSON object (a peft adapter_config.json)", str(path))
    return data


def apply_peft_config(path: str | Path, job: Job, *, model_ref: str | None = None,
                      model: ModelSpec | None = None) -> tuple[Job, tuple[InputSetting, ...]]:
    """``job`` with the adapters of the peft config at ``path``, and what each key did."""
    return peft_job(read_peft_config(path), job, model_ref=model_ref, model=model, source=str(path))


def peft_job(config: Mapping[str, Any], job: Job, *, model_ref: str | None = None, model: ModelSpec | None = None,
             source: str = _FLAG) -> tuple[Job, tuple[InputSetting, ...]]:
    """``job`` with the adapters ``config`` (a parsed adapter_config.json) describes."""
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise UnsupportedError(f"{_FLAG}: peft_type {config.get('peft_type')!r} is not modelled "
                               "(LORA and DoRA, use_dora: true, are)")
    settings: list[InputSetting] = []

    def note(key: str, effect: str, text: str) -> None:
        if key not in config:
            return  # only what the file says is reported
        settings.append(InputSetting(source=_FLAG, key=key, value=config.get(key), effect=effect,  # type: ignore[arg-type]
                                     note=text))

    _check_base(config.get("base_model_name_or_path"), model_ref, model, note)
    values: dict[str, Any] = {"peft": peft_method_of_config(config).name}
    note("peft_type", "modelled", f"--peft {values['peft']}")
    note("use_dora", "modelled", f"--peft {values['peft']}")
    for key, field, cast in (("r", "lora_rank", int), ("lora_dropout", "lora_dropout", float)):
        if config.get(key) is not None:
            values[field] = _number(key, config[key], cast)
            note(key, "modelled", f"--{field.replace('_', '-')} {values[field]}")
    if config.get("lora_alpha") is not None:
        values["lora_alpha"] = _number("lora_alpha", config["lora_alpha"], float)
        note("lora_alpha", "modelled", f"--lora-alpha {values['lora_alpha']:g} (scaling only, no memory effect)")
    values["rslora"] = bool(config.get("use_rslora"))
    note("use_rslora", "modelled", "--rslora (scaling only, no memory effect)")
    values["lora_targets"] = _targets(config.get("target_modules"), model, note)
    values["lora_rank_pattern"] = _rank_pattern(config.get("rank_pattern"), note)
    saved = config.get("modules_to_save") or []
    names = [saved] if isinstance(saved, str) else list(saved)
    values["modules_to_save"] = ",".join(str(n) for n in names)
    note("modules_to_save", "modelled", f"--modules-to-save {values['modules_to_save'] or '(none)'}")
    done = {s.key for s in settings}
    for key in sorted(set(config) - done):
        settings.append(_classify(key, config[key]))
    try:
        finetune = dataclasses.replace(job.finetune, **values)
    except ConfigError as exc:
        raise ConfigError(f"{_FLAG}: {exc.field}", exc.rule, exc.value) from None
    return dataclasses.replace(job, finetune=finetune), tuple(settings)


def _number(key: str, value: Any, cast: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{_FLAG}: {key}", "must be a number", value)
    return cast(value)


def _classify(key: str, value: Any) -> InputSetting:
    if key in _NO_EFFECT:
        return InputSetting(source=_FLAG, key=key, value=value, effect="no-memory-effect", note=_NO_EFFECT[key])
    unset = value in (None, False, "none", {}, []) or (key == "bias" and value == "none")
    if unset:
        return InputSetting(source=_FLAG, key=key, value=value, effect="no-memory-effect", note="not set")
    if key in _NOT_MODELLED:
        return InputSetting(source=_FLAG, key=key, value=value, effect="not-modelled", note=_NOT_MODELLED[key])
    return InputSetting(source=_FLAG, key=key, value=value, effect="not-modelled",
                        note="a peft setting memplan does not know")


def _base_names(ref: str) -> set[str]:
    """Comparable forms of a model name: the last path part, lower case, letters and digits only,
    with and without a trailing -instruct/-chat/-it/-hf/-base."""
    text = ref.strip().rstrip("/").split("@")[0]
    if text.endswith("config.json"):
        text = text.rsplit("/", 1)[0]
    last = re.sub(r"[^a-z0-9]", "", text.rsplit("/", 1)[-1].lower())
    out = {last}
    for suffix in ("instruct", "chat", "it", "hf", "base"):
        if last.endswith(suffix):
            out.add(last.removesuffix(suffix))
    return out


def _check_base(base: Any, model_ref: str | None, model: ModelSpec | None, note: Any) -> None:
    key = "base_model_name_or_path"
    if not base:
        note(key, "no-memory-effect", "not set: the adapter is applied to MODEL")
        return
    mine = set().union(*(_base_names(r) for r in (model_ref, model and model.name) if r))
    if not mine:
        note(key, "no-memory-effect", "not compared (the model came from Megatron arguments)")
        return
    if _base_names(str(base)) & mine:
        note(key, "no-memory-effect", f"matches MODEL {model_ref or (model and model.name)}")
        return
    raise ConfigError(f"{_FLAG}: {key}", f"names another base model than MODEL {model_ref or model.name}",  # type: ignore[union-attr]
                      base, hint="pass that model as MODEL, or fix base_model_name_or_path")


def _linear_names(model: ModelSpec) -> list[str]:
    leaves = _LINEAR_NAMES.get(model.model_type, _LLAMA_LINEAR)
    prefix = _LAYER_PREFIX.get(model.model_type, "model.layers")
    return [f"{prefix}.{i}.{leaf}" for i in range(model.num_layers) for leaf in leaves]


def _targets(value: Any, model: ModelSpec | None, note: Any) -> str:
    key = "target_modules"
    if value is None:
        note(key, "modelled", "not set: peft's default for the architecture (--lora-targets auto)")
        return "auto"
    if isinstance(value, list):
        names = ",".join(str(v) for v in value)
        note(key, "modelled", f"--lora-targets {names}")
        return names
    if not isinstance(value, str):
        raise ConfigError(f"{_FLAG}: {key}", "must be a list of module names, all-linear or a regex string", value)
    if value.strip().lower() == ALL_LINEAR:
        note(key, "modelled", "--lora-targets all-linear")
        return ALL_LINEAR
    if model is None or model.model_type not in (*_LINEAR_NAMES, *_llama_types()):
        raise UnsupportedError(f"{_FLAG}: target_modules regex {value!r} cannot be expanded for this model "
                               "(memplan knows Llama-style, GPT-2 and GPT-NeoX module names); give a list")
    from memplan.frameworks.peft_regex import full_matches

    matched = full_matches(value, _linear_names(model), field=f"{_FLAG}: {key}")
    if not matched:
        raise ConfigError(f"{_FLAG}: {key}", "matches none of the model's decoder linear modules "
                          "(peft full-matches it against names like model.layers.0.self_attn.q_proj)", value)
    leaves = sorted({n.rsplit(".", 1)[1] for n in matched}, key=[n.rsplit(".", 1)[1] for n in matched].index)
    layers = {n.split(".")[-3] for n in matched}
    partial = len(layers) < model.num_layers
    note(key, "not-modelled" if partial else "modelled",
         f"regex expanded to --lora-targets {','.join(leaves)}"
         + (f" on {len(layers)} of {model.num_layers} layers: memplan puts them on every layer" if partial else ""))
    return ",".join(leaves)


def _llama_types() -> tuple[str, ...]:
    from memplan.model.hf import SUPPORTED_MODEL_TYPES

    return tuple(t for t in SUPPORTED_MODEL_TYPES if t not in _LINEAR_NAMES and "moe" not in t
                 and t not in ("mixtral", "deepseek_v2", "deepseek_v3", "gpt_bigcode"))


def _rank_pattern(value: Any, note: Any) -> str:
    key = "rank_pattern"
    if not value:
        note(key, "no-memory-effect", "not set")
        return ""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{_FLAG}: {key}", "must be an object of module name → rank", value)
    plain = {str(k): v for k, v in value.items() if re.fullmatch(r"[\w.\-*]+", str(k))}
    text = ",".join(f"{k}={_number(key, v, int)}" for k, v in plain.items())
    if len(plain) < len(value):
        note(key, "not-modelled", f"regex keys {sorted(set(map(str, value)) - set(plain))} are not matched; "
             f"modelled: {text or '(none)'}")
    else:
        note(key, "modelled", f"--lora-rank-pattern {text}")
    return text
