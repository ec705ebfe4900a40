"""The named modules of a model as ``transformers`` builds them: linear layers and parameter tensors.

PEFT selects modules by their Hugging Face names (``q_proj``, ``all-linear``, ``layers.31``), so
pricing adapters and frozen weights needs the names and shapes ``AutoModelForCausalLM.from_config``
gives each family (tested against real modules built on the meta device for every preset):

* Llama-style families: ``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``;
  other attention kinds name their own projections (:mod:`memplan.model.attention_kinds`; MLA:
  ``q_proj`` or ``q_a_proj``/``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``);
  Phi-3: fused ``qkv_proj`` and ``gate_up_proj``; GPT-2 (``transformer.h.{i}``): ``Conv1D`` layers
  ``attn.c_attn``/``attn.c_proj``/``mlp.c_fc``/``mlp.c_proj``; GPT-NeoX (``gpt_neox.layers.{i}``):
  ``attention.query_key_value``/``attention.dense``/``mlp.dense_h_to_4h``/``mlp.dense_4h_to_h``.
* MoE routers (``mlp.gate``) are router modules, not ``nn.Linear``, and routed experts are fused
  3-D parameters (``mlp.experts.gate_up_proj`` ``(E, 2f, h)``, ``mlp.experts.down_proj``
  ``(E, h, f)``, transformers 5): neither is a linear layer peft or bitsandbytes replaces. Shared
  experts are ordinary linear layers (``mlp.shared_experts`` in DeepSeek, ``mlp.shared_expert`` and
  the ``mlp.shared_expert_gate`` ``Linear(h, 1)`` in Qwen2-MoE).
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Literal

from memplan.frozen import frozen_dataclass
from memplan.model.attention_kinds import attention_kind

if TYPE_CHECKING:  # annotations only: no import cycle with spec
    from memplan.model.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec

LinearKind = Literal["linear", "conv1d", "embedding"]


@frozen_dataclass
class LinearModule:
    """A module peft can wrap: its dotted name, ``in_features -> out_features`` and bias."""

    name: str
    in_features: int
    out_features: int
    bias: bool = False
    #: ``conv1d``: GPT-2's transposed ``Conv1D``; ``embedding``: an ``nn.Embedding`` (vocab -> hidden).
    kind: LinearKind = "linear"
    #: Decoder layer it belongs to (None: embedding, head).
    layer: int | None = None

    @property
    def weight_numel(self) -> int:
        return self.in_features * self.out_features


@frozen_dataclass
class ParamTensor:
    """One parameter tensor: its dotted name and numel; ``layer`` is its decoder layer (None outside)."""

    name: str
    numel: int
    layer: int | None = None

    @property
    def module(self) -> str:
        return self.name.rpartition(".")[0]

    @property
    def routed_expert(self) -> bool:
        """One of the routed experts' fused parameters (``mlp.experts.*``; a shared expert is an ordinary linear)."""
        return ".mlp.experts." in self.name


#: The attention module of a decoder layer, by the attribute names of transformers' families (Llama-style
#: ``self_attn``, GPT-2 ``attn``, GPT-NeoX ``attention``): what ``memplan trace --recompute selective`` checkpoints
#: and what an adapter inside it belongs to.
ATTENTION_MODULES: tuple[str, ...] = ("self_attn", "attn", "attention")


def layer_prefix(model: ModelSpec) -> str:
    """Dotted prefix of the decoder-layer list."""
    return {"gpt2": "transformer.h", "gpt_neox": "gpt_neox.layers"}.get(model.model_type, "model.layers")


def _names(model: ModelSpec) -> dict[str, str]:
    if model.model_type == "gpt2":
        return {"embed": "transformer.wte", "pos": "transformer.wpe", "norm": "transformer.ln_f"}
    if model.model_type == "gpt_neox":
        return {"embed": "gpt_neox.embed_in", "pos": "", "norm": "gpt_neox.final_layer_norm"}
    return {"embed": "model.embed_tokens", "pos": "", "norm": "model.norm"}


def _attention_linears(attn: AttentionSpec, h: int, model_type: str) -> list[tuple[str, int, int, bool]]:
    q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    v, o_in = attn.num_kv_heads * attn.v_head_dim, attn.num_heads * attn.v_head_dim
    if model_type == "gpt2":
        return [("attn.c_attn", h, q + kv + v, True), ("attn.c_proj", o_in, h, True)]
    if model_type == "gpt_neox":
        return [("attention.query_key_value", h, q + kv + v, attn.qkv_bias), ("attention.dense", o_in, h, attn.out_bias)]
    return attention_kind(attn).linears(attn, h)


def _mlp_linears(mlp: MLPSpec, h: int, prefix: str, model_type: str) -> list[tuple[str, int, int, bool]]:
    f, b = mlp.intermediate_size, mlp.bias
    if model_type == "gpt2":
        return [(f"{prefix}.c_fc", h, f, True), (f"{prefix}.c_proj", f, h, True)]
    if model_type == "gpt_neox":
        return [(f"{prefix}.dense_h_to_4h", h, f, b), (f"{prefix}.dense_4h_to_h", f, h, b)]
    if mlp.fused_gate_up:
        return [(f"{prefix}.gate_up_proj", h, 2 * f, b), (f"{prefix}.down_proj", f, h, b)]
    up = [(f"{prefix}.gate_proj", h, f, b), (f"{prefix}.up_proj", h, f, b)] if mlp.gated else [(f"{prefix}.up_proj", h, f, b)]
    return up + [(f"{prefix}.down_proj", f, h, b)]


