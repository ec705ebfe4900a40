"""ModelSpec: the architecture facts of a transformer, nothing about how it is trained.

A ``ModelSpec`` is built from a Hugging Face ``config.json`` (:mod:`memplan.model.hf`), a shipped
preset (:mod:`memplan.model.presets`) or Megatron-LM arguments. Parameter counts are derived from it
by :mod:`memplan.model.params`; how parallelism divides them lives in :mod:`memplan.estimate`.
"""

from __future__ import annotations

from dataclasses import field
from functools import cached_property
from typing import TYPE_CHECKING, Literal

from memplan.errors import ModelConfigError
from memplan.frozen import frozen_dataclass
from memplan.model.attention_kinds import MHA, attention_kind

if TYPE_CHECKING:
    from memplan.model.params import ParamGroups

#: gpt-oss's expert activation: ``(clamp(up) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate)``
#: (``swiglu_limit``, ``swiglu_alpha``), gate and up interleaved in one fused projection.
CLAMPED_SWIGLU = "clamped_swiglu"

NormKind = Literal["rmsnorm", "layernorm"]
PositionKind = Literal["rope", "learned", "none"]
#: Where a model's code applies hidden-state dropout (``--dropout``): on the embeddings and on each
#: block's output before its residual add, on the block outputs only, or nowhere.
HiddenDropout = Literal["embedding-and-residual", "residual", "none"]


def _positive(owner: str, name: str, value: int | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError(f"{owner}.{name}", "must be a positive integer", value)


@frozen_dataclass(kw_only=True)
class AttentionSpec:
    """Self-attention of one layer: multi-head / grouped-query (``mha``) or latent (``mla``)."""

    #: The kind's word (:data:`memplan.model.attention_kinds.SPEC_KINDS`); what it means is the
    #: registry entry :func:`~memplan.model.attention_kinds.attention_kind` resolves.
    kind: str = MHA.spec_kind
    #: Number of query heads.
    num_heads: int
    #: Number of key/value heads (== num_heads for MHA, 1 for MQA). For MLA, equals num_heads.
    num_kv_heads: int
    #: Per-head dimension of queries/keys (MLA: nope + rope part).
    head_dim: int
    #: Per-head dimension of values (== head_dim except for MLA).
    v_head_dim: int
    #: Bias on the q/k/v projections.
    qkv_bias: bool = False
    #: Bias on the output projection.
    out_bias: bool = False
    #: RMSNorm on queries and keys (Qwen3, Gemma 3: per head; OLMo 2: over the whole projection).
    qk_norm: bool = False
    #: The q/k norms normalize each head (weights of ``head_dim``, one 1/rms per head and token);
    #: False: the whole q and k projections (OLMo 2: weights of ``heads * head_dim`` and
    #: ``kv_heads * head_dim``, one 1/rms per token).
    qk_norm_per_head: bool = True
    #: Fraction of the head dim rotated by RoPE (GPT-NeoX ``rotary_pct``); informational.
    rotary_fraction: float = 1.0
    #: MLA only: query low-rank dim (None: queries projected directly).
    q_lora_rank: int | None = None
    #: MLA only: compressed key/value latent dim.
    kv_lora_rank: int | None = None
    #: MLA only: decoupled RoPE part of the query/key head.
    qk_rope_head_dim: int | None = None
    #: MLA only: non-rotary part of the query/key head.
    qk_nope_head_dim: int | None = None
    #: Sliding-window size if the layer uses local attention (None: global).
    sliding_window: int | None = None
    #: q, k and v come from one fused projection (GPT-2 ``c_attn``, GPT-NeoX, Phi-3 ``qkv_proj``).
    fused_qkv: bool = False
    #: Attention scores soft-capped as ``cap * tanh(scores / cap)`` before the softmax (Gemma 2
    #: ``attn_logit_softcapping``); None: no capping.
    logit_softcap: float | None = None
    #: A learned logit per query head joins each row of scores before the softmax and is dropped
    #: after it (gpt-oss ``self_attn.sinks``, ``num_heads`` parameters): "attention sinks".
    sinks: bool = False
    #: Eager attention's softmax runs in the scores' dtype (GPT-2's ``eager_attention_forward``:
    #: ``softmax(attn_weights)`` then ``.type(value.dtype)``), so in fp32 only under autocast, whose fp32 list
    #: has softmax. False: transformers' ``softmax(..., dtype=torch.float32).to(query.dtype)``, fp32 always.
    softmax_in_scores_dtype: bool = False

    @property
    def qk_norm_widths(self) -> tuple[int, int]:
        """Elements of the q and k norms' weights (0, 0 without q/k norms)."""
        if not self.qk_norm:
            return (0, 0)
        if self.qk_norm_per_head:
            return (self.head_dim, self.head_dim)
        return (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim)

    @property
    def qk_norm_rows(self) -> int:
        """1/rms values the q and k norms compute per token (one per head each, or one each)."""
        if not self.qk_norm:
            return 0
        return self.num_heads + self.num_kv_heads if self.qk_norm_per_head else 2

    def __post_init__(self) -> None:
        _positive("attention", "num_heads", self.num_heads)
        _positive("attention", "num_kv_heads", self.num_kv_heads)
        _positive("attention", "head_dim", self.head_dim)
        _positive("attention", "v_head_dim", self.v_head_dim)
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                "num_key_value_heads",
                f"must divide num_attention_heads={self.num_heads}",
                self.num_kv_heads,
            )
        kind = attention_kind(self)
        for name in kind.required_fields:
            _positive("attention", name, getattr(self, name))
        for name in kind.optional_fields:
            _positive("attention", name, getattr(self, name), allow_none=True)


