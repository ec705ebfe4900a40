"""The forward moment of an unfused eager attention core that saves nothing (helper bw16, session 16).

Under partial freezing a layer's attention core records nothing when its q, k and v need no gradient: the block's
input and pre-norm need none, no adapter or copy reads its input and no linear before its output projection trains
(:attr:`~memplan.estimate.partial_freeze.BlockFlow.inner_grad`; ``--trainable layers.1.self_attn.o_proj``, or a
frozen layer on a frozen embedding). Its backward then runs no softmax backward, but its forward still makes the
s x s tensors, which nothing saves: transformers' ``eager_attention_forward`` computes ``softmax(scores + mask,
dtype=float32).to(query.dtype)``, so at the softmax op the masked scores (compute dtype), their fp32 copy (made by
``softmax``'s ``dtype`` argument where the compute dtype is narrower) and the fp32 probabilities are alive at once.
Beside them the modeling code binds, none of it saved: the layer's input (the model's loop, the decoder layer's
``residual``), the pre-norm's output (the decoder layer's ``hidden_states``), the rotated q and k and the projected v
(``LlamaAttention.forward``'s locals), ``repeat_kv``'s copies of k and v to every query head, and the 4-D masks
(:func:`~memplan.estimate.gpt_oss_terms.forward_mask_term`), and RoPE's cos and sin tables where no attention block
of the stage saves them (:func:`~memplan.estimate.extras.rope_table_bytes`). The saved tensors of the earlier layers
exist; the layer's own (made after its core) and the later layers' do not yet, nor the autocast copies of their
trained weights (autocast casts a weight where its linear first runs).

A trace of a Llama toy (hidden 256, 8 heads, 2 KV heads, 1,024 tokens x 2, bf16-mixed, eager; trainable
``layers.1.self_attn.o_proj,layers.1.mlp``) peaks at layer 1's ``_softmax`` with exactly these tensors beside the
model states. Not priced (0): gpt-oss's sink attention (:func:`~memplan.estimate.layer_costs.sink_forward_transient`),
soft-capped scores, GPT-2's softmax in the scores' dtype, MLA, recomputed layers and a core not kept.
"""

from __future__ import annotations

from memplan.estimate.activations import Term, divided, eager_core_roles, has_eager_core, norm_output_bytes
from memplan.estimate.context import StageContext
from memplan.estimate.extras import rope_table_bytes
from memplan.estimate.gpt_oss_terms import forward_mask_term
from memplan.estimate.partial_freeze import any_attention_saves, uncast_trained_numel, uncopied_trained_numel
from memplan.estimate.terms import TermRole
from memplan.estimate.trained_dtypes import uncopied_expert_numel
from memplan.model.attention_kinds import attention_kind
from memplan.model.spec import LayerSpec
from memplan.units import dtype_bytes

__all__ = ["frozen_core_forward"]

#: Bytes per element of eager attention's softmax (``softmax(..., dtype=torch.float32)``).
_SOFTMAX_BYTES = 4


def frozen_core_forward(ctx: StageContext) -> int:
    """What the stage's worst frozen eager core's forward moment holds beyond every layer's saved tensors (the
    module's tensors, less the saved tensors of its layer and the later ones, not made yet); 0 where no layer of the
    stage has such a core, or where it is not priced."""
    run = ctx.run
    if (run.flows is None or ctx.recomputed or "core" not in run.kept_classes or not has_eager_core(run.shape)
            or not ctx.layout.layer_indices):
        return 0
    from memplan.estimate.layer_costs import layer_costs

    indices = ctx.layout.layer_indices
    tables = 0 if any_attention_saves(run.model, run.job.finetune, run.policy.input_grads, indices) else (
        rope_table_bytes(run.model, run.shape))
    later = 0  # saved tensors of the layers from this one on
    worst = 0
    for position in range(len(indices) - 1, -1, -1):
        index = indices[position]
        layer = run.model.layers[index]
        later += layer_costs(run, layer, index)[0] + _saved_copies(ctx, index)
        if run.flows[index].attention.inner_grad:
            continue
        live = _core_locals(layer, ctx, position == 0 and ctx.layout.has_embedding)
        worst = max(worst, live + tables - later)
    return worst


def _saved_copies(ctx: StageContext, index: int) -> int:
    """Bytes of the autocast copies of layer ``index``'s fully trained weights that autograd saves (one rank: the
    linears split by tensor parallelism), counted among the stage's activations
    (:func:`~memplan.estimate.stage_activations._uncopied` leaves out the others)."""
    run = ctx.run
    if run.prec.weight_copies != "autocast" or run.counts is None or not run.counts.layers[index].trained:
        return 0
    ft, layers = run.job.finetune, (index,)
    numel = (run.counts.layers[index].trained - uncast_trained_numel(run.model, ft, layers, False, False)
             - uncopied_trained_numel(run.model, ft, run.policy.input_grads, layers, run.profile.kernels != "eager"))
    if run.profile.kernels == "eager":
        numel -= uncopied_expert_numel(run.model, ft, layers)
    return numel // run.job.parallel.tp * dtype_bytes(run.prec.compute)


def _core_locals(layer: LayerSpec, ctx: StageContext, first: bool) -> int:
    """The module's tensors alive at one frozen core's softmax (one rank, one micro-batch); ``first``: the layer's
    input is the embedding's output (counted apart: :func:`~memplan.estimate.input_leaf.bound_embedding_output`)."""
    run, attn = ctx.run, layer.attention
    shape = run.shape
    if attn.sinks or attn.logit_softcap is not None or attn.softmax_in_scores_dtype or attention_kind(attn).latent:
        return 0  # (GPT-2's softmax runs in the scores' dtype)
    c, tokens = shape.act_bytes, shape.seq * shape.micro_batch
    scores = attn.num_heads * shape.micro_batch * shape.seq * shape.kv_seq
    # masked scores, their fp32 copy where the compute dtype is narrower, the fp32 probabilities
    softmax = scores * (c + _SOFTMAX_BYTES * (2 if c < _SOFTMAX_BYTES else 1))
    kv = attn.num_kv_heads * (attn.head_dim + attn.v_head_dim)
    copies = attn.num_heads * (attn.head_dim + attn.v_head_dim) if TermRole.REPEATED_KV in eager_core_roles(
        layer, shape) else 0
    heads = Term("frozen eager core's forward locals", softmax + c * tokens * (attn.num_heads * attn.head_dim + kv
                                                                                + copies), "tp", "core")
    hidden = shape.local_tokens * run.model.hidden_size
    bound = hidden * norm_output_bytes(shape) + (0 if first else hidden * shape.residual_bytes)
    return divided(heads, shape) + bound + divided(forward_mask_term(run.model, run.shape), run.shape)

