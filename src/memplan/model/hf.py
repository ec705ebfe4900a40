"""Build a :class:`~memplan.model.spec.ModelSpec` from a Hugging Face ``config.json``.

Each supported ``model_type`` has one small builder that reads the fields that family's
``transformers`` modeling code reads, with the same defaults, so that the parameter counts of
:mod:`memplan.model.params` equal what ``AutoModelForCausalLM.from_config`` builds (tested for
every shipped preset). Unknown keys are ignored; a missing, mistyped or out-of-range field raises
:class:`~memplan.errors.ModelConfigError` naming the field, the rule and the value.

Example::

    >>> spec = load_hf_config("Llama-3.1-8B/config.json")
    >>> spec.num_layers, spec.hidden_size
    (32, 4096)

Known limitations:

* Only the text decoder of the listed families; a multimodal Gemma 3 config (``model_type`` gemma3,
  with a ``vision_config``) is refused with a sentence saying to pass its ``text_config`` instead.
* Sliding-window layer patterns are informational (they change activations, not parameters).
* DeepSeek ``moe_layer_freq`` follows DeepSeek's own code (``layer % freq == 0``); ``transformers``
  ignores it, which is the same for every released checkpoint (``moe_layer_freq == 1``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from memplan.errors import ModelConfigError
from memplan.frozen import frozen_dataclass
from memplan.model.attention_kinds import MLA
from memplan.model.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, MoESpec
from memplan.bounds import MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_MODEL_INT, check_at_most, parse_json
from memplan.textfile import read_text_file

__all__ = ["SUPPORTED_MODEL_TYPES", "load_hf_config", "model_from_hf_config"]

_MISSING: Any = object()
#: Counts that size loops (one entry per layer, expert, head), with the limit each may reach.
_LIMITS = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_nextn_predict_layers"), (MAX_LAYERS, "MAX_LAYERS")),
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts", "n_shared_experts",
                     "num_experts_per_tok"), (MAX_EXPERTS, "MAX_EXPERTS")),
    **dict.fromkeys(("num_attention_heads", "num_key_value_heads", "n_head"), (MAX_HEADS, "MAX_HEADS")),
}
_WindowRule = Literal["none", "all", "qwen", "alternate", "nope"]


class _Fields:
    """Typed reads from a config mapping; every failure names the field, the rule and the value."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self._config = config

    def given(self, key: str) -> bool:
        return self._config.get(key) is not None

    def raw(self, key: str) -> Any:
        return self._config.get(key)

    def integer(self, key: str, default: Any = _MISSING, *, minimum: int = 1) -> int:
        value = self._config.get(key)
        if value is None:
            if default is _MISSING:
                raise ModelConfigError(key, "is required", hint="add it to config.json")
            return int(default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ModelConfigError(key, "must be an integer", value)
        if value < minimum:
            rule = "must be a positive integer" if minimum == 1 else f"must be an integer >= {minimum}"
            raise ModelConfigError(key, rule, value)
        limit, limit_name = _LIMITS.get(key, (MAX_MODEL_INT, "MAX_MODEL_INT"))
        return check_at_most(key, value, value, limit, limit_name, ModelConfigError)

    def opt_int(self, key: str) -> int | None:
        """A positive integer or null; the key itself must be present."""
        if key not in self._config:
            raise ModelConfigError(key, "is required (null if unused)", hint="add it to config.json")
        return None if self._config[key] is None else self.integer(key)

    def flag(self, key: str, default: bool) -> bool:
        value = self._config.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ModelConfigError(key, "must be true or false", value)
        return value

    def text(self, key: str, default: str) -> str:
        value = self._config.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise ModelConfigError(key, "must be a string", value)
        return value

    def int_list(self, key: str) -> tuple[int, ...]:
        value = self._config.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, int) and v >= 0 for v in value):
            raise ModelConfigError(key, "must be a list of layer indices", value)
        return tuple(value)

    def number(self, key: str, default: float) -> float:
        value = self._config.get(key)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
            raise ModelConfigError(key, "must be a number in (0, 1]", value)
        return float(value)


