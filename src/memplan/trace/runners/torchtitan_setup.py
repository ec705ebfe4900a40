"""What ``memplan trace --torchtitan FILE.toml`` runs: torchtitan's ``JobConfig`` of the file, memplan's
job of the same file, and everything refused before the trace starts.

* torchtitan itself must be a 0.2.x release (0.3 configures in Python and reads no TOML);
* the file is parsed twice: by memplan's TOML reader (:mod:`memplan.frameworks.torchtitan_config`,
  the job ``memplan estimate --torchtitan-config`` prices, and one :class:`~memplan.settings.InputSetting`
  per field) and by torchtitan's ``ConfigManager`` (what torchtitan's code runs). The two share the
  field list and defaults of torchtitan 0.2.2 (238fa99);
* the file is the job: job flags beside it are refused, except ``--gpus`` (the launcher's world size,
  which ``data_parallel_shard_degree = -1`` fills);
* pipeline parallelism runs one stage, this simulated rank's (:mod:`memplan.trace.runners.torchtitan_pipeline`);
* refused with the field named: context and replicated data parallelism, a CSV schedule, ``compile``
  (exit 2), flex / varlen attention (exit 1), and what the tracer refuses for any job;
* the model's shapes for the estimator come from torchtitan's llama3 arguments, or the flavor's preset.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.metadata
import logging
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memplan.errors import ConfigError, MissingDependencyError, UnsupportedError
from memplan.settings import InputSetting
from memplan.trace.setup import RunSettings, TraceSetup
from memplan.trace.runners.torchtitan import FLAG, TorchtitanTarget, import_torchtitan

__all__ = ["SUPPORTED_VERSIONS", "parse_job_config", "require_torchtitan", "torchtitan_setup"]

#: torchtitan releases whose TOML reader and trainer the tracer follows (0.3 dropped the TOML).
SUPPORTED_VERSIONS = ("0.2.",)
_FLAG = FLAG


def require_torchtitan() -> str:
    """torchtitan's version; missing, a :class:`MissingDependencyError` (exit 1, as every optional package);
    another release than 0.2.x, a :class:`ConfigError` (exit 2)."""
    try:
        importlib.import_module("torchtitan")
        version = importlib.metadata.version("torchtitan")
    except (importlib.metadata.PackageNotFoundError, ModuleNotFoundError):
        raise MissingDependencyError("torchtitan 0.2.x", feature=f"memplan trace {_FLAG}",
                                     extra="torchtitan") from None
    if not version.startswith(SUPPORTED_VERSIONS):
        raise ConfigError(_FLAG, "follows torchtitan 0.2.x (the releases that read a training TOML; 0.3 "
                          "configures in Python); install torchtitan==0.2.2", f"torchtitan {version}")
    return version


def parse_job_config(path: str | Path) -> Any:
    """The file as torchtitan's ``ConfigManager`` reads it (its ``JobConfig``); a value of the wrong
    type, which tyro only warns about, is refused here (exit 2)."""
    manager = import_torchtitan("torchtitan.config.manager")
    with warnings.catch_warnings(record=True) as caught, _quiet_root_logger():
        warnings.simplefilter("always")
        try:
            config = manager.ConfigManager().parse_args(["--job.config_file", str(path)])
        except SystemExit:  # tyro prints its own message and exits on a field it cannot read
            raise ConfigError(f"{_FLAG} {path}", "is not a torchtitan JobConfig (torchtitan's parser refused it; "
                              "see the message above)") from None
        except (TypeError, ValueError, AssertionError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ConfigError(f"{_FLAG} {path}", f"torchtitan refused it: {first}") from None
    for warning in caught:
        found = re.search(r"field `([\w.-]+)` is annotated with type `<class '(\w+)'>`, but the default value "
                          r"`(.*?)` has type `<class '(\w+)'>`", str(warning.message))
        if found:
            key = found.group(1).replace("-", "_")
            raise ConfigError(f"{_FLAG}: {key}", f"must be {found.group(2)}, not {found.group(4)}", found.group(3))
    return config


@contextlib.contextmanager
def _quiet_root_logger() -> Iterator[None]:
    """torchtitan logs on the root logger; while it parses, its warning about the tokenizer's
    ``hf_assets_path`` (which a trace never reads) is not the user's concern."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        root.setLevel(level)


