"""torchtitan's per-op selective activation checkpointing (SAC) of one decoder layer, as data.

torchtitan's ``SelectiveAC`` (``torchtitan/distributed/activation_checkpoint.py``) wraps every
transformer block in non-reentrant ``torch.utils.checkpoint`` with a
``create_selective_checkpoint_contexts`` policy. Inside the block nothing autograd saves is kept;
instead the *outputs* of the ops the policy marks ``MUST_SAVE`` are cached, and the rest of the
block is recomputed in its backward (which reuses the cached outputs). Marked ``MUST_SAVE``:

* the ops of its save list: the partitioner's compute-intensive ops (``mm``, ``addmm``, ``bmm``,
  the SDPA flash / efficient kernels, ...), the other SDPA variants, ``max`` (FP8 amax), ``topk``
  and the reduce-scatter / all-to-all collectives (a row-parallel output's reduce-scatter under TP
  with sequence parallelism is listed; ``max`` and ``topk`` have no part in a dense bf16 layer);
* except every second ``mm`` (or ``linear``): the policy counts them per block call in forward
  order and recomputes the even-numbered ones (the 2nd, 4th, ...). ``addmm`` (a linear with a
  bias) and ``bmm`` are not counted and always kept.

So a layer keeps its input (the checkpoint's argument) and the outputs of its kept ops. Here a
layer's ops are listed in forward order (:func:`layer_op_outputs`) with the bytes of their
outputs, :func:`sac_kept` applies the policy to that list. Dense layers with multi-head /
grouped-query attention are listed; MoE and MLA layers are not (``None``: the caller says so).
"""

from __future__ import annotations

from typing import Literal

from memplan.estimate.activations import LSE_BYTES, ActivationShape, Region, Term
from memplan.frozen import frozen_dataclass
from memplan.model.attention_kinds import attention_kind
from memplan.model.spec import AttentionSpec, LayerSpec, MLPSpec

__all__ = ["SAVED_OPS", "OpOutput", "layer_op_outputs", "recomputed_linear_fraction", "sac_kept", "sac_kept_terms"]

Op = Literal["mm", "addmm", "bmm", "attention", "reduce-scatter", "other"]

#: Ops whose outputs torchtitan's policy keeps (``mm`` only every other one, see :func:`sac_kept`).
SAVED_OPS: frozenset[str] = frozenset({"mm", "addmm", "bmm", "attention", "reduce-scatter"})


@frozen_dataclass
class OpOutput:
    """One op of a layer's forward and the tensor(s) it outputs."""

    op: Op
    term: Term
    #: Autograd saves this tensor anyway (it is among :func:`layer_terms`'): the layer's recompute
    #: in the backward reuses the cached output instead of making it again.
    saved_by_autograd: bool = True
    #: A linear layer's input features (its FLOPs are ``2 * tokens * in * out``); 0 for other ops.
    in_features: int = 0


def _linear(name: str, in_features: int, out_features: int, tokens: int, shape: ActivationShape, bias: bool,
            saved_by_autograd: bool = True) -> OpOutput:
    """A linear layer on a 2-D view of its input: ``mm`` (``addmm`` with a bias) of ``tokens`` rows.

    A column-parallel output is split by TP; a row-parallel one (``saved_by_autograd=False``: the
    output and down projections) is a whole partial sum on every rank before its reduction."""
    region: Region = "tp" if saved_by_autograd else "rep"
    return OpOutput("addmm" if bias else "mm", Term(f"{name} output", shape.act_bytes * tokens * out_features,
                                                     region, "body"), saved_by_autograd, in_features)


def _attention_ops(attn: AttentionSpec, shape: ActivationShape) -> list[OpOutput]:
    tokens = shape.seq * shape.micro_batch
    c = shape.act_bytes
    q_width = attn.num_heads * attn.head_dim
    k_width = attn.num_kv_heads * attn.head_dim
    v_width = attn.num_kv_heads * attn.v_head_dim
    out_width = attn.num_heads * attn.v_head_dim
    h = shape.hidden
    if attn.fused_qkv:
        ops = [_linear("qkv projection", h, q_width + k_width + v_width, tokens, shape, attn.qkv_bias)]
    else:
        ops = [_linear("q projection", h, q_width, tokens, shape, attn.qkv_bias),
               _linear("k projection", h, k_width, tokens, shape, attn.qkv_bias),
               _linear("v projection", h, v_width, tokens, shape, attn.qkv_bias)]
    # SDPA's math kernel (``math``) is a composite: the policy sees its decomposition (scaling muls,
    # copies, bmm, _safe_softmax), none of which torchtitan's llama3 save list (0.2.2, commit 238fa99:
    # mm, the SDPA kernel ops, reduce-scatter, max, ...) names; its whole attention core is recomputed.
    if shape.attention == "eager":
        # q k^T and probabilities x v are batched matmuls (bmm): both outputs kept.
        scores = attn.num_heads * shape.micro_batch * shape.seq * shape.kv_seq
        ops.append(OpOutput("bmm", Term("attention scores (q k^T)", c * scores, "tp", "body"), False))
        ops.append(OpOutput("bmm", Term("attention output (probabilities x v)", c * tokens * out_width, "tp", "body")))
    elif shape.attention != "math":
        # A fused kernel: its output (the output projection's input) and the fp32 log-sum-exp.
        ops.append(OpOutput("attention", Term("attention output", c * tokens * out_width, "tp", "body")))
        ops.append(OpOutput("attention", Term("attention log-sum-exp", LSE_BYTES * attn.num_heads * tokens,
                                              "tp", "body")))
    # The output projection's output is added to the residual: autograd saves it nowhere.
    ops.append(_linear("output projection", out_width, h, tokens, shape, attn.out_bias, saved_by_autograd=False))
    return ops + _row_parallel_reduction("output projection", shape)


