"""Megatron-LM's expert-parallel overlap: what the combined 1F1B schedule and its options keep alive.

**Combined 1F1B** (``--overlap-moe-expert-parallel-comm``). Each layer is split into nodes:
``pre_dispatch_computation`` (attention, pre-MLP norm, router, dispatch preprocess, shared expert),
``moe_dispatch``, ``mlp`` (the routed experts, or a dense layer's MLP) and ``moe_combine``. One layer
``f`` of the next micro-batch's forward runs beside one layer ``b`` of this micro-batch's backward,
in this order (megatron/core/models/common/model_chunk_schedule_plan.py
``TransformerLayerSchedulePlan.run``)::

    combine_bwd(b)  pre_dispatch_fwd(f)  mlp_bwd(b)  dispatch_fwd(f)  mlp_bwd_dw(b)  dispatch_bwd(b)
    [early release: pre_dispatch_bwd(b)]  mlp_fwd(f)  combine_fwd(f)  [else: pre_dispatch_bwd(b)]
    pre_dispatch_bwd_dw(b)

With ``P``/``D``/``M`` a layer's kept bytes in its pre-dispatch node, its dispatched tokens and its MLP
node (experts and combine), ``T`` its worst backward step, the moments that can be the peak are:

* ``b``'s MLP backward beside ``f``'s pre-dispatch: ``P_b + D_b + M_b + T_b + P_f``;
* ``f``'s dispatch after ``b``'s MLP backward: ``P_b + G_b + W_b + P_f + D_f + X_f`` (``G_b``: the
  gradient handed to ``b``'s dispatch backward; ``X_f``: the dispatch's send and receive buffers;
  ``W_b``: what ``b``'s delayed expert GEMMs hold, ``--delay-wgrad-compute`` only);
* ``b``'s attention backward: ``P_b + T_b + P_f + D_f`` with ``--ep-overlap-early-attn-memory-release``
  (before ``f``'s MLP), else ``P_b + T_b + P_f + D_f + M_f`` (after ``f``'s combine);
* after it, ``b``'s delayed attention and shared-expert GEMMs' holdings ``A_b`` beside ``f``'s layer:
  ``A_b + P_f + D_f + M_f`` (``--delay-wgrad-compute``; the end of the pair's step frees them).

:func:`combined_step_extra` returns the worst of these beyond ``b``'s own ``P + D + M + T``, which
the estimator's backward already counts. Each moment is a sum of a ``b`` part and an ``f`` part, so
the worst pair of the stage's layers is the worst ``b`` part plus the worst ``f`` part.

**Delayed weight gradients.** Transformer Engine's linears with ``delay_wgrad_compute`` compute the
input gradient and put the weight-gradient GEMM's operands in a ``WeightGradStore`` until
``backward_dw``: a linear's (gathered) input and its output gradient (transformer_engine/pytorch/
module/linear.py, layernorm_linear.py ``wgrad_store.put([inputmat_total, grad_output], ...)``;
grouped_linear.py ``put([inputmats, grad_output, wgrad_list], ...)``). Under FP8 both are the
quantized copies (one byte per element). ``--overlap-dispatch-backward-with-experts-wgrad`` delays
only the routed experts' grouped GEMMs, to the end of the layer's dispatch backward
(megatron/core/transformer/moe/moe_layer.py ``_RegisterDelayedWgradForExperts``):
:func:`dispatch_backward_extra`.

Known limitations: gradient-accumulation fusion is assumed (the weight gradients go into the main
gradient buffer; without it each delayed grouped GEMM also holds its weight gradient); within the
attention backward the holdings grow while the attention's tensors are freed, priced at its two ends;
the first layer's delayed attention wgrad, which the schedule defers past the pipeline send, is priced
to the end of its step like the others; the node outputs the schedule keeps as backward roots are not
priced separately.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from memplan.estimate.activations import ActivationShape, Term, divided, layer_terms_by_block
from memplan.estimate.terms import EXPERTS_OWN, TermRole
from memplan.frozen import frozen_dataclass
from memplan.model.attention_kinds import attention_kind
from memplan.model.spec import AttentionSpec, LayerSpec, MLPSpec, MoESpec

__all__ = ["LayerParts", "attention_wgrad_held", "combined_step_extra", "describe", "dispatch_backward_extra",
           "expert_wgrad_held", "layer_parts", "mlp_wgrad_held", "shared_expert_overlap_bytes"]


@frozen_dataclass
class LayerParts:
    """One layer in the combined 1F1B schedule, one micro-batch, one rank (bytes)."""

    #: Everything the layer keeps for its backward.
    kept: int
    #: Of which the routed experts' input tokens (0 for a dense layer).
    dispatched: int
    #: Of which the MLP node's own tensors: the experts' (or a dense MLP's) and the combine's.
    mlp: int
    #: The layer's worst backward step beyond what it keeps.
    transient: int
    #: The forward dispatch's send and receive buffers.
    dispatch: int
    #: The MLP node's input gradient, handed to the dispatch backward.
    input_grad: int
    #: What the MLP node's delayed GEMMs hold until its ``backward_dw`` (0 without delayed wgrad).
    held_mlp: int = 0
    #: What the pre-dispatch node's delayed GEMMs (attention, shared expert) hold.
    held_attn: int = 0

    @property
    def pre_dispatch(self) -> int:
        """The pre-dispatch node's kept bytes (attention, norms, router, shared expert)."""
        return self.kept - self.dispatched - self.mlp


