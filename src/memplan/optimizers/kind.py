"""What one optimizer is: the object each registry entry is, and the questions the engines ask it.

An :class:`OptimizerKind` carries everything memplan knows about one ``--optimizer`` value: the
states it keeps and their element sizes (for the estimator), the temporaries of its step, how the
tracer builds the real optimizer, the names each input dialect gives it and the frameworks that can
run it. Nothing here imports torch or the job: the engines hand the entry plain values
(:class:`StateQuery`, :class:`StepQuery`, :class:`TraceRequest`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import field
from typing import TYPE_CHECKING, Any, Protocol

from memplan.errors import MissingDependencyError
from memplan.frozen import frozen_dataclass

if TYPE_CHECKING:
    from memplan.model.linears import LinearModule

__all__ = [
    "DialectNames",
    "MegatronFlag",
    "OptimizerKind",
    "OptimizerSettings",
    "OptimizerStates",
    "SmallTensors",
    "StateQuery",
    "StepQuery",
    "WeightMatrix",
    "TraceRequest",
    "import_package",
    "torch_step_bytes",
]


class OptimizerSettings(Protocol):
    """The job's optimizer section (:class:`memplan.job.Optimizer`), as the entries read it."""

    @property
    def name(self) -> str: ...
    @property
    def momentum(self) -> float: ...
    @property
    def muon_tp_mode(self) -> str: ...
    @property
    def muon_nesterov(self) -> bool: ...
    @property
    def galore_rank(self) -> int: ...


@frozen_dataclass
class SmallTensors:
    """The stepped tensors an optimizer prices apart: bitsandbytes' small ones, Adafactor's vectors, and
    the 2-D weights GaLore projects."""

    #: In tensors of fewer than bitsandbytes' ``min_8bit_size`` elements (fp32 states even for 8-bit optimizers).
    below_8bit: int = 0
    #: In tensors of fewer than bitsandbytes' paging threshold (never paged).
    below_paged: int = 0
    #: Elements of 1-D tensors (norms, biases): Adafactor keeps their second moment unfactored.
    vectors: int = 0
    #: The linear layers of the stage's decoder layers, unsharded, named as in Hugging Face's model
    #: relative to the layer (``self_attn.q_proj``): the weights a low-rank optimizer (GaLore) picks from.
    linears: tuple[LinearModule, ...] = ()
    #: Elements of the stage's untied output-head weight (0: none or tied), the last parameter a Hugging Face
    #: model lists: what a per-parameter loop steps just before the decoder layers' weights of its next group.
    head: int = 0

    def scaled(self, fraction: float) -> SmallTensors:
        """The same split for a ``fraction`` of the tensors (a data-parallel shard)."""
        return SmallTensors(below_8bit=int(self.below_8bit * fraction), below_paged=int(self.below_paged * fraction),
                            vectors=int(self.vectors * fraction), linears=self.linears,
                            head=self.head)


@frozen_dataclass
class OptimizerStates:
    """Optimizer state bytes: in PyTorch's caching allocator, and in CUDA unified memory (paged)."""

    device_bytes: int
    paged_bytes: int = 0
    #: Peak bytes the step allocates beyond what :class:`StepQuery` prices from sizes alone (GaLore's
    #: projection of its largest matrix); 0 for most optimizers.
    step_bytes: int = 0


@frozen_dataclass
class WeightMatrix:
    """One 2-D weight an optimizer steps alone (Muon): its full shape and how tensor parallelism splits it."""

    rows: int
    cols: int
    #: Tensor-parallel group size of the weight (1: not split).
    tp: int = 1
    #: The split dimension (0: column-parallel rows, 1: row-parallel columns); None: replicated.
    partition_dim: int | None = None
    #: Bytes alive before its step starts (fp32 copies of the fused weight it is a part of).
    before: int = 0


@frozen_dataclass
class StateQuery:
    """What the estimator knows when it prices one GPU's optimizer states."""

    #: Elements the optimizer steps on this GPU (after sharding).
    numel: int
    #: Element size of torch optimizers' states (the precision's).
    state_bytes: int
    hidden: int
    small: SmallTensors
    settings: OptimizerSettings
    #: Muon: of ``numel``, the elements its scalar optimizer (Adam) steps.
    muon_scalar: int = 0
    #: The stage's 2-D weights on this rank, for an entry with :attr:`OptimizerKind.weight_matrices`.
    matrices: tuple[WeightMatrix, ...] = ()


@frozen_dataclass
class StepQuery:
    """What the estimator knows when it prices the step's temporaries."""

    #: ``foreach``, ``fused`` or ``for-loop``: ``--optimizer-impl`` or the framework's default.
    implementation: str
    stepped_numel: int
    largest_tensor: int
    state_bytes: int
    in_backward: bool


@frozen_dataclass
class TraceRequest:
    """What the tracer gives an entry's ``build`` to make the real optimizer (torch is loaded by then)."""

    #: The parameters that train (``requires_grad``).
    params: list[Any]
    #: The same parameters in one group per tensor type (DTensor and plain tensors apart, for foreach).
    groups: list[dict[str, Any]]
    #: The module the parameters belong to, when the caller passed it (None: parameters only).
    model: Any
    implementation: str
    device: str
    learning_rate: float
    settings: OptimizerSettings


