"""Apply a torchtitan training TOML (``--job.config_file``) to a Job.

``--torchtitan-config FILE.toml`` reads the TOML torchtitan's ``ConfigManager`` reads (the
``JobConfig`` of ``torchtitan/config/job_config.py``, up to commit 238fa99, after which torchtitan
moved to Python config registries). Fields the file leaves out take torchtitan's defaults, as
torchtitan does (``activation_checkpoint.mode = "selective"`` with ``selective_ac_option = "2"``,
``data_parallel_shard_degree = -1``, ``local_batch_size = 8``...).

Mapped: ``[model] name`` / ``flavor`` → the preset with the same shapes when MODEL is not given
(:data:`~memplan.frameworks.torchtitan_fields.PRESETS`); the parallel degrees → ``--gpus`` (``-1``
takes the GPUs left over after replicate x cp x tp x pp, as torchtitan's ``ParallelDims`` does),
``--tp`` (with sequence parallel, which torchtitan's TP plan always applies), ``--pp``, ``--cp``,
``--ep``, ``--etp`` and FSDP over ``data_parallel_shard_degree x context_parallel_degree`` (``--fsdp
full``, or ``hybrid`` with ``data_parallel_replicate_degree > 1``); the pipeline split of
``generate_llm_fqn_per_model_part`` (``pipeline_parallel_first/last_stage_less_layers``,
``pipeline_parallel_layers_per_stage``, two stages per rank for looped schedules) → the per-chunk
layer counts; ``local_batch_size`` → ``--mbs`` (``pipeline_parallel_microbatch_size`` under PP) and
``global_batch_size`` → ``--gbs``; ``seq_len``; ``dtype`` / ``mixed_precision_param`` →
``--precision``; ``enable_cpu_offload`` → FSDP CPU offload; the optimizer; activation
checkpointing (``full``, ``selective`` with ``"op"`` → ``--recompute selective``, with an integer N
→ full recompute of every N-th layer, priced as ``--recompute-method block``: the same number of
checkpointed layers per stage); ``model.converters`` float8 → ``--fp8``. Every field is classified
(:class:`~memplan.settings.InputSetting`); the framework is ``torchtitan``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from memplan.errors import ConfigError, MissingDependencyError
from memplan.frameworks.torchtitan_fields import (
    NO_MEMORY_EFFECT,
    PRESETS,
    field_defaults,
    field_list,
    flavors,
    torchtitan_commit,
)
from memplan.job import Job
from memplan.jobflags import build_job
from memplan.model.spec import ModelSpec
from memplan.optimizers import by_dialect
from memplan.profiles.partial_recompute import every_nth, rank_layers
from memplan.profiles.pipeline_split import weighted_split
from memplan.settings import InputSetting, dotted_leaves
from memplan.textfile import read_text_file

__all__ = ["apply_torchtitan_config", "read_torchtitan_config", "stage_layers", "torchtitan_model"]

_FLAG = "--torchtitan-config"
_SINGLE_STAGE = ("1f1b", "gpipe")
_MULTI_STAGE = ("interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev")
_FLOAT8 = ("float8", "quantize.linear.float8")


def read_torchtitan_config(path: str | Path) -> dict[str, Any]:
    """The TOML file at ``path`` as ``{"section.key": value}`` (nested tables joined with dots)."""
    text = read_text_file(path, field=_FLAG)
    toml = _toml()
    try:
        data = toml.loads(text)
    except toml.TOMLDecodeError as exc:
        found = re.search(r"\(at line (\d+), column (\d+)\)", str(exc))
        where = f"line {found.group(1)}, column {found.group(2)}" if found else "?"
        message = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(exc)) or "syntax error"
        raise ConfigError(f"{_FLAG} {path}", f"is not valid TOML at {where}: {message}") from None
    except RecursionError:
        raise ConfigError(f"{_FLAG} {path}", "nests arrays or tables too deeply to read (memplan's limit "
                          "MAX_NESTING)") from None
    return dict(dotted_leaves(data))


def _toml() -> Any:
    """The standard library's TOML reader (Python 3.11+), or tomli (its backport) on Python 3.10."""
    try:
        import tomllib

        return tomllib
    except ModuleNotFoundError:
        try:
            import tomli  # type: ignore[import-not-found]

            return tomli
        except ModuleNotFoundError:
            raise MissingDependencyError("tomli", feature=f"{_FLAG} on Python 3.10", extra="torchtitan") from None


