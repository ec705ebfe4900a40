"""What each field of a torchtitan training TOML does to training memory.

The tables behind :mod:`memplan.frameworks.torchtitan_config`: torchtitan's complete field list
(``JobConfig`` of ``torchtitan/config/job_config.py`` and the model flavors, extracted by
``tools/torchtitan_fields.py`` into ``memplan/data/torchtitan_fields.json`` at the commit it
records), the ``(name, flavor)`` → memplan preset map, and the fields that cannot change GPU
memory. Fields :mod:`memplan.frameworks.torchtitan_config` maps or judges itself are not in
:data:`NO_MEMORY_EFFECT`.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

__all__ = ["NO_MEMORY_EFFECT", "PRESETS", "field_defaults", "field_list", "field_types", "flavors", "torchtitan_commit"]

#: torchtitan (model name, flavor) → memplan preset with the same shapes (checked against each
#: flavor's ``*ModelArgs`` in ``torchtitan/models/<name>/__init__.py``; deepseek_v3 16B has
#: DeepSeek-V2-Lite's shapes). Flavors not listed have no preset: give MODEL.
PRESETS: dict[tuple[str, str], str] = {
    ("llama3", "8B"): "llama-3.1-8b",
    ("llama3", "8B_flex"): "llama-3.1-8b",
    ("llama3", "8B_varlen"): "llama-3.1-8b",
    ("llama3", "70B"): "llama-3.1-70b",
    ("llama3", "405B"): "llama-3.1-405b",
    ("qwen3", "8B"): "qwen3-8b",
    ("qwen3", "32B"): "qwen3-32b",
    ("qwen3", "30B-A3B"): "qwen3-30b-a3b",
    ("qwen3", "235B-A22B"): "qwen3-235b-a22b",
    ("deepseek_v3", "16B"): "deepseek-v2-lite",
    ("deepseek_v3", "671B"): "deepseek-v3",
}

_LOG = "logging / tracking"
_SAVE = "checkpoint saving and loading (DCP writes from the shards; staging in host memory)"
_SCHEDULE = "learning-rate schedule / loop length"
_HYPER = "optimizer hyper-parameter (no state)"
_DATA = "data loading on the host"
_PROFILE = "profiling on the host"
_COMM = "communication timeouts / host-side flight recorder"
_HOST = "host-side setting"

#: Fields that cannot change GPU memory of a training step, with why.
NO_MEMORY_EFFECT: dict[str, str] = {
    **dict.fromkeys(("job.config_file", "job.dump_folder", "job.description", "job.print_config",
                     "job.save_config_file", "job.custom_config_module"), _HOST),
    **{f"profiling.{k}": _PROFILE for k in ("enable_profiling", "save_traces_folder", "profile_freq",
                                             "profiler_active", "profiler_warmup", "enable_memory_snapshot",
                                             "save_memory_snapshot_folder")},
    **{f"metrics.{k}": _LOG for k in ("log_freq", "enable_tensorboard", "disable_color_printing",
                                       "save_tb_folder", "save_for_all_ranks", "enable_wandb")},
    "model.hf_assets_path": "tokenizer / config files",
    "model.tokenizer_path": "tokenizer files",
    "model.print_after_conversion": _LOG,
    **{f"optimizer.{k}": _HYPER for k in ("lr", "beta1", "beta2", "eps", "weight_decay")},
    **{f"lr_scheduler.{k}": _SCHEDULE for k in ("warmup_steps", "total_steps", "decay_ratio", "decay_type",
                                                 "min_lr_factor")},
    "training.dataset": _DATA,
    "training.dataset_path": _DATA,
    "training.steps": _SCHEDULE,
    "training.max_norm": "gradient clipping computes one norm per tensor (scalars)",
    "training.gc_freq": "Python garbage collection on the host",
    "training.gc_debug": "Python garbage collection on the host",
    **{f"training.dataloader.{k}": _DATA for k in ("num_workers", "persistent_workers", "pin_memory",
                                                    "prefetch_factor")},
    "parallelism.context_parallel_load_balancer": "reorders tokens across CP ranks, same sizes",
    "parallelism.pipeline_parallel_expert_parallel_overlap": "only with the DualPipeV schedule, which is "
                                                             "reported with pipeline_parallel_schedule",
    **{f"checkpoint.{k}": _SAVE for k in ("enable", "enable_ft_dataloader_checkpoints", "folder", "interval",
                                          "initial_load_path", "initial_load_model_only", "initial_load_in_hf",
                                          "initial_load_in_hf_quantized", "last_save_model_only",
                                          "last_save_in_hf", "export_dtype", "async_mode", "keep_latest_k",
                                          "load_step", "exclude_from_loading", "enable_first_step_checkpoint",
                                          "create_seed_checkpoint", "load_only")},
    "activation_checkpoint.early_stop": "stops a recompute early; saved activations unchanged",
    "activation_checkpoint.visualize_memory_budget_pareto": _LOG,
    "activation_checkpoint.preserve_rng_state": "RNG state stashing (bytes per checkpoint)",
    "activation_checkpoint.determinism_check": "checks recomputed metadata",
    "activation_checkpoint.debug": _LOG,
    **{f"comm.{k}": _COMM for k in ("init_timeout_seconds", "train_timeout_seconds", "trace_buf_size",
                                     "save_traces_folder", "save_traces_file_prefix")},
    "comm.mode": "fake_backend / local_tensor are test modes; memplan prices the real run",
    "memory_estimation.enable": "torchtitan's own memory estimation run",
    "memory_estimation.disable_fake_mode": "torchtitan's own memory estimation run",
    **{f"fault_tolerance.{k}": "read with fault_tolerance.enable" for k in (
        "process_group", "process_group_timeout_ms", "replica_id", "group_size", "min_replica_size",
        "semi_sync_method")},
    **{f"validation.{k}": "read with validation.enable" for k in (
        "dataset", "dataset_path", "local_batch_size", "seq_len", "freq", "steps", "dataloader.num_workers",
        "dataloader.persistent_workers", "dataloader.pin_memory", "dataloader.prefetch_factor")},
    "debug.seed": "random seed",
    "debug.deterministic": "deterministic kernels, same storage",
    "debug.deterministic_warn_only": "deterministic kernels, same storage",
    "debug.moe_force_load_balance": "balanced routing is memplan's default (--moe-imbalance 1)",
}


@functools.cache
def _data() -> dict[str, Any]:
    text = resources.files("memplan").joinpath("data/torchtitan_fields.json").read_text(encoding="utf-8")
    return json.loads(text)


def field_list() -> tuple[str, ...]:
    """Every leaf field of torchtitan's ``JobConfig`` as ``section.key`` (``training.dataloader.num_workers``)."""
    return tuple(f["key"] for f in _data()["fields"])


def field_defaults() -> dict[str, Any]:
    """torchtitan's default of every field (``None`` where torchtitan's is None or not a literal)."""
    return {f["key"]: f["default"] for f in _data()["fields"]}


def field_types() -> dict[str, str]:
    """The annotation of every field as torchtitan writes it (``int | None``)."""
    return {f["key"]: f["type"] for f in _data()["fields"]}


def flavors() -> dict[str, tuple[str, ...]]:
    """torchtitan's model names and their flavors."""
    return {name: tuple(found) for name, found in _data()["flavors"].items()}


def torchtitan_commit() -> str:
    """The torchtitan commit the field list and flavors were extracted from."""
    return str(_data()["commit"])