@frozen_dataclass(kw_only=True)
class MLPSpec:
    """A dense feed-forward block (also the shape of one expert)."""

    #: Inner (FFN) dimension.
    intermediate_size: int
    #: Gated (SwiGLU/GeGLU: gate, up, down = 3 matrices) or plain (up, down = 2 matrices).
    gated: bool = True
    #: Biases on the projections.
    bias: bool = False
    #: Activation function name as the config spells it (silu, gelu, gelu_pytorch_tanh, ...);
    #: :data:`CLAMPED_SWIGLU` for gpt-oss's experts, which apply their own gate whatever ``hidden_act`` says.
    activation: str = "silu"
    #: Gate and up come from one fused projection (Phi-3 ``gate_up_proj``).
    fused_gate_up: bool = False

    def __post_init__(self) -> None:
        _positive("mlp", "intermediate_size", self.intermediate_size)


@frozen_dataclass(kw_only=True)
class MoESpec:
    """A mixture-of-experts feed-forward block."""

    #: Number of routed experts.
    num_experts: int
    #: Experts each token is routed to.
    top_k: int
    #: Shape of one routed expert.
    expert: MLPSpec
    #: Shared (always active) experts, fused into one MLP of this shape (None: no shared expert).
    shared_expert: MLPSpec | None = None
    #: Sigmoid gate on the shared expert output (Qwen2-MoE: a Linear(hidden, 1)).
    shared_expert_gate: bool = False
    #: Router has a learnable bias / score-correction vector of num_experts entries.
    router_bias: bool = False
    #: The router's score-correction bias is a buffer, not a trainable parameter (DeepSeek-V3 in HF).
    router_bias_is_buffer: bool = False
    #: transformers keeps the router weight in fp32 whatever the model's dtype
    #: (``_keep_in_fp32_modules_strict = ["gate.weight"]``) and casts the router's input to fp32.
    router_fp32: bool = False
    #: The router hands the experts fp32 routing weights whatever the model's dtype: a softmax in fp32 never cast
    #: back (Mixtral's ``softmax(router_logits.float())``, DeepSeek-V2's ``softmax(dtype=torch.float32)``); the
    #: weighted combine's product is then fp32 (:mod:`memplan.estimate.grouped_experts_backward`).
    routing_weights_fp32: bool = False
    #: Name of the router module under ``mlp`` (``gate`` in most families, ``router`` in gpt-oss).
    router_name: str = "gate"
    #: The router picks the top-k logits first and takes the softmax over those k only (gpt-oss),
    #: instead of a softmax over every expert before the top-k.
    softmax_after_topk: bool = False

    def __post_init__(self) -> None:
        _positive("moe", "num_experts", self.num_experts)
        _positive("moe", "top_k", self.top_k)
        if self.top_k > self.num_experts:
            raise ModelConfigError(
                "num_experts_per_tok",
                f"must not exceed the number of experts ({self.num_experts})",
                self.top_k,
            )


