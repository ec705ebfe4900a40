"""Partial freezing inside an MoE block: which of its parameters are the routed experts and the sinks, and
which of its saved tensors serve only the routing weights' or only the experts' gradients.

HF's routed experts are one module of grouped 3-D weights (``mlp.experts.gate_up_proj``, ``down_proj`` and
their biases), beside the router (``mlp.gate`` / ``mlp.router``) and any shared expert; gpt-oss's attention
sinks are a parameter of the attention module (``self_attn.sinks``). What autograd keeps in the block
depends on which of them train (:class:`memplan.estimate.partial_freeze.BlockFlow`):

* the router's scores and the expert outputs the weighted combine keeps serve the routing weights'
  gradient only (:data:`ROUTING_GRAD_TERMS`): an MoE block that trains only its experts, on an input that
  needs no gradient, keeps neither;
* the experts' own tensors (their gathered input, GEMM and activation tensors, the ids their bias rows are
  gathered by) serve the experts' weights and input only: frozen experts on such an input keep none of
  them, under a trained router.

Checked against ``memplan trace``: tests/trace/test_agreement_grid.py's ``layers.1.mlp.experts`` and
``layers.1.mlp.gate`` / ``mlp.router`` cells.
"""

from __future__ import annotations

from memplan.estimate.terms import EXPERTS_OWN, TermRole

__all__ = ["ROUTING_GRAD_TERMS", "is_routed_experts", "is_sinks", "moe_term_kept"]

#: What an MoE block keeps only for the routing weights' gradient.
ROUTING_GRAD_TERMS = frozenset({TermRole.ROUTER_SCORES, TermRole.EXPERT_OUTPUTS})


def is_routed_experts(module: str) -> bool:
    """A module name of HF's grouped routed experts (``mlp.experts``: 3-D ``gate_up_proj`` / ``down_proj``)."""
    return module.rpartition(".")[2] == "experts"


def is_sinks(name: str) -> bool:
    """A parameter name of gpt-oss's attention sinks (``self_attn.sinks``)."""
    return name.rpartition(".")[2] == "sinks"


def _expert_internal(role: TermRole) -> bool:
    """A tensor the routed experts themselves save (their input, their GEMMs' and activation's tensors, the
    ids their bias rows are gathered by), not the combine's."""
    return role in (TermRole.DISPATCHED_TOKENS, TermRole.SORTED_BIAS_IDS) or role in EXPERTS_OWN


def moe_term_kept(role: TermRole, *, routing_grad: bool, experts_save: bool) -> bool:
    """Whether a block with trained weights keeps a term of ``role``: not one that serves only the routing
    weights' gradient when those need none, nor one of the experts' own when they record nothing."""
    if not routing_grad and role in ROUTING_GRAD_TERMS:
        return False
    return experts_save or not _expert_internal(role)
