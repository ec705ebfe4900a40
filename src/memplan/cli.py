"""The ``memplan`` command line: one typer app, a thin client of the library (parse → call → render).

Commands live here as small functions; each parses its options, calls the library and hands the
result to :mod:`memplan.report.text` (or prints ``to_dict()`` as JSON). Later commands (trace,
alloc, ckpt, fit) can live in their own modules and register on :data:`app` the same way::

    from memplan.cli import app, handle_errors

    @app.command()
    def trace(...) -> None:
        with handle_errors():
            ...

Startup matters (``memplan estimate`` must answer in well under a second): this module imports
no torch, numpy or matplotlib, and imports rich only when it renders a table.

Exit codes: 0 success; 1 a :class:`~memplan.errors.MemplanError` that is not a configuration
error (e.g. unsupported input); 2 bad input — a :class:`~memplan.errors.ConfigError` or a usage
error reported by typer/click.
"""

import dataclasses
import json
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import typer

from memplan.errors import ConfigError, MemplanError, UnsupportedError

if TYPE_CHECKING:
    from memplan.job import Job
    from memplan.model.spec import ModelSpec

__all__ = ["JobOptions", "app", "build_job", "handle_errors", "main"]

#: Exit code of bad input (the same code click uses for usage errors).
EXIT_CONFIG = 2
#: Exit code of any other deliberate memplan error.
EXIT_ERROR = 1


class _PlainCoercion:
    """Converts a command-line string to int/float/str/bool the way click does, without pydantic.

    typer >= 0.2x coerces every parameter, given or not, through a pydantic ``TypeAdapter`` built
    on first use: importing pydantic and building ~45 adapters costs ~0.2 s, which would double
    the start-up time of ``memplan estimate``. Our options are plain scalars, so they are
    converted here; any other parameter keeps typer's own path.
    """

    _NAMES: ClassVar[dict[type, str]] = {int: "integer", float: "float", str: "string", bool: "boolean"}
    _BOOLS: ClassVar[dict[str, bool]] = {
        "1": True, "true": True, "t": True, "yes": True, "y": True, "on": True,
        "0": False, "false": False, "f": False, "no": False, "n": False, "off": False,
    }

    def __init__(self, kind: type) -> None:
        self.kind = kind

    def coerce(self, value: Any, param: Any, ctx: Any) -> Any:
        if value is None or isinstance(value, self.kind):
            return value
        try:
            if self.kind is bool:
                return self._BOOLS[str(value).strip().lower()]
            return self.kind(value)
        except (KeyError, TypeError, ValueError):
            raise typer.BadParameter(f"{value!r} is not a valid {self._NAMES[self.kind]}.", ctx=ctx, param=param) from None

    @classmethod
    def install(cls, params: Iterable[Any]) -> None:
        """Give each plain scalar typer parameter this coercion (no-op on other typer versions)."""
        for param in params:
            descriptor = getattr(param, "type_descriptor", None)
            kind = getattr(descriptor, "annotation", None)
            info = getattr(descriptor, "parameter_info", None)
            plain = info is not None and all(getattr(info, a, None) is None for a in ("parser", "min", "max"))
            if kind in cls._NAMES and plain and getattr(param, "_runtime_param", 0) is None \
                    and param.nargs == 1 and not param.multiple:
                param._runtime_param = cls(kind)


class _Command(typer.core.TyperCommand):
    """typer's command with the light scalar coercion of :class:`_PlainCoercion`."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        _PlainCoercion.install(params)
        return params


class _Group(typer.core.TyperGroup):
    """typer's group with the light scalar coercion of :class:`_PlainCoercion`."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        _PlainCoercion.install(params)
        return params