@lru_cache(maxsize=1024)
def layer_linears(layer: LayerSpec, hidden: int, model_type: str) -> tuple[LinearModule, ...]:
    """The linear layers of one decoder layer, names relative to the layer (``self_attn.q_proj``)."""
    rows = _attention_linears(layer.attention, hidden, model_type)
    if layer.moe is not None:
        shared = layer.moe.shared_expert
        if shared is not None:
            prefix = "mlp.shared_expert" if model_type == "qwen2_moe" else "mlp.shared_experts"
            rows += _mlp_linears(shared, hidden, prefix, model_type)
        if layer.moe.shared_expert_gate:
            rows.append(("mlp.shared_expert_gate", hidden, 1, False))
    else:
        assert layer.mlp is not None
        rows += _mlp_linears(layer.mlp, hidden, "mlp", model_type)
    kind: LinearKind = "conv1d" if model_type == "gpt2" else "linear"
    return tuple(LinearModule(name, i, o, b, kind) for name, i, o, b in rows)


def _layer_other_params(layer: LayerSpec, hidden: int, model: ModelSpec) -> list[tuple[str, int]]:
    """Parameters of a layer that are not linear layers: norms, q/k norms, MLA norms, router, experts."""
    nb = model.norm_bias
    if model.model_type == "gpt2":
        norms = ["ln_1", "ln_2"]
    elif layer.num_hidden_norms == 4:
        norms = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"]
    elif not layer.pre_norms:  # OLMo 2: both norms on the sublayers' outputs
        norms = ["post_attention_layernorm", "post_feedforward_layernorm"]
    else:
        norms = ["input_layernorm", "post_attention_layernorm"]
    out = [(f"{n}.weight", hidden) for n in norms] + ([(f"{n}.bias", hidden) for n in norms] if nb else [])
    attn = layer.attention
    if attn.qk_norm:
        q_width, k_width = attn.qk_norm_widths
        out += [("self_attn.q_norm.weight", q_width), ("self_attn.k_norm.weight", k_width)]
    out += attention_kind(attn).extra_norms(attn)
    moe = layer.moe
    if moe is not None:
        out.append((f"mlp.{moe.router_name}.weight", hidden * moe.num_experts))
        if moe.router_bias and not moe.router_bias_is_buffer:
            out.append((f"mlp.{moe.router_name}.bias", moe.num_experts))
        e, f = moe.num_experts, moe.expert.intermediate_size
        up = 2 * f if moe.expert.gated else f
        out += [("mlp.experts.gate_up_proj", e * up * hidden), ("mlp.experts.down_proj", e * hidden * f)]
        if moe.expert.bias:  # gpt-oss: one bias row per expert on each stacked projection
            out += [("mlp.experts.gate_up_proj_bias", e * up), ("mlp.experts.down_proj_bias", e * hidden)]
    return out


def model_linears(model: ModelSpec) -> tuple[LinearModule, ...]:
    """Every linear layer of the model with full dotted names, the output head included
    (``lm_head``), and the token embedding (``kind="embedding"``, vocab -> hidden)."""
    return _model_linears(model)


@lru_cache(maxsize=64)
def _model_linears(model: ModelSpec) -> tuple[LinearModule, ...]:
    names, prefix, h = _names(model), layer_prefix(model), model.hidden_size
    out = [LinearModule(names["embed"], model.vocab_size, h, kind="embedding")]
    for i, layer in enumerate(model.layers):
        out += [LinearModule(f"{prefix}.{i}.{m.name}", m.in_features, m.out_features, m.bias, m.kind, i)
                for m in layer_linears(layer, h, model.model_type)]
    out.append(LinearModule("lm_head", h, model.vocab_size))
    return tuple(out)


def model_parameters(model: ModelSpec) -> tuple[ParamTensor, ...]:
    """Every parameter tensor as ``model.named_parameters()`` lists it (a tied head is not repeated)."""
    return _model_parameters(model)


@lru_cache(maxsize=64)
def _model_parameters(model: ModelSpec) -> tuple[ParamTensor, ...]:
    names, h = _names(model), model.hidden_size
    out: list[ParamTensor] = []
    for lin in _model_linears(model):
        if lin.name == "lm_head" and model.tie_word_embeddings:
            continue
        out.append(ParamTensor(f"{lin.name}.weight", lin.weight_numel, lin.layer))
        if lin.bias:
            out.append(ParamTensor(f"{lin.name}.bias", lin.out_features, lin.layer))
        if lin.kind == "embedding" and names["pos"]:
            out.append(ParamTensor(f"{names['pos']}.weight", model.max_position_embeddings * h))
    prefix = layer_prefix(model)
    for i, layer in enumerate(model.layers):
        out += [ParamTensor(f"{prefix}.{i}.{name}", numel, i) for name, numel in _layer_other_params(layer, h, model)]
    out.append(ParamTensor(f"{names['norm']}.weight", h))
    if model.norm_bias:
        out.append(ParamTensor(f"{names['norm']}.bias", h))
    return tuple(out)


def matches(module_name: str, pattern: str) -> bool:
    """peft's rule for a name in ``target_modules``: the whole dotted name, or its last components."""
    return module_name == pattern or module_name.endswith("." + pattern)