def _head_dim(f: _Fields, hidden: int, heads: int, default: int | None = None) -> int:
    """``head_dim`` when given, else the family default, else ``hidden // heads``."""
    if f.given("head_dim"):
        return f.integer("head_dim")
    if default is not None:
        return default
    if hidden % heads:
        raise ModelConfigError(
            "num_attention_heads", f"must divide hidden_size={hidden} when head_dim is not given", heads
        )
    return hidden // heads


def _gqa(f: _Fields, hidden: int, *, bias: bool, out_bias: bool, qk_norm: bool = False,
         head_dim_default: int | None = None) -> AttentionSpec:
    heads = f.integer("num_attention_heads")
    head_dim = _head_dim(f, hidden, heads, head_dim_default)
    return AttentionSpec(
        num_heads=heads,
        num_kv_heads=f.integer("num_key_value_heads", heads),
        head_dim=head_dim,
        v_head_dim=head_dim,
        qkv_bias=bias,
        out_bias=out_bias,
        qk_norm=qk_norm,
    )


def _windows(f: _Fields, n_layers: int, rule: _WindowRule, period: int = 2) -> tuple[int | None, ...]:
    """Sliding-window size of each layer (None: global attention)."""
    if rule == "none":
        return (None,) * n_layers
    if rule == "qwen":
        if not f.flag("use_sliding_window", False) or not f.given("sliding_window"):
            return (None,) * n_layers
        first = f.integer("max_window_layers", n_layers, minimum=0)
        size = f.integer("sliding_window")
        return tuple(size if i >= first else None for i in range(n_layers))
    if rule == "nope":  # SmolLM3: when use_sliding_window, the NoPE layers (or ``layer_types``) slide
        if not f.flag("use_sliding_window", False) or not f.given("sliding_window"):
            return (None,) * n_layers
        size = f.integer("sliding_window")
        default = tuple(size if not rope else None for rope in _rope_layers(f, n_layers))
        return _layer_type_windows(f, n_layers, size, default)
    window = f.integer("sliding_window") if f.given("sliding_window") else None
    if rule == "all" or window is None:
        return (window,) * n_layers
    # rule == "alternate": Gemma 2 (every other layer), Gemma 3 (5 of 6), OLMo 3 (3 of 4)
    default = tuple(window if (i + 1) % period else None for i in range(n_layers))
    return _layer_type_windows(f, n_layers, window, default)


def _layer_type_windows(f: _Fields, n_layers: int, window: int,
                        default: tuple[int | None, ...]) -> tuple[int | None, ...]:
    """Windows from ``layer_types`` when the config lists them, else ``default``."""
    types = f.raw("layer_types")
    if types is None:
        return default
    if not isinstance(types, list) or len(types) != n_layers:
        raise ModelConfigError("layer_types", f"must list {n_layers} layer types", types)
    return tuple(window if t == "sliding_attention" else None for t in types)


def _rope_layers(f: _Fields, n_layers: int) -> tuple[bool, ...]:
    """Whether each layer rotates q and k (SmolLM3 ``no_rope_layers``: 1 rotates, 0 is NoPE)."""
    flags = f.raw("no_rope_layers")
    if flags is None:
        interval = f.integer("no_rope_layer_interval", 4)
        return tuple(bool((i + 1) % interval) for i in range(n_layers))
    if not isinstance(flags, list) or len(flags) != n_layers or any(v not in (0, 1) for v in flags):
        raise ModelConfigError("no_rope_layers", f"must list {n_layers} flags of 0 (NoPE) or 1 (RoPE)", flags)
    return tuple(bool(v) for v in flags)


def _with_window(attn: AttentionSpec, window: int | None) -> AttentionSpec:
    if window == attn.sliding_window:
        return attn
    return replace(attn, sliding_window=window)


def _stack(kinds: Sequence[tuple[AttentionSpec, MLPSpec | MoESpec]], **layer_kw: Any) -> tuple[LayerSpec, ...]:
    """One LayerSpec per layer, reusing a single object for identical layers."""
    cache: dict[tuple[AttentionSpec, MLPSpec | MoESpec], LayerSpec] = {}
    out = []
    for attn, ffn in kinds:
        if (attn, ffn) not in cache:
            kw = {"moe": ffn} if isinstance(ffn, MoESpec) else {"mlp": ffn}
            cache[(attn, ffn)] = LayerSpec(attention=attn, **kw, **layer_kw)
        out.append(cache[(attn, ffn)])
    return tuple(out)


