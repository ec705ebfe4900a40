"""Job: how a model is trained — parallel layout, batch, precision, optimizer, recompute.

A :class:`Job` is a tree of frozen, keyword-only dataclasses. Each field is documented where it is
defined and validated in ``__post_init__`` with an error that names the field (as the CLI flag
spells it), the rule and the value; what a framework runs and its own rules come from its profile
(:mod:`memplan.profiles`). Checks that need the model (TP dividing heads, PP dividing layers) live in
:func:`memplan.jobcheck.validate_job_for_model`.
"""

from __future__ import annotations

from dataclasses import field, replace
from typing import Any, Literal, get_args

from memplan.errors import JobConfigError
from memplan.frozen import frozen_dataclass
from memplan.profiles import activation_policy_name, check_features, get_profile
from memplan.profiles.zero3 import COMMUNICATION_DTYPES, MOST_ELEMENTS, ZERO_BUFFER_KEYS
from memplan.optimizers import optimizer_kind
from memplan.tuning import (ADAPTER_METHODS, QUANTIZING_FORMATS, PeftMethodKind, QuantFormat, either, peft_method,
                            quant_format)
from memplan.units import normalize_dtype

PrecisionName = Literal["fp32", "bf16", "fp16", "bf16-mixed", "fp16-mixed"]
OptimizerName = Literal["adamw", "adam", "sgd", "adafactor", "adam8bit", "adamw8bit", "paged-adamw8bit",
                        "paged-adamw", "lion", "lion8bit", "paged-lion8bit", "muon", "galore-adamw",
                        "schedulefree-adamw"]
MuonTpMode = Literal["duplicated", "blockwise", "distributed"]
OptimizerImpl = Literal["auto", "foreach", "fused", "for-loop"]
#: ``selective`` is the framework's own selective policy; the others are :mod:`memplan.policies` names.
RecomputeMode = Literal["none", "selective", "full", "megatron-selective", "attention-core", "attention-module",
                        "torchtitan-sac", "memory-budget"]
RecomputeMethod = Literal["uniform", "block"]
AttentionImpl = Literal["flash", "sdpa", "eager"]
LossImpl = Literal["auto", "fp32-logits", "vocab-parallel", "fused", "chunked", "fused-linear"]
#: How the estimate's reserved memory is made (``auto``: the framework profile's ``default_reserved``).
ReservedMode = Literal["auto", "fixed", "simulated"]
PeftMethod = Literal["none", "lora", "dora"]
QuantizeBase = Literal["none", "nf4", "fp4", "int8"]
AdapterDtype = Literal["auto", "fp32", "bf16", "fp16"]
FrameworkName = Literal["megatron", "torchtitan", "deepspeed", "hf"]
FsdpMode = Literal["none", "full", "hybrid"]
Fp8Format = Literal["hybrid", "e4m3"]
Dispatcher = Literal["alltoall", "allgather", "flex"]
SharedExpertParallel = Literal["tp", "expert"]

#: Help panels of the command-line options generated from the fields (see :mod:`memplan.jobflags`).
PARALLEL, SHARDING, BATCH = "Parallelism", "Sharding", "Batch"
PRECISION, ACTIVATIONS = "Precision and optimizer", "Activations and loss"
MOE, FP8_OFFLOAD = "MoE and multi-token prediction", "FP8 and offload"
FINETUNE = "Fine-tuning (PEFT, quantized base)"


def knob(default: Any, flag: str, help: str, *, panel: str, metavar: str | None = None) -> Any:
    """A job field with its command-line flag and documentation, declared once.

    :mod:`memplan.jobflags` reads this metadata to build the command-line options (``help`` is
    their help text), job-file fields and error names; the field's type decides the option's type
    and a ``Literal`` its choices.
    """
    return field(default=default, metadata={"flag": flag, "help": help, "panel": panel, "metavar": metavar})


#: Largest value accepted for any count (GPUs, layers, batch): beyond it the input is a typo.
_ABSURD = 10**7


def _check_int(name: str, value: object, *, minimum: int = 1, maximum: int = _ABSURD) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise JobConfigError(name, "must be an integer", value)
    if value < minimum:
        raise JobConfigError(name, f"must be at least {minimum}", value)
    if value > maximum:
        raise JobConfigError(name, f"must be at most {maximum:,}", value)


def _module_names(flag: str, text: str, known: tuple[str, ...], refused: dict[str, str]) -> dict[str, None]:
    """The names of a comma (or space) list, in order without repeats; an unknown name, or one that
    ``refused`` explains, is a JobConfigError naming ``flag``."""
    names = dict.fromkeys(part.strip() for part in str(text).replace(" ", ",").split(",") if part.strip())
    for name in names:
        if name in refused:
            raise JobConfigError(flag, refused[name], text)
        if name not in known:
            raise JobConfigError(flag, f"must be a comma list of {', '.join(known)}", text)
    return names


def _int_list(name: str, value: object) -> tuple[int, ...]:
    """A comma list (``"7,8,8"``) or a sequence of integers as a tuple; anything else names ``name``."""
    if isinstance(value, str):
        parts = [part.strip() for part in value.split(",")]
        if not all(part.lstrip("-").isdigit() for part in parts):
            raise JobConfigError(name, "must be a comma list of integers", value)
        return tuple(int(part) for part in parts)
    if isinstance(value, (tuple, list)):
        return tuple(value)
    raise JobConfigError(name, "must be a comma list of integers", value)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise JobConfigError(name, f"must be one of {', '.join(choices)}", value)