def combined_step_extra(layers: Sequence[LayerParts], *, early_release: bool) -> int:
    """Bytes the combined 1F1B step adds at its worst moment beyond the backward layer's kept
    bytes and worst backward step (the forward layer's, and the backward layer's delayed holdings)."""
    if not layers:
        return 0

    def worst(part: Callable[[LayerParts], int]) -> int:
        return max(part(layer) for layer in layers)

    def pre(x: LayerParts) -> int:
        return x.pre_dispatch

    def base(x: LayerParts) -> int:
        return x.kept + x.transient

    moments = [
        (lambda b: 0, pre),
        (lambda b: b.pre_dispatch + b.input_grad + b.held_mlp - base(b),
         lambda f: f.pre_dispatch + f.dispatched + f.dispatch),
        (lambda b: b.pre_dispatch - b.kept,
         (lambda f: f.pre_dispatch + f.dispatched) if early_release else (lambda f: f.kept)),
        (lambda b: b.held_attn - base(b), lambda f: f.kept),
    ]
    return max(worst(b_part) + worst(f_part) for b_part, f_part in moments)


def dispatch_backward_extra(parts: LayerParts) -> int:
    """``--overlap-dispatch-backward-with-experts-wgrad``: what a layer's dispatch backward holds beyond
    its kept bytes and worst backward step (its pre-dispatch tensors, the experts' delayed operands and
    the exchange's buffers)."""
    return max(0, parts.pre_dispatch + parts.held_mlp + parts.dispatch - parts.kept - parts.transient)


def _operand_bytes(shape: ActivationShape) -> int:
    """Bytes per element of a held GEMM operand (FP8: Transformer Engine's quantized copies)."""
    return 1 if shape.fp8 else shape.act_bytes