def torchtitan_model(path: str | Path) -> str:
    """The memplan preset of the file's ``[model] name`` / ``flavor`` (used when MODEL is not given)."""
    config = read_torchtitan_config(path)
    defaults = field_defaults()
    name = config.get("model.name", defaults["model.name"])
    flavor = config.get("model.flavor", defaults["model.flavor"])
    known = flavors()
    if name not in known:
        raise ConfigError(f"{_FLAG}: model.name", f"is not a torchtitan model (known: {', '.join(sorted(known))})",
                          name)
    if flavor not in known[name]:
        raise ConfigError(f"{_FLAG}: model.flavor", f"is not a flavor of torchtitan's {name} "
                          f"(known: {', '.join(known[name])})", flavor)
    preset = PRESETS.get((name, flavor))
    if preset is None:
        have = [f for f in known[name] if (name, f) in PRESETS]
        raise ConfigError(f"{_FLAG}: model.flavor", f"{name} {flavor} has no memplan preset with its shapes "
                          f"(those with one: {', '.join(have) or 'none'}); give MODEL (a preset or config.json)",
                          flavor)
    return preset


class _Reader:
    """The file's values over torchtitan's defaults; collects job flags and one setting per field."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = config
        self.defaults = field_defaults()
        self.flags: dict[str, Any] = {"framework": "torchtitan"}
        self.settings: dict[str, InputSetting] = {}

    def get(self, key: str) -> Any:
        return self.config.get(key, self.defaults.get(key))

    def mark(self, key: str, effect: str, note: str) -> None:
        """Classify ``key``; a default that shaped the job is reported too, marked as such."""
        given = key in self.config
        if not given and effect != "modelled":
            return
        self.settings[key] = InputSetting(source=_FLAG, key=key, value=self.get(key), effect=effect,  # type: ignore[arg-type]
                                          note=note if given else f"{note} (torchtitan's default)")

    def degree(self, key: str, *, auto: bool = False) -> int:
        value = self.get(key)
        ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 1 or (auto and value == -1))
        if not ok:
            rule = "must be -1 (the GPUs left over) or a positive integer" if auto else "must be a positive integer"
            raise ConfigError(f"{_FLAG}: {key}", rule, value)
        return int(value)

    def error(self, key: str, rule: str) -> ConfigError:
        return ConfigError(f"{_FLAG}: {key}", rule, self.get(key))


def apply_torchtitan_config(path: str | Path, job: Job, *, model: ModelSpec, model_given: bool,
                            typed: Mapping[str, Any] | None = None) -> tuple[Job, tuple[InputSetting, ...]]:
    """``job`` with the settings of the torchtitan TOML at ``path``, and what each field did.

    ``model`` is the model the job trains (its layer count decides the pipeline split and which
    layers per-layer checkpointing wraps); ``model_given``: MODEL was typed, so ``[model]`` does not
    name it; ``typed``: the flags given beside the file (they win later): ``gpus``, which
    ``data_parallel_shard_degree = -1`` fills, and ``tp``/``pp``/``cp``, which replace the file's
    degrees before the -1 is resolved, so that the batch and FSDP group follow them as in torchtitan.
    """
    config = read_torchtitan_config(path)
    if not model_given:
        torchtitan_model(path)  # the same checks that chose the preset
    r = _Reader(config)
    _model(r, model_given)
    typed = typed or {}
    dp, pp = _parallel(r, typed, job.parallel.world_size)
    chunks = _pipeline(r, model.num_layers, pp)
    _batch(r, dp, pp)
    _precision(r)
    _optimizer(r)
    _recompute(r, chunks, pp, model.num_layers)
    _compile(r)
    _unmodelled_switches(r)
    try:
        # torchtitan runs its own model code (memplan.frameworks.model_code)
        out = replace(build_job(r.flags, job), torchtitan_model=True)
        if chunks is not None:
            out = replace(out, parallel=replace(out.parallel, chunk_layers=chunks, vpp=len(chunks) // pp))
    except ConfigError as exc:
        raise ConfigError(f"{_FLAG}: {exc.field}", exc.rule, exc.value) from None
    known = set(field_list())
    for key, value in config.items():
        if key in r.settings:
            continue
        if key in NO_MEMORY_EFFECT:
            r.settings[key] = InputSetting(source=_FLAG, key=key, value=value, effect="no-memory-effect",
                                           note=NO_MEMORY_EFFECT[key])
        elif key not in known:
            r.settings[key] = InputSetting(source=_FLAG, key=key, value=value, effect="not-modelled",
                                           note=f"not a field of torchtitan's JobConfig at {torchtitan_commit()[:7]}")
        else:  # a JobConfig field no table or mapping covers: say so rather than guess
            r.settings[key] = InputSetting(source=_FLAG, key=key, value=value, effect="not-modelled",
                                           note="memplan does not read this field")
    order = [k for k in config if k in r.settings] + [k for k in r.settings if k not in config]
    return out, tuple(r.settings[k] for k in order)


def _model(r: _Reader, model_given: bool) -> None:
    for key in ("model.name", "model.flavor"):
        if model_given:
            r.mark(key, "no-memory-effect", "MODEL names the model")
        else:
            r.mark(key, "modelled", f"the preset of {r.get('model.name')} {r.get('model.flavor')}")
    converters = r.get("model.converters") or []
    if not isinstance(converters, list):
        raise r.error("model.converters", "must be a list of converter names")
    fp8 = [c for c in converters if c in _FLOAT8]
    other = [c for c in converters if c not in _FLOAT8]
    if fp8:
        r.flags["fp8"] = "hybrid"
    if other:
        r.mark("model.converters", "not-modelled", f"{', '.join(map(str, other))} not modelled"
               + ("; float8 → --fp8 hybrid" if fp8 else ""))
    elif fp8:
        r.mark("model.converters", "modelled", "--fp8 hybrid (torchao Float8Linear priced as memplan's FP8 linear "
               "layers: 16-bit weights plus FP8 copies per step)")
    else:
        r.mark("model.converters", "no-memory-effect", "no converter")
    fsdp_fp8 = "quantize.linear.float8.enable_fsdp_float8_all_gather"
    r.mark(fsdp_fp8, "not-modelled" if r.get(fsdp_fp8) else "no-memory-effect",
           "FP8 all-gathers shrink the unsharded weights; memplan gathers 16 bits" if r.get(fsdp_fp8) else "off")
    for key in ("quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
                "quantize.linear.float8.recipe_name", "quantize.linear.float8.filter_fqns",
                "quantize.linear.float8.emulate"):
        r.mark(key, "no-memory-effect",
               "float8 recipe detail (scales are per tensor or per row)" if fp8 else "no float8 converter")


def _parallel(r: _Reader, typed: Mapping[str, Any], base_world: int) -> tuple[int, int]:
    """Resolve the degrees as torchtitan's ``ParallelDims`` does against ``--gpus`` (else the base
    job's GPU count); typed ``--tp/--pp/--cp`` replace the file's. Returns (dp, pp)."""
    p = "parallelism."
    gpus = typed.get("gpus")
    rep = r.degree(p + "data_parallel_replicate_degree")
    shard = r.degree(p + "data_parallel_shard_degree", auto=True)
    cp, tp, pp = (typed[flag] if isinstance(typed.get(flag), int) else r.degree(p + key)
                  for flag, key in (("cp", "context_parallel_degree"), ("tp", "tensor_parallel_degree"),
                                    ("pp", "pipeline_parallel_degree")))
    ep, etp = r.degree(p + "expert_parallel_degree"), r.degree(p + "expert_tensor_parallel_degree")
    others = rep * cp * tp * pp
    world_hint = gpus or base_world
    if shard == -1:
        if world_hint % others:
            raise r.error(p + "data_parallel_shard_degree", f"-1 takes the GPUs left over after replicate x cp x tp "
                          f"x pp = {others}, which must divide --gpus {world_hint}"
                          + ("" if gpus else " (give --gpus: torchtitan reads the world size from the launcher)"))
        shard = world_hint // others
        note = f"{shard} (the GPUs left over of --gpus {world_hint})"
    else:
        note = str(shard)
        if gpus is not None and shard * others != gpus:
            raise r.error(p + "data_parallel_shard_degree", f"replicate x shard x cp x tp x pp = {shard * others} "
                          f"must equal --gpus {world_hint}")
    world, group = shard * others, shard * cp
    r.flags.update(gpus=world, tp=tp, pp=pp, cp=cp)
    if group > 1:
        r.flags["fsdp"] = "hybrid" if rep > 1 else "full"
        if rep > 1:
            r.flags["fsdp_shard_size"] = group
    else:
        r.flags["fsdp"] = "none"
    mode = f"--fsdp {r.flags['fsdp']}" + (f" --fsdp-shard-size {group}" if rep > 1 and group > 1 else "")
    r.mark(p + "data_parallel_shard_degree", "modelled", f"{note}; FSDP over shard x cp = {group} GPUs: {mode}")
    r.mark(p + "data_parallel_replicate_degree", "modelled", f"--gpus {world}" + (" (HSDP)" if rep > 1 else ""))
    r.mark(p + "context_parallel_degree", "modelled", f"--cp {cp}")
    r.flags["sequence_parallel"] = tp > 1
    r.mark(p + "tensor_parallel_degree", "modelled", f"--tp {tp}" + (" with sequence parallel" if tp > 1 else ""))
    r.mark(p + "pipeline_parallel_degree", "modelled", f"--pp {pp}")
    if ep > 1:
        if etp not in (1, tp):
            raise r.error(p + "expert_tensor_parallel_degree", f"must be 1 or tensor_parallel_degree ({tp})")
        r.flags.update(ep=ep, etp=etp)
    r.mark(p + "expert_parallel_degree", "modelled", f"--ep {ep}")
    r.mark(p + "expert_tensor_parallel_degree", "modelled" if ep > 1 else "no-memory-effect",
           f"--etp {etp}" if ep > 1 else "no effect without expert parallelism")
    reshard = r.get(p + "fsdp_reshard_after_forward")
    if reshard not in ("default", "always", "never"):
        raise r.error(p + "fsdp_reshard_after_forward", "must be default, always or never")
    if group == 1:
        r.mark(p + "fsdp_reshard_after_forward", "no-memory-effect", "no FSDP")
    else:
        effect, note = _reshard_effect(reshard, pp)
        r.mark(p + "fsdp_reshard_after_forward", effect, note)
    for key, bad, note in (
        ("disable_loss_parallel", True, "loss on full-vocabulary logits; memplan prices TP's vocab-parallel loss"),
        ("enable_async_tensor_parallel", True, "async TP (compiled) buffers are not modelled"),
        ("expert_parallel_comm_backend", "deepep", "DeepEP buffers are not modelled"),
    ):
        on = r.get(p + key) == bad
        r.mark(p + key, "not-modelled" if on else "no-memory-effect", note if on else "off / the default")
    r.mark(p + "context_parallel_rotate_method", "not-modelled" if cp > 1 else "no-memory-effect",
           "the K/V exchange buffers of CP attention are priced as memplan's ring attention" if cp > 1
           else "no context parallelism")
    for key in ("module_fqns_per_model_part", "pipeline_parallel_schedule_csv"):
        on = bool(r.get(p + key))
        r.mark(p + key, "not-modelled" if on else "no-memory-effect",
               "a hand-made split / schedule; memplan uses torchtitan's generated one" if on else "not set")
    return rep * shard, pp


def stage_layers(num_stages: int, num_layers: int, first_less: int, last_less: int) -> tuple[int, ...]:
    """Decoder layers of each pipeline stage as torchtitan's ``generate_llm_fqn_per_model_part``
    splits them (:func:`memplan.profiles.pipeline_split.weighted_split`): the embedding counts as
    ``first_less`` layers, norm + output as ``last_less``."""
    split = weighted_split(num_stages, num_layers, first_less, last_less)
    if split is None:
        raise ConfigError(f"{_FLAG}: parallelism.pipeline_parallel_degree",
                          f"{num_stages} stages cannot split {num_layers} layers (+{first_less} +{last_less} for "
                          "embedding and output) with at least one layer each", num_stages)
    return split


def _pipeline(r: _Reader, num_layers: int, pp: int) -> tuple[int, ...] | None:
    p = "parallelism."
    keys = ("pipeline_parallel_schedule", "pipeline_parallel_layers_per_stage",
            "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
            "pipeline_parallel_microbatch_size")
    if pp == 1:
        for key in keys:
            r.mark(p + key, "no-memory-effect", "no pipeline parallelism")
        return None
    schedule = str(r.get(p + "pipeline_parallel_schedule"))
    if schedule.lower() not in _SINGLE_STAGE + _MULTI_STAGE:
        raise r.error(p + "pipeline_parallel_schedule", "must be one of 1F1B, GPipe, Interleaved1F1B, LoopedBFS, "
                      "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV")
    single = schedule.lower() in _SINGLE_STAGE
    first, last = (_non_negative(r, p + k) for k in keys[2:4])
    per_stage = r.get(p + "pipeline_parallel_layers_per_stage")
    if per_stage is not None:
        if isinstance(per_stage, bool) or not isinstance(per_stage, int) or per_stage < 1:
            raise r.error(p + "pipeline_parallel_layers_per_stage", "must be a positive integer")
        stages = -(-(num_layers + first + last) // per_stage)
        per_rank = stages // pp
        if stages % pp or (single and per_rank != 1) or (not single and per_rank < 2):
            raise r.error(p + "pipeline_parallel_layers_per_stage", f"gives {stages} stages over pp {pp}: a "
                          f"{'single' if single else 'multi'}-stage schedule needs {'1' if single else '2 or more'} "
                          "per rank")
    else:
        stages = pp * (1 if single else 2)
    chunks = stage_layers(stages, num_layers, first, last)
    layout = f"{stages // pp} stage(s) per rank, layers per stage {list(chunks)}"
    if schedule.lower() in ("1f1b", "interleaved1f1b"):
        r.mark(p + "pipeline_parallel_schedule", "modelled", f"{schedule}: {layout}")
    else:
        r.mark(p + "pipeline_parallel_schedule", "not-modelled",
               f"{schedule} priced as {'1F1B' if single else 'interleaved 1F1B'} ({layout})"
               + ("; GPipe keeps every micro-batch's activations" if schedule.lower() == "gpipe" else ""))
    for key in keys[1:4]:
        r.mark(p + key, "modelled", layout)
    return chunks


def _non_negative(r: _Reader, key: str) -> int:
    value = r.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise r.error(key, "must be a non-negative integer")
    return value


def _batch(r: _Reader, dp: int, pp: int) -> None:
    t = "training."
    local = r.degree(t + "local_batch_size")
    seq = r.degree(t + "seq_len")
    glob = r.get(t + "global_batch_size")
    if isinstance(glob, bool) or not isinstance(glob, int) or (glob < 1 and glob != -1):
        raise r.error(t + "global_batch_size", "must be -1 (local x data-parallel) or a positive integer")
    if glob == -1:
        glob = local * dp
    elif glob % (local * dp):
        raise r.error(t + "global_batch_size", f"must be a multiple of local_batch_size x data-parallel degree = "
                      f"{local} x {dp}")
    mbs = local
    if pp > 1:
        mbs = r.degree("parallelism.pipeline_parallel_microbatch_size")
        if local % mbs:
            raise r.error("parallelism.pipeline_parallel_microbatch_size", f"must divide local_batch_size {local}")
        r.mark("parallelism.pipeline_parallel_microbatch_size", "modelled", f"--mbs {mbs}")
    r.flags.update(mbs=mbs, seq=seq, gbs=glob)
    r.mark(t + "local_batch_size", "modelled", f"--mbs {mbs}" if pp == 1 else
           f"{local // mbs} pipeline micro-batches of {mbs} per step")
    r.mark(t + "global_batch_size", "modelled", f"--gbs {glob} ({glob // (local * dp)} accumulation step(s))")
    r.mark(t + "seq_len", "modelled", f"--seq {seq}")


def _precision(r: _Reader) -> None:
    t = "training."
    dtype, param = r.get(t + "dtype"), r.get(t + "mixed_precision_param")
    if dtype not in ("bfloat16", "float32"):
        raise r.error(t + "dtype", "must be bfloat16 or float32")
    if param not in ("bfloat16", "float32"):
        raise r.error(t + "mixed_precision_param", "must be bfloat16 or float32")
    fsdp = r.flags["fsdp"] != "none"
    if dtype == "bfloat16":
        precision, note = "bf16", "--precision bf16 (weights, gradients and optimizer states in bf16)"
    elif param == "float32":
        precision, note = "fp32", "--precision fp32"
    else:
        # torchtitan's maybe_enable_amp: FSDP's MixedPrecisionPolicy, else torch.autocast, but nothing with
        # TP or PP and no FSDP: the torchtitan profile resolves it (FrameworkProfile.autocast_with_tp_or_pp)
        precision = "bf16-mixed"
        if fsdp:
            how = "FSDP MixedPrecisionPolicy"
        elif r.flags["tp"] > 1 or r.flags["pp"] > 1:
            how = "torchtitan applies none with TP or PP and no FSDP: fp32 activations"
        else:
            how = "torch.autocast"
        note = f"--precision bf16-mixed ({how})"
    r.flags["precision"] = precision
    r.mark(t + "dtype", "modelled", note)
    r.mark(t + "mixed_precision_param", "modelled" if dtype == "float32" else "no-memory-effect",
           note if dtype == "float32" else "no effect with dtype bfloat16")
    r.mark(t + "mixed_precision_reduce", "modelled", "fp32 gradient reduction (the torchtitan profile's)")
    if r.get(t + "enable_cpu_offload"):
        r.flags.update(offload_params=True, offload_optimizer=True)
        r.mark(t + "enable_cpu_offload", "modelled", "--offload-params --offload-optimizer (FSDP CPUOffloadPolicy)")
    else:
        r.mark(t + "enable_cpu_offload", "no-memory-effect", "off")


def _optimizer(r: _Reader) -> None:
    o = "optimizer."
    name = r.get(o + "name")
    kinds = by_dialect("torchtitan")
    if name in kinds:
        r.flags["optimizer"] = kinds[name].name
        r.mark(o + "name", "modelled", f"--optimizer {kinds[name].name}")
    else:
        r.mark(o + "name", "not-modelled", "torchtitan builds Adam and AdamW; priced as adamw")
    impl = r.get(o + "implementation")
    if impl not in ("for-loop", "foreach", "fused"):
        raise r.error(o + "implementation", "must be for-loop, foreach or fused")
    r.flags["optimizer_impl"] = impl
    r.mark(o + "implementation", "modelled", f"--optimizer-impl {impl}")
    if r.get(o + "early_step_in_backward"):
        r.flags["optimizer_in_backward"] = True
        r.mark(o + "early_step_in_backward", "modelled", "--optimizer-in-backward")
    else:
        r.mark(o + "early_step_in_backward", "no-memory-effect", "off")


def _recompute(r: _Reader, chunks: tuple[int, ...] | None, pp: int, num_layers: int) -> None:
    a = "activation_checkpoint."
    mode, option = r.get(a + "mode"), str(r.get(a + "selective_ac_option")).strip()
    if mode not in ("none", "selective", "full", "memory_budget"):
        raise r.error(a + "mode", "must be none, selective, full or memory_budget")
    r.mark(a + "memory_budget", "modelled" if mode == "memory_budget" else "no-memory-effect",
           "--memory-budget: an upper bound of what the compiler's partitioner keeps"
           if mode == "memory_budget" else "only with mode memory_budget")
    sac_shapes = a + "per_op_sac_force_recompute_mm_shapes_by_fqns"
    changed = r.get(sac_shapes) != r.defaults.get(sac_shapes)
    per_op = mode == "selective" and option == "op"
    r.mark(sac_shapes, "not-modelled" if per_op and changed else "no-memory-effect",
           "a changed per-op policy is priced as torchtitan's default one" if per_op and changed
           else "torchtitan's default per-op policy" if per_op else "only with per-op selective checkpointing")
    if mode == "memory_budget":
        if not (r.get("compile.enable") and "model" in (r.get("compile.components") or ())):
            raise r.error(a + "mode", "memory_budget needs compile.enable = true with \"model\" in "
                          "compile.components (torchtitan asserts the model is compiled)")
        r.flags.update(recompute="memory-budget", memory_budget=r.get(a + "memory_budget"))
        r.mark(a + "mode", "modelled", "--recompute memory-budget (torch.compile's partitioner; an upper bound)")
        r.mark(a + "selective_ac_option", "no-memory-effect", "no effect with mode memory_budget")
        return
    if mode == "none":
        r.flags["recompute"] = "none"
        r.mark(a + "mode", "modelled", "--recompute none")
        r.mark(a + "selective_ac_option", "no-memory-effect", "no effect with mode none")
        return
    if mode == "full":
        r.flags["recompute"] = "full"
        r.mark(a + "mode", "modelled", "--recompute full (every layer)")
        r.mark(a + "selective_ac_option", "no-memory-effect", "no effect with mode full")
        return
    if per_op:
        r.flags["recompute"] = "selective"
        r.mark(a + "mode", "modelled", "--recompute selective (torchtitan's per-op policy)")
        r.mark(a + "selective_ac_option", "modelled", "op: --recompute selective")
        return
    if not option.isdigit():
        raise r.error(a + "selective_ac_option", "must be 'op' or a non-negative integer (checkpoint every N-th layer)")
    _every_nth(r, int(option), chunks or (num_layers,), pp)


def _every_nth(r: _Reader, every: int, chunks: tuple[int, ...], pp: int) -> None:
    """torchtitan checkpoints layers N, 2N, ... of each rank (a process-wide counter over its layers;
    0 or 1: all); memplan's block method recomputes the first k layers of each stage: the same count."""
    a = "activation_checkpoint."
    per_rank = rank_layers(chunks, pp)
    counts = [every_nth(every, (layers,)) for layers in per_rank]
    k = every_nth(every, per_rank)
    note = f"{every}: every {every}-th layer fully checkpointed ({k} per stage)"
    r.mark(a + "mode", "modelled", "selective per layer: full recompute of some layers")
    if k == 0:
        r.flags["recompute"] = "none"
        r.mark(a + "selective_ac_option", "modelled", f"{every}: no layer checkpointed (fewer layers per stage)")
        return
    r.flags.update(recompute="full", recompute_method="block", recompute_layers=k)
    exact = len(set(counts)) == 1 and len(chunks) == pp
    r.mark(a + "selective_ac_option", "modelled" if exact else "not-modelled",
           f"{note}: --recompute full --recompute-method block --recompute-layers {k}" if exact
           else f"{note}: stages differ ({counts}); priced as {k} per stage")


