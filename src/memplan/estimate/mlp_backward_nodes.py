"""A dense MLP block's backward, node by node, where the layer's saved tensors stay on the GPU (helper mlpbwd13).

The general rule (:func:`~memplan.estimate.activations.backward_transient_bytes`) prices a layer's backward by
its largest term's first node beside *all* the layer's saved tensors. In an MLP that node is the product of the
activation's two factors (eager SwiGLU's ``act(gate) * up``, GPT-2's ``gelu_new`` last product), and a trace
(``memplan trace``, the events of the last layer's MLP backward) shows autograd reaching it after the output
projection's node (``down_proj`` / ``c_proj``), which has

1. received the layer's output gradient (residual dtype; alive until the block's input gradient is added to it)
   and, where the residual dtype is not the compute dtype (fp32 weights under autocast), its 16-bit cast;
2. made the gradient of its input (one intermediate-sized tensor in the compute dtype) and, for a trained
   linear, its weight's gradient (a 16-bit ``mm`` result under autocast, then cast to the parameter's dtype by
   ``AccumulateGrad``: the second stays, a weight gradient made by the walk's end);
3. freed its saved input (the fc2 input term: a trained linear's; a frozen one saved none), the 16-bit cast and
   the 16-bit weight gradient.

Then the product's node holds the gradient coming in and one gradient per factor. Under autocast GPT-2's
``gelu_new`` runs in fp32 (``pow`` is an fp32 autocast op and type promotion carries it through the formula):
``c_proj``'s 16-bit input gradient is first cast back to fp32 (``ToCopyBackward``), and the product's gradient
for the 16-bit factor ``0.5 * x`` is made in fp32 and cast to 16 bits beside it. Eager SwiGLU goes on with
``up_proj``'s node, the activation's and ``gate_proj``'s, each freeing what it read; ``gelu_new``'s later nodes
run after the product's node freed two of its saved tensors and hold less (gpt2rc12: ``pow``'s node 1 MiB lower
on the toy), so its walk stops there.

A LoRA adapter on a frozen output projection (peft ``Linear.forward``: ``base(x) + lora_B(lora_A(x)) * scaling``)
runs its path first (made after the base's): ``lora_A``'s input gradient in the dtype of the input it saved
(a 16-bit autocast copy, or peft's fp32 cast), that saved input freed, the gradient cast back to ``x``'s dtype;
then the base's input gradient (cast back likewise) and the two summed (``x``'s gradient, a third tensor) before
the activation's nodes (a trace of GPT-2 LoRA all-linear under full recompute holds the three fp32 gradients).

The same holds on a frozen gated MLP with a LoRA adapter on ``down_proj`` (helper fp32lora13; a trace of Llama
LoRA all-linear at fp32 under full recompute holds the three gradients, then the product's two beside the sum,
with ``down_proj``'s saved input gone): the general rule priced the product's node beside it (+3.34% on that toy).

A frozen plain MLP whose activation is one PyTorch op (GPT-NeoX's ``gelu``: ``F.gelu`` saves its input and makes one
gradient) with a LoRA adapter on its output projection is walked the same way (helper neoxft14; a trace of the
GPT-NeoX toy at fp32 under full recompute holds the three gradients beside gelu's saved input, then gelu's node on
the sum): the general rule priced the adapter's saved input's node beside everything (-1.92% at fp32, where the sum
is the worse; over at pure bf16). With the adapters in another dtype than the activations and no autocast (pure
16 bits, fp32 adapters), peft's add ``result + lora_B(...) * scaling`` is in the adapters' dtype: its backward casts
the output gradient back to the base result's dtype, and that cast waits for the base's node (traced on GPT-NeoX).

DoRA adapters are walked too (helper dora14): each DoRA-adapted projection adds its magnitude's nodes
(:func:`_dora_nodes`: the gradient cast to the magnitude's dtype where it differs, the products' gradients, then the
adapter's saved results freed) before that projection's own node.

Applies to a dense MLP under eager (PyTorch reference) kernels on one tensor-parallel rank: a gated MLP with
separate gate and up projections whose fc1 term is its three tensors, fully trained, or frozen with a LoRA or DoRA
adapter on its output projection (a frozen one without is walked by :mod:`~memplan.estimate.frozen_mlp_backward`); a
frozen plain one-op-activation MLP with a LoRA or DoRA adapter on its output projection; GPT-2's ``gelu_new`` MLP, fully
trained, or frozen with or without LoRA adapters (not DoRA on its output projection); never on a quantized
base, where a gated MLP with DoRA on its output projection prices its terms' first nodes less what the nodes before
them freed (:func:`quantized_dora_mlp`). Elsewhere (partly trained blocks, a frozen gated MLP whose output projection has no adapter, a trained
plain MLP) None, and the general rule stays.
"""