@frozen_dataclass(kw_only=True)
class Parallelism:
    """Parallel layout. ``dp`` is derived from ``world_size`` when not given."""

    world_size: int = knob(1, "--gpus", "Total GPUs (world size).", panel=PARALLEL)
    tp: int = knob(1, "--tp", "Tensor-parallel size.", panel=PARALLEL)
    pp: int = knob(1, "--pp", "Pipeline-parallel size.", panel=PARALLEL)
    vpp: int = knob(1, "--vpp", "Virtual pipeline stages (model chunks) per pipeline rank; 1 = no interleaving.",
                    panel=PARALLEL)
    cp: int = knob(1, "--cp", "Context-parallel size: the sequence is split over cp ranks.", panel=PARALLEL)
    dp: int | None = knob(None, "--dp", "Data-parallel size. (default: gpus / (tp*pp*cp))", panel=PARALLEL)
    ep: int = knob(1, "--ep", "Expert-parallel size: routed experts are split over ep ranks (MoE).", panel=PARALLEL)
    #: None means 1: each expert whole on its EP rank, as fine-grained MoE models train
    #: (DeepSeek-V3). Megatron's own default is ``tp``; its argument mapping sets that explicitly.
    etp: int | None = knob(None, "--etp", "Expert tensor-parallel size. (default: 1)", panel=PARALLEL)
    sequence_parallel: bool = knob(False, "--sequence-parallel",
                                   "Megatron sequence parallelism: norms and dropout shard over TP (needs tp > 1).",
                                   panel=PARALLEL)
    first_stage_layers: int | None = knob(None, "--first-stage-layers",
                                          "Decoder layers on the first pipeline stage (uneven split).", panel=PARALLEL)
    last_stage_layers: int | None = knob(None, "--last-stage-layers",
                                         "Decoder layers on the last pipeline stage (uneven split).", panel=PARALLEL)
    #: Interleaved schedule: micro-batches run through one model chunk before moving to the next
    #: (Megatron ``--microbatch-group-size-per-virtual-pipeline-stage``); None means ``pp``.
    microbatch_group_size: int | None = None
    #: Decoder layers of every model chunk in model order, ``pp * vpp`` entries (chunk ``k`` runs
    #: on pipeline rank ``k % pp``); also what Megatron's ``--pipeline-model-parallel-layout`` and a
    #: torchtitan TOML's split give. Overrides the framework's split and ``first/last_stage_layers``;
    #: ``vpp`` is ``len / pp``. Given as a comma list (``"7,8,8"``) or a sequence of integers.
    chunk_layers: tuple[int, ...] | None = knob(
        None, "--stage-layers", "Decoder layers of every pipeline stage (model chunk) in model order, a comma list "
        "of pp*vpp counts: chunk k runs on pipeline rank k % pp, and vpp is the count / pp. (default: the "
        "framework's split)", panel=PARALLEL, metavar="N,N,...")

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
        if self.chunk_layers is not None:
            self._check_chunk_layers()

    def _check_chunk_layers(self) -> None:
        chunks = _int_list("--stage-layers", self.chunk_layers)
        if not chunks or len(chunks) % self.pp:
            raise JobConfigError(
                "--stage-layers", f"must list a layer count for each of pp*vpp chunks (a multiple of pp={self.pp})",
                ",".join(map(str, chunks)),
            )
        for count in chunks:
            _check_int("--stage-layers", count, minimum=0)
        vpp = len(chunks) // self.pp
        if self.vpp not in (1, vpp):
            raise JobConfigError("--vpp", f"contradicts the pipeline layout's {len(chunks)} chunks over pp={self.pp}", self.vpp)
        object.__setattr__(self, "chunk_layers", chunks)
        object.__setattr__(self, "vpp", vpp)

    @property
    def splits_sequence(self) -> bool:
        """Whether sequence parallelism acts: ``--sequence-parallel`` with tp > 1 (at tp 1 there is nothing to
        split; the flag stays as given and the estimate says it has no effect, as Megatron warns and turns it off)."""
        return self.sequence_parallel and self.tp > 1

    @property
    def data_parallel(self) -> int:
        assert self.dp is not None
        return self.dp

    @property
    def expert_tp(self) -> int:
        return 1 if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of expert weights: world / (ep * etp * pp)."""
        return max(1, self.world_size // (self.ep * self.expert_tp * self.pp))


@frozen_dataclass(kw_only=True)
class Sharding:
    """Optimizer-state / gradient / parameter sharding across data parallelism."""

    zero: int = knob(0, "--zero", "ZeRO stage 0-3: 1 shards optimizer states, 2 also gradients, 3 also parameters.",
                     panel=SHARDING)
    fsdp: FsdpMode = knob("none", "--fsdp",
                          "FSDP sharding: full = shard everything over DP (like ZeRO-3); hybrid = shard within "
                          "groups of --fsdp-shard-size GPUs, replicate across them. An integer N means: shard over N "
                          "GPUs (full when N = --gpus, which it sets when --gpus is not given).", panel=SHARDING)
    fsdp_shard_size: int | None = knob(None, "--fsdp-shard-size", "GPUs per hybrid-shard group. (default: min(dp, 8))",
                                       panel=SHARDING)
    distributed_optimizer: bool = knob(False, "--distributed-optimizer",
                                       "Megatron distributed optimizer: master weights and optimizer states sharded "
                                       "over DP (ZeRO-1 like); gradients stay in a full buffer.", panel=SHARDING)
    #: Megatron ``--num-distributed-optimizer-instances``: the distributed optimizer shards over
    #: DP / instances GPUs and replicates across instances.
    distributed_optimizer_instances: int = 1
    #: DeepSpeed ZeRO-3 buffer settings a DeepSpeed config gives (elements; None: DeepSpeed's default,
    #: :data:`memplan.profiles.zero3.DEEPSPEED_ZERO3`; ``"auto"``: Hugging Face fills it in from the hidden size):
    #: ``reduce_bucket_size``, ``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``,
    #: ``stage3_max_reuse_distance``, ``sub_group_size``, ``contiguous_gradients``,
    #: ``stage3_param_persistence_threshold``, ``stage3_model_persistence_threshold`` and the top-level
    #: ``communication_data_type`` (the reduce bucket's dtype; None: the model's) (:mod:`memplan.estimate.zero3_buffers`);
    #: checked where they are read (:func:`memplan.frameworks.deepspeed_config.job_with_deepspeed`).
    reduce_bucket_size: int | Literal["auto"] | None = None
    prefetch_bucket_size: int | Literal["auto"] | None = None
    max_live_parameters: int | None = None
    max_reuse_distance: int | None = None
    sub_group_size: int | None = None
    contiguous_gradients: bool | None = None
    #: DeepSpeed ``overlap_comm`` (None: DeepSpeed's default, off below stage 3): ZeRO-1/2 double-buffers its reduce
    #: bucket (:mod:`memplan.estimate.zero12_bucket`); ZeRO-3 keeps one bucket either way.
    overlap_comm: bool | None = None
    param_persistence_threshold: int | Literal["auto"] | None = None
    model_persistence_threshold: int | None = None
    communication_data_type: str | None = None

    def __post_init__(self) -> None:
        _check_int("--zero", self.zero, minimum=0, maximum=3)
        _check_int("--distributed-optimizer-instances", self.distributed_optimizer_instances)
        if self.fsdp not in get_args(FsdpMode):
            raise JobConfigError("--fsdp", "must be none, full, hybrid, or the number of GPUs to shard over", self.fsdp)
        if self.fsdp_shard_size is not None:
            _check_int("--fsdp-shard-size", self.fsdp_shard_size)
        if self.fsdp != "none" and self.zero not in (0, 3):
            raise JobConfigError("--fsdp", f"cannot be combined with --zero {self.zero}", self.fsdp)
        self._check_deepspeed_keys()

    def hybrid_shard_size(self, ranks: int) -> int:
        """Ranks a hybrid (HSDP) shard group asks for among ``ranks`` data-parallel ranks: ``--fsdp-shard-size``,
        by default min(ranks, 8) (one node's GPUs)."""
        return self.fsdp_shard_size or min(ranks, 8)

    def _check_deepspeed_keys(self) -> None:
        """The DeepSpeed buffer settings as DeepSpeed's config takes them (the Python API reaches them without the
        config reader): element counts whole and in range (``reduce_bucket_size`` above 0, ``"auto"`` where Hugging
        Face fills it in), switches booleans, the communication dtype one DeepSpeed names."""
        for name, _, least, auto in ZERO_BUFFER_KEYS:
            value = getattr(self, name)
            if value is not None and not (auto and value == "auto"):
                _check_int(f"zero_optimization.{name}", value, minimum=least, maximum=MOST_ELEMENTS)
        for name in ("contiguous_gradients", "overlap_comm"):
            if getattr(self, name) not in (None, True, False):
                raise JobConfigError(f"zero_optimization.{name}", "must be true or false", getattr(self, name))
        if self.communication_data_type not in (None, *COMMUNICATION_DTYPES):
            raise JobConfigError("communication_data_type", f"must be one of {', '.join(COMMUNICATION_DTYPES)}",
                                 self.communication_data_type)


@frozen_dataclass(kw_only=True)
class Precision:
    """Dtypes of weights, gradients, master weights and optimizer moments.

    ``name`` picks the defaults: pure ``bf16``/``fp16``/``fp32`` keep everything in that dtype;
    ``*-mixed`` computes in 16 bits and keeps fp32 master weights. The framework profile fills in
    what a framework really keeps (e.g. Megatron's fp32 gradient buffer); the ``*_dtype`` fields
    override both.
    """

    name: PrecisionName = knob("bf16-mixed", "--precision",
                               "fp32/bf16/fp16 keep everything in that dtype; *-mixed computes in 16 bits and keeps "
                               "fp32 master weights.", panel=PRECISION)
    grad_dtype: str | None = knob(None, "--grad-dtype", "Gradient dtype override (fp32, bf16, ...). "
                                  "(default: the framework's)", panel=PRECISION)
    optimizer_state_dtype: str | None = knob(None, "--optimizer-state-dtype", "Optimizer-moment dtype override. "
                                             "(default: fp32 unless pure precision)", panel=PRECISION)
    master_dtype: str | None = knob(None, "--master-dtype", "Master-weight dtype override. "
                                    "(default: fp32 for *-mixed, none for pure precision)", panel=PRECISION)
    #: Megatron ``--fp8-format``: ``hybrid`` is E4M3 forward, E5M2 gradients.
    fp8: Fp8Format | None = knob(None, "--fp8", "FP8 training of linear layers (Transformer Engine). (default: off)",
                                 panel=FP8_OFFLOAD)
    #: Megatron ``--fp8-param-gather``.
    fp8_params: bool = knob(False, "--fp8-params", "Keep the weights themselves in FP8 instead of a 16-bit weight "
                            "plus FP8 copies made per step.", panel=FP8_OFFLOAD)

    def __post_init__(self) -> None:
        _check_choice("--precision", self.name, get_args(PrecisionName))
        for name in ("grad_dtype", "optimizer_state_dtype", "master_dtype"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, normalize_dtype(value, field=f"--{name.replace('_', '-')}"))
        if self.fp8 is not None:
            _check_choice("--fp8", self.fp8, get_args(Fp8Format))
            if self.compute_dtype == "fp32":
                raise JobConfigError(
                    "--fp8", "needs a 16-bit compute precision (--precision bf16-mixed, fp16-mixed, bf16 or fp16), "
                    f"not {self.name}", self.fp8,
                )
        if self.fp8_params and self.fp8 is None:
            raise JobConfigError("--fp8-params", "needs --fp8 (FP8 weights only exist in FP8 training)", True)
        for name in ("grad_dtype", "master_dtype"):
            if getattr(self, name) in ("fp8", "int8"):
                raise JobConfigError(
                    f"--{name.replace('_', '-')}",
                    "cannot be an 8-bit type: FP8 training keeps gradients and master weights in 16 or 32 bits",
                    getattr(self, name),
                )

    @property
    def is_mixed(self) -> bool:
        return self.name.endswith("-mixed")

    @property
    def compute_dtype(self) -> str:
        """dtype of activations and of the weights the matmuls read."""
        return self.name.removesuffix("-mixed")


@frozen_dataclass(kw_only=True)
class Optimizer:
    """Optimizer and its implementation (which decides the step's temporaries)."""

    #: ``adam8bit``/``adamw8bit``/``lion8bit``: bitsandbytes block-wise 8-bit states; ``paged-*``:
    #: bitsandbytes paged optimizers, whose states live in CUDA unified memory outside PyTorch's
    #: caching allocator and page out to CPU memory under pressure.
    name: OptimizerName = knob("adamw", "--optimizer", "Optimizer: torch adamw/adam/sgd/adafactor, Lion, "
                               "bitsandbytes 8-bit and paged variants, Megatron's Muon (2-D weights; Adam for "
                               "the rest), GaLore or schedule-free AdamW.", panel=PRECISION)
    momentum: float = knob(0.0, "--momentum", "SGD momentum; 0 keeps no momentum buffer.", panel=PRECISION)
    implementation: OptimizerImpl = knob("auto", "--optimizer-impl",
                                         "PyTorch optimizer implementation (temporaries of the step); auto = the "
                                         "framework profile's (fused for every profile).", panel=PRECISION)

    #: The step of each parameter runs in a hook as soon as its gradient is ready, and the gradient
    #: is freed (torchtune/torchtitan ``optimizer_in_backward``; ``register_post_accumulate_grad_hook``).
    in_backward: bool = knob(False, "--optimizer-in-backward", "Step each parameter inside the backward as soon "
                             "as its gradient is ready, then free the gradient.", panel=PRECISION)

    #: Muon only (Megatron ``--muon-tp-mode``): how a tensor-parallel weight is orthogonalized —
    #: ``duplicated`` gathers the full matrix on every rank, ``blockwise`` and ``distributed`` keep the shard.
    muon_tp_mode: MuonTpMode = knob("duplicated", "--muon-tp-mode", "Muon: Newton-Schulz on the gathered full "
                                    "matrix (duplicated) or on the TP shard (blockwise, distributed).",
                                    panel=PRECISION)
    #: Muon only (Megatron ``--muon-nesterov``): the Nesterov update is a copy of the gradient.
    muon_nesterov: bool = knob(False, "--muon-nesterov", "Muon: Nesterov momentum (one more gradient-sized "
                               "temporary in the step).", panel=PRECISION)

    #: GaLore only: the rank of each projected gradient (Hugging Face ``optim_args="rank=N"``, its default 128).
    galore_rank: int = knob(128, "--galore-rank", "GaLore: rank of the projected gradients of the attention and "
                            "MLP weights (their moments are rank x the larger side).", panel=PRECISION)

    def __post_init__(self) -> None:
        _check_choice("--optimizer", self.name, get_args(OptimizerName))
        _check_int("--galore-rank", self.galore_rank, maximum=1 << 20)
        _check_choice("--muon-tp-mode", self.muon_tp_mode, get_args(MuonTpMode))
        _check_choice("--optimizer-impl", self.implementation, get_args(OptimizerImpl))
        if not 0.0 <= self.momentum < 1.0:
            raise JobConfigError("--momentum", "must be in [0, 1)", self.momentum)


#: Megatron's ``--recompute-modules`` choices memplan models (megatron/core/transformer/
#: transformer_config.py ``recompute_modules``), and its default.
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mla_up_proj", "mlp", "moe", "moe_act", "shared_experts")
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)
#: Megatron choices for layer kinds memplan has no model of: what they recompute.
UNMODELLED_RECOMPUTE_MODULES = {
    "gdn_norm_out": "the GatedDeltaNet output norm",
    "gdp_in_proj": "the GatedDeltaProduct input projection",
    "gdp_qkv": "the GatedDeltaProduct causal conv and q/k/v preparation",
    "mhc": "hyper-connection mixing",
}


