"""What a trace runs: the :class:`~memplan.job.Job` (the same one ``memplan estimate`` reads) plus
:class:`RunSettings`, the few things only the tracer needs. No torch import.

:class:`TraceSetup` is a read-only view of the two: it declares no job field of its own, so a
traced job and an estimated job are the same object and every default lives in the Job and its
framework profile. The tracer runs the Hugging Face model the way the job's framework does:

* ``hf`` (the trace's framework when none is given) and ``torchtitan``: PyTorch modules;
  ``*-mixed`` is ``torch.autocast`` on one rank, FSDP2's ``MixedPrecisionPolicy`` with ``--fsdp``;
* ``flash`` and ``sdpa`` attention both run PyTorch SDPA (its flash kernel on CUDA);
* the optimizer implementation ``auto`` is the profile's (:func:`resolved_optimizer_impl`);
* ``deepspeed``: DeepSpeed's own activation checkpointing under ``--recompute full``
  (:mod:`memplan.trace.runners.ds_checkpoint`), without ZeRO or FSDP, in a precision the model runs in as is.

Job settings the tracer cannot execute (pipeline or context parallelism, ZeRO, FP8, offload,
Megatron-only options, ...) are refused by :func:`check_traceable` with the flag named — never
silently dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from memplan.errors import ConfigError
from memplan.job import Job, resolved_optimizer_impl
from memplan.jobflags import build_job, job_flags
from memplan.optimizers import optimizer_kind
from memplan.policies import ActivationPolicy, resolve_policy
from memplan.trace.runners.policies import check_runnable

__all__ = ["TRACE_FRAMEWORKS", "MoeRouting", "RunSettings", "TraceDevice", "TraceSetup", "check_traceable",
           "trace_setup"]

TraceDevice = Literal["cuda", "cpu"]
#: ``balanced``: replace data-dependent MoE routing by a static, evenly balanced assignment.
MoeRouting = Literal["error", "balanced"]
#: Frameworks whose training step the tracer runs (the others are estimated only).
TRACE_FRAMEWORKS = ("hf", "torchtitan", "deepspeed")
#: The trace's framework when the user gives none: a Hugging Face model in a plain PyTorch loop.
DEFAULT_TRACE_FRAMEWORK = "hf"

#: Job fields the tracer executes, as (section, field); every other field must keep its default.
_TRACED: frozenset[tuple[str | None, str]] = frozenset({
    ("parallel", "world_size"), ("parallel", "tp"), ("parallel", "dp"),
    ("sharding", "fsdp"), ("sharding", "fsdp_shard_size"),
    ("batch", "micro_batch_size"), ("batch", "seq_length"), ("batch", "global_batch_size"), ("batch", "packing"),
    ("precision", "name"),
    ("optimizer", "name"), ("optimizer", "momentum"), ("optimizer", "implementation"),
    ("optimizer", "in_backward"), ("optimizer", "galore_rank"), ("offload", "activations"),
    ("recompute", "mode"), ("recompute", "reentrant"), ("recompute", "modules"), ("recompute", "method"),
    ("recompute", "num_layers"), ("recompute", "partition_activations"), ("recompute", "cpu_checkpointing"),
    ("recompute", "contiguous_checkpoints"),
    ("finetune", "peft"), ("finetune", "lora_rank"), ("finetune", "lora_alpha"), ("finetune", "lora_dropout"),
    ("finetune", "lora_targets"), ("finetune", "lora_rank_pattern"), ("finetune", "rslora"),
    ("finetune", "trainable"), ("finetune", "modules_to_save"), ("finetune", "frozen_dtype"), ("finetune", "adapter_dtype"),
    ("finetune", "quantize_base"), ("finetune", "double_quant"), ("finetune", "quant_compute_dtype"),
    (None, "attention"), (None, "dropout"), (None, "attention_dropout"), (None, "framework"), (None, "loss"), (None, "compile"),
    (None, "compile_loss"),
})
#: Job fields torchtitan's own parallelize code executes under ``--torchtitan`` (its TP plan always
#: shards the sequence between the TP regions).
#: ``--torchtitan`` also runs torchtitan's pipelining (one stage, :mod:`memplan.trace.runners.torchtitan_pipeline`).
_TORCHTITAN_CODE: frozenset[tuple[str | None, str]] = frozenset({
    ("parallel", "sequence_parallel"), ("parallel", "pp"), ("parallel", "vpp"), ("parallel", "chunk_layers"),
    (None, "torchtitan_model")})
_RUN_FIELDS = ("device", "iterations", "moe_routing")
def _check_in(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(name, f"must be one of {', '.join(choices)}", value)


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """How the tracer runs a job; nothing here changes the job itself."""

    #: ``--device``: ``cuda`` accounts as the CUDA caching allocator would (512-byte rounding,
    #: step counters of non-fused optimizers on the host); ``cpu`` exactly as a CPU run allocates.
    device: TraceDevice = "cuda"
    #: ``--iterations``: training iterations to run (2: the second one has its optimizer states).
    iterations: int = 2
    #: ``--moe-routing``: what to do with data-dependent MoE routing under fake tensors.
    moe_routing: MoeRouting = "balanced"

    def __post_init__(self) -> None:
        _check_in("--device", self.device, get_args(TraceDevice))
        _check_in("--moe-routing", self.moe_routing, get_args(MoeRouting))
        if isinstance(self.iterations, bool) or not isinstance(self.iterations, int) or not 1 <= self.iterations <= 100:
            raise ConfigError("--iterations", "must be an integer in [1, 100]", self.iterations)


def _flag_name(section: str | None, name: str) -> str:
    for flag in job_flags():
        if (flag.section, flag.field) == (section, name):
            return flag.flag
    return f"{section}.{name}" if section else name


def check_traceable(job: Job, *, torchtitan_code: bool = False) -> None:
    """Refuse, naming the flag, any job setting the tracer cannot execute.

    ``torchtitan_code``: torchtitan's own parallelize code runs (``--torchtitan``), so its TP plan is traced."""
    if job.framework not in TRACE_FRAMEWORKS:
        raise ConfigError("--framework", "memplan trace runs PyTorch modules as hf (Trainer or a plain loop), "
                          "torchtitan or deepspeed (activation checkpointing) do; megatron jobs are estimated only "
                          "(memplan estimate)", job.framework)
    _check_deepspeed(job)
    _check_ranks(job, torchtitan_code=torchtitan_code)
    _check_compile(job, torchtitan_code=torchtitan_code)
    check_runnable(resolve_policy(job))
    default = Job()
    traced = _TRACED | _TORCHTITAN_CODE if torchtitan_code else _TRACED
    for section in (None, "parallel", "sharding", "batch", "precision", "optimizer", "recompute", "moe", "offload",
                    "finetune"):
        now, base = (getattr(job, section), getattr(default, section)) if section else (job, default)
        for name in vars(now):
            if (section, name) in traced or (section is None and hasattr(getattr(job, name), "__dataclass_fields__")):
                continue
            if (section, name) == ("parallel", "sequence_parallel") and not job.parallel.splits_sequence:
                continue  # at tp 1 there is nothing to split: the trace runs as without it (the estimate says so)
            if getattr(now, name) != getattr(base, name):
                raise ConfigError(_flag_name(section, name), "is not something memplan trace can run (it simulates "
                                  "FSDP and TP ranks of a PyTorch training step); estimate this job with memplan "
                                  "estimate", getattr(now, name))


