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
dropout — dropped by selective recompute), ``attn`` (the rest of the attention module: q/k/v
projections and their inputs, RoPE, the output projection's input — dropped when the whole
attention module is checkpointed), ``attn_input`` (the attention module's input, kept only by the
checkpoint that recomputes that module), ``body`` (everything else — dropped by full recompute).

Each activation policy (:mod:`memplan.policies`, ``ActivationPolicy.kept_classes_key``) prices its
layers with one row: ``selective`` recomputes the attention core (Korthikanti et al.; Megatron
``--recompute-granularity selective``, whose ``--recompute-modules`` also drop sites);
``selective-attention-module``
checkpoints every attention module (``self_attn``) with non-reentrant ``torch.utils.checkpoint``,
which is what ``memplan trace --recompute selective`` runs on a Hugging Face model;
``selective-per-op`` is torchtitan's per-op selective activation checkpointing
(:mod:`memplan.estimate.sac`).
"""

from __future__ import annotations

from collections.abc import Sequence

from memplan.estimate.gpt_oss_terms import (
    clamped_swiglu_terms,
    sink_forward_extra,
    sink_softmax_bytes,
    sink_softmax_terms,
    topk_router_terms,
)
from memplan.estimate.terms import ATTENTION_ADAPTER_TERMS, Keep, Region, Term, TermRole
from memplan.frozen import frozen_dataclass
from memplan.model.attention_kinds import attention_kind
from memplan.model.spec import AttentionSpec, HiddenDropout, LayerSpec, MLPSpec, MoESpec

#: Which recompute classes each recompute mode keeps in memory. ``ckpt_input``: a layer input only a
#: checkpoint keeps (OLMo 2 under autocast: the attention module's input too); ``layer_ckpt_input``: a frozen
#: layer's input, which nothing else saves, kept by a checkpoint of the whole layer (the checkpointed attention
#: module's input is its norm's output, ``attn_input``).
KEPT_BY: dict[str, frozenset[str]] = {
    "none": frozenset({"input", "core", "attn", "body"}),
    "selective": frozenset({"input", "attn", "body", "ckpt_input", "layer_ckpt_input"}),
    "selective-attention-module": frozenset({"input", "attn_input", "body", "ckpt_input"}),
    "full": frozenset({"input", "ckpt_input", "layer_ckpt_input"}),
    # torchtitan's per-op SAC: of what autograd saves only the layer input; the outputs of the
    # policy's kept ops are added by :mod:`memplan.estimate.sac`.
    "selective-per-op": frozenset({"input", "ckpt_input", "layer_ckpt_input"}),
    # torch.compile's partitioner under a memory budget: full recompute's floor; the engine adds the
    # budget's fraction of the rest (memory-budget policy, memplan.policies).
    "memory-budget": frozenset({"input", "ckpt_input", "layer_ckpt_input"}),
}

#: Bytes per element of HF eager attention's softmax output: ``softmax(scores, dtype=float32)``
#: (transformers ``eager_attention_forward``) whatever the compute dtype.
EAGER_SOFTMAX_BYTES = 4
#: Name of the term holding eager attention's probabilities cast back to the compute dtype.
SOFTMAX_CAST = "softmax output cast to the compute dtype (PV matmul input)"
#: The name (its start) of the term of ``repeat_kv``'s copies of the grouped keys and values for the extra query heads.
REPEATED_KV = "keys and values repeated per query head"
#: Bytes per element the eager reference RMSNorm computes in (it upcasts its input to fp32).
NORM_COMPUTE_BYTES = 4

#: Bytes per element of a dropout mask (PyTorch stores bool/uint8 masks).
DROPOUT_MASK_BYTES = 1
#: Flash attention's saved log-sum-exp is fp32, one per (head, token).
LSE_BYTES = 4
#: Attention that keeps the s x s probabilities: ``eager`` (transformers' ``eager_attention_forward``)
#: and ``math`` (SDPA's math kernel, ``_scaled_dot_product_attention_math`` in
#: aten/src/ATen/native/transformers/attention.cpp: ``_safe_softmax`` of the scores, whose output the PV
#: matmul and the softmax backward keep; the matmuls keep contiguous copies of q, k and v, with grouped
#: keys and values repeated per query head). Only fp32 activations reach math here (``sdpa_attention``),
#: where the eager accounting (fp32 softmax, no 16-bit cast) is the same; math takes no explicit mask.
UNFUSED_ATTENTION = ("eager", "math")
#: Compute-dtype bytes from which SDPA runs the memory-efficient kernel (fp32; cuDNN/flash need 16 bits), whose output
#: is sequence-first whatever q's layout.
FP32_KERNEL_BYTES = 4


@frozen_dataclass
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
    #: The forward runs under ``torch.autocast`` (the profile realises ``*-mixed`` by it), also where the
    #: weights are 16-bit already (a 16-bit frozen base): autocast's fp32 ops (softmax) run in fp32.
    autocast_ops: bool = False
    #: Bytes per element of the routed experts' activations (0: ``act_bytes``). HF's grouped
    #: experts (transformers ``integrations/moe.py`` ``_grouped_mm``) are not autocast ops: they
    #: cast the input to the weights' dtype, so under autocast they run in fp32.
    expert_bytes: int = 0
    #: Bytes per element of gpt-oss's attention-sinks parameter (0: the weights', ``residual_bytes``); the
    #: sink softmax runs in it (:func:`memplan.estimate.gpt_oss_terms.sink_softmax_bytes`).
    sink_bytes: int = 0
    #: The RMSNorm scales in fp32 and casts afterwards (Gemma 2): its normalized tensor is fp32.
    norm_fp32_scale: bool = False
    #: Rotary position embeddings (q and k are rotated into new tensors).
    rope: bool = True
    #: Ways the vocabulary-wide tensors (logits, loss) are split: tp when TP splits the vocabulary,
    #: 1 under Hugging Face's TP plan (logits gathered whole); 0 means ``tp``.
    vocab_tp: int = 0
    #: Where an MoE layer applies its routing probabilities (``FrameworkProfile.moe_probs_at``).
    moe_probs_at: str = "combine"
    #: The routed experts are transformers' grouped experts (``grouped_mm_experts_forward``): the combine
    #: reorders the weighted rows back to token order and sums the ``k`` picks (:mod:`~memplan.estimate.grouped_experts_backward`).
    grouped_experts_combine: bool = False
    #: The RMSNorm is PyTorch's fused one (``aten._fused_rms_norm`` on CUDA: it saves its input and the
    #: fp32 1/rms only; :attr:`memplan.frameworks.model_code.ModelCode.fused_rms_norm`).
    fused_rms_norm: bool = False
    #: Under sequence parallelism the linear layers save their all-gathered whole-sequence input
    #: (DTensor's plan in torchtitan) instead of their shard (Megatron gathers it again in the backward).
    gathered_gemm_inputs: bool = False
    #: RoPE reads a precomputed buffer (torchtitan's ``freqs_cis``): no cos/sin tables per forward.
    rope_buffer: bool = False
    #: Dropout on the attention probabilities where it differs from ``dropout`` (``Job.attention_dropout``);
    #: None: as ``dropout``. Read through :attr:`drops_attention`.
    attention_dropout: bool | None = None
    #: Where the running model code drops out hidden states when ``dropout`` (the model's family under
    #: transformers' code, every site under Megatron's: :attr:`memplan.model.spec.ModelSpec.hidden_dropout`).
    hidden_dropout_sites: HiddenDropout = "embedding-and-residual"

    @property
    def drops_attention(self) -> bool:
        """Dropout on the attention probabilities (an unfused kernel keeps its mask; see :func:`_attention_dropout_terms`)."""
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def drops_residual(self) -> bool:
        """Each block's output is dropped out before its residual add (a 1-byte mask per hidden element)."""
        return self.dropout and self.hidden_dropout_sites != "none"

    @property
    def drops_embedding(self) -> bool:
        """The embeddings are dropped out (a 1-byte mask per hidden element, kept by the embedding stage)."""
        return self.dropout and self.hidden_dropout_sites == "embedding-and-residual"

    @property
    def local_tokens(self) -> int:
        """Tokens of one micro-batch whose hidden states this rank holds (its sequence shard under
        sequence parallelism)."""
        return self.seq * self.micro_batch // (self.tp if self.sequence_parallel else 1)