@frozen_dataclass(kw_only=True)
class Recompute:
    """Activation recomputation (checkpointing)."""

    mode: RecomputeMode = knob("none", "--recompute", "Activation policy (docs/job.md): full keeps only each "
                               "checkpointed layer's input; selective is the framework's own selective policy "
                               "(Megatron: its --recompute-modules; torchtitan: per-op SAC; hf: attention "
                               "modules; deepspeed: the attention core); or an explicit policy name.",
                               panel=ACTIVATIONS)
    method: RecomputeMethod = knob("uniform", "--recompute-method",
                                   "Full recompute: uniform checkpoints groups of --recompute-layers layers; block "
                                   "recomputes the first --recompute-layers layers of each stage.", panel=ACTIVATIONS)
    num_layers: int | None = knob(None, "--recompute-layers", "Layers per group (uniform) or per stage (block). "
                                  "(default: 1 for uniform, every layer for block)", panel=ACTIVATIONS)
    #: Hugging Face ``gradient_checkpointing_kwargs={"use_reentrant": ...}``: the reentrant
    #: ``torch.utils.checkpoint`` variant (recomputes the whole layer, needs an input that requires grad).
    reentrant: bool = knob(False, "--checkpoint-reentrant", "Use reentrant torch.utils.checkpoint (Hugging Face "
                           "use_reentrant=True) for recomputed layers.", panel=ACTIVATIONS)

    #: Megatron ``--recompute-modules`` (comma list here, space-separated there): the sub-modules a
    #: ``selective`` recompute checkpoints. None: the framework's default (Megatron: core_attn).
    modules: str | None = knob(None, "--recompute-modules", "Megatron selective recompute: a comma list of "
                               f"{', '.join(RECOMPUTE_MODULES)}. (default: core_attn)", panel=ACTIVATIONS,
                               metavar="LIST")
    #: torchtitan ``[activation_checkpoint] memory_budget`` (torch.compile's partitioner,
    #: ``torch._functorch.config.activation_memory_budget``). None: torchtitan's default 0.5.
    memory_budget: float | None = knob(None, "--memory-budget", "--recompute memory-budget: the fraction b in "
                                       "[0, 1] of the compiler's default saved activations above full "
                                       "recompute's that may be kept. (default: 0.5)", panel=ACTIVATIONS,
                                       metavar="B")
    #: DeepSpeed ``activation_checkpointing`` (deepspeed.checkpointing, what Megatron-DeepSpeed wraps
    #: each layer in): where full recompute's kept layer inputs live (memplan.estimate.ds_checkpointing).
    partition_activations: bool = knob(False, "--partition-activations", "DeepSpeed: each tensor-parallel rank "
                                       "keeps 1/tp of every checkpointed layer input (gathered in its backward).",
                                       panel=ACTIVATIONS)
    cpu_checkpointing: bool = knob(False, "--cpu-checkpointing", "DeepSpeed: checkpointed layer inputs are kept "
                                   "in CPU memory and fetched in their backward.", panel=ACTIVATIONS)
    contiguous_checkpoints: int | None = knob(None, "--contiguous-checkpoints", "DeepSpeed "
                                              "contiguous_memory_optimization with number_checkpoints N: "
                                              "partitions are copied into N preallocated buffers (needs "
                                              "--partition-activations).", panel=ACTIVATIONS, metavar="N")

    def __post_init__(self) -> None:
        _check_choice("--recompute", self.mode, get_args(RecomputeMode))
        if self.contiguous_checkpoints is not None:
            _check_int("--contiguous-checkpoints", self.contiguous_checkpoints)
            if not self.partition_activations:
                raise JobConfigError("--contiguous-checkpoints", "needs --partition-activations (DeepSpeed's "
                                     "contiguous checkpointing only copies partitioned activations)",
                                     self.contiguous_checkpoints)
        _check_choice("--recompute-method", self.method, get_args(RecomputeMethod))
        if self.num_layers is not None:
            _check_int("--recompute-layers", self.num_layers, minimum=0)
        if self.memory_budget is not None and not (isinstance(self.memory_budget, (int, float))
                                                   and 0.0 <= self.memory_budget <= 1.0):
            raise JobConfigError("--memory-budget", "must be a number in [0, 1] (torch's partitioner refuses "
                                 "others)", self.memory_budget)
        if self.modules is not None:
            object.__setattr__(self, "modules", _recompute_module_list(self.modules))
            if self.mode not in ("selective", "megatron-selective"):
                raise JobConfigError("--recompute-modules", "only applies with --recompute selective or "
                                     f"megatron-selective (Megatron ignores it otherwise); the job has --recompute {self.mode}", self.modules)

    @property
    def module_names(self) -> tuple[str, ...]:
        """The sub-modules selective recompute checkpoints (Megatron's default: the attention core)."""
        if self.modules is None:
            return DEFAULT_RECOMPUTE_MODULES
        return tuple(name for name in self.modules.split(",") if name)


