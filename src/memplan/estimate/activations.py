"""Activation memory of one decoder layer for one micro-batch.

The accounting follows Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4): every tensor the forward pass saves for the backward pass is a
*term* below, with the region that decides how it is divided:

* ``tp`` — inside the tensor-parallel region (heads, FFN columns): divided by TP;
* ``sp`` — outside it (norms, dropout, GEMM inputs before the all-gather): divided by TP only
  with sequence parallelism;
* ``rep`` — replicated on every TP rank (MoE router outputs, MLA latents without SP).

and the recompute class that says which recompute mode drops it (one table, :data:`KEPT_BY`):
``input`` (the layer input, kept by every mode), ``core`` (the attention core: scores, softmax,
dropout — dropped by selective recompute), ``body`` (everything else — dropped by full recompute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from memplan.model.spec import AttentionSpec, LayerSpec, MLPSpec, MoESpec

Region = Literal["tp", "sp", "rep"]
Keep = Literal["input", "core", "body"]

#: Which recompute classes each recompute mode keeps in memory.
KEPT_BY: dict[str, frozenset[str]] = {
    "none": frozenset({"input", "core", "body"}),
    "selective": frozenset({"input", "body"}),
    "full": frozenset({"input"}),
}

#: Bytes per element of a dropout mask (PyTorch stores bool/uint8 masks).
DROPOUT_MASK_BYTES = 1
#: Flash attention's saved log-sum-exp is fp32, one per (head, token).
LSE_BYTES = 4


@dataclass(frozen=True, slots=True)
class ActivationShape:
    """Everything a layer's activation terms depend on besides the layer itself."""

    #: Tokens per sequence on this rank (sequence / context parallelism).
    seq: int
    #: Sequence length each query attends over (== seq with CP ring attention per step).
    kv_seq: int
    micro_batch: int
    hidden: int
    tp: int
    sequence_parallel: bool
    #: Bytes per element of activations (2 for bf16/fp16, 4 for fp32).
    act_bytes: int
    #: Bytes per element of the residual stream (4 under fp32-weight autocast, else act_bytes).
    residual_bytes: int
    attention: str
    dropout: bool
    kernels: str
    expert_tp: int = 1
    #: Saved GEMM inputs in FP8 (Transformer Engine FP8 training).
    fp8: bool = False
    #: Tokens the busiest expert receives relative to balanced routing (MoE imbalance/capacity).
    routed_factor: float = 1.0
    #: MoE token dispatcher and expert-parallel size (for the dispatch buffers).
    dispatcher: str = "alltoall"
    ep: int = 1
    #: ``rmsnorm`` or ``layernorm`` (what an eager norm saves differs).
    norm: str = "rmsnorm"
    #: fp32 weights under ``torch.autocast``: every linear casts (and saves) its own 16-bit input.
    autocast: bool = False


@dataclass(frozen=True, slots=True)
class Term:
    name: str
    bytes: int
    region: Region
    keep: Keep
    #: Input of a linear layer's GEMM: saved in FP8 (1 byte per element) under FP8 training.
    gemm_input: bool = False


def layer_terms(layer: LayerSpec, shape: ActivationShape) -> list[Term]:
    """Every tensor a layer saves for backward (undivided: full TP width, local sequence)."""
    terms = _attention_terms(layer.attention, shape)
    if layer.moe is not None:
        terms += _moe_terms(layer.moe, shape)
    else:
        assert layer.mlp is not None
        terms += _mlp_terms(layer.mlp, shape, tokens=shape.seq * shape.micro_batch, region="tp", prefix="mlp")
    return terms


def _norm_terms(shape: ActivationShape, prefix: str, keep_input: Keep, consumers: int = 1) -> list[Term]:
    """A pre-norm: its input, what the norm itself saves, and its output as the next GEMMs' input.

    ``consumers`` is the number of linear layers reading the output (q, k, v: 3 unless fused);
    under autocast each casts the fp32 output itself and saves its own 16-bit copy.
    """
    sbh = shape.seq * shape.micro_batch * shape.hidden
    terms = [Term(f"{prefix} norm input", shape.residual_bytes * sbh, "sp", keep_input)]
    if shape.kernels == "eager" and shape.norm == "rmsnorm":
        # The reference RMSNorm computes in fp32 and returns weight * x_normed.to(input dtype): it
        # saves an fp32 copy of a 16-bit input (an fp32 input is saved as is) and x_normed.
        if shape.residual_bytes < 4:
            terms.append(Term(f"{prefix} norm fp32 input", 4 * sbh, "sp", "body"))
        else:
            terms.append(Term(f"{prefix} norm normalized input", shape.residual_bytes * sbh, "sp", "body"))
    terms.append(Term(f"{prefix} norm output (GEMM input)", shape.act_bytes * sbh, "sp", "body", gemm_input=True))
    if shape.autocast and consumers > 1:
        terms.append(Term(f"{prefix} norm output, autocast copies of the other {consumers - 1} GEMMs",
                          (consumers - 1) * shape.act_bytes * sbh, "sp", "body", gemm_input=True))
    return terms


