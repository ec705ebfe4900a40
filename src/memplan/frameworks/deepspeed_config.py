"""Apply a DeepSpeed JSON config (``ds_config.json``) to a Job, where its fields map.

Mapped: ``zero_optimization.stage``, ``bf16.enabled`` / ``fp16.enabled``, ``optimizer.type``,
``train_micro_batch_size_per_gpu``, ``train_batch_size``, ``gradient_accumulation_steps``,
and, for ZeRO-3's buffers (:mod:`memplan.estimate.zero3_buffers`), ``zero_optimization.reduce_bucket_size``,
``contiguous_gradients``, ``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters`` and
``stage3_max_reuse_distance`` (or their names without ``stage3_``), ``sub_group_size`` into the job's sharding; a negative or
non-numeric size is a ConfigError naming the key. ``"auto"`` reduce and prefetch buckets are Hugging Face's
hidden-size values (:mod:`memplan.profiles.zero3`); other ``"auto"`` values (Hugging Face's integration fills
them in) keep the Job's value. ``enabled: false`` in ``bf16`` / ``fp16`` with neither enabled is fp32 training;
a config naming neither keeps the Job's ``--precision``. Offloading
(``offload_optimizer`` / ``offload_param`` with ``device: cpu`` or ``nvme``) maps to the job's offload:
the states leave the GPU either way. With NVMe they live on disk behind pinned swap buffers, which
memplan does not price: its host-memory figure counts them as if they were in CPU memory, and the
setting is reported as not modelled (:mod:`memplan.frameworks.deepspeed_keys`). ``activation_checkpointing``'s
``partition_activations``, ``cpu_checkpointing`` and ``contiguous_memory_optimization`` (with
``number_checkpoints``) map to ``--partition-activations``, ``--cpu-checkpointing`` and
``--contiguous-checkpoints``; they act on the layers ``--recompute full`` checkpoints. Every key of the file is classified
(modelled / no memory effect / not modelled) by :mod:`memplan.frameworks.deepspeed_keys`;
:func:`load_deepspeed_config` returns those settings with the Job.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memplan.bounds import parse_json
from memplan.errors import ConfigError, UnsupportedError
from memplan.frameworks.deepspeed_keys import deepspeed_settings
from memplan.job import Batch, Job, Offload, Optimizer, Recompute, Sharding
from memplan.optimizers import by_dialect
from memplan.profiles.zero3 import COMMUNICATION_DTYPES, MOST_ELEMENTS, ZERO_BUFFER_KEYS
from memplan.settings import InputSetting
from memplan.textfile import read_text_file
from memplan.units import normalize_dtype


def read_deepspeed_config(path: str | Path) -> dict[str, Any]:
    """Parse a DeepSpeed JSON config; a malformed file is a ConfigError naming the line."""
    text = read_text_file(path, field="--deepspeed-config")
    try:
        data = parse_json(text, field="--deepspeed-config")
    except json.JSONDecodeError as exc:
        raise ConfigError("--deepspeed-config", f"is not valid JSON (line {exc.lineno}: {exc.msg})", str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError("--deepspeed-config", "must hold a JSON object", str(path))
    return data


def apply_deepspeed_config(path: str | Path, job: Job) -> Job:
    """``job`` with the settings of the DeepSpeed config at ``path`` (framework ``deepspeed``)."""
    return job_with_deepspeed(read_deepspeed_config(path), job)


def load_deepspeed_config(path: str | Path, job: Job) -> tuple[Job, tuple[InputSetting, ...]]:
    """:func:`apply_deepspeed_config`, and what each key of the file did
    (:func:`memplan.frameworks.deepspeed_keys.deepspeed_settings`)."""
    config = read_deepspeed_config(path)
    return job_with_deepspeed(config, job), deepspeed_settings(config)


def _value(section: Mapping[str, Any], key: str, field: str) -> Any:
    value = section.get(key)
    if value == "auto":
        return None
    return value


def _int_field(section: Mapping[str, Any], key: str, field: str) -> int | None:
    value = _value(section, key, field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(field, "must be a positive integer or \"auto\"", value)
    return value


def _switch(section: Mapping[str, Any], key: str) -> bool:
    value = section.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"activation_checkpointing.{key}", "must be true or false", value)
    return value


#: The strings pydantic reads as booleans (DeepSpeed's config sections are pydantic models), lower case.
_TRUE, _FALSE = ("1", "on", "t", "true", "y", "yes"), ("0", "off", "f", "false", "n", "no")


def _enabled(config: Mapping[str, Any], section: str) -> bool | None:
    """``config[section]["enabled"]`` read as DeepSpeed's pydantic config reads it: a boolean, 0/1, or one of
    pydantic's boolean strings (``"yes"``, ``"off"``...); None when absent or ``"auto"``."""
    body = config.get(section)
    if body is None:
        return None
    if not isinstance(body, Mapping):
        raise ConfigError(section, "must be an object", body)
    value = body.get("enabled")
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{section}.enabled", "must be true or false (DeepSpeed's pydantic config also reads 0/1 and "
                      "yes/no, on/off, true/false strings, and refuses anything else)", value)