#: What a ``--framework deepspeed`` trace runs: DeepSpeed's activation checkpointing on one rank.
_DEEPSPEED_POLICIES = ("none", "full")


def _check_deepspeed(job: Job) -> None:
    """A deepspeed trace runs ``deepspeed.checkpointing`` (:mod:`memplan.trace.runners.ds_checkpoint`) with ZeRO
    stage 0 (a default the loop below holds), no FSDP and a precision the model runs in as is; the
    switches act only there."""
    rc = job.recompute
    switches = [flag for flag, on in (("--partition-activations", rc.partition_activations),
                                      ("--cpu-checkpointing", rc.cpu_checkpointing)) if on]
    if job.framework != "deepspeed":
        if switches:
            raise ConfigError(switches[0], "is DeepSpeed activation checkpointing: trace it with --framework "
                              "deepspeed --recompute full", True)
        return
    policy = resolve_policy(job).name
    if policy not in _DEEPSPEED_POLICIES:
        raise ConfigError("--recompute", "memplan trace runs DeepSpeed's deepspeed.checkpointing on whole layers "
                          "(none or full); other deepspeed policies are estimated only", rc.mode)
    if switches and policy != "full":
        raise ConfigError(switches[0], "acts on the layers deepspeed.checkpointing wraps: use --recompute full",
                          True)
    finetune = job.finetune
    if finetune.partial:
        flag = "--peft" if finetune.peft_kind.adapters else ("--quantize-base" if finetune.quant_kind.quantizes
                                                         else "--trainable")
        raise ConfigError(flag, "fine-tuning is traced with --framework hf (a frozen embedding would leave "
                          "DeepSpeed's reentrant checkpoint without an input that requires grad)", True)
    if rc.reentrant:
        raise ConfigError("--checkpoint-reentrant", "is Hugging Face's use_reentrant; DeepSpeed's checkpoint is "
                          "an autograd.Function (reentrant) without that choice", True)
    if job.precision.name.endswith("-mixed"):
        raise ConfigError("--precision", "DeepSpeed's mixed precision keeps fp32 master weights inside its "
                          "optimizer, which memplan trace does not run; trace the same forward with "
                          f"--precision {job.precision.name.removesuffix('-mixed')}", job.precision.name)
    if job.sharding.fsdp != "none":
        raise ConfigError("--fsdp", "a deepspeed job shards with ZeRO, which memplan trace does not run; use "
                          "memplan estimate", job.sharding.fsdp)
    if rc.cpu_checkpointing and not rc.partition_activations:
        raise ConfigError("--cpu-checkpointing", "without --partition-activations DeepSpeed offloads with an "
                          "asynchronous engine on CUDA streams, which memplan trace does not run; add "
                          "--partition-activations or use memplan estimate", True)
    if job.offload.activations:
        raise ConfigError("--offload-activations", "is priced for deepspeed as layer-pipelined offloading, "
                          "which memplan trace does not run; use memplan estimate", True)