from __future__ import annotations

from functools import lru_cache

from memplan.estimate.activations import (
    ActivationShape,
    Term,
    divided,
    first_node_bytes,
    layer_terms_by_block,
    node_bytes,
    output_gradient_bytes,
)
from memplan.estimate.memo import Same
from memplan.estimate.partial_freeze import LayerFlow
from memplan.estimate.terms import SAVED_BY_OUTPUT_PROJECTION, TermRole
from memplan.frozen import frozen_dataclass
from memplan.model.spec import LayerSpec, MLPSpec

__all__ = ["MLP_WALKED", "MlpBackward", "gradients_made", "mlp_backward_nodes", "quantized_dora_mlp"]

#: Activations (``hidden_act`` as transformers' ``ACT2CLS`` names them) that are one PyTorch op (``F.gelu``,
#: ``F.silu``, ``relu``): their node makes one gradient and frees the one tensor they saved.
ONE_OP_ACTIVATIONS = frozenset({"gelu", "gelu_pytorch_tanh", "relu", "silu", "swish"})
#: The MLP's saved terms the walk prices (the general rule leaves them to it).
MLP_WALKED = frozenset({TermRole.MLP_FC1, TermRole.MLP_FC2, TermRole.GELU_NEW, TermRole.MLP_FC2_ADAPTER_INPUT,
                        TermRole.MLP_FC2_DORA_INPUT, TermRole.MLP_FC2_DORA_RESULTS, TermRole.MLP_FC1_DORA_RESULTS})


@frozen_dataclass
class MlpBackward:
    """The most an MLP block's backward holds above the layer's saved tensors (one rank)."""

    #: At its worst node: what the nodes made and hold, the layer's output gradient, less the saved tensors freed.
    transient: int
    #: The same with the block's weight gradients made before each node (where the backward makes them).
    with_gradients: int


def mlp_backward_nodes(layer: LayerSpec, shape: ActivationShape, rest: list[Term], flow: LayerFlow | None,
                       recomputed: bool = False, grad_bytes: int = 0, dequantized: int = 0,
                       frozen_copy: int = 0, adapter_bytes: int = 4) -> MlpBackward | None:
    """Layer ``layer``'s MLP backward node by node (see the module), or None where the walk does not apply.
    ``rest``: the layer's MLP-block terms for its role; ``flow``: its fine-tuning flow (None: full training);
    ``recomputed``: the layer is checkpointed (a recomputed tensor is freed once unpacked: the product's node
    casts its 16-bit gradient after its saved factors are gone); ``grad_bytes``: bytes per element of a weight
    gradient (0: not counted); ``dequantized``: a quantized base's (the walk does not apply); ``frozen_copy``: the
    frozen output projection's 16-bit weight copy a recompute made again (held with the layer's copies), freed by its
    node; ``adapter_bytes``: the adapters' bytes per element (DoRA's magnitude: :func:`_dora_nodes`)."""
    mlp = layer.mlp
    if mlp is None or layer.moe is not None or shape.kernels != "eager" or shape.tp > 1 or dequantized:
        return None
    sizes: dict[TermRole, int] = {}
    gelu = 0
    for t in rest:
        sizes[t.role] = sizes.get(t.role, 0) + divided(t, shape)
        if t.role is TermRole.GELU_NEW:
            gelu = node_bytes(t, shape)
    if not _applies(mlp, flow, sizes, gelu):
        return None
    tokens = shape.seq * shape.micro_batch
    one = tokens * mlp.intermediate_size * shape.act_bytes
    hidden = tokens * shape.hidden * shape.act_bytes
    lora = sizes.get(TermRole.MLP_FC2_ADAPTER_INPUT, 0) or sizes.get(TermRole.MLP_FC2_DORA_INPUT, 0)
    fc1 = sizes.get(TermRole.MLP_FC1, 0)
    if not one or (not gelu and (fc1 != (3 * one if mlp.gated else one) or not (sizes.get(TermRole.MLP_FC2) or lora))):
        return None
    trained = flow is None
    weights = _weight_bytes(mlp, shape.hidden, grad_bytes if trained else 0)
    # under autocast a trained weight's gradient is a 16-bit mm result first (AccumulateGrad casts it) ...
    temp = mlp.intermediate_size * shape.hidden * shape.act_bytes if trained and shape.autocast else 0
    # ... and its node frees the 16-bit weight copy it saved
    copy = temp + (shape.hidden * shape.act_bytes if temp and mlp.bias else 0) + frozen_copy
    fc2 = sizes.get(TermRole.MLP_FC2, 0) + copy
    x = gelu or one  # bytes of one tensor of the output projection's input
    # adapters in another dtype than the activations, without autocast (lora_A saved peft's cast, not a 16-bit copy
    # of the activations' size): the add's backward casts the output gradient to the base result's dtype (peft's
    # `result + lora_B(...) * scaling`), held until the base's node
    head = hidden if lora and lora != one else 0
    down, *ups = _dora_nodes(rest, shape, mlp.intermediate_size, adapter_bytes, sizes)
    nodes = [(output_gradient_bytes(shape, shape.hidden) + head, 0, 0), *down]
    nodes += _adapter_nodes(lora, x) if lora else []
    nodes += _output_projection(shape, hidden, fc2 + head, one, temp, weights[0])
    if gelu:
        nodes += [(gelu, one, 0)] if gelu != one else []
        nodes += [(gelu, 2 * gelu, 0)] if lora else []  # x's two gradients summed
        nodes += _gelu_new_product(one, gelu, recomputed)
    else:
        nodes += [(one, 2 * one, 0)] if lora else []  # the input's two gradients summed
        # a one-op activation: its input's gradient, its saved input and the sum freed after
        nodes += _gated_nodes(one, hidden, fc1 // 3, temp, weights[1], ups) if mlp.gated else [
            (one, fc1 + one, 0), *ups[0]]
    return _walk(nodes)