def _precision(config: Mapping[str, Any], job: Job) -> Any:
    """The job's precision under the config's ``bf16`` (or old ``bfloat16``) and ``fp16`` sections."""
    bf16 = _enabled(config, "bf16" if "bf16" in config else "bfloat16")
    fp16 = _enabled(config, "fp16")
    if bf16 and fp16:
        raise ConfigError("bf16.enabled", "cannot be true together with fp16.enabled (DeepSpeed refuses it: "
                          "'bfloat16 and fp16 modes cannot be simultaneously enabled')", True)
    if bf16:
        return dataclasses.replace(job.precision, name="bf16-mixed")
    if fp16:
        return dataclasses.replace(job.precision, name="fp16-mixed")
    if False in (bf16, fp16):
        return dataclasses.replace(job.precision, name="fp32")  # 16-bit modes switched off: DeepSpeed trains fp32
    return job.precision


def _number(section: Mapping[str, Any], key: str, field: str) -> float:
    value = section.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(field, "must be a number", value)
    return float(value)


def _checkpointing(config: Mapping[str, Any], recompute: Recompute) -> Recompute:
    """``recompute`` with the DeepSpeed ``activation_checkpointing`` switches of ``config``."""
    section = config.get("activation_checkpointing")
    if section is None:
        return recompute
    if not isinstance(section, Mapping):
        raise ConfigError("activation_checkpointing", "must be an object", section)
    partition, cpu = _switch(section, "partition_activations"), _switch(section, "cpu_checkpointing")
    contiguous = None
    if _switch(section, "contiguous_memory_optimization"):
        if not partition:
            raise ConfigError("activation_checkpointing.contiguous_memory_optimization", "needs "
                              "partition_activations true (DeepSpeed asserts it)", True)
        contiguous = section.get("number_checkpoints")
        if isinstance(contiguous, bool) or not isinstance(contiguous, int) or contiguous < 1:
            raise ConfigError("activation_checkpointing.number_checkpoints", "must be a positive integer with "
                              "contiguous_memory_optimization (DeepSpeed sizes its buffers by it)", contiguous)
    return dataclasses.replace(recompute, partition_activations=partition, cpu_checkpointing=cpu,
                               contiguous_checkpoints=contiguous)


#: DeepSpeed's spellings of the dtypes ``communication_data_type`` and ``data_types.grad_accum_dtype`` take
#: (deepspeed/runtime/config.py ``DtypeEnum`` and ``get_communication_data_type``): memplan's names, torch's and
#: ``torch.<torch's>``; :func:`memplan.units.normalize_dtype` names them.
_DEEPSPEED_DTYPES = frozenset({"fp32", "float32", "float", "torch.float32", "fp16", "float16", "half", "torch.float16",
                               "bf16", "bfloat16", "torch.bfloat16"})
#: ``sys.maxsize``: DeepSpeed's default ``stage3_model_persistence_threshold`` is no cap at all.
_NO_CAP = 2**63 - 1


def _elements(section: Mapping[str, Any], field: str, names: tuple[str, ...], least: int,
              hf_auto: bool) -> int | str | None:
    """A ZeRO-3 bucket size in elements as DeepSpeed's pydantic config reads it (an integer, or a float with no
    fraction such as ``5e8``); ``"auto"`` where Hugging Face fills it in, None when absent."""
    name = next((n for n in names if n in section), None)
    if name is None:
        return None
    value = section[name]
    if value == "auto":
        if hf_auto:
            return "auto"
        raise ConfigError(f"zero_optimization.{name}", "\"auto\" is filled in by Hugging Face only for "
                          "reduce_bucket_size, stage3_prefetch_bucket_size and stage3_param_persistence_threshold; "
                          "DeepSpeed refuses it here", value)
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if field == "model_persistence_threshold" and number is not None and number == _NO_CAP:
        return None
    if number is None or not math.isfinite(number) or not least <= number <= MOST_ELEMENTS or number % 1:
        rule = "a positive" if least else "a non-negative"
        raise ConfigError(f"zero_optimization.{name}", f"must be {rule} whole number of elements up to 1e15 "
                          "(DeepSpeed's config refuses anything else; it sizes a ZeRO-3 buffer)", value)
    return int(number)


