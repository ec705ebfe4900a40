"""The dense decoder families of :mod:`memplan.model.hf`: one :class:`DenseFamily` entry each.

Llama, Mistral, Qwen2/3, Gemma 1/2/3, OLMo 2/3, Granite, SmolLM3 and Phi-3 differ in a few switches
(biases, q/k norms and their width, pre-/post-norms, the norm's fp32 scale, soft-capping, sliding-window
and NoPE layer patterns, fused projections), each read from the config as that family's
``transformers`` code reads it. A multimodal Gemma 3 config is refused with what to pass instead.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memplan.errors import ModelConfigError
from memplan.frozen import frozen_dataclass
from memplan.model.hf_fields import (
    ConfigFields,
    WindowRule,
    build_model,
    gqa,
    layer_windows,
    optional_number,
    rope_layers,
    stack,
    with_window,
)
from memplan.model.spec import HiddenDropout, MLPSpec, ModelSpec

__all__ = ["DENSE_FAMILIES", "FAMILY_DEFAULTS", "DenseFamily", "build_dense", "gemma3_multimodal",
           "gemma3_vision_params"]

@frozen_dataclass(kw_only=True)
class DenseFamily:
    """How one dense family's ``transformers`` code reads its config."""

    #: Config key switching the q/k/v biases on (None: fixed at ``qkv_bias``).
    bias_key: str | None = None
    #: q/k/v bias when no key decides it (Qwen2 always has one).
    qkv_bias: bool = False
    #: The output projection has a bias whenever q/k/v do (Llama, Qwen3, Gemma 2).
    out_bias_follows: bool = False
    #: Config key switching the MLP biases on (None: never).
    mlp_bias_key: str | None = None
    qk_norm: bool = False
    #: ``head_dim`` when the config omits it (None: hidden_size // num_attention_heads).
    head_dim: int | None = None
    norms: int = 2
    #: none: global only; all: ``sliding_window`` on every layer; qwen: layers from
    #: ``max_window_layers`` when ``use_sliding_window``; alternate: even layers (or ``layer_types``).
    window: WindowRule = "none"
    tie: bool = False
    act_key: str = "hidden_act"
    #: q/k/v and gate/up are single fused projections (Phi-3).
    fused: bool = False
    #: Soft-capping of attention scores and output logits (``attn_logit_softcapping`` /
    #: ``final_logit_softcapping``, each null when off: Gemma 2, Gemma 3).
    softcap: bool = False
    #: The RMSNorm scales by its weight in fp32 and casts afterwards (Gemma 1, 2, 3: ``1 + weight``;
    #: OLMo 2, 3), so it saves its normalized tensor in fp32.
    norm_fp32_scale: bool = False
    #: ``alternate`` windows without ``layer_types``: every layer but each ``window_period``-th slides
    #: (Gemma 2: 2; Gemma 3: ``sliding_window_pattern``, default 6; OLMo 3: 4).
    window_period: int = 2
    #: Config key overriding ``window_period`` (None: fixed).
    window_period_key: str | None = None
    #: Pre-norms before attention and MLP (False: OLMo 2 normalizes the sublayers' outputs only).
    pre_norms: bool = True
    #: The q/k norms normalize each head (False: OLMo 2's norms over the whole q and k projections).
    qk_norm_per_head: bool = True
    #: One RoPE cos/sin pair per kind of layer (Gemma 3, OLMo 3: local and global bases).
    rope_per_layer_type: bool = False
    #: Layers without rotary embeddings (SmolLM3 ``no_rope_layers``: 0 marks a NoPE layer; when
    #: absent every ``no_rope_layer_interval``-th layer, default 4).
    nope_layers: bool = False
    #: Where the modeling code drops out hidden states (:attr:`ModelSpec.hidden_dropout`): Phi-3's decoder
    #: layer has ``resid_attn_dropout`` and ``resid_mlp_dropout`` (resid_pdrop); the others none.
    hidden_dropout: HiddenDropout = "none"
    #: The model's forward scales the embedding module's output into a new tensor (:attr:`ModelSpec.embedding_scaled`).
    embedding_scaled: bool = False


