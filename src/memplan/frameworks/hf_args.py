"""Apply Hugging Face TrainingArguments (Trainer, TRL SFTTrainer) to a Job.

``--hf-args FILE`` takes either the JSON ``TrainingArguments.to_json_string()`` writes (also TRL's
``SFTConfig``), or a text file holding the command line of a Trainer/TRL script
(``torchrun --nproc_per_node 8 train.py --per_device_train_batch_size 4 --bf16 ...``, backslash
continuations and shell variables as :mod:`memplan.frameworks.shell_script` reads them).

Mapped: ``per_device_train_batch_size`` → ``--mbs``; ``gradient_accumulation_steps`` → ``--gbs``
(mbs x steps x dp); ``activation_checkpointing`` / ``gradient_checkpointing`` → ``--recompute full``
with ``use_reentrant`` → ``--checkpoint-reentrant`` (transformers passes ``use_reentrant=False``
when no kwargs are given; with kwargs lacking it, torch.utils.checkpoint's default ``True``
applies); ``bf16`` / ``fp16`` → ``bf16-mixed`` / ``fp16-mixed`` (Trainer autocasts; neither → fp32 in a
JSON dump); ``optim`` (:data:`~memplan.frameworks.hf_fields.OPTIMIZERS`); TRL ``max_length`` /
``max_seq_length`` → ``--seq`` and ``packing``; ``deepspeed`` (a path or an object, applied as
``--deepspeed-config``); ``fsdp`` (``full_shard``, ``shard_grad_op``, ``hybrid_shard``, ``offload``)
and ``fsdp_config`` (``activation_checkpointing``, ``offload_params``); ``use_liger_kernel`` →
``--loss fused-linear``; TRL ``ModelConfig`` flags (``use_peft``, ``lora_r``, ``lora_alpha``,
``lora_dropout``, ``lora_target_modules``, ``use_dora``, ``load_in_4bit`` ...); the launcher's
process count (torchrun ``--nproc_per_node`` x ``--nnodes``, accelerate ``--num_processes``) → ``--gpus``.
The framework is ``hf`` (``deepspeed`` with a DeepSpeed config). Every field is classified in the
result (:class:`~memplan.settings.InputSetting`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memplan.errors import ConfigError, UnsupportedError
from memplan.frameworks.hf_args_file import parse_hf_command_line, read_hf_args, read_json_object
from memplan.frameworks.hf_fields import NO_MEMORY_EFFECT, NOT_MODELLED, OPTIMIZERS, UNMODELLED_OPTIMIZERS
from memplan.job import Job
from memplan.jobflags import build_job
from memplan.optimizers import optimizer_kind
from memplan.optimizers.kind import DialectNames
from memplan.settings import InputSetting
from memplan.tuning import FOUR_BIT_FORMATS, either, peft_method_of_config, quant_format_of_bnb

__all__ = ["apply_hf_args", "hf_args_job", "hf_args_model", "parse_hf_command_line", "read_hf_args"]

_FLAG = "--hf-args"
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "auto": None, "bf16": "bf16", "fp16": "fp16"}


def hf_args_model(path: str | Path) -> str | None:
    """The model the arguments name (TRL ``--model_name_or_path``), used when MODEL is not given."""
    name = read_hf_args(path).get("model_name_or_path")
    return name if isinstance(name, str) and name.strip() else None


def apply_hf_args(path: str | Path, job: Job) -> tuple[Job, tuple[InputSetting, ...]]:
    """``job`` with the settings of the TrainingArguments file at ``path``, and what each field did."""
    return hf_args_job(read_hf_args(path), job, base_dir=Path(path).parent)


class _Mapping:
    """Collects job flag values and one classification per field of the arguments."""

    def __init__(self, args: Mapping[str, Any]) -> None:
        self.args = args
        self.flags: dict[str, Any] = {"framework": "hf"}
        self.settings: dict[str, InputSetting] = {}

    def has(self, key: str) -> bool:
        return self.args.get(key) not in (None, False, "", [], {})

    def mark(self, key: str, effect: str, note: str, value: Any = None) -> None:
        if key in self.args or value is not None:
            self.settings[key] = InputSetting(source=_FLAG, key=key, value=self.args.get(key, value),
                                              effect=effect, note=note)  # type: ignore[arg-type]

    def int_field(self, key: str) -> int | None:
        value = self.args.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{_FLAG}: {key}", "must be a positive integer", value)
        return value


def hf_args_job(args: Mapping[str, Any], job: Job, *, base_dir: Path | None = None
                ) -> tuple[Job, tuple[InputSetting, ...]]:
    """``job`` with the settings of parsed TrainingArguments ``args`` (see the module docstring)."""
    m = _Mapping(args)
    _world(m)
    _batch(m, build_job({"gpus": m.flags["gpus"]} if "gpus" in m.flags else {}, job))
    _precision(m)
    _optimizer(m)
    _checkpointing(m)
    _compile(m)
    _fsdp(m, base_dir)
    _trl_model(m)
    if m.has("use_liger_kernel"):
        m.flags["loss"] = "fused-linear"
        m.mark("use_liger_kernel", "modelled", "--loss fused-linear (Liger's fused linear cross-entropy; its "
               "RMSNorm/SwiGLU/RoPE kernels are not modelled)")
    accel = m.args.get("accelerator_config")
    if isinstance(accel, dict):
        split = [k for k in ("split_batches", "dispatch_batches") if accel.get(k)]
        m.mark("accelerator_config", "not-modelled" if split else "no-memory-effect",
               f"{', '.join(split)} change the per-GPU batch; not modelled" if split else "batch dispatch as default")
    try:
        out = build_job(m.flags, job)
        out = _deepspeed(m, out, base_dir)
    except ConfigError as exc:
        raise ConfigError(f"{_FLAG}: {exc.field}", exc.rule, exc.value) from None
    for key in args:
        if key not in m.settings:
            m.settings[key] = _classify(key, args[key])
    return out, (*(m.settings[k] for k in args), *(v for k, v in m.settings.items() if k not in args))


def _classify(key: str, value: Any) -> InputSetting:
    if key in NO_MEMORY_EFFECT:
        return InputSetting(source=_FLAG, key=key, value=value, effect="no-memory-effect", note=NO_MEMORY_EFFECT[key])
    if value in (None, False, "", [], {}) or (isinstance(value, (int, float)) and value == 0):
        return InputSetting(source=_FLAG, key=key, value=value, effect="no-memory-effect", note="not set")
    if key in NOT_MODELLED:
        return InputSetting(source=_FLAG, key=key, value=value, effect="not-modelled", note=NOT_MODELLED[key])
    return InputSetting(source=_FLAG, key=key, value=value, effect="not-modelled",
                        note="a field memplan does not know")


def _world(m: _Mapping) -> None:
    a = m.args
    per_node = a.get("launcher.nproc_per_node") or a.get("launcher.num_gpus")
    nodes = a.get("launcher.nnodes") or a.get("launcher.num_nodes") or a.get("launcher.num_machines") or 1
    total = a.get("launcher.num_processes")
    for key in ("launcher.nproc_per_node", "launcher.num_gpus", "launcher.num_processes"):
        value = a.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{_FLAG}: {key.removeprefix('launcher.')}", "must be a positive integer", value)
    gpus = total if isinstance(total, int) else (per_node * nodes if isinstance(per_node, int) and
                                                 isinstance(nodes, int) else None)
    if gpus is not None:
        m.flags["gpus"] = gpus
        for key in ("launcher.nproc_per_node", "launcher.num_gpus", "launcher.nnodes", "launcher.num_nodes",
                    "launcher.num_processes", "launcher.num_machines"):
            m.mark(key, "modelled", f"--gpus {gpus} (processes of the launcher)")
    for key in a:
        if key.startswith("launcher.") and key not in m.settings:
            m.mark(key, "no-memory-effect", "launcher setting")


def _batch(m: _Mapping, job: Job) -> None:
    mbs = m.int_field("per_device_train_batch_size") or m.int_field("per_gpu_train_batch_size")
    if mbs is not None:
        m.flags["mbs"] = mbs
        for key in ("per_device_train_batch_size", "per_gpu_train_batch_size"):
            m.mark(key, "modelled", f"--mbs {mbs}")
    steps = m.int_field("gradient_accumulation_steps")
    if steps is not None:
        gbs = (mbs or job.batch.micro_batch_size) * steps * job.parallel.data_parallel
        m.flags["gbs"] = gbs
        m.mark("gradient_accumulation_steps", "modelled", f"--gbs {gbs} (mbs x {steps} steps x dp "
               f"{job.parallel.data_parallel})")
    for key in ("max_length", "max_seq_length"):
        seq = m.int_field(key)
        if seq is not None:
            m.flags["seq"] = seq
            m.mark(key, "modelled", f"--seq {seq} (TRL pads or truncates each row to it)")
    if "packing" in m.args:
        m.flags["packing"] = bool(m.args["packing"])
        m.mark("packing", "modelled", f"--packing {str(m.flags['packing']).lower()}")
    m.mark("packing_strategy", "no-memory-effect", "how rows are filled; every packed row holds --seq tokens")


def _precision(m: _Mapping) -> None:
    bf16, fp16 = m.has("bf16"), m.has("fp16")
    if bf16 and fp16:
        raise ConfigError(f"{_FLAG}: bf16", "cannot be combined with fp16", True)
    # bf16 given decides (false: fp16 or Trainer's and TRL's fp32); fp16 false alone does not (TRL's bf16 default)
    if bf16 or fp16 or "bf16" in m.args:
        name = "bf16-mixed" if bf16 else "fp16-mixed" if fp16 else "fp32"
        m.flags["precision"] = name
        for key in ("bf16", "fp16"):
            m.mark(key, "modelled", f"--precision {name} (Trainer autocasts; weights stay in the loaded dtype)")
    else:
        note = ("bf16 not given, so the job's precision is kept (--precision, default bf16-mixed); Trainer's own "
                "default is fp32, TRL SFTConfig's bf16")
        for key in ("bf16", "fp16"):
            m.mark(key, "no-memory-effect", f"false: {note}")
        if "bf16" not in m.args and "fp16" not in m.args:  # a command line that names neither
            m.settings["bf16"] = InputSetting(source=_FLAG, key="bf16", value=None, effect="modelled",
                                              note=f"not given: {note}")
    for key in ("half_precision_backend", "fp16_opt_level", "fp16_backend"):
        m.mark(key, "no-memory-effect", "amp backend choice")


def _optimizer(m: _Mapping) -> None:
    name = m.args.get("optim")
    if name is None:
        return
    text = str(name).strip().lower()
    if text in UNMODELLED_OPTIMIZERS:
        raise UnsupportedError(f"{_FLAG}: optim {name!r} is not modelled; modelled: {', '.join(OPTIMIZERS)}")
    if text not in OPTIMIZERS:
        raise ConfigError(f"{_FLAG}: optim", f"is not a transformers optimizer name memplan knows (known: "
                          f"{', '.join(OPTIMIZERS)})", name)
    m.flags["optimizer"], m.flags["optimizer_impl"] = OPTIMIZERS[text]
    m.mark("optim", "modelled", f"--optimizer {OPTIMIZERS[text][0]} --optimizer-impl {OPTIMIZERS[text][1]}")
    _optim_args(m, optimizer_kind(OPTIMIZERS[text][0]).dialects)


def _optim_args(m: _Mapping, names: DialectNames) -> None:
    """``optim_args`` ("rank=64,scale=0.25") keys the optimizer's registry entry reads."""
    text = m.args.get("optim_args")
    if not names.hf_optim_args or not isinstance(text, str) or not text.strip():
        return
    pairs = dict(part.split("=", 1) if "=" in part else (part, "") for part in
                 (piece.strip() for piece in text.split(",")) if part)
    read = []
    for key, field in names.hf_optim_args:
        if key in pairs:
            try:
                m.flags[field] = int(pairs[key])
            except ValueError:
                raise ConfigError(f"{_FLAG}: optim_args", f"{key} must be an integer", pairs[key]) from None
            read.append(f"{key} → --{field.replace('_', '-')} {pairs[key]}")
    other = [key for key in pairs if key not in dict(names.hf_optim_args)]
    unread = [key for key in other if key not in names.hf_optim_args_no_effect]
    note = "; ".join(read + ([f"no memory effect: {', '.join(k for k in other if k not in unread)}"]
                             if len(unread) < len(other) else []) + ([f"not read: {', '.join(unread)}"] if unread else []))
    m.mark("optim_args", "not-modelled" if unread else "modelled", note or "no key memplan reads")