def _attention_terms(attn: AttentionSpec, shape: ActivationShape) -> list[Term]:
    s, b, c = shape.seq, shape.micro_batch, shape.act_bytes
    tokens = s * b
    consumers = 2 if attn.kind == "mla" else (1 if attn.fused_qkv else 3)
    terms = _norm_terms(shape, "attention", "input", consumers)
    if attn.kind == "mla":
        terms += _mla_projection_terms(attn, shape)
        q_width = attn.num_heads * attn.head_dim
        kv_width = attn.num_heads * (attn.head_dim + attn.v_head_dim)
    else:
        q_width = attn.num_heads * attn.head_dim
        kv_width = attn.num_kv_heads * (attn.head_dim + attn.v_head_dim)
    terms.append(Term("q, k, v", c * tokens * (q_width + kv_width), "tp", "body"))
    # (RoPE multiplies q and k by cos/sin tables that need no gradient: it saves nothing more.)
    if attn.qk_norm:
        k_width = attn.num_kv_heads * attn.head_dim
        # Per-head q/k norms: the projection outputs (fp32 copies in eager code) and, in eager
        # code, the normalized tensors in the projection's dtype.
        per_element = (4 + c) if shape.kernels == "eager" else c
        terms.append(Term("q, k norms", per_element * tokens * (q_width + k_width), "tp", "body"))
    heads_scores = attn.num_heads * b * s * shape.kv_seq
    if shape.attention == "eager":
        terms.append(Term("softmax output", c * heads_scores, "tp", "core"))
        if shape.dropout:
            terms.append(Term("attention dropout mask", DROPOUT_MASK_BYTES * heads_scores, "tp", "core"))
            terms.append(Term("attention dropout output", c * heads_scores, "tp", "core"))
    else:
        terms.append(Term("flash log-sum-exp", LSE_BYTES * attn.num_heads * tokens, "tp", "core"))
    terms.append(Term("output projection input", c * tokens * attn.num_heads * attn.v_head_dim, "tp", "body", gemm_input=True))
    if shape.dropout:
        terms.append(Term("attention residual dropout mask", DROPOUT_MASK_BYTES * tokens * shape.hidden, "sp", "body"))
    return terms


def _mla_projection_terms(attn: AttentionSpec, shape: ActivationShape) -> list[Term]:
    """MLA's low-rank path: down-projected q and kv latents, their norms, the up-projection inputs."""
    tokens = shape.seq * shape.micro_batch
    c = shape.act_bytes
    latent = attn.kv_lora_rank or 0
    rope = attn.qk_rope_head_dim or 0
    terms = [Term("kv latent (+ rope key)", c * tokens * (latent + rope), "rep", "body")]
    terms.append(Term("kv latent norm output (kv up-projection input)", c * tokens * latent, "rep", "body", gemm_input=True))
    if attn.q_lora_rank:
        terms.append(Term("q latent", c * tokens * attn.q_lora_rank, "rep", "body"))
        terms.append(Term("q latent norm output (q up-projection input)", c * tokens * attn.q_lora_rank, "rep", "body", gemm_input=True))
    return terms


def _mlp_terms(mlp: MLPSpec, shape: ActivationShape, *, tokens: int, region: Region, prefix: str) -> list[Term]:
    c, f = shape.act_bytes, mlp.intermediate_size
    terms: list[Term] = []
    if prefix == "mlp":
        consumers = 2 if mlp.gated and not mlp.fused_gate_up else 1
        terms += _norm_terms(shape, "mlp", "body", consumers)
    # fc1 output (gate and up halves for a gated MLP) saved by the activation function, its
    # output saved by fc2; eager SwiGLU also saves act(gate) as a separate tensor.
    fc1_out = 2 if mlp.gated else 1
    if mlp.gated and shape.kernels != "fused":
        fc1_out += 1
    terms.append(Term(f"{prefix} fc1 output (activation input)", c * tokens * f * fc1_out, region, "body"))
    terms.append(Term(f"{prefix} fc2 input", c * tokens * f, region, "body", gemm_input=True))
    if mlp.activation == "gelu_new" and shape.kernels == "eager":
        # GPT-2's NewGELUActivation is a Python formula: it also saves tanh(...), 1 + tanh(...) and
        # 0.5 * x; under CUDA autocast its pow runs in fp32, so those are fp32.
        per_element = 12 if shape.autocast else 3 * c
        terms.append(Term(f"{prefix} gelu_new intermediates", per_element * tokens * f, region, "body"))
    if shape.dropout and prefix == "mlp":
        terms.append(Term("mlp residual dropout mask", DROPOUT_MASK_BYTES * tokens * shape.hidden, "sp", "body"))
    return terms