def _recompute_module_list(text: str) -> str:
    """``text`` as a canonical comma list (order kept, repeats dropped); unknown names refused."""
    names = dict.fromkeys(part.strip() for part in str(text).replace(" ", ",").split(",") if part.strip())
    for name in names:
        if name in UNMODELLED_RECOMPUTE_MODULES:
            raise JobConfigError("--recompute-modules", f"{name} recomputes {UNMODELLED_RECOMPUTE_MODULES[name]}, "
                                 "which memplan does not model", text)
        if name not in RECOMPUTE_MODULES:
            raise JobConfigError("--recompute-modules", f"must be a comma list of {', '.join(RECOMPUTE_MODULES)}",
                                 text)
    return ",".join(names)


@frozen_dataclass(kw_only=True)
class Batch:
    """Sizes of one step."""

    micro_batch_size: int = knob(1, "--mbs", "Micro-batch size: sequences per GPU per micro-batch.", panel=BATCH)
    seq_length: int = knob(4096, "--seq", "Sequence length in tokens.", panel=BATCH)
    global_batch_size: int | None = knob(None, "--gbs", "Global batch size in sequences per optimizer step; sets "
                                         "the micro-batches per step. (default: mbs*dp, no accumulation)", panel=BATCH)
    #: TRL ``packing=True``: documents concatenated into full rows with per-document positions
    #: (flash-attention varlen); every row holds ``seq`` tokens.
    packing: bool = knob(False, "--packing", "Sequence packing: several documents per row, attention kept per "
                         "document (every row full).", panel=BATCH)

    def __post_init__(self) -> None:
        _check_int("--mbs", self.micro_batch_size)
        _check_int("--seq", self.seq_length, maximum=10**8)
        if self.global_batch_size is not None:
            _check_int("--gbs", self.global_batch_size, maximum=10**9)


@frozen_dataclass(kw_only=True)
class MoEOptions:
    """How MoE layers route and move tokens (only used by models with MoE layers)."""

    #: The rank holding the busiest expert gets its excess on top of an even share for its others.
    imbalance: float = knob(1.0, "--moe-imbalance", "Tokens of the busiest expert over the mean (1 = balanced).",
                            panel=MOE, metavar="F")
    #: Megatron ``--moe-expert-capacity-factor``.
    capacity_factor: float | None = knob(None, "--capacity-factor", "Expert capacity as a multiple of the mean "
                                         "share; tokens beyond are dropped. (default: no dropping)", panel=MOE,
                                         metavar="F")
    #: Megatron ``--moe-pad-expert-input-to-capacity``.
    pad_to_capacity: bool = knob(False, "--pad-to-capacity", "Pad every expert's input to its capacity.", panel=MOE)
    #: Megatron ``--moe-token-dispatcher-type``; flex is DeepEP / HybridEP.
    dispatcher: Dispatcher = knob("alltoall", "--moe-dispatcher", "Token dispatcher: all-to-all, all-gather over "
                                  "the EP x TP group, or flex.", panel=MOE)
    #: ``tp``: Megatron's SharedExpertMLP; ``expert``: as the DeepSeek-V3 memory analysis assumes.
    shared_expert_parallel: SharedExpertParallel = knob(
        "tp", "--shared-expert-parallel", "Shared experts split like dense weights (tp) or placed with the routed "
        "experts (expert).", panel=MOE)
    #: Megatron ``--moe-grouped-gemm`` with Transformer Engine (TEGroupedMLP / ``GroupedLinear``).
    grouped_gemm: bool = knob(False, "--moe-grouped-gemm", "Experts run as Transformer Engine grouped GEMMs "
                              "(Megatron --moe-grouped-gemm): four extra cuBLAS workspaces.", panel=MOE)

    def __post_init__(self) -> None:
        if not isinstance(self.imbalance, (int, float)) or not 1.0 <= self.imbalance <= 1000.0:
            raise JobConfigError("--moe-imbalance", "must be a ratio of max to mean tokens per expert in [1, 1000]", self.imbalance)
        if self.capacity_factor is not None and not 0.0 < self.capacity_factor <= 1000.0:
            raise JobConfigError("--capacity-factor", "must be in (0, 1000]", self.capacity_factor)
        if self.pad_to_capacity and self.capacity_factor is None:
            raise JobConfigError("--pad-to-capacity", "needs --capacity-factor", True)
        _check_choice("--moe-dispatcher", self.dispatcher, get_args(Dispatcher))
        _check_choice("--shared-expert-parallel", self.shared_expert_parallel, get_args(SharedExpertParallel))

    @property
    def routed_token_factor(self) -> float:
        """Tokens the busiest expert receives, relative to its balanced share (after capacity)."""
        if self.capacity_factor is None:
            return float(self.imbalance)
        if self.pad_to_capacity:
            return float(self.capacity_factor)
        return float(min(self.imbalance, self.capacity_factor))


#: Megatron ``--offload-modules`` choices memplan prices (transformer_config.py ``offload_modules``, without
#: ``gdp_qkv``: memplan has no GatedDeltaProduct layers).
FINE_OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act",
                        "fused_group_mlp")


@frozen_dataclass(kw_only=True)
class Offload:
    """What lives in CPU memory instead of on the GPU."""

    #: DeepSpeed ZeRO-Offload also moves the fp32 gradient partitions; the step runs on the CPU.
    optimizer: bool = knob(False, "--offload-optimizer", "Master weights and optimizer moments in CPU memory "
                           "(ZeRO-Offload, FSDP CPU offload).", panel=FP8_OFFLOAD)
    #: Megatron ``--optimizer-offload-fraction``.
    optimizer_fraction: float = knob(1.0, "--optimizer-offload-fraction", "Fraction of the optimizer state "
                                     "offloaded.", panel=FP8_OFFLOAD, metavar="F")
    #: DeepSpeed ZeRO-3 ``offload_param``, FSDP ``CPUOffloadPolicy``: copied in per block.
    params: bool = knob(False, "--offload-params", "Sharded weights in CPU memory (ZeRO-3 / FSDP only).",
                        panel=FP8_OFFLOAD)
    #: How each framework offloads is its profile's ``activation_offload`` (Megatron ``--cpu-offloading``:
    #: layer-pipelined; Hugging Face / torchtitan: PyTorch's ``save_on_cpu``, tensor by tensor).
    activations: bool = knob(False, "--offload-activations", "Saved activations stream to CPU memory between "
                             "forward and backward: under megatron / deepspeed as Transformer Engine's "
                             "layer-pipelined CPU offload (the GPU keeps the layer computing and the one being "
                             "copied), under hf / torchtitan as PyTorch's `save_on_cpu` (every saved tensor "
                             "leaves; the backward brings back one operator's at a time).", panel=FP8_OFFLOAD)

    #: Megatron ``--fine-grained-activation-offloading`` with ``--offload-modules`` (comma list here):
    #: the saved inputs of these modules go to CPU memory group by group (:mod:`memplan.estimate.fine_offload`).
    modules: str = knob("", "--offload-modules", "Megatron fine-grained activation offloading: a comma list of "
                        f"{', '.join(FINE_OFFLOAD_MODULES)} whose saved inputs go to CPU memory. (default: none)",
                        panel=FP8_OFFLOAD, metavar="LIST")
    #: Megatron ``--min-offloaded-tensor-size``: smaller tensors (elements) stay on the GPU.
    min_tensor_numel: int = knob(1024 * 1024, "--min-offloaded-tensor-size", "Fine-grained offloading: tensors "
                                 "with fewer elements stay on the GPU.", panel=FP8_OFFLOAD, metavar="N")
    #: Megatron ``--activation-offload-fraction``: the share of eligible groups offloaded (the earliest ones).
    group_fraction: float = knob(1.0, "--activation-offload-fraction", "Fine-grained offloading: fraction of the "
                                 "eligible offload groups (earliest first) that are offloaded.", panel=FP8_OFFLOAD,
                                 metavar="F")
    #: Megatron ``--delta-offload-bytes-across-pp-ranks``: pipeline rank r keeps r x this many bytes on the GPU.
    pp_delta_bytes: int = knob(0, "--offload-pp-delta", "Fine-grained offloading: pipeline rank r keeps r x this "
                               "many offloadable bytes on the GPU.", panel=FP8_OFFLOAD,
                               metavar="BYTES")

    def __post_init__(self) -> None:
        if not 0.0 < self.optimizer_fraction <= 1.0:
            raise JobConfigError("--optimizer-offload-fraction", "must be in (0, 1]", self.optimizer_fraction)
        names = _module_names("--offload-modules", self.modules, FINE_OFFLOAD_MODULES,
                              {"gdp_qkv": "gdp_qkv offloads GatedDeltaProduct layers, which memplan does not model"})
        if "attn_proj" in names and "core_attn" not in names:
            raise JobConfigError("--offload-modules", "attn_proj needs core_attn (its input is core attention's "
                                 "output, which core attention's backward needs; Megatron refuses it)", self.modules)
        if "fused_group_mlp" in names and names.keys() & {"expert_fc1", "moe_act"}:
            raise JobConfigError("--offload-modules", "fused_group_mlp cannot be combined with expert_fc1 or moe_act "
                                 "(Megatron refuses it)", self.modules)
        object.__setattr__(self, "modules", ",".join(names))
        if names and self.activations:
            raise JobConfigError("--offload-modules", "fine-grained offloading cannot be combined with "
                                 "--offload-activations (Megatron refuses it with --cpu-offloading)", self.modules)
        _check_int("--min-offloaded-tensor-size", self.min_tensor_numel, minimum=0, maximum=10**12)
        if not isinstance(self.group_fraction, (int, float)) or not 0.0 <= self.group_fraction <= 1.0:
            raise JobConfigError("--activation-offload-fraction", "must be in [0, 1]", self.group_fraction)
        _check_int("--offload-pp-delta", self.pp_delta_bytes, minimum=0, maximum=10**15)

    @property
    def module_names(self) -> tuple[str, ...]:
        """Fine-grained offloading's modules; () when it is off."""
        return tuple(name for name in self.modules.split(",") if name)

    @property
    def any(self) -> bool:
        """Something whole (optimizer state, weights, every saved activation) lives in CPU memory."""
        return self.optimizer or self.params or self.activations

