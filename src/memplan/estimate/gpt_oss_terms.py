"""What gpt-oss's layers save beyond a Llama-style MoE layer, in transformers' eager code (5.x).

Three mechanics, each priced here once and called from :mod:`memplan.estimate.activations`:

* **Attention sinks** (``AttentionSpec.sinks``): ``eager_attention_forward`` of gpt-oss concatenates a
  learned logit per head to every row of scores (``cat([scores, sinks])``: ``s + 1`` columns),
  subtracts the row maximum (``max(dim=-1)`` keeps its int64 indices for the backward) and takes the
  softmax in the concatenation's dtype, the promotion of the 16-bit scores with the sinks parameter:
  fp32 when the weights are fp32 (autocast, fp32), 16-bit when they are 16-bit (pure bf16, a frozen
  16-bit base). The softmax output (``s + 1`` columns) is saved; the PV matmul saves a cast copy of its
  first ``s`` columns only when that dtype is wider than the compute dtype.
* **Clamped SwiGLU experts** (:data:`~memplan.model.spec.CLAMPED_SWIGLU`): ``gate.clamp(max=L)``,
  ``up.clamp(-L, L)``, ``glu = gate * sigmoid(alpha * gate)``, ``(up + 1) * glu``. The clamps keep the
  strided gate and up views (the whole fc1 output, already priced), the product with the sigmoid keeps
  the clamped gate and the sigmoid's output, the last product keeps ``up + 1`` and ``glu``: four
  ``[rows, f]`` tensors where a plain SwiGLU keeps one (``act(gate)``).
* **Top-k-then-softmax router** (``MoESpec.softmax_after_topk``): ``topk`` of the router logits keeps
  its int64 indices, the softmax over the ``k`` chosen logits its output (router dtype: the compute
  dtype), and the grouped experts gather those weights per routed row (``sample_weights[perm]``). With
  biased experts the sorted expert ids index the bias rows and are kept too (one int64 per routed row).

Checked against ``memplan trace`` (the real transformers code on fake tensors): tests/trace/
test_agreement_grid.py's gpt_oss cells.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from memplan.estimate.terms import Region, Term, TermRole
from memplan.model.spec import CLAMPED_SWIGLU

if TYPE_CHECKING:
    from memplan.model.spec import AttentionSpec, MLPSpec, ModelSpec, MoESpec


class _Shape(Protocol):
    """What these terms read of :class:`memplan.estimate.activations.ActivationShape` (which imports
    this module)."""

    @property
    def seq(self) -> int: ...
    @property
    def kv_seq(self) -> int: ...
    @property
    def micro_batch(self) -> int: ...
    @property
    def act_bytes(self) -> int: ...
    @property
    def residual_bytes(self) -> int: ...
    @property
    def sink_bytes(self) -> int: ...

__all__ = ["SORTED_BIAS_IDS", "clamped_swiglu_terms", "forward_mask_term", "gpt_oss_notes", "sink_forward_extra", "sink_softmax_bytes", "sink_softmax_terms",
           "topk_router_terms"]

#: The clamped SwiGLU's saved ``[rows, f]`` tensors beyond fc1's output and fc2's input.
_CLAMPED_SWIGLU_SAVED = ("clamped gate", "sigmoid of the scaled clamped gate", "gate x sigmoid", "up + 1")
_CLAMPED_SWIGLU_ROLES = (TermRole.CLAMPED_GATE, TermRole.CLAMPED_SIGMOID, TermRole.CLAMPED_PRODUCT,
                         TermRole.CLAMPED_UP_PLUS_ONE)
#: The sorted expert ids the biased experts' bias rows are gathered by (saved for the biases' gradient).
SORTED_BIAS_IDS = "sorted expert ids indexing the experts' bias rows (int64)"
#: Bytes of an int64 index (``max(dim)``'s and ``topk``'s saved indices, the sorted expert ids).
_INDEX_BYTES = 8


def _weights_bytes(shape: _Shape) -> int:
    """Bytes per element of the weights' dtype, which the residual stream carries too (fp32 under autocast
    and fp32, else 16-bit): the masks' (built in the embeddings' dtype)."""
    return max(shape.residual_bytes, shape.act_bytes)


def sink_softmax_bytes(shape: _Shape) -> int:
    """Bytes per element of the softmax over scores and sinks: the promotion of the 16-bit scores with the
    sinks parameter, which has the weights' dtype (a partially frozen 16-bit base's trained sinks keep the
    job's precision: ``shape.sink_bytes``)."""
    return max(shape.sink_bytes or shape.residual_bytes, shape.act_bytes)


def sink_softmax_terms(attn: AttentionSpec, shape: _Shape, cast_name: str) -> list[Term]:
    """The eager attention core of a layer with sinks: softmax over ``s + 1`` columns, the row
    maxima's indices, and the PV matmul's cast copy when the softmax is wider than the compute dtype."""
    rows = attn.num_heads * shape.micro_batch * shape.seq
    width = sink_softmax_bytes(shape)
    terms = [Term("softmax over scores and the sink column (attention sinks)", width * rows * (shape.kv_seq + 1),
                  "tp", "core", role=TermRole.SINK_SOFTMAX),
             Term("row maxima's indices (int64, max before the sink softmax)", _INDEX_BYTES * rows, "tp", "core",
                  role=TermRole.SINK_ROW_MAX)]
    if shape.act_bytes < width:
        terms.append(Term(cast_name, shape.act_bytes * rows * shape.kv_seq, "tp", "core", role=TermRole.SOFTMAX_CAST))
    return terms