def layer_terms(layer: LayerSpec, shape: ActivationShape) -> list[Term]:
    """Every tensor a layer saves for backward (undivided: full TP width, local sequence)."""
    attention, rest = layer_terms_by_block(layer, shape)
    return attention + rest


def layer_terms_by_block(layer: LayerSpec, shape: ActivationShape) -> tuple[list[Term], list[Term]]:
    """:func:`layer_terms` split into the attention block's and the rest (MLP/MoE block, post-norms)."""
    attention = _attention_terms(layer.attention, shape, pre_norm=layer.pre_norms)
    if layer.moe is not None:
        rest = _moe_terms(layer.moe, shape)
    else:
        assert layer.mlp is not None
        rest = _mlp_terms(layer.mlp, shape, tokens=shape.seq * shape.micro_batch, region="tp", prefix="mlp",
                          pre_norm=layer.pre_norms)
    if layer.parallel_residual and shape.kernels == "eager":  # (Megatron's own fused layers are sequential)
        rest = [_parallel_residual_norm_input(t) if t.role is TermRole.NORM_INPUT else t for t in rest]
    return attention, rest + post_norm_terms(shape, layer.num_post_norms)


def _parallel_residual_norm_input(term: Term) -> Term:
    """The MLP's pre-norm input in a parallel-residual layer (transformers' GPT-NeoX ``use_parallel_residual``:
    ``mlp(post_attention_layernorm(hidden_states))`` beside ``attention(input_layernorm(hidden_states))``): the
    layer input itself, which the attention's ``norm input`` term keeps already, so no bytes of its own. The
    term stays, empty, as the block's pre-norm (the reserved schedule starts the MLP block there)."""
    return Term(f"{term.name}: the layer input, kept by the attention's pre-norm (parallel residual)", 0,
                term.region, term.keep, site=term.site, role=term.role)


@frozen_dataclass
class NormSites:
    """Which Megatron ``--recompute-modules`` site each of a pre-norm's saved tensors belongs to.

    ``fused``: the GEMM inputs under fused kernels (Transformer Engine fuses the norm into the GEMM,
    whose module then saves its output). With eager modules (a Hugging Face layer, whose norms are
    modules of their own, reached by ``layernorm``'s output-discarding checkpoint): ``norm``, what
    the norm saves inside; ``output``, the GEMM inputs when they are the norm's output itself;
    ``copy``, the GEMM inputs under autocast, each linear's own 16-bit copy (not the norm's output,
    so never discarded with it).
    """

    fused: str = ""
    norm: str = ""
    output: str = ""
    copy: str = ""


def _norm_terms(shape: ActivationShape, prefix: str, keep_input: Keep, consumers: int = 1,
                gemm_keep: Keep = "body", sites: NormSites = NormSites()) -> list[Term]:
    """A pre-norm: its input, what the norm itself saves, and its output as the next GEMMs' input.

    ``consumers`` is the number of linear layers reading the output (q, k, v: 3 unless fused);
    under autocast each casts the fp32 output itself and saves its own 16-bit copy.
    ``gemm_keep`` is the recompute class of those GEMM inputs (``attn`` inside the attention module),
    ``sites`` the Megatron modules whose recompute drops each part.
    """
    sbh = shape.seq * shape.micro_batch * shape.hidden
    eager = shape.kernels == "eager"
    site = sites.fused if not eager else (sites.copy if shape.autocast else sites.output)
    # the GEMMs' input: the sequence shard, or the all-gathered whole sequence (gathered_gemm_inputs)
    gemm_region: Region = "rep" if shape.gathered_gemm_inputs and shape.sequence_parallel else "sp"
    terms = [Term(f"{prefix} norm input", shape.residual_bytes * sbh, "sp", keep_input, role=TermRole.NORM_INPUT)]
    terms += eager_norm_terms(shape, prefix, shape.residual_bytes, site=sites.norm)
    terms.append(Term(f"{prefix} norm output (GEMM input)", shape.act_bytes * sbh, gemm_region, gemm_keep,
                      gemm_input=True, site=site, role=TermRole.NORM_OUTPUT))
    if shape.autocast and consumers > 1:
        terms.append(Term(f"{prefix} norm output, autocast copies of the other {consumers - 1} GEMMs",
                          (consumers - 1) * shape.act_bytes * sbh, gemm_region, gemm_keep, gemm_input=True,
                          site=sites.copy if eager else sites.fused, role=TermRole.NORM_COPIES, tensors=consumers - 1))
    return terms


def _residual_input_terms(shape: ActivationShape, prefix: str, keep_input: Keep, consumers: int,
                          gemm_keep: Keep = "body") -> list[Term]:
    """A sublayer without a pre-norm (OLMo 2): its GEMMs read the residual stream itself.

    Without autocast the GEMMs save that tensor (``keep_input``: the layer input is kept by every
    mode). Under autocast each of the ``consumers`` linears casts it to 16 bits and saves its own
    copy, and nothing saves the fp32 residual: only a checkpoint keeps the layer input
    (``ckpt_input``), and the stream between the sublayers is freed at the next residual add.
    """
    sbh = shape.seq * shape.micro_batch * shape.hidden
    if not shape.autocast:
        return [Term(f"{prefix} input, the residual stream (GEMM input)", shape.residual_bytes * sbh, "sp", keep_input,
                     gemm_input=True)]
    terms = [Term(f"{prefix} GEMMs' autocast copies of the residual stream", consumers * shape.act_bytes * sbh, "sp",
                  gemm_keep, gemm_input=True)]
    if keep_input == "input":
        terms.append(Term("layer input (fp32 residual stream, kept by a checkpoint only)", shape.residual_bytes * sbh,
                          "sp", "ckpt_input"))
    return terms


def eager_norm_terms(shape: ActivationShape, prefix: str, input_bytes: int, site: str = "") -> list[Term]:
    """What an eager reference RMSNorm saves beyond an input of ``input_bytes`` per element.

    transformers' ``LlamaRMSNorm`` computes ``x = input.to(float32); x * rsqrt(mean(x^2) + eps)``
    and returns ``weight * x_normed.to(input dtype)``: it saves the fp32 input (an fp32 input as
    is, else an fp32 copy) and ``x_normed`` in the input dtype. ``Gemma2RMSNorm`` returns
    ``(x_normed * (1 + weight)).type_as(input)``: its ``x_normed`` is saved in fp32. The
    pre-norm's ``norm input`` term stands for the 16-bit input-dtype tensor when the input is
    16-bit (same bytes), so only the fp32 copy (and Gemma's fp32 excess) are added then.
    """
    if shape.kernels != "eager":
        return []
    if shape.norm != "rmsnorm":
        return _layernorm_autocast_copy(shape, prefix, input_bytes, site)
    sbh = shape.seq * shape.micro_batch * shape.hidden
    # ``x * rsqrt(variance + eps)`` also saves the fp32 reciprocal RMS, one per token.
    inverse_rms = Term(f"{prefix} norm 1/rms (fp32, per token)", NORM_COMPUTE_BYTES * shape.seq * shape.micro_batch,
                       "sp", "body", site=site, role=TermRole.NORM_OTHER)
    if shape.fused_rms_norm:
        # ``aten._fused_rms_norm`` saves the input (the norm-input term) and its fp32 rstd only (derivatives.yaml)
        return [inverse_rms]
    if input_bytes < NORM_COMPUTE_BYTES:
        terms = [Term(f"{prefix} norm fp32 input", NORM_COMPUTE_BYTES * sbh, "sp", "body", site=site,
                      role=TermRole.NORM_OTHER), inverse_rms]
        if shape.norm_fp32_scale:
            terms.append(Term(f"{prefix} norm normalized input in fp32 (beyond the input dtype)",
                              (NORM_COMPUTE_BYTES - input_bytes) * sbh, "sp", "body", site=site,
                              role=TermRole.NORM_NORMALIZED))
        return terms
    return [Term(f"{prefix} norm normalized input", input_bytes * sbh, "sp", "body", site=site,
                 role=TermRole.NORM_NORMALIZED), inverse_rms]


