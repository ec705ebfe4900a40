"""The job's flags: every :class:`~memplan.job.Job` field that has a command-line flag, read from
the field's own declaration (``knob(...)`` in :mod:`memplan.job`), and how flag values become a Job.

One declaration serves the command line (``memplan estimate/trace/fit/report`` generate their job
options from :func:`job_flags`), job files (their keys are the flag names), ``--save-job`` and error
messages. Example::

    >>> from memplan.jobflags import build_job
    >>> build_job({"gpus": 8, "tp": 2, "seq": 8192}).parallel.dp
    4

Importing this module imports no torch and no typer.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from typing import Any, Literal

from memplan.errors import ConfigError, JobConfigError
from memplan.job import Job
from memplan.optimizers import OPTIMIZERS
from memplan.tuning import ADAPTER_METHODS, FOUR_BIT_FORMATS

__all__ = ["JobFlag", "build_job", "check_conflicts", "flag_values", "job_flags", "unflagged_settings"]

#: A condition that holds when the condition flag has any non-empty value (``--offload-modules mlp``).
SET = ("any value",)
#: A condition that holds when the condition flag is given as anything but ``none`` (``--recompute full``).
NOT_NONE = ("not none",)

#: (flag, condition flag, allowed values): the flag only means something under those values.
_REQUIRES: tuple[tuple[str, str, tuple[Any, ...]], ...] = (
    ("recompute_method", "recompute", ("full",)),
    ("recompute_layers", "recompute", ("full",)),
    ("fsdp_shard_size", "fsdp", ("hybrid",)),
    *((knob, "optimizer", tuple(k.name for k in OPTIMIZERS if knob in k.knobs))
      for knob in dict.fromkeys(knob for k in OPTIMIZERS for knob in k.knobs)),
    *((name, "peft", ADAPTER_METHODS) for name in (
        "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "lora_rank_pattern", "rslora")),
    ("double_quant", "quantize_base", FOUR_BIT_FORMATS),
    ("adapter_dtype", "peft", ADAPTER_METHODS),
    ("checkpoint_reentrant", "recompute", NOT_NONE),
    ("optimizer_offload_fraction", "offload_optimizer", (True,)),
    ("cuda_graph_modules", "cuda_graph_impl", ("local", "transformer_engine")),
    *((name, "offload_modules", SET) for name in (
        "min_offloaded_tensor_size", "activation_offload_fraction", "offload_pp_delta")),
)
#: The flags other flags depend on (a dialect file may set them: :func:`memplan.inputs` adds its values).
CONDITIONS = frozenset(condition for _, condition, _ in _REQUIRES)
#: Changing any of these re-derives dp unless --dp is given too.
_LAYOUT_FIELDS = frozenset({"world_size", "tp", "pp", "cp"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobFlag:
    """One job field that has a command-line flag."""

    #: Python name: the flag without ``--``, ``_`` for ``-`` (``first_stage_layers``); also the
    #: job-file key (``first-stage-layers`` is accepted too).
    name: str
    #: The flag as typed (``--first-stage-layers``).
    flag: str
    #: The Job section holding the field (``parallel``, ``batch``...), None for the Job itself.
    section: str | None
    #: The field's name in its section (``world_size`` for ``--gpus``).
    field: str
    #: ``int``, ``float``, ``str`` or ``bool``.
    kind: type
    #: Accepted values of a closed choice (a ``Literal`` field), else None.
    choices: tuple[str, ...] | None
    #: The field's documentation, used as the option's help.
    help: str
    #: Help panel the option is shown in.
    panel: str
    metavar: str | None
    #: The field's default in ``Job()``.
    default: Any

    @property
    def help_text(self) -> str:
        """``help`` with the choices and the default appended (as ``--help`` shows it)."""
        text = self.help
        if self.choices:
            text += f" One of: {', '.join(self.choices)}."
        if "(default:" not in text and self.kind is not bool and self.default is not None:
            text += f" (default: {self.default})"
        return text

    def read(self, job: Job) -> Any:
        """This flag's value in ``job``."""
        return getattr(getattr(job, self.section) if self.section else job, self.field)


def _kind(hint: Any) -> tuple[type, tuple[str, ...] | None]:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is Literal:
        return str, tuple(typing.get_args(hint))
    if typing.get_origin(hint) is tuple:  # a list of integers, typed as a comma list
        return str, None
    if args and typing.get_origin(hint) is not Literal and len(args) == 1:
        return _kind(args[0])
    if isinstance(hint, type):
        return hint, None
    raise TypeError(f"job field type {hint!r} has no command-line kind")


def _flags_of(cls: type, section: str | None) -> list[JobFlag]:
    hints = typing.get_type_hints(cls)
    out: list[JobFlag] = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.extend(_flags_of(hints[f.name], f.name))
            continue
        meta = f.metadata
        if "flag" not in meta:
            continue
        kind, choices = _kind(hints[f.name])
        out.append(JobFlag(name=meta["flag"].removeprefix("--").replace("-", "_"), flag=meta["flag"],
                           section=section, field=f.name, kind=kind, choices=choices, help=meta["help"],
                           panel=meta["panel"], metavar=meta["metavar"], default=f.default))
    return out


@functools.cache
def job_flags() -> tuple[JobFlag, ...]:
    """Every job flag, in the order of the Job's fields."""
    return tuple(_flags_of(Job, None))