def _check_ranks(job: Job, *, torchtitan_code: bool = False) -> None:
    par, sharding = job.parallel, job.sharding
    if par.tp > 1 and job.framework == "torchtitan" and not torchtitan_code:
        raise ConfigError("--tp", "memplan trace applies Hugging Face's tensor-parallel plan; torchtitan's "
                          "(vocab-parallel embedding, sequence parallelism, loss parallelism) is estimated only: "
                          "trace it with --framework hf", par.tp)
    if sharding.fsdp == "hybrid" and par.data_parallel % sharding.hybrid_shard_size(par.data_parallel):
        raise ConfigError("--fsdp-shard-size", f"memplan trace simulates hybrid sharding over whole replicas: the shard "
                          f"group must divide the data-parallel size {par.data_parallel}",
                          sharding.hybrid_shard_size(par.data_parallel))
    if sharding.fsdp == "none" and par.data_parallel > 1:
        raise ConfigError("--gpus", f"memplan trace simulates FSDP and TP ranks: with --fsdp none the GPUs must "
                          f"equal --tp ({par.tp}); DDP replicas are estimated only", par.world_size)
    pipelined = torchtitan_code and par.pp > 1  # the schedule's micro-batches run in the step
    if not pipelined and job.batch.global_batch_size not in (None, job.batch.micro_batch_size * par.data_parallel):
        raise ConfigError("--gbs", "gradient accumulation is not traced: memplan trace runs one micro-batch per "
                          f"step (leave --gbs out or make it mbs*dp = {job.batch.micro_batch_size * par.data_parallel})",
                          job.batch.global_batch_size)
    if optimizer_kind(job.optimizer.name).build is None:
        raise ConfigError("--optimizer", optimizer_kind(job.optimizer.name).untraceable, job.optimizer.name)
    _check_finetune(job)
    if job.loss not in ("auto", "fp32-logits", "fused-linear", "chunked"):
        raise ConfigError("--loss", "memplan trace runs the model's own loss (fp32 logits), a fused linear "
                          "cross-entropy (fused-linear) or torchtune's chunked-output cross-entropy (chunked); other "
                          "loss paths are estimated only", job.loss)
    if job.loss == "fused-linear" and job.parallel.world_size > 1:
        raise ConfigError("--loss", "the fused linear cross-entropy is traced on one rank only", job.loss)
    if job.loss == "chunked" and (job.parallel.tp > 1 or job.parallel.pp > 1):
        raise ConfigError("--loss", "the chunked cross-entropy is traced on one rank or on FSDP ranks (no --tp or "
                          "--pp)", job.loss)