@frozen_dataclass(kw_only=True)
class LayerSpec:
    """One decoder layer: attention, then a dense MLP or an MoE block, with its norms."""

    attention: AttentionSpec
    #: Dense MLP (exactly one of mlp / moe is set).
    mlp: MLPSpec | None = None
    moe: MoESpec | None = None
    #: Norm layers applied to the hidden state in this layer (2 pre-norms; Gemma2 has 4).
    num_hidden_norms: int = 2
    #: The attention and MLP read a normalized input (pre-norms). False: they read the residual
    #: stream itself and every norm of the layer normalizes a sublayer's output (OLMo 2's
    #: ``post_attention_layernorm`` / ``post_feedforward_layernorm``).
    pre_norms: bool = True
    #: Attention and MLP read the same input (GPT-J / GPT-NeoX parallel residual).
    parallel_residual: bool = False
    #: The layer's forward holds the attention's output in a local through the MLP block (transformers'
    #: ``GPT2Block``: ``attn_output`` beside ``hidden_states = attn_output + residual``). Read in transformers 5.24
    #: for every family memplan builds: the others rebind the name to the sum and free it (Llama, Mistral, Qwen2/3,
    #: Gemma 1-3, Phi-3, OLMo 2/3, Granite, SmolLM3, Mixtral, Qwen-MoE, DeepSeek-V2/V3, gpt-oss; GPT-NeoX's sequential
    #: path rebinds ``attn_output`` to the sum and keeps the layer input, which the layer's checkpoint holds anyway).
    attention_output_local: bool = False

    def __post_init__(self) -> None:
        if (self.mlp is None) == (self.moe is None):
            raise ModelConfigError("layer", "must have exactly one of a dense MLP or an MoE block", None)

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def num_post_norms(self) -> int:
        """Norms on a sublayer's output before the residual add (Gemma 2/3: 2 of 4; OLMo 2: both)."""
        return self.num_hidden_norms - (2 if self.pre_norms else 0)