def _model(f: _Fields, name: str, model_type: str, layers: tuple[LayerSpec, ...], *,
           tie_default: bool, hidden: int, **kw: Any) -> ModelSpec:
    windows = [layer.attention.sliding_window for layer in layers]
    return ModelSpec(
        name=name,
        model_type=model_type,
        hidden_size=hidden,
        vocab_size=f.integer("vocab_size"),
        layers=layers,
        tie_word_embeddings=f.flag("tie_word_embeddings", tie_default),
        extra={"sliding_window_layers": sum(w is not None for w in windows)},
        **kw,
    )


# --------------------------------------------------------------------------- dense families
@frozen_dataclass(kw_only=True)
class _DenseFamily:
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
    window: _WindowRule = "none"
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


_DENSE: dict[str, _DenseFamily] = {
    "llama": _DenseFamily(bias_key="attention_bias", out_bias_follows=True, mlp_bias_key="mlp_bias"),
    "mistral": _DenseFamily(window="all"),
    "qwen2": _DenseFamily(qkv_bias=True, window="qwen"),
    "qwen3": _DenseFamily(bias_key="attention_bias", out_bias_follows=True, qk_norm=True, head_dim=128,
                          window="qwen"),
    "gemma": _DenseFamily(bias_key="attention_bias", out_bias_follows=True, head_dim=256, tie=True,
                          norm_fp32_scale=True),
    "gemma2": _DenseFamily(bias_key="attention_bias", out_bias_follows=True, norms=4, head_dim=256,
                           window="alternate", tie=True, act_key="hidden_activation", softcap=True,
                           norm_fp32_scale=True),
    "gemma3_text": _DenseFamily(bias_key="attention_bias", out_bias_follows=True, qk_norm=True, norms=4,
                                head_dim=256, window="alternate", window_period=6,
                                window_period_key="sliding_window_pattern", tie=True,
                                act_key="hidden_activation", softcap=True, norm_fp32_scale=True,
                                rope_per_layer_type=True),
    # Granite: Llama's layers; its embedding, residual, attention and logits multipliers are scalar
    # products, which keep no tensor for the backward.
    "granite": _DenseFamily(bias_key="attention_bias", out_bias_follows=True, mlp_bias_key="mlp_bias"),
    "smollm3": _DenseFamily(bias_key="attention_bias", out_bias_follows=True, mlp_bias_key="mlp_bias",
                            window="nope", tie=True, nope_layers=True),
    "phi3": _DenseFamily(window="all", fused=True),
    # OLMo 2: post-norms only, q/k norms over the whole projections, the norm scales in fp32 before its cast
    "olmo2": _DenseFamily(bias_key="attention_bias", out_bias_follows=True, qk_norm=True, qk_norm_per_head=False,
                          pre_norms=False, norm_fp32_scale=True),
    # OLMo 3: OLMo 2 with three sliding layers of four (``layer_types``) and a RoPE pair per kind of layer
    "olmo3": _DenseFamily(bias_key="attention_bias", out_bias_follows=True, qk_norm=True, qk_norm_per_head=False,
                          pre_norms=False, norm_fp32_scale=True, window="alternate", window_period=4,
                          rope_per_layer_type=True),
}