def norm_keeps_input(shape: ActivationShape) -> bool:
    """Whether a pre-norm saves its input tensor itself for the input's gradient: an fp32 input, or an eager
    LayerNorm's input outside autocast (``native_layer_norm`` saves its input, mean and 1/std: derivatives.yaml).
    An eager RMSNorm upcasts a 16-bit input and saves the fp32 copy; so does an eager LayerNorm under
    ``torch.autocast`` (:func:`_layernorm_autocast_copy`)."""
    if shape.residual_bytes == NORM_COMPUTE_BYTES:
        return True
    return shape.kernels == "eager" and shape.norm == "layernorm" and not shape.autocast_ops


def _layernorm_autocast_copy(shape: ActivationShape, prefix: str, input_bytes: int, site: str) -> list[Term]:
    """An eager LayerNorm's fp32 copy of a 16-bit input under ``torch.autocast``: ``layer_norm`` is on CUDA
    autocast's fp32 list (aten/src/ATen/autocast_mode.cpp), so its input is cast to fp32 and that copy is the
    input ``native_layer_norm`` saves (the 16-bit ``norm input`` term stands for nothing the norm keeps then,
    as with an RMSNorm's copy). A 16-bit input without autocast, or an fp32 one, is saved as is (the ``norm
    input`` term). Its fp32 mean and 1/std (one each per token) are not priced."""
    if not shape.autocast_ops or input_bytes >= NORM_COMPUTE_BYTES:
        return []
    sbh = shape.seq * shape.micro_batch * shape.hidden
    return [Term(f"{prefix} norm fp32 input (autocast's copy, saved by the LayerNorm)", NORM_COMPUTE_BYTES * sbh,
                 "sp", "body", site=site, role=TermRole.NORM_OTHER)]


def post_norm_terms(shape: ActivationShape, count: int) -> list[Term]:
    """Norms on a sublayer's output before the residual add (Gemma 2's post-attention and
    post-feedforward norms): the input is the output projection's, in the compute dtype; the norm
    saves it in fp32 (a copy when 16-bit) and its normalized tensor (see :func:`eager_norm_terms`)."""
    if count <= 0 or shape.kernels != "eager" or shape.norm != "rmsnorm":
        return []
    sbh = shape.seq * shape.micro_batch * shape.hidden
    c = shape.act_bytes
    normalized = NORM_COMPUTE_BYTES if shape.norm_fp32_scale else c
    return [Term("post-norms fp32 input", count * NORM_COMPUTE_BYTES * sbh, "sp", "body"),
            Term("post-norms 1/rms (fp32, per token)", count * NORM_COMPUTE_BYTES * shape.seq * shape.micro_batch,
                 "sp", "body"),
            Term("post-norms normalized output", count * normalized * sbh, "sp", "body",
                 role=TermRole.POST_NORM_NORMALIZED)]


def _attention_terms(attn: AttentionSpec, shape: ActivationShape, pre_norm: bool = True) -> list[Term]:
    tokens = shape.seq * shape.micro_batch
    kind = attention_kind(attn)
    consumers = kind.input_projections(attn)
    if not pre_norm:  # OLMo 2: the projections read the layer input (the module's input: nothing more to keep)
        return _residual_input_terms(shape, "attention", "input", consumers, gemm_keep="attn") + \
            _attention_rest_terms(attn, shape)
    # Megatron's TE layer spec fuses the pre-attention norm into linear_qkv except under MLA, where
    # it is its own module, which ``layernorm`` recompute can discard (gpt_layer_specs.py).
    terms = _norm_terms(shape, "attention", "input", consumers, gemm_keep="attn", sites=NormSites(
        fused="input_norm" if kind.separate_input_norm else "", norm="input_norm", output="input_norm"))
    # Checkpointing the attention module keeps its input: the norm output, in the residual dtype (fp32 from a
    # LayerNorm under autocast: ``layer_norm`` is on autocast's fp32 list, a 16-bit residual of a frozen base too).
    terms.append(Term("attention module input (checkpointed)", norm_output_bytes(shape) * tokens * shape.hidden, "sp",
                      "attn_input"))
    return terms + _attention_rest_terms(attn, shape)


def _attention_rest_terms(attn: AttentionSpec, shape: ActivationShape) -> list[Term]:
    """The attention module after its input: projections, q/k norms, the core, the output projection."""
    s, b, c = shape.seq, shape.micro_batch, shape.act_bytes
    tokens = s * b
    kind = attention_kind(attn)
    terms: list[Term] = []
    if kind.latent:
        terms += _mla_projection_terms(attn, shape)
        q_width = attn.num_heads * attn.head_dim
        kv_width = attn.num_heads * (attn.head_dim + attn.v_head_dim)
    else:
        q_width = attn.num_heads * attn.head_dim
        kv_width = attn.num_kv_heads * (attn.head_dim + attn.v_head_dim)
    terms += _qkv_terms(attn, shape, q_width, kv_width)
    if attn.qk_norm:
        k_width = attn.num_kv_heads * attn.head_dim
        # Per-head q/k norms: the projection outputs (fp32 copies in eager code) and, in eager
        # code, the normalized tensors in the projection's dtype (Gemma 3's ``1 + weight`` norm: in
        # fp32, cast after the scale); a fused RMSNorm keeps its input only.
        normalized = NORM_COMPUTE_BYTES if shape.norm_fp32_scale else c
        eager_norm = shape.kernels == "eager" and not shape.fused_rms_norm
        per_element = (NORM_COMPUTE_BYTES + normalized) if eager_norm else c
        name = "q, k norms (fp32 input copies, fp32 normalized)" if eager_norm and shape.norm_fp32_scale else "q, k norms"
        terms.append(Term(name, per_element * tokens * (q_width + k_width), "tp", "attn",
                          role=TermRole.QK_NORMS_FP32 if eager_norm and shape.norm_fp32_scale else TermRole.QK_NORMS))
        if shape.kernels == "eager":  # and each eager RMSNorm's fp32 1/rms, per head and token
            per = "per head and token" if attn.qk_norm_per_head else "per token"
            terms.append(Term(f"q, k norms 1/rms (fp32, {per})", NORM_COMPUTE_BYTES * tokens * attn.qk_norm_rows,
                              "tp", "attn", role=TermRole.QK_NORMS_RSTD))
    heads_scores = attn.num_heads * b * s * shape.kv_seq
    if shape.attention in UNFUSED_ATTENTION:
        core = _eager_core_terms(attn, shape, heads_scores)
        terms += core + _attention_dropout_terms(core, shape, heads_scores)
    else:
        terms.append(Term("flash log-sum-exp", LSE_BYTES * attn.num_heads * tokens, "tp", "core"))
        terms += _sdpa_mask_terms(attn, shape)
        if (kind.latent and shape.kernels == "eager") or (_fused_rotated_qk(attn, shape) and c < FP32_KERNEL_BYTES):
            # transformers' MLA and fused-projection RoPE concatenate q heads-first, the fused kernel writes its
            # output in q's layout and saves it; ``transpose(1, 2).contiguous()`` then copies it for o_proj.
            terms.append(Term("attention kernel output (heads-first; o_proj reads a copy)",
                              c * tokens * attn.num_heads * attn.v_head_dim, "tp", "core", site="core",
                              role=TermRole.KERNEL_OUTPUT))
    terms.append(Term("output projection input", c * tokens * attn.num_heads * attn.v_head_dim, "tp", "attn",
                      gemm_input=True, role=TermRole.OUTPUT_PROJECTION_INPUT))
    if shape.drops_residual:
        terms.append(Term("attention residual dropout mask", DROPOUT_MASK_BYTES * tokens * shape.hidden, "sp", "body"))
    return terms