#: Megatron ``--transformer-impl`` values.
TransformerImpl = Literal["transformer_engine", "local"]
#: Megatron ``--cp-comm-type`` values.
CpCommType = Literal["p2p", "a2a", "allgather", "a2a+p2p"]
#: Megatron ``--moe-flex-dispatcher-backend`` values.
FlexBackend = Literal["deepep", "hybridep", "ncclep"]
#: Transformer Engine userbuffer overlap methods (``initialize_ub`` in transformer_engine/pytorch/module/base.py).
UbMethod = Literal["ring_exchange", "pipeline", "bulk", "external"]
#: The GEMMs ``initialize_ub`` makes a userbuffer for.
UB_GEMMS = ("qkv_fprop", "qkv_dgrad", "qkv_wgrad", "proj_fprop", "proj_dgrad", "proj_wgrad",
            "fc1_fprop", "fc1_dgrad", "fc1_wgrad", "fc2_fprop", "fc2_dgrad", "fc2_wgrad")


@frozen_dataclass(kw_only=True)
class UbOverride:
    """One GEMM's entry of a ``--tp-comm-overlap-cfg`` YAML (what changes its userbuffer)."""

    name: str
    method: UbMethod | None = None
    is_reduce_scatter: bool | None = None
    fp8_buf: bool | None = None

    def __post_init__(self) -> None:
        _check_choice("--tp-comm-overlap-cfg", self.name, UB_GEMMS)
        if self.method is not None:
            _check_choice(f"--tp-comm-overlap-cfg {self.name}.method", self.method, get_args(UbMethod))


@frozen_dataclass(kw_only=True)
class CommOverlap:
    """Communication-overlap machinery that allocates buffers of its own (read from ``--megatron-args``)."""

    #: Megatron ``--tp-comm-overlap``: Transformer Engine's userbuffers (``initialize_ub``) and its
    #: cuBLAS workspace for the overlapped GEMMs' streams.
    tp: bool = False
    #: ``--tp-comm-overlap-cfg``: the YAML's per-GEMM changes to TE's default methods.
    tp_overrides: tuple[UbOverride, ...] = ()
    #: Where ``tp_overrides`` came from (the YAML read), or why TE's defaults are priced.
    tp_config_note: str = ""
    #: FP8 with ``--first-last-layers-bf16``: Megatron asks for a second, bf16 set of userbuffers.
    tp_bf16_set: bool = False
    #: Megatron ``--cp-comm-type`` (one for all layers, or one per layer): how Transformer Engine's
    #: context-parallel attention exchanges keys and values (its backward buffers differ).
    cp_comm_types: tuple[CpCommType, ...] = ("p2p",)
    #: Megatron ``--overlap-moe-expert-parallel-comm``: the combined 1F1B schedule runs one
    #: micro-batch's forward layers beside another's backward layers.
    ep_a2a: bool = False
    #: Megatron ``--delay-wgrad-compute`` (combined 1F1B only): Transformer Engine's linears keep each
    #: GEMM's input and output gradient until the schedule runs their weight gradient (``backward_dw``).
    delay_wgrad: bool = False
    #: Megatron ``--ep-overlap-early-attn-memory-release`` (combined 1F1B only): a layer's attention
    #: backward runs before the next micro-batch's MLP forward instead of after its combine.
    early_attn_release: bool = False
    #: Megatron ``--overlap-dispatch-backward-with-experts-wgrad`` (plain schedules): the routed
    #: experts' weight gradients wait for the dispatch backward (side stream), their GEMM operands kept.
    experts_wgrad_overlap: bool = False
    #: Megatron ``--moe-shared-expert-overlap``: the shared expert runs on a side stream beside the
    #: dispatch, gathering its own sequence-parallel input (which its first GEMM then saves).
    shared_expert_overlap: bool = False
    #: Megatron ``--moe-flex-dispatcher-backend`` (``flex`` dispatcher only).
    flex_backend: FlexBackend = "deepep"
    #: Megatron ``--moe-flex-dispatcher-num-sms``: SMs DeepEP's kernels use (its buffer has a channel
    #: per two SMs); None: Megatron's 20.
    flex_num_sms: int | None = None

    def __post_init__(self) -> None:
        if not self.cp_comm_types:
            raise JobConfigError("--cp-comm-type", "needs at least one type", self.cp_comm_types)
        for kind in self.cp_comm_types:
            _check_choice("--cp-comm-type", kind, get_args(CpCommType))
        _check_choice("--moe-flex-dispatcher-backend", self.flex_backend, get_args(FlexBackend))
        if self.flex_num_sms is not None:
            _check_int("--moe-flex-dispatcher-num-sms", self.flex_num_sms, minimum=2, maximum=1024)
            if self.flex_num_sms % 2:
                raise JobConfigError("--moe-flex-dispatcher-num-sms", "must be even (DeepEP asserts it)",
                                     self.flex_num_sms)
        names = [o.name for o in self.tp_overrides]
        if len(set(names)) != len(names):
            raise JobConfigError("--tp-comm-overlap-cfg", "names a GEMM twice", ", ".join(names))


#: Megatron ``--cuda-graph-impl`` values (megatron/core/transformer/transformer_config.py ``cuda_graph_impl``).
CudaGraphImpl = Literal["none", "local", "transformer_engine", "full_iteration"]
#: Megatron ``--cuda-graph-modules`` choices memplan prices (``CudaGraphModule`` of
#: megatron/core/transformer/cuda_graph_config.py, without ``mamba``: memplan has no Mamba layers).
CUDA_GRAPH_MODULES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess")