def _dense(f: _Fields, name: str, model_type: str) -> ModelSpec:
    fam = _DENSE[model_type]
    hidden, n_layers = f.integer("hidden_size"), f.integer("num_hidden_layers")
    bias = f.flag(fam.bias_key, False) if fam.bias_key else fam.qkv_bias
    attn = _gqa(f, hidden, bias=bias, out_bias=bias and fam.out_bias_follows, qk_norm=fam.qk_norm,
                head_dim_default=fam.head_dim)
    if not fam.qk_norm_per_head:
        attn = replace(attn, qk_norm_per_head=False)
    if fam.fused:
        attn = replace(attn, fused_qkv=True)
    extra: dict[str, Any] = {"norm_fp32_scale": fam.norm_fp32_scale, "rope_per_layer_type": fam.rope_per_layer_type}
    if fam.softcap:
        attn = replace(attn, logit_softcap=_optional_number(f, "attn_logit_softcapping"))
        extra["final_logit_softcap"] = _optional_number(f, "final_logit_softcapping")
    act = f.text(fam.act_key, "") or f.text("hidden_act", "silu")
    mlp_bias = f.flag(fam.mlp_bias_key, False) if fam.mlp_bias_key else False
    mlp = MLPSpec(intermediate_size=f.integer("intermediate_size"), bias=mlp_bias, activation=act,
                  fused_gate_up=fam.fused)
    period = f.integer(fam.window_period_key, fam.window_period) if fam.window_period_key else fam.window_period
    windows = _windows(f, n_layers, fam.window, period)
    ropes = _rope_layers(f, n_layers) if fam.nope_layers else (True,) * n_layers
    kinds = [(_with_window(attn if rope else replace(attn, rotary_fraction=0.0), w), mlp)
             for w, rope in zip(windows, ropes)]
    layers = _stack(kinds, num_hidden_norms=fam.norms, pre_norms=fam.pre_norms)
    return _model(f, name, model_type, layers, tie_default=fam.tie, hidden=hidden, **extra)


