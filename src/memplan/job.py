"""Job: how a model is trained — parallel layout, batch, precision, optimizer, recompute.

A :class:`Job` is a tree of frozen, keyword-only dataclasses. Each field is documented where it is
defined and validated in ``__post_init__`` with an error that names the field (as the CLI flag
spells it), the rule and the value. Checks that need the model (TP dividing heads, PP dividing
layers) live in :func:`validate_job_for_model`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from memplan.errors import JobConfigError
from memplan.model.spec import ModelSpec
from memplan.units import normalize_dtype

PrecisionName = Literal["fp32", "bf16", "fp16", "bf16-mixed", "fp16-mixed"]
OptimizerName = Literal["adamw", "adam", "sgd", "adafactor", "adam8bit"]
OptimizerImpl = Literal["auto", "foreach", "fused", "for-loop"]
RecomputeMode = Literal["none", "selective", "full"]
RecomputeMethod = Literal["uniform", "block"]
AttentionImpl = Literal["flash", "sdpa", "eager"]
LossImpl = Literal["auto", "fp32-logits", "vocab-parallel", "fused", "chunked"]
FrameworkName = Literal["megatron", "torchtitan", "deepspeed", "hf"]
FsdpMode = Literal["none", "full", "hybrid"]

#: Largest value accepted for any count (GPUs, layers, batch): beyond it the input is a typo.
_ABSURD = 10**7


def _check_int(name: str, value: object, *, minimum: int = 1, maximum: int = _ABSURD) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise JobConfigError(name, "must be an integer", value)
    if value < minimum:
        raise JobConfigError(name, f"must be at least {minimum}", value)
    if value > maximum:
        raise JobConfigError(name, f"must be at most {maximum:,}", value)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise JobConfigError(name, f"must be one of {', '.join(choices)}", value)


@dataclass(frozen=True, kw_only=True)
class Parallelism:
    """Parallel layout. ``dp`` is derived from ``world_size`` when not given."""

    #: Total number of GPUs (``--gpus``).
    world_size: int = 1
    #: Tensor-parallel size (``--tp``).
    tp: int = 1
    #: Pipeline-parallel size (``--pp``).
    pp: int = 1
    #: Virtual pipeline stages (model chunks) per pipeline rank (``--vpp``); 1 = no interleaving.
    vpp: int = 1
    #: Context-parallel size (``--cp``): the sequence is split over ``cp`` ranks.
    cp: int = 1
    #: Data-parallel size (``--dp``); ``None`` derives world_size / (tp * pp * cp).
    dp: int | None = None
    #: Expert-parallel size (``--ep``): routed experts are split over ``ep`` ranks.
    ep: int = 1
    #: Expert tensor-parallel size (``--etp``); ``None`` means the same as ``tp``.
    etp: int | None = None
    #: Megatron sequence parallelism (``--sequence-parallel``): norms/dropout shard over TP.
    sequence_parallel: bool = False
    #: Decoder layers on the first pipeline stage when the split is uneven.
    first_stage_layers: int | None = None
    #: Decoder layers on the last pipeline stage when the split is uneven.
    last_stage_layers: int | None = None
    #: Interleaved schedule: micro-batches run through one model chunk before moving to the next
    #: (Megatron ``--microbatch-group-size-per-virtual-pipeline-stage``); None means ``pp``.
    microbatch_group_size: int | None = None

    def __post_init__(self) -> None:
        _check_int("--gpus", self.world_size)
        for name in ("tp", "pp", "vpp", "cp", "ep"):
            _check_int(f"--{name}", getattr(self, name))
        if self.etp is not None:
            _check_int("--etp", self.etp)
        model_parallel = self.tp * self.pp * self.cp
        if self.world_size % model_parallel:
            raise JobConfigError(
                "--gpus",
                f"must be divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {model_parallel}",
                self.world_size,
            )
        if self.dp is None:
            object.__setattr__(self, "dp", self.world_size // model_parallel)
        else:
            _check_int("--dp", self.dp)
            if self.dp * model_parallel != self.world_size:
                raise JobConfigError(
                    "--dp",
                    f"dp*tp*pp*cp must equal --gpus={self.world_size} (tp*pp*cp = {model_parallel})",
                    self.dp,
                )
        if self.vpp > 1 and self.pp == 1:
            raise JobConfigError("--vpp", "interleaving needs --pp greater than 1", self.vpp)
        if self.microbatch_group_size is not None:
            _check_int("--microbatch-group-size", self.microbatch_group_size)
        for name in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, name)
            if value is not None:
                _check_int(f"--{name.replace('_', '-')}", value, minimum=0)
        if self.sequence_parallel and self.tp == 1:
            object.__setattr__(self, "sequence_parallel", False)

    @property
    def data_parallel(self) -> int:
        assert self.dp is not None
        return self.dp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of expert weights: world / (ep * etp * pp)."""
        return max(1, self.world_size // (self.ep * self.expert_tp * self.pp))


@dataclass(frozen=True, kw_only=True)
class Sharding:
    """Optimizer-state / gradient / parameter sharding across data parallelism."""

    #: ZeRO stage (``--zero``): 1 shards optimizer states, 2 also gradients, 3 also parameters.
    zero: int = 0
    #: FSDP (``--fsdp``): ``full`` = shard everything over DP (like ZeRO-3); ``hybrid`` = shard
    #: within groups of ``fsdp_shard_size`` GPUs and replicate across them.
    fsdp: FsdpMode = "none"
    #: GPUs per hybrid-shard group (``--fsdp-shard-size``); default: min(dp, 8).
    fsdp_shard_size: int | None = None
    #: Megatron distributed optimizer (``--distributed-optimizer``): shards master weights and
    #: optimizer states over DP (ZeRO-1 like), gradients stay in a full buffer.
    distributed_optimizer: bool = False
    #: Megatron ``--num-distributed-optimizer-instances``: the distributed optimizer shards over
    #: DP / instances GPUs and replicates across instances.
    distributed_optimizer_instances: int = 1

    def __post_init__(self) -> None:
        _check_int("--zero", self.zero, minimum=0, maximum=3)
        _check_int("--distributed-optimizer-instances", self.distributed_optimizer_instances)
        _check_choice("--fsdp", self.fsdp, get_args(FsdpMode))
        if self.fsdp_shard_size is not None:
            _check_int("--fsdp-shard-size", self.fsdp_shard_size)
        if self.fsdp != "none" and self.zero not in (0, 3):
            raise JobConfigError("--fsdp", f"cannot be combined with --zero {self.zero}", self.fsdp)


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Dtypes of weights, gradients, master weights and optimizer moments.

    ``name`` picks the defaults: pure ``bf16``/``fp16``/``fp32`` keep everything in that dtype;
    ``*-mixed`` computes in 16 bits and keeps fp32 master weights. The framework profile fills in
    what a framework really keeps (e.g. Megatron's fp32 gradient buffer); the ``*_dtype`` fields
    override both.
    """

    #: ``--precision``.
    name: PrecisionName = "bf16-mixed"
    #: ``--grad-dtype``: dtype of stored gradients (None: framework default).
    grad_dtype: str | None = None
    #: ``--optimizer-state-dtype``: dtype of optimizer moments (None: fp32 unless pure precision).
    optimizer_state_dtype: str | None = None
    #: ``--master-dtype``: dtype of master weights (None: fp32 for mixed, none for pure).
    master_dtype: str | None = None

    def __post_init__(self) -> None:
        _check_choice("--precision", self.name, get_args(PrecisionName))
        for name in ("grad_dtype", "optimizer_state_dtype", "master_dtype"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, normalize_dtype(value, field=f"--{name.replace('_', '-')}"))

    @property
    def is_mixed(self) -> bool:
        return self.name.endswith("-mixed")

    @property
    def compute_dtype(self) -> str:
        """dtype of activations and of the weights the matmuls read."""
        return self.name.removesuffix("-mixed")


@dataclass(frozen=True, kw_only=True)
class Optimizer:
    """Optimizer and its implementation (which decides the step's temporaries)."""

    #: ``--optimizer``.
    name: OptimizerName = "adamw"
    #: SGD momentum (``--momentum``); 0 keeps no momentum buffer.
    momentum: float = 0.0
    #: ``--optimizer-impl``: PyTorch's foreach (default on GPU), fused, or a per-tensor loop;
    #: ``auto`` takes the framework's default.
    implementation: OptimizerImpl = "auto"

    def __post_init__(self) -> None:
        _check_choice("--optimizer", self.name, get_args(OptimizerName))
        _check_choice("--optimizer-impl", self.implementation, get_args(OptimizerImpl))
        if not 0.0 <= self.momentum < 1.0:
            raise JobConfigError("--momentum", "must be in [0, 1)", self.momentum)


@dataclass(frozen=True, kw_only=True)
class Recompute:
    """Activation recomputation (checkpointing)."""

    #: ``--recompute``: none; selective (the attention core is recomputed); full (layers keep
    #: only their input).
    mode: RecomputeMode = "none"
    #: ``--recompute-method`` for full recompute: ``uniform`` checkpoints groups of
    #: ``num_layers`` layers keeping one input per group; ``block`` fully recomputes the first
    #: ``num_layers`` layers of each stage and keeps the rest whole.
    method: RecomputeMethod = "uniform"
    #: ``--recompute-layers`` (None: every layer for block, groups of 1 for uniform).
    num_layers: int | None = None

    def __post_init__(self) -> None:
        _check_choice("--recompute", self.mode, get_args(RecomputeMode))
        _check_choice("--recompute-method", self.method, get_args(RecomputeMethod))
        if self.num_layers is not None:
            _check_int("--recompute-layers", self.num_layers, minimum=0)


@dataclass(frozen=True, kw_only=True)
class Batch:
    """Sizes of one step."""

    #: ``--mbs``: sequences per micro-batch per data-parallel rank.
    micro_batch_size: int = 1
    #: ``--seq``: tokens per sequence.
    seq_length: int = 4096
    #: ``--gbs``: sequences per optimizer step over all DP ranks (None: mbs * dp, no accumulation).
    global_batch_size: int | None = None

    def __post_init__(self) -> None:
        _check_int("--mbs", self.micro_batch_size)
        _check_int("--seq", self.seq_length, maximum=10**8)
        if self.global_batch_size is not None:
            _check_int("--gbs", self.global_batch_size, maximum=10**9)


@dataclass(frozen=True, kw_only=True)
class Job:
    """Everything about a training job except the model architecture."""

    parallel: Parallelism = field(default_factory=Parallelism)
    sharding: Sharding = field(default_factory=Sharding)
    batch: Batch = field(default_factory=Batch)
    precision: Precision = field(default_factory=Precision)
    optimizer: Optimizer = field(default_factory=Optimizer)
    recompute: Recompute = field(default_factory=Recompute)
    #: ``--attention``: flash/sdpa keep no s*s score matrix; eager keeps scores and softmax.
    attention: AttentionImpl = "flash"
    #: ``--dropout``: dropout probability on attention and hidden states (masks are kept).
    dropout: float = 0.0
    #: ``--loss``: how logits and cross-entropy are materialised (``auto``: the framework's way).
    loss: LossImpl = "auto"
    #: Megatron ``--defer-embedding-wgrad-compute``: the output layer's weight gradient is
    #: computed after the pipeline drains, so each finished micro-batch keeps its logits gradient
    #: and the layer input; ``--wgrad-deferral-limit`` caps how many (0 = all).
    defer_embedding_wgrad: bool = False
    wgrad_deferral_limit: int = 0
    #: ``--framework``: whose implementation decides buffers, dtypes and workspaces.
    framework: FrameworkName = "megatron"
    #: Pad the vocabulary to a multiple of this times TP (Megatron's
    #: ``--make-vocab-size-divisible-by``); None: the framework's default.
    vocab_divisible_by: int | None = None

    def __post_init__(self) -> None:
        _check_choice("--attention", self.attention, get_args(AttentionImpl))
        _check_choice("--loss", self.loss, get_args(LossImpl))
        _check_choice("--framework", self.framework, get_args(FrameworkName))
        if not 0.0 <= self.dropout < 1.0:
            raise JobConfigError("--dropout", "must be in [0, 1)", self.dropout)
        if self.vocab_divisible_by is not None:
            _check_int("--make-vocab-size-divisible-by", self.vocab_divisible_by)
        _check_int("--wgrad-deferral-limit", self.wgrad_deferral_limit, minimum=0)
        self._check_batch()

    def _check_batch(self) -> None:
        per_step = self.batch.micro_batch_size * self.parallel.data_parallel
        gbs = self.batch.global_batch_size
        if gbs is not None and gbs % per_step:
            raise JobConfigError(
                "--gbs",
                f"must be a multiple of mbs*dp = {self.batch.micro_batch_size}*"
                f"{self.parallel.data_parallel} = {per_step}",
                gbs,
            )
        if self.batch.seq_length % self.parallel.cp:
            raise JobConfigError(
                "--seq", f"must be divisible by --cp={self.parallel.cp}", self.batch.seq_length
            )

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        gbs = self.batch.global_batch_size
        if gbs is None:
            return 1
        return gbs // (self.batch.micro_batch_size * self.parallel.data_parallel)


def validate_job_for_model(job: Job, model: ModelSpec) -> None:
    """Checks that need both the job and the model; raise :class:`JobConfigError`."""
    par = job.parallel
    attn = model.layers[0].attention
    if attn.num_heads % par.tp:
        raise JobConfigError(
            "--tp", f"must divide the number of attention heads ({attn.num_heads})", par.tp
        )
    if attn.kind == "mha" and attn.num_kv_heads % par.tp and par.tp % attn.num_kv_heads:
        raise JobConfigError(
            "--tp",
            f"must divide the number of key/value heads ({attn.num_kv_heads}) or be a multiple of it",
            par.tp,
        )
    chunks = par.pp * par.vpp
    uneven = par.first_stage_layers is not None or par.last_stage_layers is not None
    if uneven:
        fixed = (par.first_stage_layers or 0) + (par.last_stage_layers or 0)
        inner = par.pp - (par.first_stage_layers is not None) - (par.last_stage_layers is not None)
        rest = model.num_layers - fixed
        if rest < 0 or (inner and rest % (inner * par.vpp)) or (not inner and rest):
            raise JobConfigError(
                "--first-stage-layers/--last-stage-layers",
                f"the remaining {rest} of {model.num_layers} layers must divide evenly over the "
                f"{inner} other pipeline stages x vpp={par.vpp}",
                (par.first_stage_layers, par.last_stage_layers),
            )
    elif model.num_layers % chunks:
        raise JobConfigError(
            "--pp",
            f"pp*vpp = {chunks} must divide the number of layers ({model.num_layers}); "
            "or give --first-stage-layers/--last-stage-layers for an uneven split",
            par.pp,
        )
    for layer in model.layers:
        if layer.moe is not None:
            if layer.moe.num_experts % par.ep:
                raise JobConfigError(
                    "--ep", f"must divide the number of experts ({layer.moe.num_experts})", par.ep
                )
            break
    if par.ep * par.expert_tp * par.pp > par.world_size or par.world_size % (par.ep * par.expert_tp * par.pp):
        raise JobConfigError(
            "--ep",
            f"ep*etp*pp = {par.ep}*{par.expert_tp}*{par.pp} must divide --gpus={par.world_size}",
            par.ep,
        )