#: Job flags that may stand beside ``--torchtitan``: the GPU count is the launcher's, not the file's
#: (``data_parallel_shard_degree = -1`` takes the GPUs left over).
_LAUNCHER_FLAGS = frozenset({"gpus"})


def torchtitan_setup(path: str, flags: dict[str, Any], *, device: str = "cuda", iterations: int = 2,
                     moe_routing: str = "balanced") -> tuple[TorchtitanTarget, TraceSetup, tuple[InputSetting, ...]]:
    """What ``memplan trace --torchtitan FILE`` runs: the target, the job memplan reads from the file
    (its :class:`TraceSetup`) and the file's settings as memplan's TOML reader classifies them.

    ``flags``: the job flags given beside the file; any but ``gpus`` is refused (the file is the job).
    """
    from memplan.frameworks.torchtitan_config import read_torchtitan_config

    with _as_torchtitan_flag():
        read_torchtitan_config(path)  # a missing file or malformed TOML: one memplan error first
    given = sorted(k for k, v in flags.items() if v is not None and k not in _LAUNCHER_FLAGS)
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ConfigError(flag, f"cannot stand beside {_FLAG}: the TOML is the job torchtitan runs; set it in "
                          f"the file (the one job flag allowed is --gpus, the launcher's world size)")
    require_torchtitan()
    job_config = parse_job_config(path)
    args = _model_args(job_config)
    _check_runnable(job_config, args)
    spec = _model_spec(job_config, args)
    with _as_torchtitan_flag():
        job, settings = _job(path, spec, flags.get("gpus"))
    run = RunSettings(device=device, iterations=iterations, moe_routing=moe_routing)  # type: ignore[arg-type]
    try:
        setup = TraceSetup(job, run, frozenset(k for k, v in flags.items() if v is not None), torchtitan_code=True)
    except ConfigError as exc:
        raise ConfigError(f"{_FLAG} {path}: {exc.field}", exc.rule, exc.value) from None
    return TorchtitanTarget(str(path), job_config, args, spec), setup, settings


@contextlib.contextmanager
def _as_torchtitan_flag() -> Iterator[None]:
    """memplan's TOML reader names ``--torchtitan-config`` in its errors; here the file came with ``--torchtitan``."""
    try:
        yield
    except ConfigError as exc:
        if not exc.field.startswith("--torchtitan-config"):
            raise
        raise type(exc)(_FLAG + exc.field[len("--torchtitan-config"):], exc.rule, exc.value) from None


def _check_runnable(jc: Any, args: Any) -> None:
    """What torchtitan would run but a fake-tensor trace cannot (the rest is refused with the job's flag)."""
    if jc.compile.enable:
        raise ConfigError(f"{_FLAG}: compile.enable", "memplan trace runs eager kernels; torchtitan's compiled "
                          "blocks are not traced (set it false; memplan estimate reports it as not modelled)", True)
    p = jc.parallelism
    if p.pipeline_parallel_degree > 1 and p.tensor_parallel_degree > 1:
        raise ConfigError(f"{_FLAG}: parallelism.tensor_parallel_degree", "is not traced together with pipeline "
                          "parallelism (the stages exchange DTensor hidden states); memplan estimate "
                          "--torchtitan-config prices it", p.tensor_parallel_degree)
    if p.pipeline_parallel_degree > 1 and p.pipeline_parallel_schedule_csv:
        raise ConfigError(f"{_FLAG}: parallelism.pipeline_parallel_schedule_csv", "a schedule from a CSV file is not "
                          "traced (memplan trace runs torchtitan's named schedules)", p.pipeline_parallel_schedule_csv)
    for key, what in (("context_parallel_degree", "context parallelism"),
                      ("data_parallel_replicate_degree", "replicated data parallelism (DDP / HSDP)")):
        if getattr(p, key) != 1:
            raise ConfigError(f"{_FLAG}: parallelism.{key}", f"{what} is not traced (memplan trace simulates FSDP "
                              "and TP ranks); memplan estimate --torchtitan-config prices it", getattr(p, key))
    attention = getattr(args, "attn_type", "sdpa")
    if attention != "sdpa":
        raise UnsupportedError(f"{_FLAG}: {jc.model.name} {jc.model.flavor} uses {attention} attention, whose "
                               "block-causal masks torchtitan builds from its tokenizer and the batch's documents; "
                               "memplan trace runs the sdpa flavors")