def _check_compile(job: Job, *, torchtitan_code: bool = False) -> None:
    """``--compile`` runs each decoder layer's partitioned graphs (:mod:`memplan.trace.runners.partitioner`) on
    one rank, in full training, without another activation policy."""
    if not job.compile:
        return
    reasons = (("--torchtitan", torchtitan_code, "torchtitan's own code is traced eagerly"),
               ("--gpus", job.parallel.world_size > 1, "compiled layers are traced on one rank (no FSDP or TP)"),
               ("--recompute", job.recompute.mode != "none", "compiled layers are traced without an activation "
                "policy (the partitioner's saved set alone)"),
               ("--peft", job.finetune.partial, "compiled layers are traced in full training"),
               ("--offload-activations", job.offload.activations, "compiled layers keep their saved set on the GPU"))
    for flag, refused, why in reasons:
        if refused:
            raise ConfigError(flag, f"cannot be traced with --compile: {why}; estimate it with memplan estimate "
                              "--compile", getattr(job.recompute, "mode") if flag == "--recompute" else True)


def _check_finetune(job: Job) -> None:
    ft = job.finetune
    if (ft.peft_kind.adapters or ft.has_frozen) and job.parallel.world_size > 1 and not _sharded_adapters(job):
        raise ConfigError("--gpus", "memplan trace runs fine-tuning (--peft, --trainable) on one rank, and peft "
                          "adapters alone on an unquantized base under --fsdp full or hybrid without --tp; estimate the "
                          "rest with memplan estimate", job.parallel.world_size)
    for flag, on in (("--optimizer-in-backward", job.optimizer.in_backward),
                     ("--offload-activations", job.offload.activations)):
        if on and job.parallel.world_size > 1:
            raise ConfigError(flag, "is traced on one rank only (no FSDP or TP); estimate it with memplan estimate",
                              job.parallel.world_size)


def _sharded_adapters(job: Job) -> bool:
    """peft adapters alone trained on an unquantized base, FSDP2-sharded without TP: peft wraps the model first,
    then each block is ``fully_shard``-ed (accelerate's ``fsdp2_prepare_model`` order), adapters and frozen base
    together; under ``--fsdp hybrid`` on HSDP's 2-D mesh, each unit's adapter gradients reduce-scattered within the
    shard group and all-reduced across the replicas. Not a ``modules_to_save`` copy or a ``--trainable`` module
    beside them: FSDP2 wants one dtype for a unit's trainable parameters (accelerate upcasts them to fp32 first,
    which the trace does not)."""
    ft = job.finetune
    return (ft.peft_kind.adapters and not ft.quant_kind.quantizes and job.parallel.tp == 1
            and job.sharding.fsdp in ("full", "hybrid") and ft.resolved_trainable == "adapters"
            and not ft.modules_to_save)