@frozen_dataclass(kw_only=True)
class CudaGraphs:
    """Megatron-LM CUDA graphs (:mod:`memplan.estimate.cuda_graphs` prices them)."""

    #: ``local``: Megatron's ``CudaGraphManager``; ``transformer_engine``: TE's
    #: ``make_graphed_callables``; ``full_iteration``: one graph of the forward-backward step.
    impl: CudaGraphImpl = knob("none", "--cuda-graph-impl", "Megatron CUDA graphs: per-layer graphs (local, "
                               "transformer_engine) or the whole forward-backward (full_iteration); captured "
                               "regions allocate from a private pool kept for the run.", panel=ACTIVATIONS)
    #: Megatron ``--cuda-graph-modules`` as a comma list; empty: the whole decoder layer.
    modules: str = knob("", "--cuda-graph-modules", "What the per-layer graphs capture: a comma list of "
                        f"{', '.join(CUDA_GRAPH_MODULES)}. (default: the whole decoder layer)", panel=ACTIVATIONS,
                        metavar="LIST")

    def __post_init__(self) -> None:
        _check_choice("--cuda-graph-impl", self.impl, get_args(CudaGraphImpl))
        names = _module_names("--cuda-graph-modules", self.modules, CUDA_GRAPH_MODULES,
                              {"mamba": "mamba captures Mamba layers, which memplan does not model"})
        if "moe_preprocess" in names and "moe_router" not in names:
            raise JobConfigError("--cuda-graph-modules", "moe_preprocess must be used together with moe_router "
                                 "(Megatron's rule)", self.modules)
        if names and self.impl == "full_iteration":
            raise JobConfigError("--cuda-graph-modules", "must be empty with --cuda-graph-impl full_iteration "
                                 "(Megatron asserts it)", self.modules)
        object.__setattr__(self, "modules", ",".join(names))

    @property
    def module_names(self) -> tuple[str, ...]:
        """The captured modules; () means the whole decoder layer."""
        return tuple(name for name in self.modules.split(",") if name)


#: What ``--lora-targets all-linear`` selects: every linear layer of the decoder, not the output
#: head (peft's ``INCLUDE_LINEAR_LAYERS_SHORTHAND``).
ALL_LINEAR = "all-linear"
#: Dtypes a bitsandbytes quantized layer can compute in (``bnb_4bit_compute_dtype``).
QUANT_COMPUTE_DTYPES = ("fp32", "bf16", "fp16")


def _name_list(flag: str, text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in str(text).split(",") if part.strip())
    for name in names:
        if not all(c.isalnum() or c in "_.-*" for c in name):
            raise JobConfigError(flag, "must be a comma list of module names (letters, digits, _ . - *)", text)
    return names


@frozen_dataclass(kw_only=True)
class FineTuning:
    """What trains and how: PEFT adapters, frozen and quantized base weights.

    Frozen parameters keep no gradient and no optimizer state. With ``peft`` set, only the adapters
    (and ``modules_to_save``) train unless ``trainable`` says otherwise.
    """

    peft: PeftMethod = knob("none", "--peft", "Parameter-efficient fine-tuning method (peft): LoRA adapters, or "
                            "DoRA (LoRA plus a magnitude vector per output feature).", panel=FINETUNE)
    lora_rank: int = knob(8, "--lora-rank", "LoRA rank r of every adapter.", panel=FINETUNE, metavar="R")
    lora_alpha: float = knob(8.0, "--lora-alpha", "LoRA alpha (scaling alpha/r, or alpha/sqrt(r) with --rslora); "
                             "no memory effect.", panel=FINETUNE, metavar="A")
    #: peft applies dropout to the adapter's input and autograd keeps the dropped-out copy (and its mask).
    lora_dropout: float = knob(0.0, "--lora-dropout", "Dropout on each adapter's input (keeps a dropped-out copy "
                               "of the input).", panel=FINETUNE, metavar="P")
    lora_targets: str = knob("auto", "--lora-targets", "Modules that get adapters: a comma list of names "
                             "(q_proj,v_proj,...), all-linear (every decoder linear, not the head), or auto "
                             "(peft's default for the model type: q_proj,v_proj for Llama, Mistral, Qwen, Gemma; "
                             "c_attn for GPT-2; query_key_value for GPT-NeoX; q_proj,v_proj, said in the result, "
                             "where peft has none).", panel=FINETUNE, metavar="NAMES")
    #: peft ``rank_pattern``: ``name=rank`` pairs overriding ``lora_rank`` for matching modules.
    lora_rank_pattern: str = knob("", "--lora-rank-pattern", "Per-module ranks: comma list of NAME=R (peft "
                                  "rank_pattern), e.g. o_proj=16,down_proj=32.", panel=FINETUNE, metavar="NAME=R,...")
    rslora: bool = knob(False, "--rslora", "Rank-stabilised LoRA scaling alpha/sqrt(r); no memory effect.",
                        panel=FINETUNE)
    #: ``auto``: the adapters (and ``modules_to_save``) with --peft, everything without.
    trainable: str = knob("auto", "--trainable", "What trains: auto (adapters with --peft, else all), all, "
                          "adapters, or a comma list of module names/patterns trained fully (e.g. "
                          "layers.31,norm,lm_head); everything else is frozen.", panel=FINETUNE, metavar="WHAT")
    #: peft ``modules_to_save``: a trainable copy of each module beside the frozen original.
    modules_to_save: str = knob("", "--modules-to-save", "Modules peft trains fully as a copy beside the frozen "
                                "original (e.g. lm_head,embed_tokens).", panel=FINETUNE, metavar="NAMES")
    quantize_base: QuantizeBase = knob("none", "--quantize-base", "Quantize the frozen base weights with "
                                       "bitsandbytes: 4-bit NF4/FP4 (QLoRA) or 8-bit LLM.int8.", panel=FINETUNE)
    double_quant: bool = knob(True, "--double-quant", "4-bit only: quantize the per-block absmax too "
                              "(bnb_4bit_use_double_quant).", panel=FINETUNE)
    quant_compute_dtype: str | None = knob(None, "--quant-compute-dtype", "dtype the quantized layers "
                                           "dequantize to and compute in (bnb_4bit_compute_dtype). (default: the "
                                           "precision's compute dtype)", panel=FINETUNE)
    #: Fine-tuners load the base in 16 bits (``torch_dtype=torch.bfloat16``): frozen weights need no
    #: fp32 master; ``fp32`` keeps them as full fine-tuning under ``*-mixed`` would.
    frozen_dtype: str | None = knob(None, "--frozen-dtype", "dtype of frozen, unquantized weights. (default: the "
                                    "compute dtype, as a base loaded with torch_dtype=bfloat16)", panel=FINETUNE)
    #: ``auto``: the framework's (its profile's ``adapter_dtype``): fp32 as peft's
    #: ``get_peft_model(autocast_adapter_dtype=True)`` upcasts 16-bit adapters (DeepSpeed's engine casts them back to
    #: the model's dtype, :func:`resolved_adapter_dtype`); ``bf16`` is what torchtune
    #: keeps and what peft keeps with ``autocast_adapter_dtype=False`` on a bf16 base.
    adapter_dtype: AdapterDtype = knob("auto", "--adapter-dtype", "dtype of the adapters (lora_A/B, DoRA "
                                       "magnitudes): their weights, gradients, optimizer states and the "
                                       "activations they compute (under FSDP's mixed precision they compute "
                                       "in its param dtype). auto: the framework's (fp32, peft's "
                                       "autocast_adapter_dtype=True; deepspeed below ZeRO-3: the model's dtype, "
                                       "as deepspeed.initialize casts them).", panel=FINETUNE)

    def __post_init__(self) -> None:
        _check_choice("--peft", self.peft, get_args(PeftMethod))
        _check_choice("--quantize-base", self.quantize_base, get_args(QuantizeBase))
        _check_choice("--adapter-dtype", self.adapter_dtype, get_args(AdapterDtype))
        _check_int("--lora-rank", self.lora_rank, maximum=1_000_000)
        if not isinstance(self.lora_alpha, (int, float)) or isinstance(self.lora_alpha, bool) or self.lora_alpha <= 0:
            raise JobConfigError("--lora-alpha", "must be a positive number", self.lora_alpha)
        if not isinstance(self.lora_dropout, (int, float)) or not 0.0 <= self.lora_dropout < 1.0:
            raise JobConfigError("--lora-dropout", "must be in [0, 1)", self.lora_dropout)
        targets = str(self.lora_targets).strip()
        if targets not in ("auto", ALL_LINEAR):
            if not _name_list("--lora-targets", targets):
                raise JobConfigError("--lora-targets", "must name at least one module, or be all-linear or auto",
                                     self.lora_targets)
            targets = ",".join(_name_list("--lora-targets", targets))
        object.__setattr__(self, "lora_targets", targets)
        self.rank_pattern  # noqa: B018  (validates)
        trainable = str(self.trainable).strip()
        if trainable not in ("auto", "all", "adapters"):
            if not _name_list("--trainable", trainable):
                raise JobConfigError("--trainable", "must be auto, all, adapters or a comma list of module names",
                                     self.trainable)
            trainable = ",".join(_name_list("--trainable", trainable))
        object.__setattr__(self, "trainable", trainable)
        object.__setattr__(self, "modules_to_save", ",".join(_name_list("--modules-to-save", self.modules_to_save)))
        if not self.peft_kind.adapters:
            if self.trainable == "adapters":
                raise JobConfigError("--trainable", f"adapters needs --peft {either(ADAPTER_METHODS)}", self.trainable)
            if self.modules_to_save:
                raise JobConfigError("--modules-to-save", f"needs --peft {either(ADAPTER_METHODS)} (it is a peft "
                                     "setting)", self.modules_to_save)
        if self.quant_kind.quantizes:
            if self.trainable == "all" or self.resolved_trainable == "all":
                raise JobConfigError(
                    "--quantize-base", "needs frozen base weights: quantized weights cannot train (use --peft lora, "
                    "as QLoRA does, or --trainable with the modules to train)", self.quantize_base)
        if self.quant_compute_dtype is not None:
            dtype = normalize_dtype(self.quant_compute_dtype, field="--quant-compute-dtype")
            if dtype not in QUANT_COMPUTE_DTYPES:
                raise JobConfigError("--quant-compute-dtype", "bitsandbytes dequantizes to fp32, bf16 or fp16 only",
                                     self.quant_compute_dtype)
            if not self.quant_kind.quantizes:
                raise JobConfigError("--quant-compute-dtype", "only applies with --quantize-base "
                                     f"{either(QUANTIZING_FORMATS)}", self.quant_compute_dtype)
            object.__setattr__(self, "quant_compute_dtype", dtype)
        if self.frozen_dtype is not None:
            dtype = normalize_dtype(self.frozen_dtype, field="--frozen-dtype")
            if dtype not in QUANT_COMPUTE_DTYPES:
                raise JobConfigError("--frozen-dtype", "must be fp32, bf16 or fp16", self.frozen_dtype)
            if not self.has_frozen:
                raise JobConfigError("--frozen-dtype", "only applies with frozen weights (--peft, --quantize-base or "
                                     "--trainable); this job trains every weight", self.frozen_dtype)
            object.__setattr__(self, "frozen_dtype", dtype)

    @property
    def rank_pattern(self) -> dict[str, int]:
        """``--lora-rank-pattern`` as ``{name: rank}``."""
        out: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in str(self.lora_rank_pattern).split(","))):
            name, sep, rank = item.partition("=")
            name, rank = name.strip(), rank.strip()
            if not sep or not name or not rank.isdigit() or int(rank) < 1 or int(rank) > 1_000_000:
                raise JobConfigError("--lora-rank-pattern", "must be a comma list of NAME=R with R a positive "
                                     "integer", self.lora_rank_pattern)
            out[name.strip()] = int(rank)
        return out

    @property
    def resolved_trainable(self) -> str:
        """``all``, ``adapters`` or a comma list of module names (``auto`` resolved)."""
        if self.trainable == "auto":
            return "adapters" if self.peft_kind.adapters else "all"
        return self.trainable

    @property
    def peft_kind(self) -> PeftMethodKind:
        """The ``--peft`` registry entry (:mod:`memplan.tuning.peft_methods`)."""
        return peft_method(self.peft)

    @property
    def quant_kind(self) -> QuantFormat:
        """The ``--quantize-base`` registry entry (:mod:`memplan.tuning.quant_formats`)."""
        return quant_format(self.quantize_base)

    @property
    def has_frozen(self) -> bool:
        """Some base weights do not train."""
        return self.resolved_trainable != "all"

    @property
    def partial(self) -> bool:
        """Not full training: adapters, frozen or quantized base weights."""
        return self.peft_kind.adapters or self.has_frozen or self.quant_kind.quantizes