def sink_forward_extra(attn: AttentionSpec, shape: _Shape) -> Term:
    """What the sink attention's forward holds beyond its saved tensors when its cast runs: the masked
    scores (``scores + mask``, in the mask's dtype: the weights') and the max-subtracted logits (``s + 1``
    columns, in the softmax's dtype), both still bound to local names, and the projections' locals
    (:func:`_projection_locals`). A recomputed layer makes them again inside its backward."""
    rows = attn.num_heads * shape.micro_batch * shape.seq
    per_row = _weights_bytes(shape) * shape.kv_seq + sink_softmax_bytes(shape) * (shape.kv_seq + 1)
    return Term("masked scores, max-subtracted logits and the rotated q, k and v alive at the sink softmax's cast",
                per_row * rows + _projection_locals(attn, shape), "tp", "core")


def _projection_locals(attn: AttentionSpec, shape: _Shape) -> int:
    """Bytes of the tensors ``GptOssAttention.forward`` and ``eager_attention_forward`` still bind to local names at
    the sink softmax that autograd does not save: RoPE multiplies the 16-bit q and k by tables in the hidden states'
    dtype (the weights'), so under autocast the rotated q, the rotated k and ``repeat_kv``'s copy of it are in that
    wider dtype and the matmul saves its own 16-bit casts of q and the copy; with grouped heads ``repeat_kv`` copies
    k and v (``expand`` then ``reshape``), the matmuls save the copies, the rotated k and the projected v stay
    bound (in the compute dtype: the rotated q and the copies are then what the matmuls save)."""
    tokens, wide = shape.micro_batch * shape.seq, _weights_bytes(shape)
    copied = attn.num_kv_heads < attn.num_heads and not (attn.num_kv_heads == 1 and shape.micro_batch == 1)
    q, k, v = (tokens * heads * dim for heads, dim in ((attn.num_heads, attn.head_dim),
                                                       (attn.num_kv_heads, attn.head_dim),
                                                       (attn.num_kv_heads, attn.v_head_dim)))
    held = wide * (q + (q if copied else k)) if wide > shape.act_bytes else 0
    return held + (wide * k + shape.act_bytes * v if copied else 0)


def forward_mask_term(model: ModelSpec, shape: _Shape) -> Term:
    """The 4-D additive masks transformers' forward builds for eager attention, alive until the model's
    forward returns: one ``(batch, 1, s, s)`` per layer type (gpt-oss: full and sliding), in the
    embeddings' dtype (the weights')."""
    kinds = len({layer.attention.sliding_window is not None for layer in model.layers})
    return Term("eager attention masks (one per layer type) during the forward",
                kinds * _weights_bytes(shape) * shape.micro_batch * shape.seq * shape.kv_seq, "rep", "core")


def clamped_swiglu_terms(mlp: MLPSpec, tokens: int, region: Region, elem_bytes: int, site: str) -> list[Term]:
    """What the clamped SwiGLU keeps beyond fc1's output and fc2's input (empty for other activations)."""
    if mlp.activation != CLAMPED_SWIGLU:
        return []
    size = elem_bytes * tokens * mlp.intermediate_size
    # four tensors apart: the backward's transient is priced from the largest single saved tensor
    return [Term(f"experts clamped SwiGLU: {what}", size, region, "body", site=site, role=role)
            for what, role in zip(_CLAMPED_SWIGLU_SAVED, _CLAMPED_SWIGLU_ROLES)]


def topk_router_terms(moe: MoESpec, shape: _Shape) -> list[Term]:
    """A top-k-then-softmax router with HF's grouped experts: what it and the routing keep per routed row."""
    routed = shape.seq * shape.micro_batch * moe.top_k
    terms = [Term("router top-k indices (int64), softmax of the top-k logits, routing weights gathered per row",
                  routed * (_INDEX_BYTES + 2 * shape.act_bytes), "sp", "body", site="moe", role=TermRole.ROUTER_OTHER)]
    if moe.expert.bias:
        terms.append(Term(SORTED_BIAS_IDS, routed * _INDEX_BYTES, "sp",
                          "body", site="moe", role=TermRole.SORTED_BIAS_IDS))
    return terms


def gpt_oss_notes(model: ModelSpec, attention: str, kernels: str) -> list[str]:
    """The --explain sentences of the mechanics above, for a model that has them (none otherwise)."""
    out: list[str] = []
    if model.has_attention_sinks:
        if attention == "eager" and kernels == "eager":
            out.append("attention sinks (gpt-oss): the eager softmax runs over the s scores and one learned sink logit "
                       "per head, in the weights' dtype (fp32 under autocast), keeping the row maxima's int64 "
                       "indices; the PV matmul keeps a cast copy only when that softmax is wider than the compute "
                       "dtype")
        elif attention != "eager":
            out.append(f"attention sinks (gpt-oss) under {attention} attention: priced as a flash kernel that takes "
                       "the sinks (transformers: kernels-community/vllm-flash-attn3), keeping the fp32 log-sum-exp; "
                       "not checked by memplan trace, which runs flash as PyTorch SDPA (no sinks)")
    if CLAMPED_SWIGLU in model.expert_activations:
        if kernels == "eager":
            out.append("gpt-oss experts: the clamped SwiGLU keeps the clamped gate, its sigmoid, gate x sigmoid and "
                       "up + 1 beside fc1's output and fc2's input; the router's softmax over its top-k logits keeps "
                       "the int64 indices and the k weights, and the experts' bias rows keep the sorted expert ids")
        else:
            out.append(f"gpt-oss experts under {kernels} kernels: the clamped SwiGLU is priced as a fused gated "
                       "activation that keeps its input, the router as the framework's; not checked by memplan "
                       "trace (which runs transformers' eager code)")
    return out