def _mlp_operands(mlp: MLPSpec, shape: ActivationShape) -> int:
    """A tensor-parallel MLP's two GEMMs: fc1's gathered input and output gradient, fc2's input and
    (gathered) output gradient."""
    c, tokens, tp, h = _operand_bytes(shape), shape.seq * shape.micro_batch, shape.tp, shape.hidden
    f = mlp.intermediate_size
    fc1_out = f * (2 if mlp.gated else 1)
    return c * tokens * (h + fc1_out // tp + f // tp + h)


def _attention_operands(attn: AttentionSpec, shape: ActivationShape) -> int:
    """The attention's linears (Megatron's Transformer Engine spec): q/k/v (or MLA's down and up
    projections) and the output projection."""
    c, tokens, tp, h = _operand_bytes(shape), shape.seq * shape.micro_batch, shape.tp, shape.hidden
    heads = attn.num_heads
    proj = tokens * heads * attn.v_head_dim // tp + tokens * h
    if not attention_kind(attn).latent:
        qkv = heads * attn.head_dim + attn.num_kv_heads * (attn.head_dim + attn.v_head_dim)
        return c * (tokens * h + tokens * qkv // tp + proj)
    rope = attn.qk_rope_head_dim or 0
    kv_lora, q_lora = attn.kv_lora_rank or 0, attn.q_lora_rank
    # down projections: duplicated linears on the local tokens, one shared input
    local = shape.local_tokens
    down = local * h + local * (kv_lora + rope) + (local * q_lora if q_lora else 0)
    # up projections: column-parallel on the gathered latents (queries from the hidden states without q_lora)
    q_in = q_lora or h
    up = tokens * q_in + tokens * heads * attn.head_dim // tp
    up += tokens * kv_lora + tokens * heads * (attn.head_dim - rope + attn.v_head_dim) // tp
    return c * (down + up + proj)


def attention_wgrad_held(layer: LayerSpec, shape: ActivationShape) -> int:
    """``--delay-wgrad-compute``: what the pre-dispatch node's GEMMs hold until its ``backward_dw``
    (the attention's linears and the shared expert's: megatron/core/models/common/utils.py
    ``_BackwardDWWrapper``)."""
    held = _attention_operands(layer.attention, shape)
    if layer.moe is not None and layer.moe.shared_expert is not None:
        held += _mlp_operands(layer.moe.shared_expert, shape)
    return held


def expert_wgrad_held(layer: LayerSpec, shape: ActivationShape) -> int:
    """The routed experts' two grouped GEMMs on this rank's rows (the dispatched tokens' rows, at
    ``f/etp`` width): fc1's input and output gradient, fc2's input and output gradient."""
    if layer.moe is None:
        return 0
    c, h, etp = _operand_bytes(shape), shape.hidden, shape.expert_tp
    f = layer.moe.expert.intermediate_size // etp
    fc1_out = f * (2 if layer.moe.expert.gated else 1)
    return c * _expert_rows(layer.moe, shape) * (h + fc1_out + f + h)


def _expert_rows(moe: MoESpec, shape: ActivationShape) -> int:
    """The routed experts' rows on this rank: every routed copy of the micro-batch's tokens, times the
    expert-TP gather, split by sequence parallelism."""
    rows = int(shape.seq * shape.micro_batch * moe.top_k * shape.routed_factor) * shape.expert_tp
    return rows // shape.tp if shape.sequence_parallel else rows


def mlp_wgrad_held(layer: LayerSpec, shape: ActivationShape) -> int:
    """``--delay-wgrad-compute``: what the MLP node's GEMMs hold until its ``backward_dw`` (the routed
    experts', or a dense layer's MLP)."""
    if layer.moe is None:
        assert layer.mlp is not None
        return _mlp_operands(layer.mlp, shape)
    return expert_wgrad_held(layer, shape)


def _input_grad(layer: LayerSpec, shape: ActivationShape) -> int:
    """The MLP node's input gradient: the experts' rows, or a dense MLP's local tokens, of width h."""
    rows = shape.local_tokens if layer.moe is None else _expert_rows(layer.moe, shape)
    return shape.act_bytes * rows * shape.hidden


def layer_parts(layer: LayerSpec, shape: ActivationShape, *, kept: int, transient: int, dispatch: int,
                is_kept: Callable[[Term], bool], held_mlp: int = 0, held_attn: int = 0) -> LayerParts:
    """Split a layer's ``kept`` bytes into the combined 1F1B nodes (``is_kept``: whether the job's
    recompute keeps a term). What the split does not name (checkpoint inputs, adapters) counts as
    pre-dispatch."""
    _, rest = layer_terms_by_block(layer, shape)
    if layer.moe is None:
        dispatched, mlp = 0, sum(divided(t, shape) for t in rest if is_kept(t))
    else:
        dispatched = sum(divided(t, shape) for t in rest if t.role is TermRole.DISPATCHED_TOKENS and is_kept(t))
        mlp = sum(divided(t, shape) for t in rest if is_kept(t) and _in_mlp_node(t))
    return LayerParts(kept=kept, dispatched=min(dispatched, kept), mlp=min(mlp, kept - min(dispatched, kept)),
                      transient=transient, dispatch=dispatch, input_grad=_input_grad(layer, shape),
                      held_mlp=held_mlp, held_attn=held_attn)


def _in_mlp_node(term: Term) -> bool:
    """An MoE layer's terms made by the experts or the combine (and the layer's output dropout)."""
    return term.role in EXPERTS_OWN or term.role in (TermRole.EXPERT_OUTPUTS, TermRole.MLP_RESIDUAL_DROPOUT)


def shared_expert_overlap_bytes(layer: LayerSpec, shape: ActivationShape) -> int:
    """``--moe-shared-expert-overlap``: the shared expert gathers its sequence-parallel input itself
    and runs its first linear without Transformer Engine's parallel mode, which then saves the gathered
    ``[s*b, h]`` input (megatron/core/transformer/moe/shared_experts.py ``pre_forward_comm``); without
    the overlap the linear saves nothing beyond the norm output the router keeps too."""
    if layer.moe is None or layer.moe.shared_expert is None or not shape.sequence_parallel or shape.tp == 1:
        return 0
    return _operand_bytes(shape) * shape.seq * shape.micro_batch * shape.hidden


def describe(*, ep_a2a: bool, delay_wgrad: bool, early_release: bool, experts_wgrad: bool,
             shared_overlap: bool) -> list[str]:
    """The assumption lines of the options that are on."""
    out = []
    if ep_a2a:
        out.append("EP all-to-all overlap (combined 1F1B): the next micro-batch's forward runs layer by layer beside "
                   "each backward; priced at the worst of the layer pair's moments (the backward layer's MLP "
                   "backward beside the forward layer's attention, the forward dispatch, the backward layer's "
                   "attention backward), and the next micro-batch's batch is alive in the backward")
    if early_release:
        out.append("--ep-overlap-early-attn-memory-release: the backward layer's attention backward runs before the "
                   "forward layer's MLP, so its attention activations never meet the forward layer's MLP's")
    if delay_wgrad:
        out.append("--delay-wgrad-compute: each delayed GEMM keeps its input and output gradient until its weight "
                   "gradient runs: the experts' (or dense MLP's) across the forward layer's dispatch, the "
                   "attention's and shared expert's to the end of the layer pair (gradient accumulation fusion "
                   "assumed)")
    if experts_wgrad:
        out.append("--overlap-dispatch-backward-with-experts-wgrad: the routed experts' GEMM inputs and output "
                   "gradients stay alive through each MoE layer's dispatch backward (grouped-GEMM experts)")
    if shared_overlap:
        out.append("--moe-shared-expert-overlap: each shared expert saves its gathered sequence-parallel input; its "
                   "side-stream allocations are priced as allocated bytes (the allocator pools them per stream)")
    return out
