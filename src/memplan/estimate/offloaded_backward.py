"""Mechanic: the backward of a layer that is not recomputed under ``save_on_cpu``, node by node.

``torch.autograd.graph.save_on_cpu`` (torch/autograd/graph.py) packs every tensor autograd saves into host
memory as it is saved and unpacks it into a new device tensor when the node that saved it runs its backward.
A layer that is not recomputed therefore holds none of its saved tensors on the GPU when its backward starts
(:mod:`memplan.estimate.stage_activations` moves them to ``cpu``); at each node the GPU holds that node's
unpacked tensors (the stage's ``bring_back``: :func:`memplan.estimate.layer_costs.largest_saved_term`, or a
weight, :mod:`memplan.estimate.offload_weights`), the gradient coming in and those the node makes, beside

* the layer's output gradient (the residual stream's), held until the block's input gradient is added to it;
* the weight gradients the layer's earlier nodes made, where the backward makes them (``zero_grad`` to
  None: :func:`memplan.estimate.backward_walk.walked_backward` counts them as a layer's early gradients): the
  MLP's output projection's before the activation's nodes; the MLP block's and the attention output
  projection's before the attention's nodes (the eager softmax backward's among them);
* at the eager softmax backward, the values' gradient the PV matmul's backward made just before (batch x
  heads x keys x head dim in the matmul's 16-bit dtype; ``repeat_kv``'s sum over the query groups and the
  value projection's backward run after the softmax's, autograd going by creation order, newest first).
  Without offload the PV node's release of the saved values stands for it
  (:func:`memplan.estimate.activations.backward_transient_bytes`); here the values were in host memory, so
  nothing on the GPU is released beside it.

A :class:`~memplan.estimate.terms.Term` may lump tensors of one size (``tensors``): a node brings back
``node_saves`` of them and holds ``node_made`` more (the gradient coming in, those it makes, its temporaries),
where the rule for a layer whose saved tensors stay on the GPU counts the term's first node's ``first_made``
beside all of them (:func:`memplan.estimate.activations.backward_transient_bytes`). A single tensor gets two.

Frozen routed experts (an adapter job's MoE block) whose stacked weight is the largest tensor the layer brings
back: the MLP block's worst node is the grouped GEMM's backward through that weight (``gate_up_proj``, or
``up_proj``), which brings back the weight alone (a frozen weight's GEMM saves no input) and holds the gradient of
its output coming in and the routed tokens' input gradient it makes; every other node of the block brings back
less than the weight, so it stands above the stage's bring-back only by what it holds beyond the weight
(the agreement grid's qwen3_moe_wide LoRA cell: at layer 0's ``_grouped_mm`` backward the 16 MiB ``gate_up_proj``,
its output's 2 MiB gradient and the 512 KiB input gradient; two of the 2 MiB output had been counted).

Known limitations: the attention output projection's gradient is counted before every attention node (its
own included); MoE layers, adapters and tensor parallelism get no early gradients; trained experts' weight
node (their weight gradient, their saved input) is priced by the general pairing; the figures are held to
what the layer holds without offload by the general rule (:meth:`OffloadedBackward.within`), which counts no
early gradients.
"""

from __future__ import annotations

from memplan.estimate.activations import (
    ActivationShape,
    Term,
    dispatch_buffer_bytes,
    divided,
    eager_core_roles,
    node_bytes,
    output_gradient_bytes,
    softmax_gradient_bytes,
)
from memplan.estimate.context import RunContext
from memplan.estimate.layer_costs import largest_saved_term, layer_blocks
from memplan.estimate.offload_weights import largest_expert_weight
from memplan.estimate.terms import TermRole
from memplan.frozen import frozen_dataclass
from memplan.model.linears import LinearModule, layer_linears
from memplan.model.spec import LayerSpec


@frozen_dataclass
class OffloadedBackward:
    """A layer's backward under ``save_on_cpu`` beyond the tensors it brings back (one rank)."""

    #: At its worst node: what the node makes and holds, with the layer's output gradient.
    transient: int
    #: The layer's weight gradients made before that node, where the backward makes them (else 0).
    early_gradients: int

    def within(self, ceiling: int) -> OffloadedBackward:
        """These figures held to ``ceiling``, what the layer's backward holds without offload by the general rule
        (its saved tensors and two of its largest): ``save_on_cpu`` only moves saved tensors off the GPU. The
        rule without offload counts no weight gradients made inside the layer (its two largest tensors stand in),
        so without the ceiling a short sequence's offloaded job could stand above the same job without offload
        (DeepSeek-V3, 1,024 tokens: its dense layers' 2 GB of MLP and output-projection gradients)."""
        transient = min(self.transient, ceiling)
        return OffloadedBackward(transient=transient,
                                 early_gradients=max(0, min(self.early_gradients, ceiling - transient)))