def _optional_number(f: _Fields, key: str) -> float | None:
    """A number the config may set to null (Gemma 2's soft-capping values)."""
    value = f.raw(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError(key, "must be a positive number or null", value)
    return float(value)


def _gpt2(f: _Fields, name: str, model_type: str) -> ModelSpec:
    hidden, heads = f.integer("n_embd"), f.integer("n_head")
    if hidden % heads:
        raise ModelConfigError("n_head", f"must divide n_embd={hidden}", heads)
    attn = AttentionSpec(num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
                         v_head_dim=hidden // heads, qkv_bias=True, out_bias=True, fused_qkv=True)
    mlp = MLPSpec(intermediate_size=f.integer("n_inner", 4 * hidden), gated=False, bias=True,
                  activation=f.text("activation_function", "gelu_new"))
    layers = _stack([(attn, mlp)] * f.integer("n_layer"))
    return _model(f, name, model_type, layers, tie_default=True, hidden=hidden, norm="layernorm",
                  norm_bias=True, position_embedding="learned",
                  max_position_embeddings=f.integer("n_positions", 1024))


def _gpt_neox(f: _Fields, name: str, model_type: str) -> ModelSpec:
    hidden, heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    if hidden % heads:
        raise ModelConfigError("num_attention_heads", f"must divide hidden_size={hidden}", heads)
    bias = f.flag("attention_bias", True)
    rope = f.raw("rope_parameters") or f.raw("rope_scaling") or {}
    rotary = f.number("rotary_pct", rope.get("partial_rotary_factor", 0.25) if isinstance(rope, dict) else 0.25)
    attn = AttentionSpec(num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
                         v_head_dim=hidden // heads, qkv_bias=bias, out_bias=bias, rotary_fraction=rotary,
                         fused_qkv=True)
    mlp = MLPSpec(intermediate_size=f.integer("intermediate_size"), gated=False, bias=True,
                  activation=f.text("hidden_act", "gelu"))
    layers = _stack([(attn, mlp)] * f.integer("num_hidden_layers"),
                    parallel_residual=f.flag("use_parallel_residual", True))
    return _model(f, name, model_type, layers, tie_default=False, hidden=hidden, norm="layernorm",
                  norm_bias=True)


# --------------------------------------------------------------------------- MoE families
def _mixtral(f: _Fields, name: str, model_type: str) -> ModelSpec:
    hidden, n_layers = f.integer("hidden_size"), f.integer("num_hidden_layers")
    attn = _gqa(f, hidden, bias=False, out_bias=False)
    expert = MLPSpec(intermediate_size=f.integer("intermediate_size"), activation=f.text("hidden_act", "silu"))
    moe = MoESpec(num_experts=f.integer("num_local_experts"), top_k=f.integer("num_experts_per_tok"), expert=expert)
    kinds = [(_with_window(attn, w), moe) for w in _windows(f, n_layers, "all")]
    return _model(f, name, model_type, _stack(kinds), tie_default=False, hidden=hidden)


def _qwen_moe(f: _Fields, name: str, model_type: str) -> ModelSpec:
    """Qwen2-MoE (shared expert with a sigmoid gate) and Qwen3-MoE (q/k norm, no shared expert)."""
    hidden, n_layers = f.integer("hidden_size"), f.integer("num_hidden_layers")
    act = f.text("hidden_act", "silu")
    if model_type == "qwen2_moe":
        bias = f.flag("qkv_bias", True)
        attn = _gqa(f, hidden, bias=bias, out_bias=False)
    else:
        bias = f.flag("attention_bias", False)
        attn = _gqa(f, hidden, bias=bias, out_bias=bias, qk_norm=True)
    dense = MLPSpec(intermediate_size=f.integer("intermediate_size"), activation=act)
    n_experts = f.integer("num_experts", minimum=0)
    step = f.integer("decoder_sparse_step", 1)
    dense_only = set(f.int_list("mlp_only_layers"))
    moe: MoESpec | None = None
    if n_experts:
        shared = None
        if model_type == "qwen2_moe":
            shared = MLPSpec(intermediate_size=f.integer("shared_expert_intermediate_size"), activation=act)
        moe = MoESpec(
            num_experts=n_experts,
            top_k=f.integer("num_experts_per_tok"),
            expert=MLPSpec(intermediate_size=f.integer("moe_intermediate_size"), activation=act),
            shared_expert=shared,
            shared_expert_gate=shared is not None,
        )
    kinds: list[tuple[AttentionSpec, MLPSpec | MoESpec]] = []
    for i, window in enumerate(_windows(f, n_layers, "qwen")):
        sparse = moe is not None and i not in dense_only and (i + 1) % step == 0
        kinds.append((_with_window(attn, window), moe if sparse and moe else dense))
    return _model(f, name, model_type, _stack(kinds), tie_default=False, hidden=hidden)


def _deepseek(f: _Fields, name: str, model_type: str) -> ModelSpec:
    """DeepSeek-V2/V3: multi-head latent attention, leading dense layers, shared + routed experts."""
    hidden, n_layers, heads = f.integer("hidden_size"), f.integer("num_hidden_layers"), f.integer("num_attention_heads")
    nope, rope = f.integer("qk_nope_head_dim"), f.integer("qk_rope_head_dim")
    bias = f.flag("attention_bias", False)
    attn = AttentionSpec(
        kind=MLA.spec_kind, num_heads=heads, num_kv_heads=heads, head_dim=nope + rope,
        v_head_dim=f.integer("v_head_dim"), qkv_bias=bias, out_bias=bias,
        q_lora_rank=f.opt_int("q_lora_rank"), kv_lora_rank=f.integer("kv_lora_rank"),
        qk_rope_head_dim=rope, qk_nope_head_dim=nope,
    )
    act = f.text("hidden_act", "silu")
    v3 = model_type == "deepseek_v3"
    mlp_bias = False if v3 else f.flag("mlp_bias", False)
    dense = MLPSpec(intermediate_size=f.integer("intermediate_size"), bias=mlp_bias, activation=act)
    moe_inter = f.integer("moe_intermediate_size")
    n_shared = f.integer("n_shared_experts", 0, minimum=0)
    moe = MoESpec(
        num_experts=f.integer("n_routed_experts"),
        top_k=f.integer("num_experts_per_tok"),
        expert=MLPSpec(intermediate_size=moe_inter, activation=act),
        shared_expert=(MLPSpec(intermediate_size=n_shared * moe_inter, bias=mlp_bias, activation=act)
                       if n_shared else None),
        # DeepSeek-V3's e_score_correction_bias: an nn.Buffer in transformers, not a parameter.
        router_bias=v3,
        router_bias_is_buffer=v3,
        # DeepseekV2/V3PreTrainedModel: ``_keep_in_fp32_modules_strict`` holds ``gate.weight``.
        router_fp32=True,
    )
    first_dense = f.integer("first_k_dense_replace", 0, minimum=0)
    freq = f.integer("moe_layer_freq", 1)
    kinds = [(attn, moe if i >= first_dense and i % freq == 0 else dense) for i in range(n_layers)]
    mtp = f.integer("num_nextn_predict_layers", 0, minimum=0) if v3 else 0
    return _model(f, name, model_type, _stack(kinds), tie_default=False, hidden=hidden, mtp_layers=mtp)


def _gemma3_multimodal(f: _Fields, name: str, model_type: str) -> ModelSpec:
    """Gemma 3 4B/12B/27B (``Gemma3ForConditionalGeneration``): refused, never read as text only.

    ``AutoModelForCausalLM`` builds the SigLIP vision tower and projector beside the text decoder (about
    0.4B weights, held in memory even when fine-tuning on text); memplan does not model them, so it does
    not drop them silently: the user chooses the text decoder alone, as ``Gemma3ForCausalLM`` builds it.
    """
    raise ModelConfigError(
        "model_type", "gemma3 is a multimodal checkpoint (text_config + vision_config) whose SigLIP vision "
        "tower and projector memplan does not model", hint="to size the text decoder alone (Gemma3ForCausalLM, "
        "which transformers loads from the same checkpoint), save the text_config object as a config.json of its "
        "own: its model_type is gemma3_text")


#: Fields a family's ``transformers`` config defaults that published configs omit (Gemma 3's multimodal
#: checkpoints list only what differs from ``Gemma3TextConfig``'s defaults in their ``text_config``).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "olmo3": {"sliding_window": 4096},
    "gemma3_text": {"vocab_size": 262_208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh"},
}

_Builder = Callable[[_Fields, str, str], ModelSpec]
_BUILDERS: dict[str, _Builder] = {
    **{model_type: _dense for model_type in _DENSE},
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen_moe,
    "qwen3_moe": _qwen_moe,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
}
#: ``model_type`` values refused with a sentence saying what to pass instead.
_REFUSED: dict[str, _Builder] = {"gemma3": _gemma3_multimodal}

#: ``model_type`` values :func:`model_from_hf_config` understands.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_BUILDERS))


def model_from_hf_config(config: Mapping[str, Any], *, name: str) -> ModelSpec:
    """Build a :class:`ModelSpec` from the parsed contents of a Hugging Face ``config.json``.

    ``name`` becomes :attr:`ModelSpec.name`. Raises :class:`ModelConfigError` for an unsupported
    ``model_type`` (the message lists the supported ones) or any invalid field.
    """
    if not isinstance(config, Mapping):
        raise ModelConfigError("config", "must be a JSON object", type(config).__name__)
    model_type = config.get("model_type")
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    if model_type is None:
        raise ModelConfigError("model_type", "is required", hint=f"supported: {supported}")
    if isinstance(model_type, str) and model_type in _REFUSED:
        return _REFUSED[model_type](_Fields(config), name, model_type)
    if not isinstance(model_type, str) or model_type not in _BUILDERS:
        raise ModelConfigError("model_type", "is not supported", model_type, hint=f"supported: {supported}")
    defaults = _FAMILY_DEFAULTS.get(model_type, {})
    fields = {**defaults, **{k: v for k, v in config.items() if v is not None or k not in defaults}}
    return _BUILDERS[model_type](_Fields(fields), name, model_type)


def load_hf_config(path: str | Path, *, name: str | None = None) -> ModelSpec:
    """Read a ``config.json`` (or a directory holding one) and build its :class:`ModelSpec`.

    The default name is the directory holding ``config.json`` (a Hub snapshot's model folder),
    or the file's stem for any other file name.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    text = read_text_file(path, field="model", error=ModelConfigError)
    try:
        config = parse_json(text, field=str(path))
    except json.JSONDecodeError as exc:
        raise ModelConfigError(
            str(path), f"is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
            hint="the file may be truncated; download config.json again",
        ) from None
    if not isinstance(config, dict):
        raise ModelConfigError(str(path), "top level must be a JSON object", type(config).__name__)
    default = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return model_from_hf_config(config, name=name or default)