def _qkv_terms(attn: AttentionSpec, shape: ActivationShape, q_width: int, kv_width: int) -> list[Term]:
    """What the attention core's inputs keep: q, k and v (a fused q/k/v projection's output besides, see
    :func:`_fused_qkv_terms`); RoPE multiplies q and k by cos/sin tables that need no gradient: nothing more."""
    c, tokens = shape.act_bytes, shape.seq * shape.micro_batch
    kind = attention_kind(attn)
    if _eager_mla_value_copied(attn, shape):
        # the PV matmul's own copy of v, which the core saves (recompute of the stretch keeps it)
        v_width = attn.num_heads * attn.v_head_dim
        return [Term("q, k", c * tokens * (q_width + kv_width - v_width), "tp", "attn", site="mla_up"),
                Term("v copied by the eager PV matmul (strided value view, micro-batch > 1)",
                     c * tokens * v_width, "tp", "core", site="core")]
    if _fused_rotated_qk(attn, shape):  # v is a view of the fused output (counted there): q and k only
        k_width = attn.num_kv_heads * attn.head_dim
        return [Term("q, k (rotated copies)", c * tokens * (q_width + k_width), "tp", "attn", role=TermRole.QKV),
                *_fused_qkv_terms(attn, shape)]
    return [Term("q, k, v", c * tokens * (q_width + kv_width), "tp", "attn", site="mla_up" if kind.latent else "",
                 role=TermRole.QKV), *_fused_qkv_terms(attn, shape)]


def _attention_dropout_terms(core: list[Term], shape: ActivationShape, heads_scores: int) -> list[Term]:
    """Dropout on an unfused kernel's probabilities: its 1-byte mask, and its output where that is a tensor more.

    The PV matmul saves the dropout output in place of its input. Where that input is a cast of the
    softmax output (transformers' ``softmax(..., dtype=float32).to(query.dtype)`` below fp32, gpt-oss's cast
    after the dropout), the cast is not kept: mask only. Where the PV matmul would have read the softmax
    output itself, which its backward keeps anyway (fp32 compute, Megatron's fused softmax in the compute
    dtype), the dropout output is extra (measured with ``memplan trace``, tests/trace/test_dropout_trace.py).
    """
    if not shape.drops_attention:
        return []
    terms = [Term("attention dropout mask", DROPOUT_MASK_BYTES * heads_scores, "tp", "core")]
    if not any(t.role is TermRole.SOFTMAX_CAST for t in core):
        terms.append(Term("attention dropout output", shape.act_bytes * heads_scores, "tp", "core"))
    return terms


def _eager_core_terms(attn: AttentionSpec, shape: ActivationShape, heads_scores: int) -> list[Term]:
    """The attention core without a fused kernel: the s x s probabilities (and what leads to them).

    Fused kernels (Megatron's scale-mask-softmax) keep the softmax output in the compute dtype.
    transformers' ``eager_attention_forward`` (``kernels="eager"``) instead runs
    ``softmax(scores, dtype=float32).to(query.dtype)``: softmax saves its fp32 output and the PV
    matmul the cast copy (none when the compute dtype is fp32; GPT-2's softmax runs in the scores' dtype,
    :attr:`AttentionSpec.softmax_in_scores_dtype`: fp32 and cast under autocast only); Gemma 2's soft-capping
    ``tanh(scores / cap) * cap`` saves the tanh output; and ``repeat_kv`` copies grouped keys and
    values to every query head before the two matmuls, which save the copies.
    """
    c = shape.act_bytes
    if shape.kernels != "eager":
        return [Term("softmax output", c * heads_scores, "tp", "core", role=TermRole.SOFTMAX)]
    if attn.sinks:  # gpt-oss: the softmax runs over a sink column too, in the weights' dtype
        terms = sink_softmax_terms(attn, shape, SOFTMAX_CAST)
    else:
        soft = _eager_softmax_bytes(attn, shape)
        terms = [Term("softmax output (fp32)", soft * heads_scores, "tp", "core", role=TermRole.SOFTMAX_FP32)
                 if soft == EAGER_SOFTMAX_BYTES else
                 Term("softmax output", soft * heads_scores, "tp", "core", role=TermRole.SOFTMAX)]
        if c < soft:
            terms.append(Term(SOFTMAX_CAST, c * heads_scores, "tp", "core", role=TermRole.SOFTMAX_CAST))
    if attn.logit_softcap is not None:
        terms.append(Term("soft-capped scores (tanh output)", c * heads_scores, "tp", "core",
                          role=TermRole.SOFTCAP_SCORES))
    if attention_kind(attn).grouped_kv and (width := _repeated_kv_width(attn, shape)):
        tokens = shape.seq * shape.micro_batch
        extra_heads = attn.num_heads - attn.num_kv_heads
        name = (f"{REPEATED_KV} (repeat_kv copies)" if width > attn.head_dim else
                "keys cast to the compute dtype for every query head (autocast; the values stay a view)")
        role = TermRole.REPEATED_KV if width > attn.head_dim else TermRole.KEYS_CAST
        terms.append(Term(name, c * tokens * extra_heads * width, "tp", "core", role=role))
    return terms


def _eager_softmax_bytes(attn: AttentionSpec, shape: ActivationShape) -> int:
    """Bytes per element eager attention's softmax (and its backward's gradients) runs in: the promotion of the
    scores with gpt-oss's sinks, the scores' dtype in GPT-2's code outside autocast
    (:attr:`AttentionSpec.softmax_in_scores_dtype`), else fp32 (``softmax(..., dtype=torch.float32)``)."""
    if attn.sinks:
        return sink_softmax_bytes(shape)
    return shape.act_bytes if attn.softmax_in_scores_dtype and not shape.autocast_ops else EAGER_SOFTMAX_BYTES


def _repeated_kv_width(attn: AttentionSpec, shape: ActivationShape) -> int:
    """Per-head elements of the grouped keys and values that eager attention (or SDPA given a mask)
    copies per query head.

    ``repeat_kv`` expands the KV heads and reshapes them to every query head, a copy that the two
    matmuls (or the SDPA kernel) save. With a single KV head at micro-batch 1 (multi-query: Gemma 2B, Gemma 3 1B) the
    reshape is a view, and so is ``torch.matmul``'s fold of batch and heads into its ``bmm`` batch (a
    stride-0 batch): nothing is copied. Only under autocast the rotated keys, fp32 after RoPE's fp32
    tables, are cast to the compute dtype for the matmul, which writes every head (measured with
    ``memplan trace`` on gemma-3-1b: fp32 +3.2% and bf16-mixed +0.7% activations when both were priced;
    SDPA with its sliding-window mask, 6 layers at seq 1024: bf16 +2.2%, bf16-mixed +0.5%).
    """
    if attn.num_kv_heads == 1 and shape.micro_batch == 1:
        return attn.head_dim if shape.autocast and shape.rope else 0
    return attn.head_dim + attn.v_head_dim


def _sdpa_mask_terms(attn: AttentionSpec, shape: ActivationShape) -> list[Term]:
    """transformers' SDPA attention given an explicit mask: a sliding window no longer than the keys.

    With a mask, ``sdpa_attention_forward`` does not pass ``enable_gqa`` and ``repeat_kv`` copies the
    grouped keys and values to every query head (the kernel saves the copies), and CUDA's
    ``scaled_dot_product_attention`` turns the boolean ``(batch, 1, s, s)`` mask into an additive
    one in the query dtype (``convert_boolean_attn_mask[_cudnn]``), which the cuDNN / efficient
    kernel saves as its bias: one per layer.
    """
    window = attn.sliding_window
    if shape.attention != "sdpa" or shape.kernels != "eager" or window is None or shape.kv_seq < window:
        return []
    if attention_kind(attn).latent:
        return []
    c, tokens = shape.act_bytes, shape.seq * shape.micro_batch
    terms = [Term("additive attention mask (SDPA, from the boolean sliding-window mask)",
                  c * shape.micro_batch * shape.seq * shape.kv_seq, "rep", "core")]
    if attn.num_kv_heads < attn.num_heads and (width := _repeated_kv_width(attn, shape)):
        extra_heads = attn.num_heads - attn.num_kv_heads
        name = (f"{REPEATED_KV} (repeat_kv: no enable_gqa with a mask)"
                if width > attn.head_dim else "keys cast to the compute dtype for every query head (autocast)")
        role = TermRole.REPEATED_KV if width > attn.head_dim else TermRole.KEYS_CAST
        terms.append(Term(name, c * tokens * extra_heads * width, "tp", "core", role=role))
    return terms