@functools.cache
def _by_name() -> dict[str, JobFlag]:
    return {f.name: f for f in job_flags()}


def build_job(values: Mapping[str, Any], base: Job | None = None) -> Job:
    """``base`` (default ``Job()``) with every flag in ``values`` replaced (``None`` = not given).

    Keys are :attr:`JobFlag.name`; other keys are ignored. Changing gpus/tp/pp/cp derives dp again
    unless ``dp`` is given. ``fsdp`` also takes an integer N: shard over N GPUs (full sharding when
    N equals the GPU count, which it sets when ``gpus`` is not given; hybrid groups of N otherwise).
    Raises :class:`~memplan.errors.JobConfigError` naming the flag when a value is invalid.
    """
    values = _fsdp_groups({k: v for k, v in values.items() if v is not None and k in _by_name()}, base)
    changes: dict[str | None, dict[str, Any]] = {}
    for name, value in values.items():
        flag = _by_name()[name]
        changes.setdefault(flag.section, {})[flag.field] = value
    base = base or Job()
    par = changes.get("parallel", {})
    if _LAYOUT_FIELDS & par.keys() and "dp" not in par:
        par["dp"] = None  # derived again from the new layout
    rc = changes.get("recompute", {})
    if rc.get("mode", "selective") != "selective" and "modules" not in rc:
        rc["modules"] = None  # a base job's modules (e.g. from --megatron-args) only mean something under selective
    top = changes.pop(None, {})
    for section, section_values in changes.items():
        assert section is not None
        top[section] = dataclasses.replace(getattr(base, section), **section_values)
    return dataclasses.replace(base, **top) if top else base


def _fsdp_groups(values: dict[str, Any], base: Job | None) -> dict[str, Any]:
    """``fsdp: N`` → full or hybrid sharding over groups of N data-parallel GPUs."""
    fsdp = values.get("fsdp")
    text = str(fsdp).strip()
    if fsdp is None or isinstance(fsdp, bool) or not text.isdigit():
        return values
    group = int(text)
    if group < 1:
        raise JobConfigError("--fsdp", "an integer must be the number of GPUs to shard over, at least 1", fsdp)
    par = (base or Job()).parallel
    model_parallel = 1
    for name in ("tp", "pp", "cp"):
        size = values.get(name, getattr(par, name))
        model_parallel *= size if isinstance(size, int) and size > 0 else 1
    out = dict(values)
    if "gpus" not in out:
        out["gpus"] = max(group * model_parallel, par.world_size)
    dp = out["gpus"] // model_parallel if isinstance(out["gpus"], int) else group
    if group == 1:
        out["fsdp"] = "none"
    elif group == dp:
        out["fsdp"] = "full"
    elif dp % group == 0:
        out["fsdp"], out["fsdp_shard_size"] = "hybrid", group
    else:
        raise JobConfigError("--fsdp", f"the shard group of {group} GPUs must divide the data-parallel size {dp}", fsdp)
    return out


def _holds(value: Any, allowed: tuple[Any, ...]) -> bool:
    """Whether a condition flag's ``value`` is one of ``allowed`` (or, for :data:`SET` / :data:`NOT_NONE`, given)."""
    if allowed is SET:
        return bool(value)
    if allowed is NOT_NONE:
        return value not in (None, "none")
    return value in allowed


def check_conflicts(values: Mapping[str, Any]) -> None:
    """Refuse a flag that only applies under another flag's values (e.g. --momentum without sgd)."""
    for name, condition, allowed in _REQUIRES:
        value = values.get(condition)
        if name in values and not _holds(value, allowed):
            flag = condition.replace("_", "-")
            if allowed is SET or allowed == (True,):  # a list or a switch: given or not
                rule = f"only applies with --{flag} (the job has none)"
            elif allowed is NOT_NONE:
                rule = f"only applies with a --{flag} policy (the job has --{flag} {value or 'none'})"
            else:
                rule = (f"only applies with --{flag} {' or '.join(map(str, allowed))} (the job has --{flag} "
                        f"{values.get(condition, 'not set')})")
            raise ConfigError(f"--{name.replace('_', '-')}", rule, values[name])


def flag_values(job: Job, *, changed_only: bool = True) -> dict[str, Any]:
    """``{flag name: value}`` of ``job``: the ones that differ from ``Job()`` (``gpus`` always)."""
    default = Job()
    out: dict[str, Any] = {}
    for flag in job_flags():
        value = flag.read(job)
        if flag.name == "dp" or value is None:
            continue
        if changed_only and flag.name != "gpus" and value == flag.read(default):
            continue
        out[flag.name] = ",".join(map(str, value)) if isinstance(value, tuple) else value
    return out


def unflagged_settings(job: Job) -> tuple[str, ...]:
    """Settings of ``job`` that differ from ``Job()`` and that no flag expresses (e.g. Megatron's
    ``parallel.microbatch_group_size``), as ``section.field``."""
    covered = {(f.section, f.field) for f in job_flags()} | {("parallel", "dp")}
    default = Job()
    dropped = []
    for f in dataclasses.fields(job):
        value, base = getattr(job, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            dropped += [f"{f.name}.{sub.name}" for sub in dataclasses.fields(value)
                        if (f.name, sub.name) not in covered and getattr(value, sub.name) != getattr(base, sub.name)]
        elif (None, f.name) not in covered and value != base:
            dropped.append(f.name)
    return tuple(dropped)