def quantized_dora_mlp(layer: LayerSpec, shape: ActivationShape, rest: list[Term]) -> int | None:
    """A dense eager gated MLP on a quantized base with DoRA on its output projection (not walked node by node): the
    general rule's first node of each of its saved terms beside the layer's saved tensors, less what the nodes
    autograd ran before it freed: the activation's product (the fc1 term's node) runs after the output projection's
    node and its DoRA magnitude's, which freed that projection's saved tensors
    (:data:`~memplan.estimate.terms.SAVED_BY_OUTPUT_PROJECTION`: an 8-bit base's kept input, ``lora_A``'s input,
    DoRA's results); the input projections' DoRA magnitude nodes run after the product's, which freed two of the fc1
    term's three tensors as well. None where it does not apply (no DoRA there, not a three-tensor fc1 term, an MoE
    block, fused kernels, TP > 1)."""
    if layer.mlp is None or layer.moe is not None or shape.kernels != "eager" or shape.tp > 1:
        return None
    if not any(t.role is TermRole.MLP_FC2_DORA_RESULTS for t in rest):
        return None
    fc1 = next((t for t in rest if t.role is TermRole.MLP_FC1 and t.tensors == 3), None)
    if fc1 is None:
        return None
    before = {TermRole.MLP_FC1: sum(divided(t, shape) for t in rest if t.role in SAVED_BY_OUTPUT_PROJECTION)}
    before[TermRole.MLP_FC1_DORA_RESULTS] = before[TermRole.MLP_FC1] + 2 * divided(fc1, shape) // 3
    return max((first_node_bytes(t, shape) - before.get(t.role, 0) for t in rest if t.role in MLP_WALKED), default=0)


@lru_cache(maxsize=4096)
def gradients_made(layer: Same, shape: ActivationShape, recomputed: bool, grad_bytes: int) -> int:
    """What a fully trained layer's (``layer.obj``) MLP walk holds at its worst with the weight gradients made
    before each node (``grad_bytes`` per element) beyond its worst without them; 0 where it is not walked.
    Memoised across estimates (the key holds the layer, compared by identity)."""
    spec: LayerSpec = layer.obj  # type: ignore[assignment]
    walked = mlp_backward_nodes(spec, shape, layer_terms_by_block(spec, shape)[1], None, recomputed, grad_bytes)
    return 0 if walked is None else walked.with_gradients - walked.transient


def _applies(mlp: MLPSpec, flow: LayerFlow | None, sizes: dict[TermRole, int], gelu: int) -> bool:
    """Whether the walk prices this block (see the module): a trained gated MLP, or a frozen one (with a LoRA adapter
    on its output projection, which the caller checks), a frozen plain one-op-activation one (likewise), or a trained
    or frozen (maybe LoRA-adapted) ``gelu_new`` one."""
    if not (gelu or (mlp.gated and not mlp.fused_gate_up) or (flow is not None and not mlp.gated
                                                           and mlp.activation in ONE_OP_ACTIVATIONS)):
        return False
    return flow is None or (not flow.mlp.linears_train and not (gelu and TermRole.MLP_FC2_DORA_INPUT in sizes))


#: A node: (bytes it makes and holds at its worst, bytes it frees after, weight-gradient bytes it leaves made).
_Node = tuple[int, int, int]