def pv_matmul_saves_v_view(attn: AttentionSpec, shape: ActivationShape) -> bool:
    """Unfused attention's PV matmul saves v as the strided view it was given (a slice of a fused q/k/v
    projection's output, which it keeps alive), not a copy.

    GQA's ``repeat_kv`` copies v first (``expand`` then ``reshape``). Without it, ``torch.matmul`` of two
    4-D tensors folds batch and heads into one batch dimension with ``reshape``: a view of the slice only
    where one of the two is 1 (its batch stride is ``seq·(H + 2·KV)·d``, not ``H·d``), else a contiguous
    copy, which the matmul saves instead. The same in eager autograd and under torch.compile (the matmul
    is decomposed the same way before the partitioner); autocast changes nothing (the projection's output
    is already 16-bit, the matmul's cast of v returns v)."""
    return attn.num_kv_heads == attn.num_heads and (shape.micro_batch == 1 or attn.num_heads == 1)


def _fused_rotated_qk(attn: AttentionSpec, shape: ActivationShape) -> bool:
    """A fused q/k/v projection with RoPE (GPT-NeoX ``query_key_value``, Phi-3 ``qkv_proj``) in eager code under a
    fused SDPA kernel: ``apply_rotary_pos_emb`` rotates q and k into new tensors with ``torch.cat``, contiguous in the
    heads-first layout, while v stays a view of the projection's output (the kernel saves q, k and that view).

    At 16 bits (the cuDNN kernel) the kernel writes its output in q's heads-first layout, so
    ``transpose(1, 2).contiguous()`` copies it for the output projection: the kernel's output (which it saves) and
    the output projection's input are two tensors, and a frozen output projection keeps only the first. At fp32
    (:data:`FP32_KERNEL_BYTES`, the memory-efficient kernel) the output is sequence-first and the copy a no-op: one
    tensor. (Llama's separate projections keep q sequence-first: one tensor under either kernel.)"""
    return (attn.fused_qkv and shape.kernels == "eager" and shape.rope and not attention_kind(attn).latent
            and shape.attention not in UNFUSED_ATTENTION)


def _fused_qkv_terms(attn: AttentionSpec, shape: ActivationShape) -> list[Term]:
    """A fused q/k/v projection with RoPE (Phi-3 ``qkv_proj``) in eager code.

    q and k are sliced out and rotated into new tensors, but v stays a strided view of the
    projection's output, and the output lives as long as a view of it is saved:

    * a fused SDPA kernel (flash, memory-efficient, cuDNN) saves its inputs as given (the view): the
      whole output is kept, v's part included (:func:`_fused_rotated_qk`: the ``q, k`` term counts the
      rotated q and k only; at 16 bits the kernel's own output is a term of its own);
    * SDPA's math backend (``math``): the ``q, k, v`` term and the whole output;
    * eager attention where :func:`pv_matmul_saves_v_view`: the PV matmul saves the view itself
      (counted as v), so the output's q and k parts are extra;
    * eager attention elsewhere: v reaches the matmul as a copy (``repeat_kv``'s, or the matmul's
      own), which is saved: the output is freed, nothing extra.

    GPT-2's unrotated q, k, v are all views of ``c_attn``'s output: nothing extra either.
    """
    if not attn.fused_qkv or shape.kernels != "eager" or not shape.rope or attention_kind(attn).latent:
        return []
    if shape.attention == "eager":
        heads = attn.num_heads + attn.num_kv_heads if pv_matmul_saves_v_view(attn, shape) else 0
    else:
        heads = attn.num_heads + 2 * attn.num_kv_heads
    if not heads:
        return []
    tokens = shape.seq * shape.micro_batch
    return [Term("fused qkv output kept alive by the saved v view", shape.act_bytes * tokens * heads * attn.head_dim,
                 "tp", "attn")]


def _mla_projection_terms(attn: AttentionSpec, shape: ActivationShape) -> list[Term]:
    """MLA's low-rank path: down-projected q and kv latents, their norms, the up-projection inputs."""
    if shape.kernels == "eager":
        return _eager_mla_projection_terms(attn, shape)
    tokens = shape.seq * shape.micro_batch
    c = shape.act_bytes
    latent = attn.kv_lora_rank or 0
    rope = attn.qk_rope_head_dim or 0
    terms = [Term("kv latent (+ rope key)", c * tokens * (latent + rope), "rep", "body")]
    terms.append(Term("kv latent norm output (kv up-projection input)", c * tokens * latent, "rep", "body",
                      gemm_input=True, site="mla_up"))
    if attn.q_lora_rank:
        terms.append(Term("q latent", c * tokens * attn.q_lora_rank, "rep", "body"))
        terms.append(Term("q latent norm output (q up-projection input)", c * tokens * attn.q_lora_rank, "rep",
                          "body", gemm_input=True, site="mla_up"))
    return terms


def _eager_mla_projection_terms(attn: AttentionSpec, shape: ActivationShape) -> list[Term]:
    """MLA's low-rank path in transformers' ``DeepseekV2Attention`` / ``DeepseekV3Attention``.

    Each latent goes through an eager RMSNorm (:func:`eager_norm_terms`): it saves an fp32 copy of
    the 16-bit latent, the reciprocal RMS per token and the normalized latent in the input dtype
    (``weight * x.to(input_dtype)``); the up-projection saves its own 16-bit input (the product
    with the fp32 weight is fp32 under autocast, which the GEMM casts back; without autocast it is
    the product itself). The latent itself and the rope key are not saved (the norm and RoPE keep
    copies and tables only). The value heads are a view of the kv up-projection's output, which
    attention saves as it is: the whole output (the key's no-rope part too) stays alive. Checked
    with ``memplan trace`` and ``torch.autograd.graph.saved_tensors_hooks`` on a DeepSeek-V2 toy.
    """
    tokens = shape.seq * shape.micro_batch
    c = shape.act_bytes
    terms: list[Term] = []
    for name, rank, site, role in (("kv", attn.kv_lora_rank or 0, "mla_up", TermRole.KV_LATENT_NORM),
                                   ("q", attn.q_lora_rank or 0, "mla_up", TermRole.Q_LATENT_NORM)):
        if not rank:
            continue
        # (all inside the stretch ``mla_up_proj`` recomputes: transformers' latent norms, as TE's fused ones)
        terms += [Term(f"{name} latent norm fp32 input", NORM_COMPUTE_BYTES * tokens * rank, "rep", "body", site=site,
                       role=role),
                  Term(f"{name} latent norm 1/rms (fp32, per token)", NORM_COMPUTE_BYTES * tokens, "rep", "body",
                       site=site, role=role),
                  Term(f"{name} latent norm normalized (input dtype)", c * tokens * rank, "rep", "body", site=site,
                       role=TermRole.LATENT_NORM_NORMALIZED),
                  Term(f"{name} latent norm output ({name} up-projection input)", c * tokens * rank, "rep", "body",
                       gemm_input=True, site=site)]
    if attn.kv_lora_rank and not _eager_mla_value_copied(attn, shape):
        nope = attn.head_dim - (attn.qk_rope_head_dim or 0)
        terms.append(Term("kv up-projection output kept whole by the value view (its key part)",
                          c * tokens * attn.num_heads * nope, "tp", "attn", site="mla_up"))
    return terms


