"""Build a Hugging Face causal-LM from a preset or ``config.json`` on fake tensors.

No weights are downloaded or allocated: the model is constructed while a ``FakeTensorMode`` is
active, so every parameter is a fake tensor with exact shape and dtype and no data (a 70B model
costs a few MB of Python objects). ``transformers`` builds the architecture from the config
(``AutoModelForCausalLM.from_config``) exactly as a training script would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memplan.errors import ConfigError, MemplanError, ModelConfigError, UnsupportedError
from memplan.job import resolved_adapter_dtype
from memplan.trace.finetune import apply_finetune, frozen_dtype, materialize_fake, needs_finetune
from memplan.trace.setup import TraceSetup

__all__ = [
    "TORCH_DTYPES",
    "BuiltModel",
    "build_hf_model",
    "hf_config_dict",
    "quiet_transformers",
    "unpacked_sequences",
]

TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: Config keys that set a dropout probability (GPT-2 style ``*_pdrop`` and Llama style ``*_dropout``).
_DROPOUT_SUFFIXES = ("_pdrop", "dropout")
#: Of those, the dropouts on attention probabilities (``attention_dropout``, GPT-2's ``attn_pdrop``).
_ATTENTION_DROPOUT_PREFIXES = ("attention", "attn")


@dataclass(frozen=True)
class BuiltModel:
    """A fake model and what the tracer needs to know about it."""

    model: torch.nn.Module
    #: Name for reports (preset name or config path).
    name: str
    #: The parsed config.json the model was built from.
    config: dict[str, Any]
    #: Module paths whose forward outputs are logits (the output head, the root computing the loss).
    head_modules: frozenset[str]


def hf_config_dict(model: str) -> tuple[str, dict[str, Any]]:
    """A preset name, a path to a ``config.json`` (or its folder) or a Hub id ``ORG/NAME[@REV]`` (its cached or
    downloaded config.json, :mod:`memplan.model.hub`) → (name, parsed config)."""
    from memplan.model.presets import preset_config, preset_names

    if model.lower() in preset_names():
        return model.lower(), preset_config(model)
    from memplan.model.hub import hub_config_path, looks_like_hub_id, split_hub_id

    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    hub_name = None
    if not path.exists() and looks_like_hub_id(model):
        path, hub_name = hub_config_path(model), split_hub_id(model.strip())[0]
    if not path.is_file():
        from memplan.model import load_model

        load_model(model)  # raises the estimator's error: unknown preset, closest name, list
        raise ModelConfigError("model", "is not a preset or a config.json", model)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(str(path), f"cannot be read as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelConfigError(str(path), "top level must be a JSON object", type(config).__name__)
    config.pop("_memplan", None)
    name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return hub_name or name, config


def _hf_config(config: dict[str, Any], options: TraceSetup) -> Any:
    import transformers

    values = dict(config)
    values["use_cache"] = False
    model_type = values.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ModelConfigError("model_type", "is required in config.json to build the model with transformers")
    try:
        hf = transformers.AutoConfig.for_model(model_type, **values)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelConfigError("model_type", f"transformers cannot read this config ({_first_line(exc)})",
                               model_type) from None
    if options.attention != "eager" and not _runs_sdpa(transformers, hf):
        raise ConfigError("--attention", f"transformers has no SDPA path for {model_type} (memplan trace runs "
                          f"{options.attention} as PyTorch SDPA): trace it with --attention eager", options.attention)
    hf._attn_implementation = options.attention
    _set_dropouts(hf, options)
    return hf


def _set_dropouts(hf: Any, options: TraceSetup) -> None:
    """Every dropout probability of the config, the class defaults the file leaves out included (GPT-2's
    ``*_pdrop`` are 0.1 unless given), is the job's: ``--attention-dropout`` on the attention probabilities,
    ``--dropout`` on the rest."""
    for key, value in hf.to_dict().items():
        if isinstance(value, float) and key.endswith(_DROPOUT_SUFFIXES):
            setattr(hf, key, options.attention_dropout if key.startswith(_ATTENTION_DROPOUT_PREFIXES)
                    else options.dropout)


def _runs_sdpa(transformers: Any, hf: Any) -> bool:
    """Whether the causal LM of ``hf`` takes PyTorch SDPA (gpt-oss's attention sinks do not:
    ``_supports_sdpa = False``); True when transformers does not say."""
    try:
        cls = transformers.AutoModelForCausalLM._model_mapping[type(hf)]
    except (KeyError, AttributeError):
        return True
    return bool(getattr(cls, "_supports_sdpa", True))


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' config-validation and loss-type chatter while a trace runs."""
    try:
        import transformers
    except ImportError:
        yield
        return
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)