@dataclass(frozen=True)
class TraceSetup:
    """The job a trace runs and how: a read-only view of ``job`` and ``run`` in the tracer's words."""

    job: Job
    run: RunSettings = field(default_factory=RunSettings)
    #: Names of the job flags the user gave (the rest are defaults): a job function that takes no
    #: context must not be given any (see :mod:`memplan.trace.script`).
    given: frozenset[str] = frozenset()
    #: ``memplan trace --torchtitan``: torchtitan's own model and parallelize code run the job
    #: (:mod:`memplan.trace.runners.torchtitan`), so torchtitan's TP plan is traced, not refused.
    torchtitan_code: bool = False

    def __post_init__(self) -> None:
        check_traceable(self.job, torchtitan_code=self.torchtitan_code)
        if self.job.offload.activations and self.run.device == "cpu":
            raise ConfigError("--offload-activations", "moves saved tensors from the GPU to host memory; trace it "
                              "with --device cuda (a cpu trace has no device memory to free)", True)
        if self.job.recompute.cpu_checkpointing and self.run.device == "cpu":
            raise ConfigError("--cpu-checkpointing", "moves checkpointed inputs from the GPU to host memory; trace "
                              "it with --device cuda (a cpu trace has no device memory to free)", True)

    @property
    def seq(self) -> int:
        return self.job.batch.seq_length

    @property
    def mbs(self) -> int:
        return self.job.batch.micro_batch_size

    @property
    def precision(self) -> str:
        return self.job.precision.name

    @property
    def mixed(self) -> bool:
        return self.job.precision.is_mixed

    @property
    def compute_dtype(self) -> str:
        """``fp32``, ``bf16`` or ``fp16``: the dtype matmuls run in."""
        return self.job.precision.compute_dtype

    @property
    def fsdp_reduce_dtype(self) -> str:
        """The dtype FSDP2 reduce-scatters in under ``*-mixed`` (the framework's ``fsdp_reduce_dtype``: fp32,
        torchtitan's; the compute dtype, accelerate's ``MixedPrecisionPolicy(param_dtype=reduce_dtype)``)."""
        from memplan.profiles import get_profile

        return self.compute_dtype if get_profile(self.job.framework).fsdp_reduce_dtype == "compute" else "fp32"

    @property
    def fsdp_autocast(self) -> bool:
        """``*-mixed`` under FSDP also wraps the forward in ``torch.autocast`` (accelerate's ``prepare_model``;
        the framework's ``fsdp_autocast``); torchtitan's FSDP policy casts alone."""
        from memplan.profiles import get_profile

        return self.mixed and get_profile(self.job.framework).fsdp_autocast

    @property
    def optimizer(self) -> str:
        return self.job.optimizer.name

    @property
    def momentum(self) -> float:
        return self.job.optimizer.momentum

    @property
    def resolved_optimizer_impl(self) -> str:
        """``foreach``, ``fused`` or ``for-loop``: the implementation the job's framework uses."""
        return resolved_optimizer_impl(self.job)

    @property
    def recompute(self) -> str:
        return self.job.recompute.mode

    @property
    def policy(self) -> ActivationPolicy:
        """The job's activation policy (:func:`memplan.policies.resolve_policy`)."""
        return resolve_policy(self.job)

    @property
    def attention(self) -> str:
        """The attention implementation transformers is given: ``sdpa`` (for flash too) or ``eager``."""
        return "eager" if self.job.attention == "eager" else "sdpa"

    @property
    def dropout(self) -> float:
        return self.job.dropout

    @property
    def attention_dropout(self) -> float:
        """Dropout on the attention probabilities (``--attention-dropout``, else ``--dropout``)."""
        return self.job.attention_probability_dropout

    @property
    def tp(self) -> int:
        return self.job.parallel.tp

    @property
    def fsdp(self) -> int:
        """FSDP ranks a parameter is sharded over: all data-parallel ranks under full sharding, one shard
        group's under hybrid (1 = no FSDP): :func:`memplan.profiles.unwrapped_fsdp.shard_group`, the estimate's."""
        from memplan.profiles.unwrapped_fsdp import shard_group

        return shard_group(self.job)

    @property
    def fsdp_wrapped(self) -> bool:
        """FSDP2 wraps the model: over more than one rank, or at one where the framework wraps it there too
        (``FrameworkProfile.fsdp_at_one_rank``: accelerate under its launcher)."""
        from memplan.profiles.unwrapped_fsdp import wraps_fsdp

        return self.fsdp > 1 or wraps_fsdp(self.job)

    @property
    def fsdp_replicas(self) -> int:
        """Replicas of the shard group under hybrid sharding (HSDP's replicate dimension; 1 otherwise)."""
        return self.job.parallel.data_parallel // self.fsdp if self.job.sharding.fsdp == "hybrid" else 1

    @property
    def world_size(self) -> int:
        return self.job.parallel.world_size

    @property
    def device(self) -> str:
        return self.run.device

    @property
    def iterations(self) -> int:
        return self.run.iterations

    @property
    def moe_routing(self) -> str:
        return self.run.moe_routing

    def to_dict(self) -> dict[str, Any]:
        """The job (as Job fields) and the run settings, JSON-ready (tuples as lists, as a trace
        file reads them back)."""
        from dataclasses import asdict

        return {"job": _json_ready(asdict(self.job)), "run": _json_ready(asdict(self.run)), "given": sorted(self.given),
                "resolved": {"optimizer_impl": self.resolved_optimizer_impl, "attention": self.attention,
                             "fsdp_ranks": self.fsdp, "fsdp_replicas": self.fsdp_replicas,
                             "tp_ranks": self.tp}}