def _model_args(jc: Any) -> Any:
    """The flavor's model arguments from torchtitan's train spec (the name and flavor checked)."""
    spec_module = import_torchtitan("torchtitan.protocols.train_spec")
    models = import_torchtitan("torchtitan.models")
    name, flavor = jc.model.name, jc.model.flavor
    try:
        spec = spec_module.get_train_spec(name)
    except ValueError:
        known = sorted(getattr(models, "_supported_models", ()))
        raise ConfigError(f"{_FLAG}: model.name", f"is not a torchtitan model (known: {', '.join(known)})",
                          name) from None
    if flavor not in spec.model_args:
        raise ConfigError(f"{_FLAG}: model.flavor", f"is not a flavor of torchtitan's {name} "
                          f"(known: {', '.join(spec.model_args)})", flavor)
    args = copy.deepcopy(spec.model_args[flavor])
    args.update_from_config(jc)
    return args


def _model_spec(jc: Any, args: Any) -> Any:
    """memplan's :class:`~memplan.model.spec.ModelSpec` of the flavor: from its arguments for the
    dense llama3 / qwen3 models (their shapes as torchtitan builds them), else its preset."""
    from memplan.frameworks.torchtitan_fields import PRESETS
    from memplan.model import load_model
    from memplan.model.hf import model_from_hf_config

    name, flavor = jc.model.name, jc.model.flavor
    if name == "llama3":
        hidden = int(2 * 4 * args.dim / 3)
        if args.ffn_dim_multiplier is not None:
            hidden = int(args.ffn_dim_multiplier * hidden)
        hidden = args.multiple_of * -(-hidden // args.multiple_of)  # torchtitan's FeedForward
        config = {"model_type": "llama", "hidden_size": args.dim, "num_hidden_layers": args.n_layers,
                  "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads or args.n_heads,
                  "intermediate_size": hidden, "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
                  "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": False}
        return model_from_hf_config(config, name=f"torchtitan-{name}-{flavor}")
    preset = PRESETS.get((name, flavor))
    if preset is None:
        raise UnsupportedError(f"{_FLAG}: memplan derives the shapes of torchtitan's llama3 flavors, and of "
                               f"those with a preset ({', '.join(f'{n} {f}' for n, f in PRESETS)}); "
                               f"{name} {flavor} has neither")
    return load_model(preset)


def _job(path: str, spec: Any, gpus: int | None) -> tuple[Any, tuple[InputSetting, ...]]:
    """The job memplan's TOML reader makes of the file (what ``memplan estimate --torchtitan-config``
    prices), with the file's ``[model]`` marked as the model traced."""
    from memplan.frameworks.torchtitan_config import apply_torchtitan_config
    from memplan.job import Job
    from memplan.jobcheck import validate_job_for_model

    typed = {} if gpus is None else {"gpus": gpus}
    job, settings = apply_torchtitan_config(path, Job(framework="torchtitan"), model=spec, model_given=True,
                                            typed=typed)
    validate_job_for_model(job, spec)
    model_note = "torchtitan's own model of this name and flavor is traced"
    settings = tuple(InputSetting(source=_FLAG, key=s.key, value=s.value, effect="modelled", note=model_note)
                     if s.key in ("model.name", "model.flavor") else s for s in settings)
    return job, settings