def _kwargs(m: _Mapping, key: str) -> dict[str, Any]:
    from memplan.bounds import parse_json

    value = m.args.get(key)
    if isinstance(value, str):
        try:
            value = parse_json(value, field=f"{_FLAG}: {key}")
        except json.JSONDecodeError:
            raise ConfigError(f"{_FLAG}: {key}", "must be a JSON object", value) from None
    if value is not None and not isinstance(value, dict):
        raise ConfigError(f"{_FLAG}: {key}", "must be an object", value)
    return dict(value or {})


def _checkpointing(m: _Mapping) -> None:
    on = m.has("activation_checkpointing") or m.has("gradient_checkpointing")
    kwargs = _kwargs(m, "activation_checkpointing_kwargs") or _kwargs(m, "gradient_checkpointing_kwargs")
    if not on:
        for key in ("activation_checkpointing", "gradient_checkpointing", "activation_checkpointing_kwargs",
                    "gradient_checkpointing_kwargs"):
            m.mark(key, "no-memory-effect", "checkpointing is off")
        return
    every = kwargs.pop("every_n_layers", 1)
    offload = kwargs.pop("offload", False)
    # transformers passes use_reentrant=False when no kwargs are left; else torch's default (True) applies
    reentrant = bool(kwargs.get("use_reentrant", True)) if kwargs else False
    m.flags["recompute"], m.flags["checkpoint_reentrant"] = "full", reentrant
    for key in ("activation_checkpointing", "gradient_checkpointing"):
        m.mark(key, "modelled", "--recompute full (each decoder layer keeps only its input)")
    notes = [f"--checkpoint-reentrant {str(reentrant).lower()}"]
    effect = "modelled"
    if every != 1 or offload or set(kwargs) - {"use_reentrant", "preserve_rng_state"}:
        effect, notes = "not-modelled", [*notes, "every_n_layers / offload / other kwargs are not modelled"]
    for key in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        m.mark(key, effect, "; ".join(notes))


