"""Terms of the ``hf`` profile's plain PyTorch loop that depend on autocast, recompute and tied weights.

* which layer weights ``torch.autocast`` copies to 16 bits and autograd keeps until the backward;
* the gradient sum of a tied embedding at the end of the backward.
"""

from __future__ import annotations

from memplan.estimate.layout import StageLayout
from memplan.estimate.states import layer_numel_on_rank
from memplan.job import Job
from memplan.model.attention_kinds import attention_kind
from memplan.model.params import attention_params, mlp_params
from memplan.model.spec import ModelSpec
from memplan.policies.kinds import PolicyKind

__all__ = ["attention_weight_copy_numel", "autocast_weight_copy_numel", "layer_weight_copy_numel",
           "tied_embedding_gradient_sum_bytes"]


def autocast_weight_copy_numel(model: ModelSpec, job: Job, layout: StageLayout, *, recomputed: set[int],
                               policy: PolicyKind, eager_experts: bool, modules: tuple[str, ...] = ()) -> int:
    """Elements of the 16-bit weight copies autograd keeps for the backward under ``torch.autocast``
    (the decoder layers' part; the output head is added by the caller).

    ``torch.autocast`` casts the weight (and bias) of every linear layer it runs, caches the copy
    for the rest of the autocast region and the linear's autograd node saves it. Not cast: norms
    and embedding tables (not autocast ops), and, with ``eager_experts``, HF's grouped MoE experts
    (transformers ``integrations/moe.py``: ``grouped_mm`` is not an autocast op and the input is
    cast to the fp32 weights' dtype instead); the router is an ``F.linear`` and is cast.

    Under non-reentrant checkpointing (``torch.utils.checkpoint``) the checkpointed region saves
    nothing: its copies live only in autocast's cache, which is cleared when the forward's autocast
    region exits, before the backward (they are recomputed with the region). So recomputed layers
    contribute none, and when the ``policy`` checkpoints every attention module the attention
    projections none; under per-op SAC (every layer checkpointed, casts not in the save list) no layer any; under
    Megatron's ``modules`` the checkpointed MLP / MoE blocks none (:func:`checkpointed_module_copy_numel`).
    """
    total = 0
    for index in layout.layer_indices:
        if index in recomputed or policy.per_op:
            continue
        total += layer_weight_copy_numel(model, job, index, eager_experts=eager_experts)
        if policy.checkpoints_attention:
            total -= attention_weight_copy_numel(model, job, index)
        total -= checkpointed_module_copy_numel(model, job, index, modules, eager_experts=eager_experts)
    return total


def checkpointed_module_copy_numel(model: ModelSpec, job: Job, index: int, modules: tuple[str, ...], *,
                                   eager_experts: bool) -> int:
    """Elements autocast copies inside the blocks Megatron's ``--recompute-modules`` checkpoint in
    layer ``index``: the dense MLP's (``mlp``), the MoE block's (``moe``: router and shared experts;
    eager experts are not cast) or the shared experts' weights (``shared_experts``), and MLA's
    up-projections (``mla_up_proj``: the stretch runs under ``no_grad``, so autocast caches no copy).
    A checkpoint made on the block keeps none of them."""
    layer = model.layers[index]
    moe = layer.moe
    numel = 0
    if ("mlp" in modules and moe is None) or ("moe" in modules and moe is not None):
        numel += (layer_weight_copy_numel(model, job, index, eager_experts=eager_experts)
                  - attention_weight_copy_numel(model, job, index))
    elif "shared_experts" in modules and moe is not None and moe.shared_expert is not None:
        numel += mlp_params(moe.shared_expert, model.hidden_size).tp_sharded // job.parallel.tp
    attn = layer.attention
    if "mla_up_proj" in modules and attention_kind(attn).latent:
        numel += attention_kind(attn).up_projection_numel(attn, model.hidden_size) // job.parallel.tp
    return numel


def layer_weight_copy_numel(model: ModelSpec, job: Job, index: int, *, eager_experts: bool) -> int:
    """Elements autocast copies for one decoder layer's linear layers (see
    :func:`autocast_weight_copy_numel`); a recomputed layer makes them again in its backward."""
    layer = model.layers[index]
    dense, expert = layer_numel_on_rank(model.layer_param_groups[index], job)
    numel = dense + expert - model.layer_non_gemm_params[index]
    if layer.moe is not None and eager_experts:
        numel -= expert
        numel += model.hidden_size * layer.moe.num_experts  # the router's F.linear weight
    return numel


def attention_weight_copy_numel(model: ModelSpec, job: Job, index: int) -> int:
    """Elements autocast copies for one layer's attention projections (q, k, v, o and biases)."""
    return _attention_linear_numel(model, index, job)


def _attention_linear_numel(model: ModelSpec, index: int, job: Job) -> int:
    attn = model.layers[index].attention
    groups = attention_params(attn, model.hidden_size)
    norms = sum(attn.qk_norm_widths)
    return groups.tp_sharded // job.parallel.tp + groups.replicated - norms


def tied_embedding_gradient_sum_bytes(model: ModelSpec, layout: StageLayout, vocab_rows: int, tp: int,
                                      grad_bytes: int) -> int:
    """Temporaries at the end of the backward when the head shares the embedding's weight.

    The weight is used twice, so autograd sums its two gradients before accumulating them: the
    head's gradient waits in the engine's input buffer until ``embedding_dense_backward`` has
    produced the embedding's (a new vocabulary x hidden tensor), and their sum becomes ``.grad``
    (PyTorch ``torch/csrc/autograd/input_buffer.cpp``; checked with ``memplan trace``). While the sum
    is made, two weight-sized gradients exist beside all the others.
    """
    if not model.tie_word_embeddings or not (layout.has_embedding and layout.has_head):
        return 0
    return 2 * (vocab_rows * model.hidden_size // tp) * grad_bytes