def _eager_mla_value_copied(attn: AttentionSpec, shape: ActivationShape) -> bool:
    """Whether transformers' eager attention copies MLA's value heads before its PV matmul.

    MLA's value heads are a strided view of the kv up-projection's output (``(b, h, s, dv)`` with the
    key's no-rope part between heads). Where :func:`pv_matmul_saves_v_view` (micro-batch 1) the matmul
    saves that view (the whole output stays alive); elsewhere it copies v, saves the copy, and the output
    is freed. The copy belongs to the attention core: ``mla_up_proj`` recompute cannot release it
    (checked with ``memplan trace`` on a DeepSeek-V2 toy, micro-batch 1 and 2)."""
    return (attention_kind(attn).latent and bool(attn.kv_lora_rank) and shape.kernels == "eager"
            and shape.attention == "eager" and not pv_matmul_saves_v_view(attn, shape))


#: Sites of an MLP's (fc1 output, activation output) by the MLP's role: the routed experts'
#: activation output is what ``moe_act`` recomputes (experts.py), the rest the whole module's.
_MLP_SITES = {"mlp": ("mlp", "mlp"), "experts": ("moe", "moe_act"),
              "shared expert": ("shared_experts", "shared_experts")}
#: Roles of an MLP's (fc1 output, fc2 input, other tensors) by the MLP's role.
_MLP_ROLES = {"mlp": (TermRole.MLP_FC1, TermRole.MLP_FC2, TermRole.OTHER),
              "experts": (TermRole.EXPERT_FC1, TermRole.EXPERT_FC2, TermRole.EXPERT_OTHER),
              "shared expert": (TermRole.OTHER, TermRole.SHARED_EXPERT_FC2, TermRole.OTHER)}


def _mlp_terms(mlp: MLPSpec, shape: ActivationShape, *, tokens: int, region: Region, prefix: str,
               elem_bytes: int = 0, pre_norm: bool = True) -> list[Term]:
    c, f = elem_bytes or shape.act_bytes, mlp.intermediate_size
    fc1_site, fc2_site = _MLP_SITES[prefix]
    terms: list[Term] = []
    if prefix == "mlp":
        consumers = 2 if mlp.gated and not mlp.fused_gate_up else 1
        # TE fuses this norm into linear_fc1: its output is saved inside the MLP module.
        terms += _norm_terms(shape, "mlp", "body", consumers, sites=NormSites(
            fused="mlp", norm="pre_mlp_norm", output="mlp_norm_out", copy="mlp")) if pre_norm else \
            _residual_input_terms(shape, "mlp", "body", consumers)
    # fc1 output (gate and up halves for a gated MLP) saved by the activation function, its
    # output saved by fc2; eager SwiGLU also saves act(gate) as a separate tensor.
    fc1_out = 2 if mlp.gated else 1
    eager_gate = mlp.gated and shape.kernels != "fused"
    if eager_gate and prefix != "experts":
        fc1_out += 1
    fc1_role, fc2_role, other_role = _MLP_ROLES[prefix]
    # eager SwiGLU's three tensors are apart: the product act(gate) * up saves two of them and makes their two
    # gradients beside the one coming in (save_on_cpu brings back no more than that node's)
    apart = fc1_out == 3
    terms.append(Term(f"{prefix} fc1 output (activation input)", c * tokens * f * fc1_out, region, "body",
                      site=fc1_site, role=fc1_role, tensors=3 if apart else 1, node_saves=2 if apart else 1,
                      node_made=3 if apart else 2, first_made=3 if apart else 2))
    if eager_gate and prefix == "experts":
        # act(gate), saved by the product with the up half: inside the activation function (moe_act);
        # gpt-oss's clamped SwiGLU keeps more there (memplan.estimate.gpt_oss_terms).
        terms += (clamped_swiglu_terms(mlp, tokens, region, c, fc2_site)
                  or [Term(f"{prefix} activation of the gate half (eager gated activation)", c * tokens * f, region,
                           "body", site=fc2_site, role=other_role)])
    terms.append(Term(f"{prefix} fc2 input", c * tokens * f, region, "body", gemm_input=True, site=fc2_site,
                      role=fc2_role))
    if mlp.activation == "gelu_new" and shape.kernels == "eager":
        # GPT-2's NewGELUActivation is a Python formula: it also saves tanh(...), 1 + tanh(...) and
        # 0.5 * x; under CUDA autocast (fp32 weights or a 16-bit frozen base alike) its pow runs in fp32, so
        # those are fp32.
        per_element = 12 if shape.autocast_ops else 3 * c
        # brought back node by node (save_on_cpu), its worst node is pow's (grad * 3 * x^2: x^2, 3 * x^2 and the
        # product beside the gradient coming in), while the gradients of x from the formula's two other uses wait
        # in autograd's input buffer (16-bit: half a tensor each under autocast); with its saved tensors on the
        # GPU, its first node's: the last product, 0.5 * x times 1 + tanh(...), makes a gradient per factor in
        # the gradient's dtype beside the one coming in, before any saved tensor is freed
        terms.append(Term(f"{prefix} gelu_new intermediates", per_element * tokens * f, region, "body",
                          site=fc2_site, role=TermRole.GELU_NEW if prefix == "mlp" else other_role, tensors=3,
                          node_made=4 + (1 if shape.autocast_ops else 2), first_made=3))
    if shape.drops_residual and prefix == "mlp":
        terms.append(Term("mlp residual dropout mask", DROPOUT_MASK_BYTES * tokens * shape.hidden, "sp", "body",
                          role=TermRole.MLP_RESIDUAL_DROPOUT))
    return terms


#: The routed experts' input rows (what the dispatch delivers and the first grouped GEMM saves).
DISPATCHED_TOKENS = "dispatched tokens (grouped-GEMM input)"
#: The expert outputs the weighted combine keeps (routing probabilities applied at the combine).
EXPERT_OUTPUTS = "expert outputs kept by the weighted combine"
#: What an eager (HF) router keeps: its fp32 softmax over every expert.
ROUTER_SCORES = "router scores (fp32 softmax output)"
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
    s, b, h = shape.seq, shape.micro_batch, shape.hidden
    c = shape.expert_bytes or shape.act_bytes
    tokens = s * b
    # A separate pre-MLP norm in Megatron's TE spec (its output, the MoE layer's input: ``layernorm``).
    terms = _norm_terms(shape, "mlp", "body", sites=NormSites(
        fused="pre_mlp_norm", norm="pre_mlp_norm", output="pre_mlp_norm", copy="moe"))
    routed = tokens * moe.top_k
    if moe.softmax_after_topk and shape.kernels == "eager":  # gpt-oss's router (memplan.estimate.gpt_oss_terms)
        terms += topk_router_terms(moe, shape)
    else:
        terms += _router_terms(moe, shape)
        terms.append(Term("routing indices and probabilities", routed * ROUTED_INDEX_BYTES, "sp", "body",
                          site="moe", role=TermRole.ROUTING_INDICES))
    if shape.kernels == "eager":
        # transformers' grouped_mm_experts_forward: the gather index (perm // top_k), the sort
        # permutation and its inverse (int64 per routed copy), and the int32 per-expert offsets.
        terms.append(Term("grouped experts' permutations and offsets", routed * 3 * 8 + moe.num_experts * 4, "sp",
                          "body", site="moe"))
    received = int(routed * shape.routed_factor)
    terms.append(Term(DISPATCHED_TOKENS, c * received * h * shape.expert_tp, "sp", "body",
                      gemm_input=True, site="moe", role=TermRole.DISPATCHED_TOKENS))
    terms += _mlp_terms(moe.expert, shape, tokens=received, region="sp", prefix="experts", elem_bytes=c)
    if shape.moe_probs_at == "experts":
        terms += _expert_probability_terms(moe, shape, received, c)
    else:
        # Combine weights each expert output by its routing probability: the product's backward keeps
        # the expert outputs (back on the source rank: one row per routed copy).
        terms.append(Term(EXPERT_OUTPUTS, c * routed * h, "sp", "body", site="moe", role=TermRole.EXPERT_OUTPUTS))
    if moe.shared_expert is not None:
        terms += _mlp_terms(moe.shared_expert, shape, tokens=tokens, region="tp", prefix="shared expert")
        if moe.shared_expert_gate:
            # sigmoid(gate(x)) * shared_output: the product keeps both factors for its backward. It is
            # inside Megatron's SharedExpertMLP (``shared_experts`` recompute drops it) but outside
            # transformers' ``shared_expert`` module (Qwen2MoeSparseMoeBlock applies the gate).
            terms.append(Term("shared expert output and its sigmoid gate (kept by their product)",
                              shape.act_bytes * tokens * (h + 1), "sp", "body",
                              site="" if shape.kernels == "eager" else "shared_experts"))
    if shape.drops_residual:
        terms.append(Term("mlp residual dropout mask", DROPOUT_MASK_BYTES * tokens * h, "sp", "body",
                          role=TermRole.MLP_RESIDUAL_DROPOUT))
    return terms


