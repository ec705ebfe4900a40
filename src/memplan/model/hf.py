"""Build a :class:`~memplan.model.spec.ModelSpec` from a Hugging Face ``config.json``.

Each supported ``model_type`` has one small builder (the dense families: one entry each of
:data:`memplan.model.hf_dense.DENSE_FAMILIES`; the typed reads they share: :mod:`memplan.model.hf_fields`)
that reads the fields that family's ``transformers`` modeling code reads, with the same defaults, so that
the parameter counts of
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
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from memplan.bounds import parse_json
from memplan.errors import ModelConfigError
from memplan.model.attention_kinds import MLA
from memplan.model.hf_dense import DENSE_FAMILIES, FAMILY_DEFAULTS, build_dense, gemma3_multimodal
from memplan.model.hf_aliases import canonical_config
from memplan.model.hf_fields import ConfigFields, build_model, gqa, layer_windows, stack, with_window
from memplan.model.spec import CLAMPED_SWIGLU, AttentionSpec, MLPSpec, ModelSpec, MoESpec
from memplan.textfile import read_text_file

__all__ = ["SUPPORTED_MODEL_TYPES", "load_hf_config", "model_from_hf_config"]


def _gpt2(f: ConfigFields, name: str, model_type: str) -> ModelSpec:
    hidden, heads = f.integer("n_embd"), f.integer("n_head")
    if hidden % heads:
        raise ModelConfigError("n_head", f"must divide n_embd={hidden}", heads)
    attn = AttentionSpec(num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
                         v_head_dim=hidden // heads, qkv_bias=True, out_bias=True, fused_qkv=True,
                         softmax_in_scores_dtype=True)
    mlp = MLPSpec(intermediate_size=f.integer("n_inner", 4 * hidden), gated=False, bias=True,
                  activation=f.text("activation_function", "gelu_new"))
    layers = stack([(attn, mlp)] * f.integer("n_layer"), attention_output_local=True)
    # GPT2Model's ``drop`` (embd_pdrop), GPT2Attention's ``resid_dropout`` and GPT2MLP's ``dropout`` (resid_pdrop)
    return build_model(f, name, model_type, layers, tie_default=True, hidden=hidden, norm="layernorm",
                  norm_bias=True, position_embedding="learned",
                  max_position_embeddings=f.integer("n_positions", 1024), hidden_dropout="embedding-and-residual")


def _gpt_neox(f: ConfigFields, name: str, model_type: str) -> ModelSpec:
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
    layers = stack([(attn, mlp)] * f.integer("num_hidden_layers"),
                    parallel_residual=f.flag("use_parallel_residual", True))
    # GPTNeoXModel's ``emb_dropout``, the layer's ``post_attention_dropout`` and ``post_mlp_dropout`` (hidden_dropout)
    return build_model(f, name, model_type, layers, tie_default=False, hidden=hidden, norm="layernorm",
                  norm_bias=True, hidden_dropout="embedding-and-residual")


# --------------------------------------------------------------------------- MoE families
def _mixtral(f: ConfigFields, name: str, model_type: str) -> ModelSpec:
    hidden, n_layers = f.integer("hidden_size"), f.integer("num_hidden_layers")
    attn = gqa(f, hidden, bias=False, out_bias=False)
    expert = MLPSpec(intermediate_size=f.integer("intermediate_size"), activation=f.text("hidden_act", "silu"))
    # MixtralTopKRouter: ``softmax(router_logits.float())``, its top-k values never cast back
    moe = MoESpec(num_experts=f.integer("num_local_experts"), top_k=f.integer("num_experts_per_tok"), expert=expert,
                  routing_weights_fp32=True)
    kinds = [(with_window(attn, w), moe) for w in layer_windows(f, n_layers, "all")]
    return build_model(f, name, model_type, stack(kinds), tie_default=False, hidden=hidden)


def _qwen_moe(f: ConfigFields, name: str, model_type: str) -> ModelSpec:
    """Qwen2-MoE (shared expert with a sigmoid gate) and Qwen3-MoE (q/k norm, no shared expert)."""
    hidden, n_layers = f.integer("hidden_size"), f.integer("num_hidden_layers")
    act = f.text("hidden_act", "silu")
    if model_type == "qwen2_moe":
        bias = f.flag("qkv_bias", True)
        attn = gqa(f, hidden, bias=bias, out_bias=False)
    else:
        bias = f.flag("attention_bias", False)
        attn = gqa(f, hidden, bias=bias, out_bias=bias, qk_norm=True)
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
    for i, window in enumerate(layer_windows(f, n_layers, "qwen")):
        sparse = moe is not None and i not in dense_only and (i + 1) % step == 0
        kinds.append((with_window(attn, window), moe if sparse and moe else dense))
    return build_model(f, name, model_type, stack(kinds), tie_default=False, hidden=hidden)


def _deepseek(f: ConfigFields, name: str, model_type: str) -> ModelSpec:
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
        # DeepseekV2TopkRouter: ``softmax(dtype=torch.float32)``, not cast back (V3's sigmoid follows its logits)
        routing_weights_fp32=not v3,
    )
    first_dense = f.integer("first_k_dense_replace", 0, minimum=0)
    freq = f.integer("moe_layer_freq", 1)
    kinds = [(attn, moe if i >= first_dense and i % freq == 0 else dense) for i in range(n_layers)]
    mtp = f.integer("num_nextn_predict_layers", 0, minimum=0) if v3 else 0
    return build_model(f, name, model_type, stack(kinds), tie_default=False, hidden=hidden, mtp_layers=mtp)


# --------------------------------------------------------------------------- gpt-oss (begin)
#: ``GptOssConfig``'s defaults (transformers ``configuration_gpt_oss.py``) for the keys this builder reads.
_GPT_OSS_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "sliding_window": 128, "num_experts_per_tok": 4, "attention_bias": True,
}


def _gpt_oss(f: ConfigFields, name: str, model_type: str) -> ModelSpec:
    """OpenAI gpt-oss: biased GQA with per-head sinks, sliding (even) / full (odd) layers by ``layer_types``,
    every layer an MoE block: a biased router and biased stacked experts under a clamped SwiGLU."""
    hidden, n_layers = f.integer("hidden_size"), f.integer("num_hidden_layers")
    bias = f.flag("attention_bias", True)
    attn = replace(gqa(f, hidden, bias=bias, out_bias=bias), sinks=True)
    expert = MLPSpec(intermediate_size=f.integer("intermediate_size"), bias=True, activation=CLAMPED_SWIGLU,
                     fused_gate_up=True)
    moe = MoESpec(num_experts=f.integer("num_local_experts"), top_k=f.integer("num_experts_per_tok"),
                  expert=expert, router_bias=True, router_name="router", softmax_after_topk=True)
    kinds = [(with_window(attn, w), moe) for w in layer_windows(f, n_layers, "alternate")]
    # GptOssRMSNorm: ``(weight * x_normed).to(input dtype)``, the product in fp32
    return build_model(f, name, model_type, stack(kinds), tie_default=False, hidden=hidden, norm_fp32_scale=True)
# --------------------------------------------------------------------------- gpt-oss (end)


def _quant_method(config: Mapping[str, Any]) -> str:
    """``quantization_config.quant_method``: how the checkpoint stores its weights ("" when not quantized)."""
    quant = config.get("quantization_config")
    if quant is None:
        return ""
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if not isinstance(method, str) or not method:
        raise ModelConfigError("quantization_config.quant_method", "must be a non-empty string",
                               method if isinstance(quant, dict) else quant)
    return method


_Builder = Callable[[ConfigFields, str, str], ModelSpec]
_BUILDERS: dict[str, _Builder] = {
    **{model_type: build_dense for model_type in DENSE_FAMILIES},
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen_moe,
    "qwen3_moe": _qwen_moe,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "gpt_oss": _gpt_oss,
}
#: Config-class defaults of the other families (the dense ones' are :data:`FAMILY_DEFAULTS`).
_DEFAULTS: dict[str, dict[str, Any]] = {**FAMILY_DEFAULTS, "gpt_oss": _GPT_OSS_DEFAULTS}
#: ``model_type`` values refused with a sentence saying what to pass instead.
_REFUSED: dict[str, _Builder] = {"gemma3": gemma3_multimodal}

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
        return _REFUSED[model_type](ConfigFields(config), name, model_type)
    if not isinstance(model_type, str) or model_type not in _BUILDERS:
        raise ModelConfigError("model_type", "is not supported", model_type, hint=f"supported: {supported}")
    defaults = _DEFAULTS.get(model_type, {})
    config = canonical_config(config, model_type)
    fields = {**defaults, **{k: v for k, v in config.items() if v is not None or k not in defaults}}
    spec = _BUILDERS[model_type](ConfigFields(fields), name, model_type)
    method = _quant_method(config)
    return replace(spec, checkpoint_quantization=method) if method else spec


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
