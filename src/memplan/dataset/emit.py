"""``--emit hf|trl|torchtune|axolotl FILE``: the chosen setting written as the trainer's own configuration.

* ``hf``: a ``TrainingArguments`` JSON (``TrainingArguments(**json.load(f))``): micro-batch,
  accumulation, gradient checkpointing, the sampler (``train_sampling_strategy``), seed, drop_last,
  epochs. The truncation length is the tokenizer's (``tokenizer(..., truncation=True, max_length=N)``),
  not a TrainingArguments field: it is listed in the command's output, not in the file.
* ``trl``: an ``SFTConfig`` JSON (``SFTConfig(**json.load(f))``): the above plus ``max_length``,
  ``packing``/``packing_strategy``, ``padding_free`` and ``shuffle_dataset``.
* ``torchtune``: a YAML of recipe overrides with the keys of torchtune's own recipe configs
  (``batch_size``, ``gradient_accumulation_steps``, ``epochs``, ``enable_activation_checkpointing``,
  ``shuffle``, ``seed``, ``dataset.packed``, ``tokenizer.max_seq_len``), merged into a recipe config
  with ``tune run ... --config base.yaml`` plus these keys as overrides. A test merges the file into
  torchtune's own llama3_2 1B recipe config with torchtune's parser and runs the recipe's data loader
  on the merged values: the same step shapes as memplan's (it needs torchao, see requirements-test.txt).
* ``axolotl``: a YAML of Axolotl config keys (``sequence_len``, ``sample_packing``,
  ``pad_to_sequence_len``, ``micro_batch_size``, ``gradient_accumulation_steps``, ``num_epochs``,
  ``seed``, ``gradient_checkpointing``, ``optimizer``) to merge into the user's config (which names the
  model and datasets). A test passes it through Axolotl's own ``validate_config`` and packs the
  validated values with Axolotl's ``MultipackBatchSampler``: the chosen shapes.

Files are written atomically (a temporary file renamed over the target).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memplan.dataset.rules import family as rule_family
from memplan.dataset.search import Setting
from memplan.errors import ConfigError
from memplan.optimizers import OPTIMIZER_NAMES, optimizer_kind
from memplan.textfile import write_atomic

__all__ = ["EMITTERS", "emit_config"]

EMITTERS = ("hf", "trl", "torchtune", "axolotl")
#: memplan's optimizer names -> TrainingArguments.optim (transformers' OptimizerNames).
_HF_OPTIM = {"adamw": "adamw_torch", "adamw8bit": "adamw_bnb_8bit", "paged-adamw8bit": "paged_adamw_8bit",
             "adafactor": "adafactor", "sgd": "sgd", "lion": "lion_32bit", "lion8bit": "lion_8bit"}


def emit_config(kind: str, setting: Setting, path: str) -> dict[str, Any]:
    """Write ``setting`` as ``kind``'s configuration at ``path``; return what was written."""
    if kind not in EMITTERS:
        raise ConfigError("--emit", f"must be one of {', '.join(EMITTERS)}", kind)
    family = rule_family(setting.batching.rule)
    if family != kind and not (kind == "trl" and family == "hf" and not setting.batching.group_by_length):
        raise ConfigError("--emit", f"the chosen setting uses --batching {setting.batching.rule}; emit it as "
                          f"{family}, or search with --batching of the {kind} family", kind)
    data = (_torchtune(setting) if kind == "torchtune" else _axolotl(setting) if kind == "axolotl"
            else _hf(setting, sft=kind == "trl"))
    text = json.dumps(data, indent=2) + "\n" if kind in ("hf", "trl") else _yaml(data, kind)
    write_atomic(Path(path).expanduser(), text)
    return data


def _hf(setting: Setting, *, sft: bool) -> dict[str, Any]:
    b = setting.batching
    data: dict[str, Any] = {
        "output_dir": "output",
        "per_device_train_batch_size": b.micro_batch_size,
        "gradient_accumulation_steps": setting.gradient_accumulation_steps,
        "gradient_checkpointing": setting.recompute == "full",
        "num_train_epochs": b.epochs,
        "seed": b.seed,
        "dataloader_drop_last": b.drop_last,
        "train_sampling_strategy": "group_by_length" if b.group_by_length else "random",
    }
    if b.data_seed is not None:
        data["data_seed"] = b.data_seed
    if setting.optimizer in _HF_OPTIM:
        data["optim"] = _HF_OPTIM[setting.optimizer]
    if sft:
        data.update({"max_length": b.max_length, "packing": b.rule == "trl-packing",
                     "padding_free": b.rule == "trl-padding-free", "shuffle_dataset": b.shuffle_dataset})
        if b.rule == "trl-packing":
            data["packing_strategy"] = b.packing_strategy
            data["max_length"] = b.effective_max_length
        if b.pad_to_multiple_of:
            data["pad_to_multiple_of"] = b.pad_to_multiple_of
    return data


def _torchtune(setting: Setting) -> dict[str, Any]:
    b = setting.batching
    return {
        "batch_size": b.micro_batch_size,
        "gradient_accumulation_steps": setting.gradient_accumulation_steps,
        "epochs": b.epochs,
        "enable_activation_checkpointing": setting.recompute == "full",
        "shuffle": True,
        "seed": b.seed,
        "dataset": {"packed": b.rule == "torchtune-packing"},
        "tokenizer": {"max_seq_len": b.max_length},
        **({"optimizer": {"_component_": component}} if (component := _torchtune_optimizer(setting.optimizer)) else {}),
    }


def _torchtune_optimizer(name: str) -> str:
    """torchtune's ``_component_`` for memplan's optimizer ``name`` (empty: its default AdamW)."""
    return optimizer_kind(name).dialects.torchtune if name in OPTIMIZER_NAMES else ""


def _axolotl(setting: Setting) -> dict[str, Any]:
    b = setting.batching
    data: dict[str, Any] = {
        "sequence_len": b.max_length,
        "sample_packing": True,
        "pad_to_sequence_len": True,
        "micro_batch_size": b.micro_batch_size,
        "gradient_accumulation_steps": setting.gradient_accumulation_steps,
        "num_epochs": b.epochs,
        "seed": b.seed,
        "gradient_checkpointing": setting.recompute == "full",
    }
    if setting.optimizer in _HF_OPTIM:  # Axolotl's ``optimizer`` takes transformers' OptimizerNames
        data["optimizer"] = _HF_OPTIM[setting.optimizer]
    return data


def _yaml(data: dict[str, Any], kind: str) -> str:
    import yaml

    header = {"torchtune": "# memplan fit --emit torchtune: overrides for a torchtune recipe config\n",
              "axolotl": "# memplan fit --emit axolotl: merge into your Axolotl config (base_model, datasets, "
                         "...)\n"}[kind]
    return header + yaml.safe_dump(data, sort_keys=False)