def _router_terms(moe: MoESpec, shape: ActivationShape) -> list[Term]:
    """The router's saved tensors (and under autocast the shared expert's copies of the norm output)."""
    tokens, h = shape.seq * shape.micro_batch, shape.hidden
    terms: list[Term] = []
    if shape.autocast and moe.shared_expert is not None:
        # Under autocast every other linear reading the norm output casts its own 16-bit copy (the
        # router's is the term above; transformers' routed experts index the output as it is): the
        # shared expert's GEMMs and Qwen2-MoE's shared-expert gate. Measured with the tracer: a
        # ``shared_experts`` checkpoint of transformers' shared expert keeps its GEMMs' copies
        # (tests/trace/test_policies_trace.py); only the whole MoE block's checkpoint drops them.
        sbh = tokens * h
        shared = 2 if moe.shared_expert.gated and not moe.shared_expert.fused_gate_up else 1
        terms.append(Term("mlp norm output, autocast copies of the shared expert's GEMMs",
                          shared * shape.act_bytes * sbh, "sp", "body", gemm_input=True, site="moe",
                          role=TermRole.SHARED_EXPERT_NORM_COPIES))
        if moe.shared_expert_gate:
            terms.append(Term("mlp norm output, autocast copy of the shared-expert gate", shape.act_bytes * sbh, "sp",
                              "body", gemm_input=True, site="moe", role=TermRole.SHARED_EXPERT_NORM_COPIES))
    if moe.router_fp32 and shape.kernels == "eager" and not shape.autocast and shape.act_bytes < NORM_COMPUTE_BYTES:
        # transformers' fp32 router (DeepSeek: ``F.linear(hidden.type(float32), weight)``) saves an fp32
        # copy of its 16-bit input; under autocast the linear casts back and saves autocast's copy instead,
        # a GEMM input like any other (16-bit weights under autocast: a frozen router keeps none).
        if shape.autocast_ops:
            terms.append(Term("router input, autocast's 16-bit copy of its fp32 cast", shape.act_bytes * tokens * h,
                              "sp", "body", gemm_input=True, site="moe", role=TermRole.ROUTER_OTHER))
        else:
            terms.append(Term("router input cast to fp32 (fp32 router weight)", NORM_COMPUTE_BYTES * tokens * h,
                              "sp", "body", site="moe", role=TermRole.ROUTER_OTHER))
    if shape.kernels == "eager":
        # HF routers keep only softmax(router_logits, dtype=float)'s fp32 output for backward.
        terms.append(Term(ROUTER_SCORES, tokens * moe.num_experts * EAGER_SOFTMAX_BYTES,
                          "sp", "body", site="moe", role=TermRole.ROUTER_SCORES))
    else:
        terms.append(Term("router logits/scores (fp32) + routing map", tokens * moe.num_experts * ROUTER_BYTES_PER_EXPERT,
                          "sp", "body", site="moe", role=TermRole.ROUTER_OTHER))
    return terms


def _expert_probability_terms(moe: MoESpec, shape: ActivationShape, received: int, c: int) -> list[Term]:
    """What Megatron's experts keep for scaling their activation output by the routing probabilities.

    ``act(fc1_output) * probs`` (fp32 probabilities, cast back to the activation dtype before fc2) is
    an autograd product whose both operands need a gradient, so it keeps the activation output, a
    third ``[tokens, ffn]`` tensor beside fc1's output and fc2's input. Only a gated SwiGLU /
    quick-GeGLU expert has a fused weighted kernel (``weighted_bias_swiglu_impl``, Megatron's
    default ``bias_activation_fusion``, or TE's ``ScaledSwiGLU`` under the op fuser) that keeps just
    its input; a plain (GELU) expert always takes the unfused product, as Megatron refuses the fused
    GELU with probabilities (megatron/core/transformer/moe/experts.py ``TEGroupedMLP.forward``,
    megatron/core/transformer/mlp.py ``MLP.forward``).
    """
    if moe.expert.gated:
        return []
    return [Term("experts activation output kept by the probability product", c * received * moe.expert.intermediate_size,
                 "sp", "body", site="moe_act", role=TermRole.EXPERT_OTHER)]


def dispatch_buffer_bytes(layer: LayerSpec, shape: ActivationShape) -> int:
    """Transient buffers while an MoE layer moves tokens (one rank, forward or backward).

    All-to-all (and flex): the permuted send buffer and the received tokens, both alive around the
    exchange. All-gather: every token of the TP x EP group gathered on each rank (hidden states,
    fp32 probabilities and the routing map) before the local experts pick theirs.
    """
    if layer.moe is None:
        return 0
    c, h = shape.act_bytes, shape.hidden
    local = shape.local_tokens
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


def node_bytes(term: Term, shape: ActivationShape) -> int:
    """Bytes one tensor of ``term`` weighs on one rank."""
    return divided(term, shape) // term.tensors


def first_node_bytes(term: Term, shape: ActivationShape) -> int:
    """What ``term``'s first backward node holds beside the layer's saved tensors (one rank): ``first_made`` of its
    tensors' size, the gradient coming in and those the node makes."""
    return node_bytes(term, shape) * term.first_made


def output_gradient_bytes(shape: ActivationShape, hidden: int) -> int:
    """The gradient of a decoder layer's output on one rank (the residual stream's dtype)."""
    return divided(Term("output gradient", shape.residual_bytes * shape.seq * shape.micro_batch * hidden, "sp",
                        "input"), shape)


def backward_transient_bytes(layer: LayerSpec, shape: ActivationShape,
                             blocks: tuple[list[Term], list[Term]] | None = None,
                             dropped: frozenset[str] = frozenset(), released_inputs: int = 0,
                             offloaded: bool = False, walked: frozenset[TermRole] = frozenset()) -> int:
    """Memory a layer's backward needs beyond what the layer saved (one rank), at its worst step.

    In general the most one term's first backward node holds (:func:`first_node_bytes`: two tensors of
    one of its tensors' size, the incoming gradient and the one produced; three for a product of two of
    its tensors, whose node makes a gradient per factor) or two of an MoE layer's dispatch buffers. A
    term that lumps tensors (:attr:`~memplan.estimate.terms.Term.tensors`) is priced by one of them, as
    autograd holds it: its later nodes run after the earlier ones freed what they saved. Under HF eager attention the s x s
    softmax backward holds two fp32 gradients of the probabilities (the one coming from the
    ``.to(dtype)`` cast and the one it produces), but by then autograd has released what the
    layer's later nodes saved: the whole MLP block (its backward ran first), the output
    projection's input and the PV matmul's 16-bit probabilities. ``blocks``: the layer's terms
    from :func:`layer_terms_by_block` when the caller has them. Under Megatron's sub-module recompute
    the MLP block's terms at ``dropped`` sites were never kept (their recompute came and went with the
    MLP backward) and release nothing; its checkpoints' inputs (``released_inputs`` bytes) do. Under
    ``save_on_cpu`` (``offloaded``) what the later nodes saved is in host memory: releasing it frees nothing
    on the GPU (the softmax's own saved output, brought back beside, is the stage's bring-back). Terms
    whose role is in ``walked`` are not the largest saved term: their block's backward is priced op by op apart
    (:mod:`~memplan.estimate.frozen_mlp_backward`).
    """
    attention, rest = blocks = blocks or layer_terms_by_block(layer, shape)
    skipped = eager_core_roles(layer, shape) | walked
    transient = max(max((first_node_bytes(t, shape) for t in attention + rest if t.role not in skipped), default=0),
                    2 * dispatch_buffer_bytes(layer, shape))
    return max(transient, softmax_backward_bytes(layer, shape, blocks, dropped, released_inputs, offloaded))