DENSE_FAMILIES: dict[str, DenseFamily] = {
    "llama": DenseFamily(bias_key="attention_bias", out_bias_follows=True, mlp_bias_key="mlp_bias"),
    "mistral": DenseFamily(window="all"),
    "qwen2": DenseFamily(qkv_bias=True, window="qwen"),
    "qwen3": DenseFamily(bias_key="attention_bias", out_bias_follows=True, qk_norm=True, head_dim=128,
                          window="qwen"),
    "gemma": DenseFamily(bias_key="attention_bias", out_bias_follows=True, head_dim=256, tie=True,
                          norm_fp32_scale=True),
    "gemma2": DenseFamily(bias_key="attention_bias", out_bias_follows=True, norms=4, head_dim=256,
                           window="alternate", tie=True, act_key="hidden_activation", softcap=True,
                           norm_fp32_scale=True),
    "gemma3_text": DenseFamily(bias_key="attention_bias", out_bias_follows=True, qk_norm=True, norms=4,
                                head_dim=256, window="alternate", window_period=6,
                                window_period_key="sliding_window_pattern", tie=True,
                                act_key="hidden_activation", softcap=True, norm_fp32_scale=True,
                                rope_per_layer_type=True),
    # Granite: Llama's layers; its embedding, residual, attention and logits multipliers are scalar
    # products, which keep no tensor for the backward (the embedding's, in GraniteModel.forward, makes a new one).
    "granite": DenseFamily(bias_key="attention_bias", out_bias_follows=True, mlp_bias_key="mlp_bias",
                           embedding_scaled=True),
    "smollm3": DenseFamily(bias_key="attention_bias", out_bias_follows=True, mlp_bias_key="mlp_bias",
                            window="nope", tie=True, nope_layers=True),
    "phi3": DenseFamily(window="all", fused=True, hidden_dropout="residual"),
    # OLMo 2: post-norms only, q/k norms over the whole projections, the norm scales in fp32 before its cast
    "olmo2": DenseFamily(bias_key="attention_bias", out_bias_follows=True, qk_norm=True, qk_norm_per_head=False,
                          pre_norms=False, norm_fp32_scale=True),
    # OLMo 3: OLMo 2 with three sliding layers of four (``layer_types``) and a RoPE pair per kind of layer
    "olmo3": DenseFamily(bias_key="attention_bias", out_bias_follows=True, qk_norm=True, qk_norm_per_head=False,
                          pre_norms=False, norm_fp32_scale=True, window="alternate", window_period=4,
                          rope_per_layer_type=True),
}


def build_dense(f: ConfigFields, name: str, model_type: str) -> ModelSpec:
    fam = DENSE_FAMILIES[model_type]
    hidden, n_layers = f.integer("hidden_size"), f.integer("num_hidden_layers")
    bias = f.flag(fam.bias_key, False) if fam.bias_key else fam.qkv_bias
    attn = gqa(f, hidden, bias=bias, out_bias=bias and fam.out_bias_follows, qk_norm=fam.qk_norm,
                head_dim_default=fam.head_dim)
    if not fam.qk_norm_per_head:
        attn = replace(attn, qk_norm_per_head=False)
    if fam.fused:
        attn = replace(attn, fused_qkv=True)
    extra: dict[str, Any] = {"norm_fp32_scale": fam.norm_fp32_scale, "rope_per_layer_type": fam.rope_per_layer_type,
                             "hidden_dropout": fam.hidden_dropout, "embedding_scaled": fam.embedding_scaled}
    if fam.softcap:
        attn = replace(attn, logit_softcap=optional_number(f, "attn_logit_softcapping"))
        extra["final_logit_softcap"] = optional_number(f, "final_logit_softcapping")
    act = f.text(fam.act_key, "") or f.text("hidden_act", "silu")
    mlp_bias = f.flag(fam.mlp_bias_key, False) if fam.mlp_bias_key else False
    mlp = MLPSpec(intermediate_size=f.integer("intermediate_size"), bias=mlp_bias, activation=act,
                  fused_gate_up=fam.fused)
    period = f.integer(fam.window_period_key, fam.window_period) if fam.window_period_key else fam.window_period
    windows = layer_windows(f, n_layers, fam.window, period)
    ropes = rope_layers(f, n_layers) if fam.nope_layers else (True,) * n_layers
    kinds = [(with_window(attn if rope else replace(attn, rotary_fraction=0.0), w), mlp)
             for w, rope in zip(windows, ropes)]
    layers = stack(kinds, num_hidden_norms=fam.norms, pre_norms=fam.pre_norms)
    return build_model(f, name, model_type, layers, tie_default=fam.tie, hidden=hidden, **extra)