def _compile(m: _Mapping) -> None:
    """``torch_compile`` (or a ``torch_compile_backend`` / ``_mode``, which TrainingArguments takes to mean it):
    ``--compile``. The Trainer compiles the whole model (``torch.compile(model, backend, mode)``), whose forward
    computes the loss from the labels, unless a label smoother takes them out (``Trainer.compute_loss``):
    then ``--compile-loss off``. The estimate says which compiled parts it prices as eager
    (``unmodelled_settings``)."""
    backend, mode = m.args.get("torch_compile_backend"), m.args.get("torch_compile_mode")
    if not (m.has("torch_compile") or backend or mode):
        return
    m.flags["compile"] = True
    # with a label smoother the Trainer takes the labels out and computes the loss after the compiled forward
    smoothed = float(m.args.get("label_smoothing_factor") or 0.0) > 0.0
    if smoothed:
        m.flags["compile_loss"] = "off"
    m.mark("torch_compile", "modelled", "--compile (each decoder layer keeps what AOT autograd's min-cut "
           "partitioner saves; " + ("the smoothed loss runs after the compiled forward: --compile-loss off)"
                                    if smoothed else "the model's loss is compiled with its forward)"), value=True)
    if backend in (None, "inductor"):
        m.mark("torch_compile_backend", "modelled", "inductor: its partitioner decides the saved activations")
    else:
        m.mark("torch_compile_backend", "not-modelled", f"backend {backend!r}: memplan prices inductor's "
               "partitioner (min-cut); other backends partition differently")
    if mode in (None, "default", "max-autotune-no-cudagraphs"):
        m.mark("torch_compile_mode", "no-memory-effect", "no CUDA graphs in this mode")
    else:
        m.mark("torch_compile_mode", "not-modelled", f"mode {mode!r} records CUDA graphs, whose static input and "
               "output buffers and private memory pool are not modelled")