def offloaded_backward(run: RunContext, index: int) -> OffloadedBackward | None:
    """Layer ``index``'s backward under ``save_on_cpu`` (see the module), memoised per layer kind in the run's
    cache; None for a layer that saves nothing."""
    layer = run.model.layers[index]
    key = ("save_on_cpu backward", id(layer), index if run.counts is not None else None)
    if key not in run.cache:
        priced = layer_blocks(run, layer, index)
        run.cache[key] = None if priced is None else _figures(run, index, *priced)
    return run.cache[key]


def _figures(run: RunContext, index: int, shape: ActivationShape,
             blocks: tuple[list[Term], list[Term]]) -> OffloadedBackward:
    """The worst of the MLP block's nodes and the attention block's, ``blocks`` (attention, rest) the layer's
    terms as its role saves them."""
    attention, rest = blocks
    layer = run.model.layers[index]
    core = eager_core_roles(layer, shape)
    # an MoE layer's dispatch buffers: two, as in the rule without offload
    mlp = _frozen_experts_node(run, index, shape, rest)
    if mlp is None:
        mlp = max([node_bytes(t, shape) * t.node_made for t in rest] + [2 * dispatch_buffer_bytes(layer, shape)])
    attn = max([node_bytes(t, shape) * t.node_made for t in attention if t.role not in core]
               + [softmax_gradient_bytes(layer, shape) + _value_gradient_bytes(layer, shape) if core else 0])
    before_mlp, before_attention = _early_gradients(run, layer)
    worst = max(mlp, attn)
    with_gradients = max(mlp + before_mlp, attn + before_attention)
    return OffloadedBackward(transient=worst + output_gradient_bytes(shape, run.model.hidden_size),
                             early_gradients=with_gradients - worst)


def _frozen_experts_node(run: RunContext, index: int, shape: ActivationShape, rest: list[Term]) -> int | None:
    """Frozen routed experts whose stacked weight is the most the layer brings back (see the module): what the MLP
    block holds beyond that weight at its worst node, the weight's grouped GEMM (its output's gradient, one
    ``EXPERT_FC1`` tensor, and the routed tokens' input gradient) or another node beyond the weight; None
    elsewhere."""
    layer = run.model.layers[index]
    flows = run.flows
    weight = largest_expert_weight(run, index)
    fc1 = [t for t in rest if t.role is TermRole.EXPERT_FC1]
    if layer.moe is None or flows is None or not flows[index].mlp.frozen_experts or not fc1 or \
            weight < largest_saved_term(run, [index]):
        return None
    expert = layer.moe.expert
    out_width = expert.intermediate_size * (2 if expert.gated else 1)
    grad_out = node_bytes(fc1[0], shape)
    grad_in = grad_out * run.model.hidden_size // out_width
    others = [node_bytes(t, shape) * (t.node_saves + t.node_made) - weight for t in rest]
    return max([grad_out + grad_in, 2 * dispatch_buffer_bytes(layer, shape) - weight] + others)


def _value_gradient_bytes(layer: LayerSpec, shape: ActivationShape) -> int:
    """The values' gradient the eager PV matmul's backward makes (one rank): one per query head (``repeat_kv``'s
    copies), each keys x the value head dim, in the activations' dtype (autocast runs the matmul in 16 bits)."""
    attn = layer.attention
    numel = shape.micro_batch * attn.num_heads * shape.kv_seq * attn.v_head_dim
    return divided(Term("value gradient", numel * shape.act_bytes, "tp", "core"), shape)


def _early_gradients(run: RunContext, layer: LayerSpec) -> tuple[int, int]:
    """Bytes of the weight gradients made before (the MLP activation's nodes, the attention's nodes): the MLP's
    output projection's, and the whole MLP block's with the attention output projection's. Only for a
    trained dense layer on one rank's whole weights (other layers: 0, 0)."""
    if run.counts is not None or run.job.parallel.tp > 1 or layer.mlp is None or layer.moe is not None:
        return 0, 0
    mlp = layer.mlp
    linears = layer_linears(layer, run.model.hidden_size, run.model.model_type)
    # the MLP's linears close the layer's list: fc1 (gate and up apart, or one) and fc2, after the attention's
    count = 3 if mlp.gated and not mlp.fused_gate_up else 2
    if len(linears) <= count:
        return 0, 0
    grad = run.prec.grad_bytes
    fc2 = _numel(linears[-1]) * grad
    block = sum(_numel(linear) for linear in linears[-count - 1:]) * grad
    return fc2, block


def _numel(linear: LinearModule) -> int:
    """A linear layer's parameters (weight and bias)."""
    return linear.weight_numel + (linear.out_features if linear.bias else 0)