@frozen_dataclass
class MegatronFlag:
    """A Megatron-LM argument the optimizer reads (``--sgd-momentum``): how it maps onto the job."""

    flag: str
    #: The :class:`memplan.job.Optimizer` field it sets.
    field: str
    #: ``float``, ``str`` or ``flag`` (a store_true switch).
    kind: str
    default: object
    #: The values memplan models (empty: any); another is refused naming the flag.
    modelled: tuple[str, ...] = ()


@frozen_dataclass
class DialectNames:
    """The names each input dialect gives the optimizer (empty: that dialect cannot name it)."""

    #: Megatron-LM ``--optimizer`` values, the canonical one first.
    megatron: tuple[str, ...] = ()
    megatron_flags: tuple[MegatronFlag, ...] = ()
    #: DeepSpeed ``optimizer.type`` values, lower case; DeepSpeed builds them with ``fused`` kernels.
    deepspeed: tuple[str, ...] = ()
    #: DeepSpeed ``optimizer.params`` read: (key, Optimizer field, default).
    deepspeed_params: tuple[tuple[str, str, float], ...] = ()
    #: Hugging Face TrainingArguments ``optim`` values and the ``--optimizer-impl`` each means.
    hf: tuple[tuple[str, str], ...] = ()
    #: Hugging Face ``optim_args`` keys read ("rank=64"): (key, Optimizer field); and keys without memory effect.
    hf_optim_args: tuple[tuple[str, str], ...] = ()
    hf_optim_args_no_effect: tuple[str, ...] = ()
    #: torchtitan ``[optimizer] name`` values.
    torchtitan: tuple[str, ...] = ()
    #: torchtune's ``optimizer._component_`` a config emitted for it names (empty: torchtune's default AdamW).
    torchtune: str = ""


def _no_description(settings: OptimizerSettings) -> str:
    return ""


@frozen_dataclass(kw_only=True)
class OptimizerKind:
    """One optimizer: its states, its step, its real implementation, its names, where it runs."""

    #: The ``--optimizer`` value.
    name: str
    #: One line for the docs and ``--help``.
    summary: str
    #: The states it keeps for :attr:`StateQuery.numel` stepped elements.
    states: Callable[[StateQuery], OptimizerStates]
    #: Extra bytes alive while it steps.
    step_temporaries: Callable[[StepQuery], int]
    #: The assumption line (empty: nothing beyond its name).
    describe: Callable[[OptimizerSettings], str] = _no_description
    #: Its pricing needs :class:`SmallTensors` (bitsandbytes thresholds, Adafactor vectors, GaLore matrices).
    small_tensors: bool = False
    #: Its pricing needs the stage's 2-D weights with their TP split (:attr:`StateQuery.matrices`) and the
    #: elements its scalar optimizer steps (:attr:`StateQuery.muon_scalar`): Muon.
    weight_matrices: bool = False
    #: torch.optim's Adam/AdamW: one fp32 ``step`` tensor per parameter on the GPU when fused.
    fused_step_counters: bool = False
    #: bitsandbytes paged states (CUDA unified memory).
    paged: bool = False
    #: Frameworks that can run it (None: every framework), and the rule refusing the others (``{framework}``:
    #: the job's).
    frameworks: frozenset[str] | None = None
    framework_rule: str = ""
    #: Non-empty: refused when part of the model is frozen or adapters train (this rule).
    full_training_rule: str = ""
    #: Non-empty: refused with ZeRO, FSDP or tensor parallelism (this rule).
    unsharded_rule: str = ""
    #: ``--optimizer-impl`` values it has (an explicit other value is refused); ``auto`` is always accepted.
    implementations: tuple[str, ...] = ("foreach", "fused", "for-loop")
    #: :class:`memplan.job.Optimizer` fields that only apply to this optimizer (their flags are refused otherwise).
    knobs: tuple[str, ...] = ()
    #: The bitsandbytes 8-bit optimizer a memory search may try in its place (empty: none).
    eight_bit_variant: str = ""
    dialects: DialectNames = field(default_factory=DialectNames)
    #: The real optimizer for the tracer (None: not traceable, :attr:`untraceable` says why).
    build: Callable[[TraceRequest], Any] | None = None
    untraceable: str = ""

    def refusal(self, *, framework: str, full_training: bool, sharded: bool, implementation: str) -> str:
        """Why a job cannot run this optimizer (empty: it can). The framework rule comes first."""
        if self.frameworks is not None and framework not in self.frameworks:
            return self.framework_rule.format(framework=framework)
        if self.full_training_rule and not full_training:
            return self.full_training_rule
        if self.unsharded_rule and sharded:
            return self.unsharded_rule
        if implementation != "auto" and implementation not in self.implementations:
            return (f"{self.name} has the {' and '.join(self.implementations)} implementation"
                    f"{'s' if len(self.implementations) > 1 else ''} (--optimizer-impl {implementation} is not one)")
        return ""


def torch_step_bytes(query: StepQuery) -> int:
    """A torch.optim-style step: fused kernels work in place; a foreach step makes one state-sized temporary
    for the whole group (``sqrt(v)`` in ``_multi_tensor_adam``); a for-loop step (or a per-parameter step in
    the backward) one of the largest tensor."""
    if query.implementation == "fused":
        return 0
    if query.implementation == "foreach" and not query.in_backward:
        return query.stepped_numel * query.state_bytes
    return query.largest_tensor * query.state_bytes


def import_package(module: str, *, package: str, optimizer: str, extra: str) -> Any:
    """The optimizer's own package for the tracer; missing, a one-line error naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependencyError(package, feature=f"tracing --optimizer {optimizer}", extra=extra) from None
