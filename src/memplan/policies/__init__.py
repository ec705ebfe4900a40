"""Activation policies: what each decoder layer keeps for its backward and what it makes again.

A policy is declared once (its entry in :mod:`memplan.policies.kinds`: what it keeps and recomputes,
its label and its sentence), resolved once from a :class:`~memplan.job.Job` and its framework
(:func:`resolve_policy`), priced by the estimator (:mod:`memplan.estimate.engine`) and run for real
by the tracer (:mod:`memplan.trace.runners.policies`). Example::

    >>> from memplan.job import Job, Recompute
    >>> resolve_policy(Job(framework="torchtitan", recompute=Recompute(mode="selective"))).name
    'torchtitan-sac'

Policies (``--recompute NAME``; ``selective`` is the chosen framework's own selective policy):

* ``none`` — every layer keeps what autograd saves;
* ``full`` — checkpointed layers keep only their input (Megatron ``--recompute-granularity full``
  with ``--recompute-method uniform|block`` and ``--recompute-num-layers N``; Hugging Face
  ``gradient_checkpointing``; torchtitan ``mode = "full"``; DeepSpeed activation checkpointing, whose
  ``partition_activations`` / ``cpu_checkpointing`` / contiguous buffers move the kept inputs);
* ``megatron-selective`` — Megatron ``--recompute-granularity selective --recompute-modules ...``:
  each listed sub-module is checkpointed on its inputs (default ``core_attn``);
* ``attention-core`` — Megatron-DeepSpeed's selective recompute: the attention core only;
* ``attention-module`` — every attention module (``self_attn``) under non-reentrant
  ``torch.utils.checkpoint``: what a Hugging Face model can wrap;
* ``torchtitan-sac`` — torchtitan's per-op selective activation checkpointing of every block;
* ``memory-budget`` — torchtitan ``mode = "memory_budget"``: torch.compile's partitioner keeps at
  most the budget fraction of what it could save above the compiled region's inputs
  (``torch._functorch.config.activation_memory_budget``); priced as that upper bound.

Activation offloading (``--offload-activations``) is carried by every policy as :attr:`offload`.

Known limitations: the memory-budget policy is an upper bound (the knapsack may keep less); the
tracer cannot run it (it needs torch.compile's partitioner).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal, get_args

from memplan.frozen import frozen_dataclass
from memplan.job import Job
from memplan.policies.kinds import POLICY_KINDS, PolicyKind, policy_kind
from memplan.profiles import activation_policy_name, get_profile

__all__ = ["HF_MODULES", "POLICY_KINDS", "POLICY_NAMES", "ActivationPolicy", "PolicyKind", "PolicyName",
           "framework_policies", "policy_kind", "resolve_policy"]

PolicyName = Literal["none", "full", "megatron-selective", "attention-core", "attention-module", "torchtitan-sac",
                     "memory-budget"]
POLICY_NAMES: tuple[str, ...] = get_args(PolicyName)
#: Megatron ``--recompute-modules`` that are sub-modules of a Hugging Face layer (``--framework hf``):
#: the attention function, the dense MLP, the sparse MoE block, its shared experts, and as
#: output-discarding checkpoints the input and pre-MLP norms, multi-latent attention's up-projections
#: and RoPE, and the routed experts' activation: every kind Megatron has.
HF_MODULES = ("core_attn", "layernorm", "mla_up_proj", "mlp", "moe", "moe_act", "shared_experts")
#: torchtitan's ``activation_checkpoint.memory_budget`` default (torchtitan/config/job_config.py).
DEFAULT_MEMORY_BUDGET = 0.5

@frozen_dataclass(kw_only=True)
class ActivationPolicy:
    """One resolved activation policy and its parameters (see the module docstring)."""

    name: PolicyName
    framework: str
    #: ``full``: ``uniform`` checkpoints groups of :attr:`num_layers` layers, ``block`` the first
    #: :attr:`num_layers` layers of each stage (None: every layer).
    method: Literal["uniform", "block"] = "uniform"
    num_layers: int | None = None
    #: Reentrant ``torch.utils.checkpoint`` (Hugging Face ``use_reentrant=True``).
    reentrant: bool = False
    #: ``megatron-selective``: the ``--recompute-modules`` it checkpoints.
    modules: tuple[str, ...] = ()
    #: ``memory-budget``: the partitioner's budget b in [0, 1].
    memory_budget: float | None = None
    #: DeepSpeed activation checkpointing switches (they act on ``full``'s kept inputs).
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_checkpoints: int | None = None
    #: Saved activations stream to CPU memory (``--offload-activations``).
    offload: bool = False

    @property
    def kind(self) -> PolicyKind:
        """The policy's registry entry (:mod:`memplan.policies.kinds`): what it keeps and recomputes."""
        return policy_kind(self.name)

    @property
    def kept_classes_key(self) -> str:
        """The :data:`~memplan.estimate.activations.KEPT_BY` key this policy's layers are priced with."""
        return self.kind.kept_classes

    @property
    def recomputes(self) -> bool:
        """Something is made again in the backward."""
        return self.kind.recomputes

    @property
    def input_grads(self) -> bool:
        """The model's input is made to require grad: transformers' ``activation_checkpointing_enable`` calls
        ``enable_input_require_grads`` for checkpointed layers; checkpointing the attention modules alone
        (non-reentrant ``torch.utils.checkpoint``, which needs no input that requires grad) does not."""
        return self.kind.recomputes and not self.kind.checkpoints_attention

    @property
    def partial(self) -> bool:
        """Every layer keeps part of its saved tensors (a selective policy or the memory budget)."""
        return self.kind.partial

    @property
    def keeps_mask(self) -> bool:
        """A checkpointed region takes the attention mask as an input and keeps it (eager attention)."""
        return self.kind.keeps_mask or "core_attn" in self.modules

    @property
    def label(self) -> str:
        """A short human name (``full uniform x2``, ``megatron-selective core_attn,mlp``)."""
        return self.kind.label(self)


def framework_policies(framework: str) -> tuple[str, ...]:
    """The policies ``framework`` has (its profile's ``activation_policies``)."""
    return get_profile(framework).activation_policies


@lru_cache(maxsize=256)
def resolve_policy(job: Job) -> ActivationPolicy:
    """The activation policy ``job`` asks for: ``--recompute`` (``selective`` = the framework's own
    selective policy) with its parameters; a policy the framework does not have is refused
    (:class:`~memplan.errors.JobConfigError`)."""
    rc = job.recompute
    name = activation_policy_name(get_profile(job.framework), mode=rc.mode, modules=rc.modules,
                                  memory_budget=rc.memory_budget, fine_tuning=job.finetune.partial)
    kind = policy_kind(name)
    return ActivationPolicy(
        name=name,  # type: ignore[arg-type]
        framework=job.framework,
        method=rc.method,
        num_layers=rc.num_layers,
        reentrant=rc.reentrant,
        modules=rc.module_names if kind.drops_modules else (),
        memory_budget=(DEFAULT_MEMORY_BUDGET if rc.memory_budget is None else rc.memory_budget)
        if kind.budget else None,
        partition_activations=rc.partition_activations,
        cpu_checkpointing=rc.cpu_checkpointing,
        contiguous_checkpoints=rc.contiguous_checkpoints,
        offload=job.offload.activations,
    )