def attention_backward_transient_bytes(layer: LayerSpec, shape: ActivationShape,
                                       blocks: tuple[list[Term], list[Term]], offloaded: bool = False) -> int:
    """The attention block's own moments of :func:`backward_transient_bytes` (its terms' first backward nodes, an
    eager core's softmax backward): those a checkpointed attention module's recompute is alive at, which runs
    where the attention block's backward starts, after the MLP block's."""
    skipped = eager_core_roles(layer, shape)
    first = max((first_node_bytes(t, shape) for t in blocks[0] if t.role not in skipped), default=0)
    return max(first, softmax_backward_bytes(layer, shape, blocks, offloaded=offloaded))


def softmax_backward_bytes(layer: LayerSpec, shape: ActivationShape, blocks: tuple[list[Term], list[Term]],
                           dropped: frozenset[str] = frozenset(), released_inputs: int = 0,
                           offloaded: bool = False) -> int:
    """What an unfused eager core's softmax backward holds beyond the layer's saved tensors (one rank; 0 for a
    fused or flash core, or where what autograd has released by then outweighs it): see
    :func:`backward_transient_bytes`, whose arguments these are."""
    roles = eager_core_roles(layer, shape)
    if not roles:
        return 0
    attention, rest = blocks
    if not any(t.role in roles for t in attention):
        return 0  # the core saves nothing (its q, k and v need no gradient): no softmax backward runs
    gradients = softmax_gradient_bytes(layer, shape)
    # an attention input projection's adapter keeps its tensors until that projection's backward, after the core's
    released = sum(divided(t, shape) for t in rest if t.keep != "input" and t.site not in dropped
                   and t.role not in ATTENTION_ADAPTER_TERMS)
    released += released_inputs
    released += sum(divided(t, shape) for t in attention
                    if t.role in (TermRole.OUTPUT_PROJECTION_INPUT, TermRole.SOFTMAX_CAST))
    return max(0, gradients - (0 if offloaded else released))


def has_eager_core(shape: ActivationShape) -> bool:
    """Whether the job's attention core is unfused eager code (it saves the s x s probabilities)."""
    return shape.kernels == "eager" and shape.attention in UNFUSED_ATTENTION


def eager_core_roles(layer: LayerSpec, shape: ActivationShape) -> set[TermRole]:
    """The roles of the terms an unfused eager attention core saves (none for a fused or flash core)."""
    if not has_eager_core(shape):
        return set()
    return {t.role for t in _eager_core_terms(layer.attention, shape, 1)}


def softmax_gradient_bytes(layer: LayerSpec, shape: ActivationShape) -> int:
    """What an eager softmax backward holds (one rank): two gradients of the probabilities, the one coming
    from the ``.to(dtype)`` cast and the one it produces; in the softmax's dtype (:func:`_eager_softmax_bytes`):
    fp32, except gpt-oss's sink softmax (the weights' dtype, 16-bit in pure bf16) and GPT-2's outside autocast."""
    attn = layer.attention
    heads_scores = attn.num_heads * shape.micro_batch * shape.seq * shape.kv_seq
    softmax_bytes = _eager_softmax_bytes(attn, shape)
    return divided(Term("softmax gradients", 2 * softmax_bytes * heads_scores, "tp", "core"), shape)


def norm_output_bytes(shape: ActivationShape) -> int:
    """Bytes per element of a pre-norm's output: the residual dtype, fp32 from a LayerNorm under autocast
    (``layer_norm`` is on autocast's fp32 list, a 16-bit residual of a frozen base too)."""
    return max(shape.residual_bytes, NORM_COMPUTE_BYTES if shape.norm == "layernorm" and shape.autocast_ops else 0)


def recomputed_forward_transient(layer: LayerSpec, shape: ActivationShape, rest: list[Term],
                                 attention: Sequence[Term] = ()) -> int:
    """Bytes a recomputed layer's forward holds beyond everything the layer saves, at its worst moment
    (0 where :func:`backward_transient_bytes` covers it). Only gpt-oss's eager sink attention needs it:
    its masked scores, max-subtracted logits and rotated projections, while the MLP block (``rest``, the terms
    the layer's role saves there, less the q/k/v adapters' inputs: made with their projections, before the core)
    is not recomputed yet, nor the output projection's input (among the role's ``attention`` terms: made after
    the core). The attention module's input (the pre-norm's output) is bound by the decoder layer's forward
    (``hidden_states = self.input_layernorm(...)``) until the module returns: a tensor apart, alive at that moment,
    where the role saves it nowhere (frozen projections: no norm-output term; nor q/k/v adapters whose lora_A peft
    hands it uncast) or where it is wider than the projections' inputs (an fp32 norm output under
    ``torch.autocast``, which each projection casts to its own 16-bit copy: :func:`_module_input_apart`), in the
    first forward and in a recomputed one alike (there the checkpoint's input is the layer's, not this one)."""
    attn = layer.attention
    if not (attn.sinks and has_eager_core(shape)):
        return 0
    later = [*(t for t in rest if t.role not in ATTENTION_ADAPTER_TERMS),
             *(t for t in attention if t.role is TermRole.OUTPUT_PROJECTION_INPUT)]
    saved = any(t.role is TermRole.NORM_OUTPUT for t in attention) or any(
        t.role is TermRole.ATTENTION_MODULE_INPUT for t in rest)
    apart = not saved or _module_input_apart(shape)
    bound = sum(divided(t, shape) for t in attention if t.keep == "attn_input") if apart else 0
    return max(0, divided(sink_forward_extra(attn, shape), shape) + bound - sum(divided(t, shape) for t in later))


def _module_input_apart(shape: ActivationShape) -> bool:
    """Whether an eager attention module's input (its pre-norm's output, in the residual's dtype) is wider than the
    16-bit copies ``torch.autocast`` makes of it for each projection: then a tensor apart from what they save."""
    return shape.autocast and shape.kernels == "eager" and norm_output_bytes(shape) > shape.act_bytes


def checkpointed_input_apart_bytes(terms: list[Term], shape: ActivationShape, kept: frozenset[str]) -> int:
    """Bytes of the checkpointed attention module's input (``attn_input``, kept under the ``kept`` classes) where it is
    a tensor apart from those a layer without recompute saves, so that the checkpoint's recompute reads it again and
    does not make it: its pre-norm's fp32 output under ``torch.autocast`` in eager code, where each projection casts
    it and saves its own 16-bit copy (made again). Elsewhere it is the projections' input itself (the ``norm output``
    term, read again, not made again); 0 there (measured with ``memplan trace --recompute selective`` on GPT-NeoX,
    eager bf16-mixed, fp32 and pure bf16)."""
    if "attn_input" not in kept or not (shape.autocast and shape.kernels == "eager"):
        return 0
    return sum(divided(t, shape) for t in terms if t.keep == "attn_input")


def layer_activation_bytes(layer: LayerSpec, shape: ActivationShape, recompute_mode: str) -> int:
    """Bytes one layer keeps for backward on one rank, for one micro-batch (``recompute_mode`` a
    key of :data:`KEPT_BY`)."""
    kept = KEPT_BY[recompute_mode]
    return sum(divided(t, shape) for t in layer_terms(layer, shape) if t.keep in kept)