app = typer.Typer(
    name="memplan",
    cls=_Group,
    help="How much GPU memory a training job needs, where it goes, and how to make it fit.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@contextmanager
def handle_errors() -> Iterator[None]:
    """Turn memplan's own errors into one red ``error:`` line on stderr and an exit code.

    :class:`ConfigError` (bad input) exits 2, any other :class:`MemplanError` exits 1. Other
    exceptions are bugs and keep their traceback.
    """
    try:
        yield
    except ConfigError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(EXIT_CONFIG) from None
    except MemplanError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(EXIT_ERROR) from None


def _print_json(data: object) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def _print(*renderables: Any) -> None:
    from rich.console import Console

    Console(highlight=False).print(*renderables)


# --------------------------------------------------------------------------------------------
# Job options: the CLI flags that describe a training job, and how they become a Job.


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobOptions:
    """Job flags as given on the command line; ``None`` means "not given" (keep the base value).

    Field names are the flags' names with ``_`` for ``-`` (``--first-stage-layers`` →
    ``first_stage_layers``), so that other commands taking the same flags can reuse them.
    """

    gpus: int | None = None
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    vpp: int | None = None
    cp: int | None = None
    ep: int | None = None
    etp: int | None = None
    sequence_parallel: bool | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    zero: int | None = None
    fsdp: str | None = None
    fsdp_shard_size: int | None = None
    distributed_optimizer: bool | None = None
    mbs: int | None = None
    gbs: int | None = None
    seq: int | None = None
    precision: str | None = None
    grad_dtype: str | None = None
    optimizer_state_dtype: str | None = None
    master_dtype: str | None = None
    optimizer: str | None = None
    momentum: float | None = None
    optimizer_impl: str | None = None
    recompute: str | None = None
    recompute_method: str | None = None
    recompute_layers: int | None = None
    attention: str | None = None
    dropout: float | None = None
    loss: str | None = None
    framework: str | None = None
    make_vocab_size_divisible_by: int | None = None
    mtp_layers: int | None = None
    moe_imbalance: float | None = None
    capacity_factor: float | None = None
    pad_to_capacity: bool | None = None
    moe_dispatcher: str | None = None
    shared_expert_parallel: str | None = None
    fp8: str | None = None
    fp8_params: bool | None = None
    offload_optimizer: bool | None = None
    optimizer_offload_fraction: float | None = None
    offload_params: bool | None = None
    offload_activations: bool | None = None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "JobOptions":
        """Pick this class's fields out of ``values`` (e.g. a command's ``locals()``)."""
        return cls(**{f.name: values.get(f.name) for f in dataclasses.fields(cls)})


#: Where each flag lands in a Job: section (None: the Job itself) and field name.
_JOB_FIELDS: dict[str, tuple[str | None, str]] = {
    "gpus": ("parallel", "world_size"),
    "dp": ("parallel", "dp"),
    "tp": ("parallel", "tp"),
    "pp": ("parallel", "pp"),
    "vpp": ("parallel", "vpp"),
    "cp": ("parallel", "cp"),
    "ep": ("parallel", "ep"),
    "etp": ("parallel", "etp"),
    "sequence_parallel": ("parallel", "sequence_parallel"),
    "first_stage_layers": ("parallel", "first_stage_layers"),
    "last_stage_layers": ("parallel", "last_stage_layers"),
    "zero": ("sharding", "zero"),
    "fsdp": ("sharding", "fsdp"),
    "fsdp_shard_size": ("sharding", "fsdp_shard_size"),
    "distributed_optimizer": ("sharding", "distributed_optimizer"),
    "mbs": ("batch", "micro_batch_size"),
    "gbs": ("batch", "global_batch_size"),
    "seq": ("batch", "seq_length"),
    "precision": ("precision", "name"),
    "grad_dtype": ("precision", "grad_dtype"),
    "optimizer_state_dtype": ("precision", "optimizer_state_dtype"),
    "master_dtype": ("precision", "master_dtype"),
    "optimizer": ("optimizer", "name"),
    "momentum": ("optimizer", "momentum"),
    "optimizer_impl": ("optimizer", "implementation"),
    "recompute": ("recompute", "mode"),
    "recompute_method": ("recompute", "method"),
    "recompute_layers": ("recompute", "num_layers"),
    "attention": (None, "attention"),
    "dropout": (None, "dropout"),
    "loss": (None, "loss"),
    "framework": (None, "framework"),
    "make_vocab_size_divisible_by": (None, "vocab_divisible_by"),
    "mtp_layers": (None, "mtp_layers"),
    "moe_imbalance": ("moe", "imbalance"),
    "capacity_factor": ("moe", "capacity_factor"),
    "pad_to_capacity": ("moe", "pad_to_capacity"),
    "moe_dispatcher": ("moe", "dispatcher"),
    "shared_expert_parallel": ("moe", "shared_expert_parallel"),
    "fp8": ("precision", "fp8"),
    "fp8_params": ("precision", "fp8_params"),
    "offload_optimizer": ("offload", "optimizer"),
    "optimizer_offload_fraction": ("offload", "optimizer_fraction"),
    "offload_params": ("offload", "params"),
    "offload_activations": ("offload", "activations"),
}
#: Changing any of these re-derives dp unless --dp is given too.
_LAYOUT_FIELDS = frozenset({"world_size", "tp", "pp", "cp"})


def build_job(options: "JobOptions", base: "Job | None" = None) -> "Job":
    """``base`` (default: ``Job()``) with every flag that was given replaced; validates the result.

    Raises :class:`~memplan.errors.JobConfigError` naming the flag when a value is invalid.
    """
    from memplan.job import Job

    base = base or Job()
    changes: dict[str | None, dict[str, Any]] = {}
    for flag, (section, name) in _JOB_FIELDS.items():
        value = getattr(options, flag)
        if value is not None:
            changes.setdefault(section, {})[name] = value
    par = changes.get("parallel", {})
    if _LAYOUT_FIELDS & par.keys() and "dp" not in par:
        par["dp"] = None  # derived again from the new layout
    top = changes.pop(None, {})
    for section, values in changes.items():
        assert section is not None
        top[section] = dataclasses.replace(getattr(base, section), **values)
    return dataclasses.replace(base, **top) if top else base


def load_job_and_model(
    model: str | None,
    options: JobOptions,
    *,
    megatron_args: str | None = None,
    deepspeed_config: str | None = None,
) -> "tuple[ModelSpec, Job]":
    """The model and job a command describes: files give the base, explicit flags override it.

    ``--megatron-args`` yields both a model and a job; a MODEL given as well replaces its model.
    ``--deepspeed-config`` is applied to the job built so far, then the flags are applied again
    so that what the user typed wins over both files.
    """
    base: Job | None = None
    spec: ModelSpec | None = None
    if megatron_args is not None:
        load_megatron_args = _lazy("memplan.frameworks.megatron_args", "load_megatron_args", "--megatron-args")
        spec, base = load_megatron_args(megatron_args, gpus=options.gpus if options.gpus is not None else 1)
    if model is not None:
        from memplan.model import load_model

        spec = load_model(model)
    if spec is None:
        raise ConfigError("MODEL", "is required (a preset name or a config.json path) unless --megatron-args is given")
    job = build_job(options, base)
    if deepspeed_config is not None:
        apply = _lazy("memplan.frameworks.deepspeed_config", "apply_deepspeed_config", "--deepspeed-config")
        job = build_job(options, apply(deepspeed_config, job))
    return spec, job


def _lazy(module: str, name: str, flag: str) -> Any:
    """Import ``module.name`` on first use; a build without it gets a clear error, not a traceback."""
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        raise UnsupportedError(f"{flag} is not available in this build of memplan ({module} is missing)") from None


# --------------------------------------------------------------------------------------------
# Option declarations (typer reads the help from here; defaults are the Job's defaults).

_PAR, _SHARD, _BATCH, _PREC = "Parallelism", "Sharding", "Batch", "Precision and optimizer"
_ACT, _OUT = "Activations and loss", "Inputs and output"
_MOE, _OFF = "MoE and multi-token prediction", "FP8 and offload"


def _opt(*names: str, help: str, panel: str, metavar: str | None = None) -> Any:
    return typer.Option(*names, help=help, rich_help_panel=panel, metavar=metavar, show_default=False)


OptInt = int | None
OptStr = str | None
OptFloat = float | None
OptBool = bool | None

_ESTIMATE_EPILOG = """\
Examples:

  memplan estimate llama-3.1-8b --gpus 8 --gpu h100-80gb

  memplan estimate llama-3.1-70b --gpus 64 --tp 8 --pp 4 --distributed-optimizer --gbs 512

  memplan estimate path/to/config.json --framework torchtitan --fsdp full --gpus 16

  memplan estimate --megatron-args train_args.sh --gpus 128 --json

  memplan estimate mistral-7b --gpus 8 --deepspeed-config ds_config.json --explain

  memplan estimate --job llama-70b.yaml --seq 16384 --save-job llama-70b-16k.yaml

  memplan estimate deepseek-v3 --gpus 1024 --tp 2 --pp 16 --ep 8 --fp8 hybrid --mtp-layers 1

All sizes are GiB = 2^30 bytes. Exit codes: 0 ok, 1 unsupported input, 2 invalid input.
"""


@app.command("estimate", cls=_Command, epilog=_ESTIMATE_EPILOG)
def estimate_command(
    model: Annotated[OptStr, typer.Argument(
        help="Preset name (see `memplan models`) or path to a Hugging Face config.json / its folder. "
        "Optional with --megatron-args.", show_default=False, metavar="MODEL")] = None,
    gpus: Annotated[OptInt, _opt("--gpus", help="Total GPUs (world size). (default: 1)", panel=_PAR)] = None,
    dp: Annotated[OptInt, _opt("--dp", help="Data-parallel size. (default: gpus / (tp*pp*cp))", panel=_PAR)] = None,
    tp: Annotated[OptInt, _opt("--tp", help="Tensor-parallel size. (default: 1)", panel=_PAR)] = None,
    pp: Annotated[OptInt, _opt("--pp", help="Pipeline-parallel size. (default: 1)", panel=_PAR)] = None,
    vpp: Annotated[OptInt, _opt("--vpp", help="Virtual pipeline stages per rank (interleaved 1F1B). (default: 1)", panel=_PAR)] = None,
    cp: Annotated[OptInt, _opt("--cp", help="Context-parallel size. (default: 1)", panel=_PAR)] = None,
    ep: Annotated[OptInt, _opt("--ep", help="Expert-parallel size (MoE). (default: 1)", panel=_PAR)] = None,
    etp: Annotated[OptInt, _opt("--etp", help="Expert tensor-parallel size. (default: 1)", panel=_PAR)] = None,
    sequence_parallel: Annotated[OptBool, _opt("--sequence-parallel/--no-sequence-parallel", help="Megatron sequence parallelism (needs tp > 1).", panel=_PAR)] = None,
    first_stage_layers: Annotated[OptInt, _opt("--first-stage-layers", help="Decoder layers on the first pipeline stage (uneven split).", panel=_PAR)] = None,
    last_stage_layers: Annotated[OptInt, _opt("--last-stage-layers", help="Decoder layers on the last pipeline stage (uneven split).", panel=_PAR)] = None,
    zero: Annotated[OptInt, _opt("--zero", help="ZeRO stage 0-3. (default: 0)", panel=_SHARD)] = None,
    fsdp: Annotated[OptStr, _opt("--fsdp", help="FSDP sharding: none|full|hybrid. (default: none)", panel=_SHARD)] = None,
    fsdp_shard_size: Annotated[OptInt, _opt("--fsdp-shard-size", help="GPUs per hybrid-shard group. (default: min(dp, 8))", panel=_SHARD)] = None,
    distributed_optimizer: Annotated[OptBool, _opt("--distributed-optimizer/--no-distributed-optimizer", help="Megatron distributed optimizer (shards master weights and moments over DP).", panel=_SHARD)] = None,
    mbs: Annotated[OptInt, _opt("--mbs", help="Micro-batch size (sequences per GPU per micro-batch). (default: 1)", panel=_BATCH)] = None,
    gbs: Annotated[OptInt, _opt("--gbs", help="Global batch size; sets the micro-batches per step (pipeline in-flight count). (default: mbs*dp)", panel=_BATCH)] = None,
    seq: Annotated[OptInt, _opt("--seq", help="Sequence length in tokens. (default: 4096)", panel=_BATCH)] = None,
    precision: Annotated[OptStr, _opt("--precision", help="fp32|bf16|fp16|bf16-mixed|fp16-mixed. (default: bf16-mixed)", panel=_PREC)] = None,
    grad_dtype: Annotated[OptStr, _opt("--grad-dtype", help="Gradient dtype override (fp32, bf16, ...). (default: framework's)", panel=_PREC)] = None,
    optimizer_state_dtype: Annotated[OptStr, _opt("--optimizer-state-dtype", help="Optimizer-moment dtype override.", panel=_PREC)] = None,
    master_dtype: Annotated[OptStr, _opt("--master-dtype", help="Master-weight dtype override.", panel=_PREC)] = None,
    optimizer: Annotated[OptStr, _opt("--optimizer", help="adamw|adam|sgd|adafactor|adam8bit. (default: adamw)", panel=_PREC)] = None,
    momentum: Annotated[OptFloat, _opt("--momentum", help="SGD momentum; 0 keeps no buffer. (default: 0)", panel=_PREC)] = None,
    optimizer_impl: Annotated[OptStr, _opt("--optimizer-impl", help="auto|foreach|fused|for-loop. (default: auto)", panel=_PREC)] = None,
    recompute: Annotated[OptStr, _opt("--recompute", help="Activation recompute: none|selective|full. (default: none)", panel=_ACT)] = None,
    recompute_method: Annotated[OptStr, _opt("--recompute-method", help="Full recompute method: uniform|block. (default: uniform)", panel=_ACT)] = None,
    recompute_layers: Annotated[OptInt, _opt("--recompute-layers", help="Layers per group (uniform) or per stage (block).", panel=_ACT)] = None,
    attention: Annotated[OptStr, _opt("--attention", help="flash|sdpa|eager. (default: flash)", panel=_ACT)] = None,
    dropout: Annotated[OptFloat, _opt("--dropout", help="Dropout probability (masks are kept). (default: 0)", panel=_ACT, metavar="P")] = None,
    loss: Annotated[OptStr, _opt("--loss", help="auto|fp32-logits|vocab-parallel|fused|chunked. (default: auto)", panel=_ACT)] = None,
    framework: Annotated[OptStr, _opt("--framework", help="megatron|torchtitan|deepspeed|hf. (default: megatron)", panel=_ACT)] = None,
    make_vocab_size_divisible_by: Annotated[OptInt, _opt("--make-vocab-size-divisible-by", help="Pad the vocabulary to a multiple of this x tp. (default: framework's)", panel=_ACT)] = None,
    mtp_layers: Annotated[OptInt, _opt("--mtp-layers", help="Multi-token-prediction modules trained on the last stage (DeepSeek-V3: 1). (default: 0)", panel=_MOE)] = None,
    moe_imbalance: Annotated[OptFloat, _opt("--moe-imbalance", help="Tokens of the busiest expert over the mean (1 = balanced). (default: 1)", panel=_MOE, metavar="F")] = None,
    capacity_factor: Annotated[OptFloat, _opt("--capacity-factor", help="Expert capacity as a multiple of the mean; tokens beyond are dropped. (default: none)", panel=_MOE, metavar="F")] = None,
    pad_to_capacity: Annotated[OptBool, _opt("--pad-to-capacity/--no-pad-to-capacity", help="Pad every expert's input to its capacity.", panel=_MOE)] = None,
    moe_dispatcher: Annotated[OptStr, _opt("--moe-dispatcher", help="Token dispatcher: alltoall|allgather|flex. (default: alltoall)", panel=_MOE)] = None,
    shared_expert_parallel: Annotated[OptStr, _opt("--shared-expert-parallel", help="Shared experts split like dense weights (tp) or placed with the routed experts (expert). (default: tp)", panel=_MOE)] = None,
    fp8: Annotated[OptStr, _opt("--fp8", help="FP8 training of linear layers (Transformer Engine): hybrid|e4m3. (default: off)", panel=_OFF)] = None,
    fp8_params: Annotated[OptBool, _opt("--fp8-params/--no-fp8-params", help="Keep the weights themselves in FP8 (Megatron --fp8-param-gather).", panel=_OFF)] = None,
    offload_optimizer: Annotated[OptBool, _opt("--offload-optimizer/--no-offload-optimizer", help="Master weights and optimizer moments in CPU memory (ZeRO-Offload, FSDP CPU offload).", panel=_OFF)] = None,
    optimizer_offload_fraction: Annotated[OptFloat, _opt("--optimizer-offload-fraction", help="Fraction of the optimizer state offloaded. (default: 1)", panel=_OFF, metavar="F")] = None,
    offload_params: Annotated[OptBool, _opt("--offload-params/--no-offload-params", help="Sharded weights in CPU memory (ZeRO-3 / FSDP only).", panel=_OFF)] = None,
    offload_activations: Annotated[OptBool, _opt("--offload-activations/--no-offload-activations", help="Saved activations stream to CPU memory between forward and backward.", panel=_OFF)] = None,
    gpu: Annotated[OptStr, _opt("--gpu", help="GPU to check the fit against (see `memplan gpus`).", panel=_OUT, metavar="NAME")] = None,
    fragmentation: Annotated[OptFloat, _opt("--fragmentation", help="Assumed allocator fragmentation fraction. (default: 0.10)", panel=_OUT, metavar="F")] = None,
    megatron_args: Annotated[OptStr, _opt("--megatron-args", help="File with a Megatron-LM launch command line or args mapping.", panel=_OUT, metavar="FILE")] = None,
    deepspeed_config: Annotated[OptStr, _opt("--deepspeed-config", help="DeepSpeed JSON config applied to the job.", panel=_OUT, metavar="FILE")] = None,
    explain: Annotated[bool, _opt("--explain", help="Also print the numbered assumptions.", panel=_OUT)] = False,
    json_output: Annotated[bool, _opt("--json", help="Print Estimate.to_dict() as JSON (nothing else on stdout).", panel=_OUT)] = False,
    job_file: Annotated[OptStr, _opt("--job", help="YAML/JSON job file whose fields are these flags' names (flags typed here win).", panel=_OUT, metavar="FILE")] = None,
    save_job: Annotated[OptStr, _opt("--save-job", help="Write the resolved job as a YAML/JSON job file.", panel=_OUT, metavar="FILE")] = None,
) -> None:
    """Estimate the per-GPU peak memory of training MODEL, for every pipeline stage.

    Prints a table per pipeline stage (GiB = 2^30 bytes): parameters, gradients, optimizer
    states, activations, logits, buffers, peak allocated and predicted reserved memory.
    """
    given = {k: v for k, v in locals().items()
             if v is not None and k not in ("explain", "json_output", "job_file", "save_job")}
    with handle_errors():
        from memplan.estimate.engine import DEFAULT_FRAGMENTATION, estimate

        values = dict(given)
        if job_file is not None:
            from memplan.jobfile import load_job_file

            values = {**load_job_file(job_file, overrides=given), **given}
        options = JobOptions.from_mapping(values)
        model, gpu, fragmentation = values.get("model"), values.get("gpu"), values.get("fragmentation")
        megatron_args, deepspeed_config = values.get("megatron_args"), values.get("deepspeed_config")
        spec, job = load_job_and_model(model, options, megatron_args=megatron_args, deepspeed_config=deepspeed_config)
        gpu_spec = None
        if gpu is not None:
            from memplan.gpus import get_gpu

            gpu_spec = get_gpu(gpu)
        frag = DEFAULT_FRAGMENTATION if fragmentation is None else fragmentation
        result = estimate(spec, job, gpu=gpu_spec, fragmentation=frag)
        if save_job is not None:
            from memplan.jobfile import dump_job_file

            for name in dump_job_file(model, job, save_job, gpu=gpu, fragmentation=fragmentation,
                                      megatron_args=megatron_args, deepspeed_config=deepspeed_config):
                typer.secho(f"warning: --save-job: {name} has no flag and was not written", fg="yellow", err=True)
    if json_output:
        _print_json(result.to_dict())
        return
    from memplan.report.text import render_estimate

    _print(render_estimate(result, explain=explain))


@app.command("models", cls=_Command, epilog="Examples:\n\n  memplan models\n\n  memplan models --json")
def models_command(
    json_output: Annotated[bool, typer.Option("--json", help="Print the list as JSON.")] = False,
) -> None:
    """List the shipped model presets (name, type, parameters, layers, hidden size, MoE)."""
    with handle_errors():
        from memplan.model import list_presets

        presets = list_presets()
    if json_output:
        _print_json([dataclasses.asdict(p) for p in presets])
        return
    from memplan.report.text import presets_table

    _print(presets_table(presets))


@app.command("gpus", cls=_Command, epilog="Examples:\n\n  memplan gpus\n\n  memplan gpus --json")
def gpus_command(
    json_output: Annotated[bool, typer.Option("--json", help="Print the catalogue as JSON.")] = False,
) -> None:
    """List the GPU catalogue: memory the driver reports and what PyTorch's allocator can use."""
    from memplan.gpus import list_gpus

    gpus = list_gpus()
    if json_output:
        _print_json([{**dataclasses.asdict(g), "usable_bytes": g.usable_bytes} for g in gpus])
        return
    from memplan.report.text import gpus_table

    _print(gpus_table(gpus))


def _version(value: bool) -> None:
    if value:
        from memplan import __version__

        typer.echo(f"memplan {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
) -> None:
    """memplan: how much GPU memory a training job needs, where it goes, and how to make it fit."""


#: Modules under :mod:`memplan.commands` that register further commands on :data:`app` when
#: imported. Each must import nothing heavy (torch, numpy, matplotlib) at module level.
COMMAND_MODULES: tuple[str, ...] = ("alloc", "ckpt", "fit", "report", "trace")


def _register_commands() -> None:
    import importlib

    for name in COMMAND_MODULES:
        importlib.import_module(f"memplan.commands.{name}")


_register_commands()


def main() -> None:
    """Console-script entry point (``memplan``)."""
    app(prog_name="memplan")