def _zero3_buffers(section: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`~memplan.job.Sharding` fields of the ZeRO-3 buffer keys in ``zero_optimization``."""
    out: dict[str, Any] = {field: _elements(section, field, names, least, auto)
                           for field, names, least, auto in ZERO_BUFFER_KEYS}
    for key in ("contiguous_gradients", "overlap_comm"):
        value = section.get(key)
        if value is not None:
            if not isinstance(value, bool):  # "auto" too: Hugging Face fills in neither
                raise ConfigError(f"zero_optimization.{key}", "must be true or false", value)
            out[key] = value
    return out


def _dtype(value: Any, key: str, allowed: tuple[str, ...]) -> str | None:
    """A DeepSpeed dtype setting as memplan's dtype name; None when absent or ``"auto"``."""
    if value is None or value == "auto":
        return None
    known = isinstance(value, str) and value in _DEEPSPEED_DTYPES
    name = normalize_dtype(value.removeprefix("torch.")) if known else None
    if name not in allowed:
        raise ConfigError(key, f"must be one of {', '.join(allowed)} (DeepSpeed's names: fp32/float32, "
                          "fp16/float16/half, bf16/bfloat16)", value)
    return name


def _grad_accum_dtype(config: Mapping[str, Any], stage: int, precision: Any) -> Any:
    """``precision`` with ``data_types.grad_accum_dtype``: the dtype DeepSpeed keeps gradients in (its gradient
    partitions at ZeRO-3, engine.py ``get_data_types``; the model's by default); at stage 0 DeepSpeed runs only
    the model's dtype (engine.py ``_do_optimizer_sanity_check``: "unsupported mix")."""
    types = config.get("data_types")
    if types is None:
        return precision
    if not isinstance(types, Mapping):
        raise ConfigError("data_types", "must be an object", types)
    dtype = _dtype(types.get("grad_accum_dtype"), "data_types.grad_accum_dtype", ("fp32", "fp16", "bf16"))
    if dtype is None or dtype == precision.compute_dtype:
        return precision
    if stage == 0:
        raise ConfigError("data_types.grad_accum_dtype", f"must be the model's dtype ({precision.compute_dtype}) "
                          "without ZeRO (DeepSpeed raises 'unsupported mix of model_dtype and grad_accum_dtype')",
                          types.get("grad_accum_dtype"))
    return dataclasses.replace(precision, grad_dtype=dtype)


def job_with_deepspeed(config: Mapping[str, Any], job: Job) -> Job:
    zero_section = config.get("zero_optimization") or {}
    if not isinstance(zero_section, Mapping):
        raise ConfigError("zero_optimization", "must be an object", zero_section)
    stage = zero_section.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError("zero_optimization.stage", "must be 0, 1, 2 or 3", stage)
    offloaded: dict[str, bool] = {}
    for key in ("offload_optimizer", "offload_param"):
        device = (zero_section.get(key) or {}).get("device", "none") if isinstance(zero_section.get(key), Mapping) else "none"
        if device not in ("none", None, "cpu", "nvme"):
            raise ConfigError(f"zero_optimization.{key}.device", "must be none, cpu or nvme", device)
        offloaded[key] = device in ("cpu", "nvme")
    precision = _grad_accum_dtype(config, stage, _precision(config, job))
    optimizer = job.optimizer
    opt_section = config.get("optimizer")
    if isinstance(opt_section, Mapping) and opt_section.get("type"):
        kinds = by_dialect("deepspeed")
        kind = kinds.get(str(opt_section["type"]).lower())
        if kind is None:
            raise UnsupportedError(f"optimizer.type: DeepSpeed optimizer {opt_section['type']!r} is not modelled")
        params = opt_section.get("params") or {}
        values = {field: _number(params, key, f"optimizer.params.{key}") if key in params else default
                  for key, field, default in kind.dialects.deepspeed_params}
        optimizer = Optimizer(name=kind.name, implementation="fused", **values)  # type: ignore[arg-type]
    batch = job.batch
    mbs = _int_field(config, "train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu")
    gbs = _int_field(config, "train_batch_size", "train_batch_size")
    accumulation = _int_field(config, "gradient_accumulation_steps", "gradient_accumulation_steps")
    mbs = mbs or batch.micro_batch_size
    if gbs is None and accumulation is not None:
        gbs = mbs * accumulation * job.parallel.data_parallel
    batch = Batch(micro_batch_size=mbs, seq_length=batch.seq_length, global_batch_size=gbs or batch.global_batch_size)
    return dataclasses.replace(
        job,
        framework="deepspeed",
        sharding=Sharding(zero=stage, **_zero3_buffers(zero_section), communication_data_type=_dtype(
            config.get("communication_data_type"), "communication_data_type", COMMUNICATION_DTYPES)),
        precision=precision,
        optimizer=optimizer,
        batch=batch,
        recompute=_checkpointing(config, job.recompute),
        offload=Offload(optimizer=offloaded["offload_optimizer"], params=offloaded["offload_param"],
                        activations=job.offload.activations),
    )