@frozen_dataclass(kw_only=True)
class ModelSpec:
    """Architecture facts of a decoder-only transformer (dense, GQA, MLA, MoE, MTP)."""

    #: Display name (preset name or the config's path/name).
    name: str
    #: Hugging Face ``model_type`` (or ``megatron-gpt`` for Megatron arguments).
    model_type: str
    hidden_size: int
    vocab_size: int
    #: One entry per decoder layer, in order.
    layers: tuple[LayerSpec, ...]
    norm: NormKind = "rmsnorm"
    #: LayerNorm with bias (GPT-2, GPT-NeoX); RMSNorm never has one.
    norm_bias: bool = False
    #: Output head shares the input embedding matrix.
    tie_word_embeddings: bool = False
    position_embedding: PositionKind = "rope"
    #: Rows of the learned position table (0 unless ``position_embedding == "learned"``).
    max_position_embeddings: int = 0
    #: Multi-token-prediction modules (DeepSeek-V3 ``num_nextn_predict_layers``); not built by HF.
    mtp_layers: int = 0
    #: Output logits soft-capped as ``cap * tanh(logits / cap)`` (Gemma 2 ``final_logit_softcapping``).
    final_logit_softcap: float | None = None
    #: The RMSNorm scales by ``1 + weight`` (Gemma 2 ``Gemma2RMSNorm``) or ``weight`` (gpt-oss
    #: ``GptOssRMSNorm``) in fp32 and casts to the input dtype afterwards, so its saved normalized
    #: tensor is fp32; Llama-style norms cast first.
    norm_fp32_scale: bool = False
    #: The rotary embedding runs once per kind of layer (sliding, global), each with its own base
    #: (Gemma 3, OLMo 3 ``position_embeddings[layer_type]``): one cos/sin pair per kind, not one in all.
    rope_per_layer_type: bool = False
    #: How the published checkpoint stores its weights (``quantization_config.quant_method``: ``mxfp4`` for
    #: gpt-oss's experts, ``fp8`` ...; "" when not quantized). The parameters are priced in the job's
    #: dtypes, as loaded dequantized; the estimate says so where the method is one it knows.
    checkpoint_quantization: str = ""
    #: Where transformers' modeling code of this family drops out hidden states: GPT-2 (``embd_pdrop``,
    #: ``resid_pdrop``) and GPT-NeoX (``hidden_dropout``) on the embeddings and both block outputs;
    #: Phi-3 on the block outputs only (``resid_pdrop``; no module reads its ``embd_pdrop``); the
    #: Llama-style families nowhere (their configs have ``attention_dropout`` only). The default is
    #: Megatron's GPTModel (embedding dropout, bias-dropout-add), which a framework building its own
    #: layers applies whatever the family (``FrameworkProfile.own_hidden_dropout``).
    hidden_dropout: HiddenDropout = "embedding-and-residual"
    #: The decoder's forward scales the embedding module's output into a new tensor before the first layer
    #: (Granite's ``inputs_embeds * embedding_multiplier``; Gemma scales inside its embedding module).
    embedding_scaled: bool = False
    #: Layers of the layer list that are global attention vs sliding-window: informational.
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    @property
    def first_input_apart(self) -> bool:
        """The first decoder layer's input is a new tensor made from the embedding module's output, not that
        output itself: GPT-2 adds the learned position embeddings to it, Granite scales it."""
        return self.position_embedding == "learned" or self.embedding_scaled

    def __post_init__(self) -> None:
        _positive("model", "hidden_size", self.hidden_size)
        _positive("model", "vocab_size", self.vocab_size)
        if not self.layers:
            raise ModelConfigError("num_hidden_layers", "must be a positive integer", 0)
        if self.position_embedding == "learned":
            _positive("model", "max_position_embeddings", self.max_position_embeddings)
        if self.mtp_layers < 0:
            raise ModelConfigError("num_nextn_predict_layers", "must not be negative", self.mtp_layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @cached_property
    def layer_param_groups(self) -> tuple[ParamGroups, ...]:
        """Parameters of each decoder layer grouped by TP sharding (computed once per spec)."""
        from memplan.model.params import layer_params

        return tuple(layer_params(layer, self.hidden_size, self.norm_bias) for layer in self.layers)

    @cached_property
    def layer_non_gemm_params(self) -> tuple[int, ...]:
        """Per decoder layer: weights no matrix multiply reads (norms, router), computed once per spec."""
        from memplan.model.params import layer_non_gemm_params

        return tuple(layer_non_gemm_params(layer, self.hidden_size, self.norm_bias) for layer in self.layers)

    @cached_property
    def layer_tensor_counts(self) -> tuple[int, ...]:
        """Per decoder layer: parameter tensors (not elements), computed once per spec."""
        from memplan.model.tensors import layer_tensors

        return tuple(layer_tensors(layer, self.norm_bias) for layer in self.layers)

    @cached_property
    def total_parameters(self) -> int:
        """Every trainable parameter as ``transformers`` counts them (computed once per spec)."""
        from memplan.model.params import total_params

        return total_params(self)

    @cached_property
    def num_moe_layers(self) -> int:
        """Decoder layers with an MoE block (computed once per spec: the estimator asks per stage)."""
        return sum(1 for layer in self.layers if layer.is_moe)

    @property
    def is_moe(self) -> bool:
        return self.num_moe_layers > 0

    @cached_property
    def has_attention_sinks(self) -> bool:
        """Whether a decoder layer's attention has learned sink logits (gpt-oss); computed once per spec."""
        return any(layer.attention.sinks for layer in self.layers)

    @cached_property
    def expert_activations(self) -> frozenset[str]:
        """The routed experts' activation functions over the MoE layers (computed once per spec)."""
        return frozenset(layer.moe.expert.activation for layer in self.layers if layer.moe is not None)

    @property
    def num_heads(self) -> int:
        return self.layers[0].attention.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].attention.num_kv_heads