def gemma3_multimodal(f: ConfigFields, name: str, model_type: str) -> ModelSpec:
    """Gemma 3 4B/12B/27B (``Gemma3ForConditionalGeneration``): refused, never read as text only.

    ``AutoModelForCausalLM`` builds the SigLIP vision tower and projector beside the text decoder (about
    0.42B weights, held in memory even when fine-tuning on text); memplan does not model them, so it does
    not drop them silently: the message counts them, and the user chooses the text decoder alone, as
    ``Gemma3ForCausalLM`` builds it.
    """
    vision, text = f.raw("vision_config"), f.raw("text_config")
    tower = ""
    if isinstance(vision, dict) and isinstance(text, dict):
        try:
            count = gemma3_vision_params(ConfigFields(vision), ConfigFields(text).integer("hidden_size", 2304))
            tower = f" ({count:,} parameters)"
        except ModelConfigError:  # a malformed sub-config: the refusal stands without the count
            pass
    raise ModelConfigError(
        "model_type", f"gemma3 is a multimodal checkpoint (text_config + vision_config) whose SigLIP vision "
        f"tower and projector{tower} memplan does not model", hint="to size the text decoder alone "
        "(Gemma3ForCausalLM, which transformers loads from the same checkpoint), save the text_config object as "
        "a config.json of its own: its model_type is gemma3_text")


def gemma3_vision_params(vision: ConfigFields, text_hidden: int) -> int:
    """Parameters of Gemma 3's SigLIP vision tower and multimodal projector (``SiglipVisionConfig``'s defaults).

    Tower: a biased patch convolution, a position table of ``(image_size / patch_size)^2`` rows, per layer
    two LayerNorms, biased q/k/v/out projections and a biased two-layer MLP, a final LayerNorm, and the
    attention-pooling head when ``vision_use_head``. Projector: a ``vision x text`` matrix and an RMSNorm.
    """
    h, inner = vision.integer("hidden_size", 768), vision.integer("intermediate_size", 3072)
    patch = vision.integer("patch_size", 16)
    patches = (vision.integer("image_size", 224) // patch) ** 2
    embed = vision.integer("num_channels", 3) * patch * patch * h + h + patches * h
    mlp = 2 * h * inner + inner + h
    layer = 2 * 2 * h + 4 * (h * h + h) + mlp
    head = h + 4 * h * h + 4 * h + 2 * h + mlp if vision.flag("vision_use_head", True) else 0
    tower = embed + vision.integer("num_hidden_layers", 12) * layer + 2 * h + head
    return tower + h * text_hidden + h


#: Fields a family's ``transformers`` config defaults that published configs omit (Gemma 3's multimodal
#: checkpoints list only what differs from ``Gemma3TextConfig``'s defaults in their ``text_config``).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "olmo3": {"sliding_window": 4096},
    "gemma3_text": {"vocab_size": 262_208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh"},
}