def _fsdp(m: _Mapping, base_dir: Path | None) -> None:
    raw = m.args.get("fsdp")
    options = raw if isinstance(raw, list) else str(raw or "").replace(",", " ").split()
    options = ["full_shard"] if raw is True else [str(o).lower() for o in options]
    config = m.args.get("fsdp_config")
    if isinstance(config, str):
        config = read_json_object(config, base_dir, "fsdp_config")
    config = {str(k).removeprefix("fsdp_"): v for k, v in (config or {}).items()}
    if not options or options == ["no_shard"]:
        m.mark("fsdp", "no-memory-effect", "FSDP is off")
        m.mark("fsdp_config", "no-memory-effect", "FSDP is off")
        return
    known = {"full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "offload", "auto_wrap", "no_shard"}
    unknown = [o for o in options if o not in known]
    if unknown:
        raise ConfigError(f"{_FLAG}: fsdp", f"options must be among {', '.join(sorted(known))}", unknown[0])
    notes = []
    if "shard_grad_op" in options:
        m.flags["zero"], m.flags["fsdp"] = 2, "none"
        notes.append("shard_grad_op → --zero 2")
    elif "hybrid_shard" in options or "hybrid_shard_zero2" in options:
        m.flags["fsdp"] = "hybrid"
        notes.append("hybrid_shard → --fsdp hybrid (shard groups of --fsdp-shard-size GPUs)")
    else:
        m.flags["fsdp"] = "full"
        notes.append("full_shard → --fsdp full")
    if "offload" in options or config.get("offload_params") is True:
        m.flags["offload_params"] = m.flags["offload_optimizer"] = True
        notes.append("offload → --offload-params --offload-optimizer")
    if config.get("activation_checkpointing") is True:
        m.flags["recompute"] = "full"
        notes.append("fsdp_config activation_checkpointing → --recompute full")
    m.mark("fsdp", "not-modelled" if "hybrid_shard_zero2" in options else "modelled",
           "; ".join(notes) + ("; hybrid_shard_zero2's gradient sharding is not modelled"
                               if "hybrid_shard_zero2" in options else ""))
    unread = sorted(k for k, v in config.items() if k not in ("activation_checkpointing", "offload_params", "version",
                                                              "cpu_ram_efficient_loading", "sync_module_states",
                                                              "state_dict_type", "use_orig_params") and v)
    if "fsdp_config" in m.args:
        m.mark("fsdp_config", "not-modelled" if unread else "modelled",
               f"not modelled: {', '.join(unread)} (memplan assumes one FSDP unit per decoder layer)" if unread
               else "activation_checkpointing / offload_params read; the rest has no memory effect")


def _deepspeed(m: _Mapping, job: Job, base_dir: Path | None) -> Job:
    value = m.args.get("deepspeed")
    if not value:
        m.mark("deepspeed", "no-memory-effect", "not set")
        return job
    from memplan.frameworks.deepspeed_config import job_with_deepspeed
    from memplan.frameworks.deepspeed_keys import deepspeed_settings

    config = value if isinstance(value, dict) else read_json_object(str(value), base_dir, "deepspeed")
    m.mark("deepspeed", "modelled", "applied as --deepspeed-config (framework deepspeed; \"auto\" keeps these args' "
           "values)")
    for setting in deepspeed_settings(config, source=f"{_FLAG} deepspeed"):
        m.settings[f"deepspeed.{setting.key}"] = setting
    return job_with_deepspeed(config, job)


def _trl_model(m: _Mapping) -> None:
    """TRL ``ModelConfig`` flags of an SFT script's command line (trl/trainer/model_config.py)."""
    a = m.args
    if m.has("use_peft"):
        m.flags["peft"] = peft_method_of_config(a, m.has).name
        m.mark("use_peft", "modelled", f"--peft {m.flags['peft']}")
        m.mark("use_dora", "modelled", f"--peft {m.flags['peft']}")
        for key, flag in (("lora_r", "lora_rank"), ("lora_alpha", "lora_alpha"), ("lora_dropout", "lora_dropout")):
            if a.get(key) is not None:
                m.flags[flag] = a[key]
                m.mark(key, "modelled", f"--{flag.replace('_', '-')} {a[key]}")
        m.flags["rslora"] = m.has("use_rslora")
        m.mark("use_rslora", "modelled", "--rslora (scaling only)")
        for key, flag in (("lora_target_modules", "lora_targets"), ("lora_modules_to_save", "modules_to_save")):
            if a.get(key) is not None:
                names = a[key] if isinstance(a[key], list) else [a[key]]
                m.flags[flag] = ",".join(str(n) for n in names)
                m.mark(key, "modelled", f"--{flag.replace('_', '-')} {m.flags[flag]}")
    m.mark("lora_task_type", "no-memory-effect", "the task head is the model's own")
    if m.has("load_in_4bit") or m.has("load_in_8bit"):
        fmt = quant_format_of_bnb(load_in_8bit=m.has("load_in_8bit"), quant_type=a.get("bnb_4bit_quant_type"))
        if fmt is None:
            raise ConfigError(f"{_FLAG}: bnb_4bit_quant_type", f"must be {either(FOUR_BIT_FORMATS)}",
                              a.get("bnb_4bit_quant_type"))
        kind = m.flags["quantize_base"] = fmt.name
        if fmt.four_bit:
            m.flags["double_quant"] = m.has("use_bnb_nested_quant")  # TRL's default: no nested quantization
        for key in ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "use_bnb_nested_quant"):
            m.mark(key, "modelled", f"--quantize-base {kind}" + (f" --double-quant "
                   f"{str(m.flags['double_quant']).lower()}" if fmt.four_bit else ""))
    for key in ("dtype", "torch_dtype"):
        if a.get(key) is not None:
            dtype = _DTYPES.get(str(a[key]).lower().removeprefix("torch."), "?")
            if dtype == "?":
                raise ConfigError(f"{_FLAG}: {key}", "must be bfloat16, float16, float32 or auto", a[key])
            if dtype is not None and "peft" in m.flags:
                m.flags["frozen_dtype"] = dtype
                m.mark(key, "modelled", f"--frozen-dtype {dtype} (the frozen base is loaded in it)")
            elif dtype is not None and m.flags.get("precision", "bf16-mixed").startswith(dtype):
                m.flags["precision"] = dtype
                m.mark(key, "modelled", f"--precision {dtype} (weights, gradients and states in {dtype}: no fp32 "
                       "master)")
            else:
                m.mark(key, "not-modelled", "a load dtype other than the autocast dtype is not modelled")