@frozen_dataclass(kw_only=True)
class Job:
    """Everything about a training job except the model architecture."""

    parallel: Parallelism = field(default_factory=Parallelism)
    sharding: Sharding = field(default_factory=Sharding)
    batch: Batch = field(default_factory=Batch)
    precision: Precision = field(default_factory=Precision)
    optimizer: Optimizer = field(default_factory=Optimizer)
    recompute: Recompute = field(default_factory=Recompute)
    #: ``memplan trace`` runs both flash and sdpa as PyTorch SDPA (its flash kernel on CUDA).
    attention: AttentionImpl = knob("flash", "--attention", "Attention kernel: flash/sdpa keep no s*s score "
                                    "matrix; eager keeps scores and softmax.", panel=ACTIVATIONS)
    dropout: float = knob(0.0, "--dropout", "Dropout probability on hidden states (embedding, residuals: "
                          "where the model's code has them; Llama-style Hugging Face models have none) and, unless "
                          "--attention-dropout is given, on the attention probabilities (masks are kept).",
                          panel=ACTIVATIONS, metavar="P")
    #: Dropout on the attention probabilities where it differs from ``dropout`` (Megatron ``--attention-dropout``
    #: beside ``--hidden-dropout``); None: the same as ``dropout``. Only an unfused attention kernel keeps its mask.
    attention_dropout: float | None = knob(None, "--attention-dropout", "Dropout probability on the attention "
                                           "probabilities when it differs from --dropout (an unfused kernel keeps "
                                           "its mask). (default: --dropout)", panel=ACTIVATIONS, metavar="P")
    loss: LossImpl = knob("auto", "--loss", "How logits and cross-entropy are materialised; auto = the framework "
                          "profile's.", panel=ACTIVATIONS)
    #: ``torch.compile`` of every decoder layer (torchtitan ``[compile] enable``, torchtune ``compile``, Hugging
    #: Face ``torch_compile``): a layer keeps what AOT autograd's min-cut partitioner saves
    #: (:mod:`memplan.estimate.compiled`); what is not priced is reported in ``unmodelled_settings``.
    compile: bool = knob(False, "--compile", "torch.compile: each decoder layer keeps what AOT autograd's "
                         "min-cut partitioner saves (default settings); inductor's own buffers are not "
                         "modelled (docs/estimate.md).", panel=ACTIVATIONS)
    #: With ``compile``: whether the cross-entropy is compiled too (:mod:`memplan.estimate.compiled_loss`);
    #: ``auto`` is the framework profile's ``compiles_loss``.
    compile_loss: Literal["auto", "on", "off"] = knob(
        "auto", "--compile-loss", "With --compile, whether the loss is compiled too (a compiled cross-entropy "
        "keeps the 16-bit logits and two fp32 values per token); auto = the framework's (torchtitan's default "
        "compile.components; the Hugging Face model's loss, computed in its compiled forward).", panel=ACTIVATIONS)
    #: Issue 25, item 8: ``fixed`` prices the reserved memory as the peak allocated over (1 - fragmentation);
    #: ``simulated`` replays an allocation schedule built from the estimate's own contributions through
    #: memplan's model of PyTorch's caching allocator (:mod:`memplan.estimate.reserved_sim`).
    reserved: ReservedMode = knob("auto", "--reserved", "How reserved memory is estimated: fixed = peak allocated "
                                  "/ (1 - fragmentation); simulated = PyTorch's caching allocator simulated on "
                                  "the estimate's allocation schedule; auto = the framework profile's (simulated under hf and "
                                  "torchtitan without pipeline parallelism, else fixed).",
                                  panel=ACTIVATIONS)
    #: Megatron ``--defer-embedding-wgrad-compute``: the output layer's weight gradient is
    #: computed after the pipeline drains, so each finished micro-batch keeps its logits gradient
    #: and the layer input; ``--wgrad-deferral-limit`` caps how many (0 = all).
    defer_embedding_wgrad: bool = False
    wgrad_deferral_limit: int = 0
    #: The profile (memplan.profiles.framework) decides every ``auto`` default for all engines.
    framework: FrameworkName = knob("megatron", "--framework", "Whose implementation decides buffers, dtypes, "
                                    "kernels and workspaces (memplan trace: hf unless given).", panel=ACTIVATIONS)
    vocab_divisible_by: int | None = knob(None, "--make-vocab-size-divisible-by", "Pad the vocabulary to a "
                                          "multiple of this x tp. (default: the framework's)", panel=ACTIVATIONS)
    #: DeepSeek-V3 depth D; Megatron ``--mtp-num-layers``. Hugging Face and torchtitan train none.
    mtp_layers: int = knob(0, "--mtp-layers", "Multi-token-prediction modules trained on the last pipeline stage.",
                           panel=MOE)
    #: Token routing and dispatch of MoE layers.
    moe: MoEOptions = field(default_factory=MoEOptions)
    #: What is kept in CPU memory.
    offload: Offload = field(default_factory=Offload)
    #: What trains: adapters, frozen and quantized base weights.
    finetune: FineTuning = field(default_factory=FineTuning)
    #: Communication overlap with buffers of its own (Megatron / Transformer Engine).
    overlap: CommOverlap = field(default_factory=CommOverlap)
    #: Megatron ``--transformer-impl``: ``local`` layers use Megatron's global memory buffer for their
    #: sequence-parallel all-gathers and unfused attention scores.
    transformer_impl: TransformerImpl = "transformer_engine"
    #: The job was read from a torchtitan TOML: under ``--framework torchtitan`` (its default there) it runs
    #: torchtitan's own model code, whose layers save less than transformers' modules
    #: (:mod:`memplan.frameworks.model_code`); another typed ``--framework`` prices that framework's code.
    torchtitan_model: bool = False
    #: Megatron CUDA graphs.
    cuda_graphs: CudaGraphs = field(default_factory=CudaGraphs)

    def __post_init__(self) -> None:
        _check_choice("--attention", self.attention, get_args(AttentionImpl))
        _check_choice("--loss", self.loss, get_args(LossImpl))
        _check_choice("--reserved", self.reserved, get_args(ReservedMode))
        _check_choice("--framework", self.framework, get_args(FrameworkName))
        if not 0.0 <= self.dropout < 1.0:
            raise JobConfigError("--dropout", "must be in [0, 1)", self.dropout)
        if self.attention_dropout is not None and not 0.0 <= self.attention_dropout < 1.0:
            raise JobConfigError("--attention-dropout", "must be in [0, 1)", self.attention_dropout)
        if self.vocab_divisible_by is not None:
            _check_int("--make-vocab-size-divisible-by", self.vocab_divisible_by)
        _check_int("--wgrad-deferral-limit", self.wgrad_deferral_limit, minimum=0)
        _check_int("--mtp-layers", self.mtp_layers, minimum=0, maximum=64)
        self._check_batch()
        self._check_offload()
        _check_choice("--transformer-impl", self.transformer_impl, get_args(TransformerImpl))
        profile = get_profile(self.framework)
        rc = self.recompute
        activation_policy_name(profile, mode=rc.mode, modules=rc.modules, memory_budget=rc.memory_budget,
                               fine_tuning=self.finetune.partial)
        self._check_optimizer()  # the optimizer's registry entry: frameworks that run it, its settings
        check_features(self, profile)  # the framework-specific options the profile does not run
        if self.compile and profile.compile_scope == "none":
            raise JobConfigError("--compile", f"{self.framework} has no option to torch.compile its model (Megatron-LM "
                                 "compiles only its own fused kernels, which memplan prices); use --framework "
                                 "torchtitan, hf or deepspeed", True)
        if self.compile_loss == "on" and not self.compile:
            raise JobConfigError("--compile-loss", "needs --compile (the loss is compiled with the model)", "on")
        for rule in profile.job_rules:  # the framework's own assertions (Megatron's transformer_config.py)
            rule(self)
        self._check_sharding(profile.fsdp_refusal)
        self._check_trained_dtypes(profile.one_trained_dtype_zero)
        if self.optimizer.in_backward and self.num_microbatches > 1:
            raise JobConfigError("--optimizer-in-backward", "cannot accumulate gradients over micro-batches (each "
                                 "gradient is freed by its step); drop --gbs or set it to mbs*dp",
                                 self.batch.global_batch_size)

    def _check_sharding(self, fsdp_refusal: str | None) -> None:
        """Sharding switches of different frameworks that contradict each other (``fsdp_refusal``: the
        profile's reason it has no FSDP)."""
        sh = self.sharding
        if sh.distributed_optimizer and sh.zero:
            raise JobConfigError("--distributed-optimizer", f"cannot be combined with --zero {sh.zero}: both shard the "
                                 "optimizer states (Megatron's distributed optimizer is its own ZeRO-1); choose one",
                                 f"--zero {sh.zero}")
        if sh.fsdp != "none" and fsdp_refusal is not None:
            raise JobConfigError("--fsdp", fsdp_refusal, f"--framework {self.framework}")

    def _check_trained_dtypes(self, stages: tuple[int, ...]) -> None:
        """An engine that flattens every trained partition into one buffer of one dtype at these ZeRO ``stages``
        (the profile's ``one_trained_dtype_zero``) cannot take adapters beside ``modules_to_save`` copies or
        ``--trainable`` base weights of another dtype (both keep the base's dtype)."""
        sh, ft = self.sharding, self.finetune
        beside = ft.modules_to_save or (ft.peft_kind.adapters and ft.resolved_trainable != "adapters")
        if sh.zero not in stages or sh.fsdp != "none" or self.offload.params or not beside:
            return
        adapters, copies = resolved_adapter_dtype(self), ft.frozen_dtype or self.precision.compute_dtype
        if adapters != copies:
            what = (f"--modules-to-save copies ({ft.modules_to_save})" if ft.modules_to_save
                    else f"--trainable base weights ({ft.resolved_trainable})")
            raise JobConfigError(
                "--adapter-dtype", f"{adapters} adapters beside {copies} {what}"
                f" cannot run under --framework {self.framework} --zero {sh.zero}: its engine moves all trained "
                "parameters into one flat buffer of one dtype (DeepSpeed asserts it in deepspeed.initialize); give "
                f"--adapter-dtype {copies}, or --offload-params", self.finetune.adapter_dtype)

    def _check_offload(self) -> None:
        sh, off = self.sharding, self.offload
        if off.optimizer and not (sh.zero >= 1 or sh.fsdp != "none" or sh.distributed_optimizer):
            raise JobConfigError(
                "--offload-optimizer",
                "needs sharded optimizer states (--zero 1/2/3, --fsdp or --distributed-optimizer), "
                "as ZeRO-Offload, FSDP CPU offload and Megatron's optimizer offload do",
                f"zero={sh.zero}, fsdp={sh.fsdp}",
            )
        if off.params and not (sh.zero == 3 or sh.fsdp != "none"):
            raise JobConfigError(
                "--offload-params",
                "needs sharded parameters (--zero 3 or --fsdp full/hybrid): only ZeRO-3 and FSDP offload weights",
                f"zero={sh.zero}, fsdp={sh.fsdp}",
            )
        if off.params and sh.fsdp != "none" and not off.optimizer:
            # FSDP's CPUOffloadPolicy moves parameters, gradients and the optimizer step together.
            object.__setattr__(self, "offload", replace(off, optimizer=True))

    def _check_optimizer(self) -> None:
        """Refuse an optimizer the framework cannot run, or in a setting its entry rules out."""
        ft, sh = self.finetune, self.sharding
        rule = optimizer_kind(self.optimizer.name).refusal(
            framework=self.framework,
            full_training=not ft.partial,
            sharded=sh.zero > 0 or sh.fsdp != "none" or sh.distributed_optimizer or self.parallel.tp > 1,
            implementation=self.optimizer.implementation)
        if rule:
            raise JobConfigError("--optimizer", rule, self.optimizer.name)

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
    def attention_probability_dropout(self) -> float:
        """Dropout on the attention probabilities: ``attention_dropout``, or ``dropout`` when not given."""
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        gbs = self.batch.global_batch_size
        if gbs is None:
            return 1
        return gbs // (self.batch.micro_batch_size * self.parallel.data_parallel)