def _compile(r: _Reader) -> None:
    """``[compile] enable`` with ``"model"`` in ``components``: ``--compile`` (torchtitan's ``apply_compile``
    compiles each transformer block on its own); ``"loss"`` among them: ``--compile-loss on``. A backend other
    than inductor is reported; the estimate says which compiled parts it prices as eager (``unmodelled_settings``)."""
    components = r.get("compile.components") or ()
    if not r.get("compile.enable"):
        for key in ("compile.enable", "compile.components", "compile.backend"):
            r.mark(key, "no-memory-effect", "off")
        return
    if "model" in components:
        r.flags["compile"] = True
        r.mark("compile.enable", "modelled", "--compile (each transformer block keeps what AOT autograd's "
               "min-cut partitioner saves)")
    else:
        r.mark("compile.enable", "no-memory-effect", "the model is not among compile.components")
    r.flags["compile_loss"] = "on" if "loss" in components else "off"
    r.mark("compile.components", "modelled", "the model's blocks and the loss (--compile-loss on: the 16-bit "
           "logits and two fp32 values per token)" if "loss" in components else
           "the model's blocks (--compile-loss off)")
    backend = r.get("compile.backend")
    r.mark("compile.backend", "modelled" if backend in (None, "inductor") else "not-modelled",
           "inductor's partitioner" if backend in (None, "inductor") else
           f"backend {backend!r}: memplan prices inductor's partitioner (min-cut)")


