"""The activation-policy registry: one :class:`PolicyKind` per ``--recompute`` policy.

An entry says what its policy does to a decoder layer (which recompute classes of
:data:`memplan.estimate.activations.KEPT_BY` it keeps, whether it checkpoints whole layers, drops
Megatron's ``--recompute-modules`` sites or keeps a memory budget's share), its short label and the
sentence that explains it. The engines ask the entry of a resolved
:class:`~memplan.policies.ActivationPolicy` (``policy.kind``) and compare no policy names; adding a
policy is one entry here, its name in :data:`memplan.policies.PolicyName`, the profiles that run it,
and its tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from memplan.frozen import frozen_dataclass

if TYPE_CHECKING:
    from memplan.policies import ActivationPolicy

__all__ = ["POLICY_KINDS", "PolicyKind", "PolicySetting", "policy_kind"]


class PolicySetting(Protocol):
    """What a policy's sentence reads of the estimate it explains (the estimator supplies it)."""

    @property
    def autocast_weight_copies(self) -> bool:
        """Layers make autocast weight copies in their forward."""
        ...

    def modules_sentence(self, modules: tuple[str, ...]) -> str:
        """Megatron's ``--recompute-modules``: what they drop of this model's layers."""
        ...

    def layers_not_per_op(self) -> bool:
        """Some layer (MoE, latent attention) is not listed op by op by per-op SAC."""
        ...


Sentence = Callable[["ActivationPolicy", PolicySetting], str]


@frozen_dataclass
class PolicyKind:
    """One activation policy: what it keeps and recomputes, its label and its sentence."""

    name: str
    #: The :data:`~memplan.estimate.activations.KEPT_BY` key its layers are priced with.
    kept_classes: str
    sentence: Sentence
    #: Something is made again in the backward.
    recomputes: bool = True
    #: Every layer keeps part of its saved tensors (a selective policy or the memory budget).
    partial: bool = True
    #: A checkpointed region takes the attention mask as an input and keeps it (eager attention).
    keeps_mask: bool = False
    #: Whole layers (``--recompute-method``/``--recompute-layers``) keep only their input.
    checkpoints_layers: bool = False
    #: The sites of Megatron's ``--recompute-modules`` are dropped and made again.
    drops_modules: bool = False
    #: torch.compile's partitioner keeps at most the budget's share above full recompute's floor.
    budget: bool = False
    #: Every layer is checkpointed op by op (torchtitan's SelectiveAC): saved ops' outputs are kept.
    per_op: bool = False
    #: Every attention module is checkpointed (non-reentrant ``torch.utils.checkpoint``).
    checkpoints_attention: bool = False

    def label(self, policy: ActivationPolicy) -> str:
        """A short human name (``full uniform x2``, ``megatron-selective core_attn,mlp``)."""
        if self.checkpoints_layers and policy.num_layers is not None:
            return f"{self.name} {policy.method} x{policy.num_layers}"
        if self.drops_modules:
            return f"{self.name} {','.join(policy.modules) or '(no modules)'}"
        if self.budget:
            return f"{self.name} {policy.memory_budget:g}"
        return self.name


def _full(policy: ActivationPolicy, setting: PolicySetting) -> str:
    grouped = policy.method == "uniform" and (policy.num_layers or 1) > 1
    return (f"full recompute ({policy.method}, {policy.num_layers or 'all'} layers): "
            + (f"each checkpointed group of {policy.num_layers} layers keeps only its input and is recomputed "
               "whole in its backward" if grouped else "recomputed layers keep only their input")
            + ("; their autocast weight copies are not kept (autocast's cache is cleared when the "
               "forward ends) and are made again by the recompute" if setting.autocast_weight_copies else ""))


def _torchtitan_sac(policy: ActivationPolicy, setting: PolicySetting) -> str:
    return ("selective recompute: torchtitan's per-op selective activation checkpointing (SelectiveAC) of every "
            "decoder layer: its input and the outputs of the saved ops are kept (matmuls except every second "
            "mm of each layer call, the attention kernel's output and log-sum-exp; with a bias a linear is an "
            "addmm, always kept), the rest is recomputed in its backward"
            + ("; MoE/MLA layers are not modelled op by op: the attention core's recompute stands in"
               if setting.layers_not_per_op() else ""))


def _memory_budget(policy: ActivationPolicy, setting: PolicySetting) -> str:
    return (f"torchtitan memory_budget {policy.memory_budget:g} (torch.compile's partitioner, "
            "activation_memory_budget): an upper bound — each layer keeps its input plus the budget's fraction of "
            "the rest of what eager autograd saves (the partitioner's knapsack keeps at most that fraction of its "
            "default min-cut's saved bytes above the compiled region's inputs; the min-cut saves no more than "
            "eager autograd); compiled kernels' fusion is not modelled")


NONE = PolicyKind(name="none", kept_classes="none", recomputes=False, partial=False,
                  sentence=lambda policy, setting: "no recompute: every layer keeps what autograd saves for its "
                                                   "backward")
FULL = PolicyKind(name="full", kept_classes="full", partial=False, keeps_mask=True, checkpoints_layers=True,
                  sentence=_full)
MEGATRON_SELECTIVE = PolicyKind(name="megatron-selective", kept_classes="selective", drops_modules=True,
                                sentence=lambda policy, setting: setting.modules_sentence(policy.modules))
ATTENTION_CORE = PolicyKind(name="attention-core", kept_classes="selective",
                            sentence=lambda policy, setting: "selective recompute: the attention core is recomputed; "
                                                             "its inputs are kept")
ATTENTION_MODULE = PolicyKind(
    name="attention-module", kept_classes="selective-attention-module", keeps_mask=True, checkpoints_attention=True,
    sentence=lambda policy, setting: (
        "selective recompute: every attention module (self_attn) is checkpointed (non-reentrant "
        "torch.utils.checkpoint); its input and the attention mask are kept, its saved tensors and autocast "
        "weight copies are made again in its backward"))
TORCHTITAN_SAC = PolicyKind(name="torchtitan-sac", kept_classes="selective-per-op", keeps_mask=True, per_op=True,
                            sentence=_torchtitan_sac)
MEMORY_BUDGET = PolicyKind(name="memory-budget", kept_classes="memory-budget", budget=True, sentence=_memory_budget)

POLICY_KINDS: dict[str, PolicyKind] = {k.name: k for k in (
    NONE, FULL, MEGATRON_SELECTIVE, ATTENTION_CORE, ATTENTION_MODULE, TORCHTITAN_SAC, MEMORY_BUDGET)}


def policy_kind(name: str) -> PolicyKind:
    """The registry entry of a policy name (one of :data:`memplan.policies.POLICY_NAMES`)."""
    return POLICY_KINDS[name]