#: Router outputs kept per token and expert: fp32 logits, fp32 scores (softmax/sigmoid) and the
#: boolean routing map (megatron/core/transformer/moe/router.py).
ROUTER_BYTES_PER_EXPERT = 4 + 4 + 1
#: Per routed token: the int64 permutation index and the fp32 routing probability.
ROUTED_INDEX_BYTES = 8 + 4


def _moe_terms(moe: MoESpec, shape: ActivationShape) -> list[Term]:
    """MoE block: router, token dispatch, expert MLPs on the tokens this rank receives, combine.

    Tokens enter sequence-parallel (``s*b/tp`` per rank). Each routed copy goes to one of the
    ``ep`` expert ranks; with expert tensor parallelism every one of the ``etp`` ranks of an
    expert receives all its tokens and holds ``f/etp`` of its columns. So a rank runs its experts
    on ``tokens * top_k * etp`` rows (balanced routing; times ``routed_factor`` for the busiest
    rank) and keeps their FFN activations at ``f/etp`` width.
    """
    s, b, c, h = shape.seq, shape.micro_batch, shape.act_bytes, shape.hidden
    tokens = s * b
    terms = _norm_terms(shape, "mlp", "body")
    terms.append(Term("router logits/scores (fp32) + routing map", tokens * moe.num_experts * ROUTER_BYTES_PER_EXPERT, "sp", "body"))
    routed = tokens * moe.top_k
    terms.append(Term("routing indices and probabilities", routed * ROUTED_INDEX_BYTES, "sp", "body"))
    received = int(routed * shape.routed_factor)
    terms.append(Term("dispatched tokens (grouped-GEMM input)", c * received * h * shape.expert_tp, "sp", "body", gemm_input=True))
    terms += _mlp_terms(moe.expert, shape, tokens=received, region="sp", prefix="experts")
    # Combine weights each expert output by its routing probability: the product's backward keeps
    # the expert outputs (back on the source rank: one row per routed copy).
    terms.append(Term("expert outputs kept by the weighted combine", c * routed * h, "sp", "body"))
    if moe.shared_expert is not None:
        terms += _mlp_terms(moe.shared_expert, shape, tokens=tokens, region="tp", prefix="shared expert")
    if shape.dropout:
        terms.append(Term("mlp residual dropout mask", DROPOUT_MASK_BYTES * tokens * h, "sp", "body"))
    return terms


def dispatch_buffer_bytes(layer: LayerSpec, shape: ActivationShape) -> int:
    """Transient buffers while an MoE layer moves tokens (one rank, forward or backward).

    All-to-all (and flex): the permuted send buffer and the received tokens, both alive around the
    exchange. All-gather: every token of the TP x EP group gathered on each rank (hidden states,
    fp32 probabilities and the routing map) before the local experts pick theirs.
    """
    if layer.moe is None:
        return 0
    c, h = shape.act_bytes, shape.hidden
    local = shape.seq * shape.micro_batch // (shape.tp if shape.sequence_parallel else 1)
    routed = local * layer.moe.top_k
    if shape.dispatcher == "allgather":
        gathered = local * shape.tp * shape.ep
        return gathered * (c * h + layer.moe.num_experts * (4 + 1))
    return c * h * (routed + int(routed * shape.routed_factor) * shape.expert_tp)


def divided(term: Term, shape: ActivationShape) -> int:
    """Bytes of ``term`` on one TP rank (FP8 GEMM inputs at one byte per element)."""
    size = term.bytes
    if shape.fp8 and term.gemm_input and shape.act_bytes > 1:
        size //= shape.act_bytes
    if term.region == "tp" or (term.region == "sp" and shape.sequence_parallel):
        return size // shape.tp
    return size


def layer_activation_bytes(layer: LayerSpec, shape: ActivationShape, recompute_mode: str) -> int:
    """Bytes one layer keeps for backward on one rank, for one micro-batch."""
    kept = KEPT_BY[recompute_mode]
    return sum(divided(t, shape) for t in layer_terms(layer, shape) if t.keep in kept)