def _unmodelled_switches(r: _Reader) -> None:
    """Switches whose ``true`` changes memory in ways memplan does not price."""
    for key, note in (
        ("fault_tolerance.enable", "torchft's replica groups and extra state are not modelled"),
        ("validation.enable", "validation steps (no_grad forward, their own batch) are not priced"),
        ("experimental.custom_import", "custom code may change the model; not read"),
        ("experimental.custom_args_module", "custom arguments are not read"),
    ):
        r.mark(key, "not-modelled" if r.get(key) else "no-memory-effect", note if r.get(key) else "off")
    for key in ("quantize.grouped_mm.float8.fqns", "quantize.grouped_mm.mx.fqns"):
        r.mark(key, "not-modelled" if r.get(key) else "no-memory-effect",
               "quantized grouped GEMMs of MoE experts are not modelled" if r.get(key) else "none")
    for key in ("quantize.linear.mx.mxfp8_dim1_cast_kernel_choice", "quantize.linear.mx.recipe_name",
                "quantize.linear.mx.filter_fqns", "quantize.grouped_mm.mx.recipe_name"):
        r.mark(key, "no-memory-effect", "read with an mx converter (reported with model.converters)")



def _reshard_effect(reshard: str, pp: int) -> tuple[str, str]:
    """How memplan prices ``fsdp_reshard_after_forward`` (torchtitan's ``apply_fsdp``): under PP the
    default and ``never`` keep the stage unsharded for the whole step (memplan.estimate.pipeline_fsdp)."""
    if pp > 1 and reshard != "always":
        return "modelled", ("the stage's blocks stay unsharded for the whole step and their gradients "
                            "accumulate unsharded in the reduce dtype until the last micro-batch")
    if pp > 1:
        return "not-modelled", ("reshard after each forward under PP (gathered again per micro-batch); "
                                "memplan prices the default (kept unsharded for the whole step)")
    if reshard == "never":
        return "not-modelled", "parameters stay unsharded from forward to backward; memplan reshards after each block"
    return "modelled", "reshard after forward (memplan's FSDP)"