@contextmanager
def unpacked_sequences(enabled: bool = True) -> Iterator[None]:
    """Let transformers decide about sequence packing as it does on real tensors for our batches.

    ``transformers.masking_utils.find_packed_sequence_indices`` cannot read fake position ids, so
    under fake tensors it assumes the batch may be packed and materialises a full 4-D attention
    mask (and repeats GQA keys/values for SDPA). The traced batches are never packed (one
    sequence per row, position ids ``0..seq-1``), for which a real run finds "not packed" and
    uses SDPA's ``is_causal`` path: this context returns that answer after computing the same
    temporaries. ``enabled=False`` (a packed batch under SDPA or eager attention) leaves
    transformers' packed path: the 4-D mask built from the restarted position ids.
    """
    if not enabled:
        yield
        return
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def not_packed(position_ids: Any) -> None:
        original(position_ids)

    masking_utils.find_packed_sequence_indices = not_packed
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def build_hf_model(model: str, options: TraceSetup) -> BuiltModel:
    """Build ``model`` (preset or config path) with ``transformers``; call inside a fake mode.

    Weights are in the precision's storage dtype (fp32 for ``*-mixed``); a fine-tuning job's frozen
    base is in its frozen dtype and wrapped as :mod:`memplan.trace.finetune` says. Raises
    :class:`ModelConfigError` when transformers cannot build the config.
    """
    import transformers

    name, config = hf_config_dict(model)
    dtype = torch.float32 if options.mixed else TORCH_DTYPES[options.compute_dtype]
    finetune = options.job.finetune
    try:
        hf_config = _hf_config(config, options)
        if needs_finetune(finetune):
            net = _fine_tuned(hf_config, options, storage_dtype=dtype)
        else:
            net = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    except MemplanError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, ImportError) as exc:
        raise ModelConfigError("model", f"transformers cannot build a causal LM from this config "
                               f"({_first_line(exc)})", name) from None
    except RuntimeError as exc:
        raise UnsupportedError(f"building {name} on fake tensors failed: {_first_line(exc)}") from None
    net.train()
    return BuiltModel(net, name, config, _head_modules(net))


def _fine_tuned(hf_config: Any, options: TraceSetup, *, storage_dtype: torch.dtype) -> torch.nn.Module:
    """The base in the frozen dtype, quantized and wrapped on ``meta``, then made of fake tensors."""
    import transformers
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    finetune = options.job.finetune
    with unset_fake_temporarily(), torch.device("meta"):
        net = transformers.AutoModelForCausalLM.from_config(
            hf_config, dtype=frozen_dtype(finetune, options.compute_dtype))
        net = apply_finetune(net, finetune, storage_dtype=storage_dtype, compute_dtype=options.compute_dtype,
                             adapter_dtype=resolved_adapter_dtype(options.job))
    materialize_fake(net)
    return net


def _head_modules(net: torch.nn.Module) -> frozenset[str]:
    """The output head's path and the model computing the loss: the root, or the transformers model
    inside a peft wrapper (``base_model.model``)."""
    get = getattr(net, "get_output_embeddings", None)
    base = getattr(net, "get_base_model", None)
    wanted = [m for m in (get() if callable(get) else None, base() if callable(base) else None) if m is not None]
    heads = {""} | {path for path, module in net.named_modules() if any(module is m for m in wanted)}
    return frozenset(heads)