def _walk(nodes: list[_Node]) -> MlpBackward:
    """The most held over ``nodes`` in order, without and with the weight gradients they made."""
    held = made = worst = worst_made = 0
    for take, give, grads in nodes:
        held += take
        worst, worst_made = max(worst, held), max(worst_made, held + made)
        held -= give
        made += grads
    return MlpBackward(transient=worst, with_gradients=worst_made)


def _weight_bytes(mlp: MLPSpec, hidden: int, grad_bytes: int) -> tuple[int, int]:
    """(the output projection's, one input projection's) weight-gradient bytes, biases included."""
    f = mlp.intermediate_size
    return (f * hidden + (hidden if mlp.bias else 0)) * grad_bytes, (f * hidden + (f if mlp.bias else 0)) * grad_bytes


def _adapter_nodes(lora: int, x: int) -> list[_Node]:
    """A LoRA adapter's path on the output projection: ``lora_A``'s input gradient (in the dtype of the ``lora``
    bytes it saved, which are freed after), cast back to the input's dtype (``x`` bytes) where that differs."""
    if lora == x:
        return [(lora, lora, 0)]
    return [(lora, lora, 0), (x, lora, 0)]


def _output_projection(shape: ActivationShape, hidden: int, fc2: int, one: int, temp: int,
                       grad: int) -> list[_Node]:
    """The output projection's node: the output gradient's 16-bit cast (a residual stream in another dtype) and
    ``temp`` (a trained weight's 16-bit gradient) beside the input's gradient, its saved input and weight copy
    (``fc2``) freed after; ``grad``: its weight's gradient, made."""
    cast = hidden if shape.residual_bytes != shape.act_bytes else 0
    return [(cast + temp + one, cast + temp + fc2, grad)]


def _gelu_new_product(one: int, gelu: int, recomputed: bool) -> list[_Node]:
    """``gelu_new``'s last product in its formula's dtype (``gelu`` bytes a tensor): its two gradients beside the
    one coming in and, unless the layer is ``recomputed``, the 16-bit factor's cast."""
    return [(2 * gelu + (0 if recomputed or gelu == one else one), gelu, 0)]


def _gated_nodes(one: int, hidden: int, fc1: int, temp: int, up: int,
                 doras: list[list[_Node]] | None = None) -> list[_Node]:
    """Eager SwiGLU's nodes after ``down_proj``'s: the product (``act(gate)``'s and up's gradients; the incoming
    one, ``act(gate)`` and up freed), ``up_proj`` (its input's gradient), the activation (the gate's gradient),
    ``gate_proj`` and the two input gradients' sum. ``fc1``: one of the saved gate, up, ``act(gate)``; ``temp``: a
    weight's 16-bit gradient before its cast; ``up``: one input projection's weight gradient, made; ``doras``: the
    DoRA magnitude nodes before ``up_proj``'s and ``gate_proj``'s (:func:`_dora_nodes`)."""
    first, second = doras or ([], [])
    return [(2 * one, one + 2 * fc1, 0), *first, (hidden + temp, one + temp, up), (one, one + fc1, 0),
            *second, (hidden + temp, one + temp, up), (hidden, 3 * hidden, 0)]


def _dora_nodes(rest: list[Term], shape: ActivationShape, intermediate: int, adapter_bytes: int,
                sizes: dict[TermRole, int]) -> list[list[_Node]]:
    """DoRA's magnitude nodes (peft ``DoraLinearLayer.forward``: ``(m - 1) * base_result + m * lora_result *
    scaling``, in the fp32 magnitude's dtype, added to the base result and cast back): on the output projection, then
    on the last and the first input projection carrying one (each list empty without). Where the magnitude's dtype
    is not the activations' the gradient is cast to it and, for the base result, back (an input projection's
    incoming gradient is freed then: traces of Llama LoRA all-linear at pure bf16); the node makes the product by
    ``scaling``'s gradient and ``m * lora_result``'s two (one a vector's, summed), then frees what the adapter saved
    (its ``MLP_*_DORA_RESULTS`` term; a trace at fp32 holds the three beside the incoming gradient)."""
    tokens, act = shape.seq * shape.micro_batch, shape.act_bytes
    wide = max(adapter_bytes, act)

    def node(elements: int, results: int, frees_incoming: bool) -> _Node:
        cast = elements * (wide + act) - (elements * act if frees_incoming else 0) if wide != act else 0
        return (cast + 3 * elements * wide, cast + 3 * elements * wide + results, 0)

    down = sizes.get(TermRole.MLP_FC2_DORA_RESULTS, 0)
    ins = [node(tokens * intermediate, divided(t, shape), True) for t in rest
           if t.role is TermRole.MLP_FC1_DORA_RESULTS]
    return [[node(tokens * shape.hidden, down, False)] if down else [], ins[-1:], ins[:-1]]