def _json_ready(value: Any) -> Any:
    """``value`` with every tuple made a list, recursively (what JSON gives back)."""
    if isinstance(value, dict):
        return {key: _json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(item) for item in value]
    return value


def _trace_base(flags: Mapping[str, Any]) -> Job:
    """The Job under a trace's flags: the trace's framework unless one is given."""
    return Job(framework=DEFAULT_TRACE_FRAMEWORK) if flags.get("framework") is None else Job()


def _rank_flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    """``--tp N`` alone simulates N ranks: the GPU count follows the ranks when it is not given."""
    out = {k: v for k, v in flags.items() if v is not None}
    if "gpus" not in out and "tp" in out and not str(out.get("fsdp", "")).strip().isdigit():
        out["gpus"] = out["tp"]
    return out


def trace_setup(job: Job | None = None, **values: Any) -> TraceSetup:
    """A :class:`TraceSetup` from job flags and run settings given as keywords.

    Example: ``trace_setup(seq=512, mbs=2, precision="fp32", device="cpu")``. Keywords are job flag
    names (:mod:`memplan.jobflags`: ``seq``, ``mbs``, ``fsdp``, ``tp``, ``recompute``...) or run
    settings (``device``, ``iterations``, ``moe_routing``); ``job`` replaces the flags' base.
    """
    run_values = {k: values.pop(k) for k in _RUN_FIELDS if k in values}
    run = RunSettings(**{k: v for k, v in run_values.items() if v is not None})
    unknown = sorted(set(values) - {f.name for f in job_flags()})
    if unknown:
        raise ConfigError(unknown[0], "is not a job flag or a trace run setting")
    flags = _rank_flags(values)
    return TraceSetup(build_job(flags, job if job is not None else _trace_base(flags)), run, frozenset(flags))