def _row_parallel_reduction(name: str, shape: ActivationShape) -> list[OpOutput]:
    """Under TP with sequence parallelism a row-parallel output's partial sums are reduce-scattered
    (``_c10d_functional.reduce_scatter_tensor``, in the save list); without it they are all-reduced
    (not in the list)."""
    if shape.tp == 1 or not shape.sequence_parallel:
        return []
    tokens = shape.seq * shape.micro_batch
    return [OpOutput("reduce-scatter", Term(f"{name} reduce-scatter output", shape.act_bytes * tokens * shape.hidden,
                                            "sp", "body"), saved_by_autograd=False)]


def _mlp_ops(mlp: MLPSpec, shape: ActivationShape) -> list[OpOutput]:
    tokens = shape.seq * shape.micro_batch
    f, h = mlp.intermediate_size, shape.hidden
    if mlp.gated and mlp.fused_gate_up:
        ops = [_linear("gate/up projection", h, 2 * f, tokens, shape, mlp.bias)]
    elif mlp.gated:
        # gate first (the activation's input), then up: transformers and torchtitan (w1, w3) alike
        ops = [_linear("gate projection", h, f, tokens, shape, mlp.bias),
               _linear("up projection", h, f, tokens, shape, mlp.bias)]
    else:
        ops = [_linear("fc1", h, f, tokens, shape, mlp.bias)]
    ops.append(_linear("down projection", f, h, tokens, shape, mlp.bias, saved_by_autograd=False))
    return ops + _row_parallel_reduction("down projection", shape)


def layer_op_outputs(layer: LayerSpec, shape: ActivationShape) -> list[OpOutput] | None:
    """The ops of a dense layer's forward that the save list names, in call order, with their
    outputs (full TP width, local sequence); ``None`` for MoE and MLA layers (not listed)."""
    if layer.moe is not None or layer.mlp is None or not attention_kind(layer.attention).per_op_sac:
        return None
    return _attention_ops(layer.attention, shape) + _mlp_ops(layer.mlp, shape)


def sac_kept(ops: list[OpOutput]) -> list[OpOutput]:
    """The outputs torchtitan's policy keeps: every op of the save list, except the even-numbered
    ``mm`` calls (counted from 1 per block call; ``addmm`` and ``bmm`` are not counted)."""
    kept = []
    mm_count = 0
    for out in ops:
        if out.op == "mm":
            mm_count += 1
            if mm_count % 2 == 0:
                continue
        if out.op in SAVED_OPS:
            kept.append(out)
    return kept


def sac_kept_terms(layer: LayerSpec, shape: ActivationShape) -> tuple[list[Term], list[Term]] | None:
    """(kept op outputs, those of them autograd does not save) of one layer, as terms; ``None``
    for a layer :func:`layer_op_outputs` does not list."""
    ops = layer_op_outputs(layer, shape)
    if ops is None:
        return None
    kept = sac_kept(ops)
    return [o.term for o in kept], [o.term for o in kept if not o.saved_by_autograd]


def recomputed_linear_fraction(layer: LayerSpec, hidden: int) -> float | None:
    """Share of a layer's linear-layer FLOPs its backward recomputes (the dropped ``mm`` calls);
    ``None`` for a layer :func:`layer_op_outputs` does not list. The attention kernel is kept."""
    unit = ActivationShape(seq=1, kv_seq=1, micro_batch=1, hidden=hidden, tp=1, sequence_parallel=False,
                           act_bytes=1, residual_bytes=1, attention="flash", dropout=False, kernels="eager")
    ops = layer_op_outputs(layer, unit)
    if ops is None:
        return None
    linears = [o for o in ops if o.op in ("mm", "addmm")]
    kept = {id(o) for o in sac_kept(linears)}
    total = sum(o.in_features * o.term.bytes for o in linears)
    return sum(o.in_features * o.term.bytes for o in linears if id(o) not in kept) / total