def default_uneven_split(num_layers: int, pp: int) -> tuple[int, int] | None:
    """Layers per stage when ``pp`` does not divide them and no split is given: ``ceil(L/pp)`` on
    each of the first ``pp - 1`` stages and the remainder on the last (DeepSeek-V3's 61 layers on 16
    stages: 4 + 14 x 4 + 1). Returns (per stage, last stage), or None when the last would be empty.
    """
    each = -(-num_layers // pp)
    last = num_layers - each * (pp - 1)
    return (each, last) if last >= 1 else None


def resolved_optimizer_impl(job: Job) -> str:
    """``foreach``, ``fused`` or ``for-loop``: ``--optimizer-impl``, or the job's framework default
    for ``auto`` — the one rule every engine uses."""
    impl = job.optimizer.implementation
    return impl if impl != "auto" else get_profile(job.framework).default_optimizer_impl


def resolved_adapter_dtype(job: Job) -> str:
    """The adapters' dtype: ``--adapter-dtype``, or the job's framework default for ``auto``; a default of ``model``
    (the engine casts every parameter to the model's dtype) is the compute dtype, but fp32 (peft's) at ZeRO-3, whose
    model is built under ``zero.Init`` and not cast (``is_zero_init_model``)."""
    dtype = job.finetune.adapter_dtype
    if dtype != "auto":
        return dtype
    dtype = get_profile(job.framework).adapter_dtype
    if dtype != "model":
        return dtype
    return "fp32" if job.sharding.zero == 3 else job.precision.compute_dtype


def resolved_loss(job: Job) -> str:
    """The loss path: ``--loss``, or the job's framework default for ``auto``."""
    return job.loss if job.loss != "auto" else get_profile(job.framework).default_loss
