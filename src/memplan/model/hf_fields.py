"""Typed reads of a Hugging Face ``config.json`` and the helpers every family's builder shares.

:class:`ConfigFields` reads one field at a time with the family's default and raises
:class:`~memplan.errors.ModelConfigError` naming the field, the rule and the value; the helpers build
the grouped-query attention, the per-layer stack and the :class:`ModelSpec` (:mod:`memplan.model.hf`,
:mod:`memplan.model.hf_dense`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

from memplan.bounds import MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_MODEL_INT, check_at_most
from memplan.errors import ModelConfigError
from memplan.model.spec import AttentionSpec, HiddenDropout, LayerSpec, MLPSpec, ModelSpec, MoESpec

__all__ = ["ConfigFields", "WindowRule", "build_model", "gqa", "layer_windows", "optional_number", "rope_layers", "stack",
           "with_window"]

_MISSING: Any = object()
#: Counts that size loops (one entry per layer, expert, head), with the limit each may reach.
_LIMITS = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_nextn_predict_layers"), (MAX_LAYERS, "MAX_LAYERS")),
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts", "n_shared_experts",
                     "num_experts_per_tok"), (MAX_EXPERTS, "MAX_EXPERTS")),
    **dict.fromkeys(("num_attention_heads", "num_key_value_heads", "n_head"), (MAX_HEADS, "MAX_HEADS")),
}


class ConfigFields:
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


def _head_dim(f: ConfigFields, hidden: int, heads: int, default: int | None = None) -> int:
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


def gqa(f: ConfigFields, hidden: int, *, bias: bool, out_bias: bool, qk_norm: bool = False,
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


def with_window(attn: AttentionSpec, window: int | None) -> AttentionSpec:
    if window == attn.sliding_window:
        return attn
    return replace(attn, sliding_window=window)


def stack(kinds: Sequence[tuple[AttentionSpec, MLPSpec | MoESpec]], **layer_kw: Any) -> tuple[LayerSpec, ...]:
    """One LayerSpec per layer, reusing a single object for identical layers."""
    cache: dict[tuple[AttentionSpec, MLPSpec | MoESpec], LayerSpec] = {}
    out = []
    for attn, ffn in kinds:
        if (attn, ffn) not in cache:
            kw = {"moe": ffn} if isinstance(ffn, MoESpec) else {"mlp": ffn}
            cache[(attn, ffn)] = LayerSpec(attention=attn, **kw, **layer_kw)
        out.append(cache[(attn, ffn)])
    return tuple(out)


def build_model(f: ConfigFields, name: str, model_type: str, layers: tuple[LayerSpec, ...], *,
           tie_default: bool, hidden: int, hidden_dropout: HiddenDropout = "none", **kw: Any) -> ModelSpec:
    """The spec of a family's transformers model; ``hidden_dropout``: where its modeling code drops out
    hidden states (none unless the builder says: most families have ``attention_dropout`` only)."""
    windows = [layer.attention.sliding_window for layer in layers]
    return ModelSpec(
        name=name,
        model_type=model_type,
        hidden_size=hidden,
        vocab_size=f.integer("vocab_size"),
        layers=layers,
        tie_word_embeddings=f.flag("tie_word_embeddings", tie_default),
        extra={"sliding_window_layers": sum(w is not None for w in windows)},
        hidden_dropout=hidden_dropout,
        **kw,
    )


def optional_number(f: ConfigFields, key: str) -> float | None:
    """A number the config may set to null (Gemma 2's soft-capping values)."""
    value = f.raw(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError(key, "must be a positive number or null", value)
    return float(value)


WindowRule = Literal["none", "all", "qwen", "alternate", "nope"]


def layer_windows(f: ConfigFields, n_layers: int, rule: WindowRule, period: int = 2) -> tuple[int | None, ...]:
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
        default = tuple(size if not rope else None for rope in rope_layers(f, n_layers))
        return _layer_type_windows(f, n_layers, size, default)
    window = f.integer("sliding_window") if f.given("sliding_window") else None
    if rule == "all" or window is None:
        return (window,) * n_layers
    # rule == "alternate": Gemma 2 (every other layer), Gemma 3 (5 of 6), OLMo 3 (3 of 4)
    default = tuple(window if (i + 1) % period else None for i in range(n_layers))
    return _layer_type_windows(f, n_layers, window, default)


def _layer_type_windows(f: ConfigFields, n_layers: int, window: int,
                        default: tuple[int | None, ...]) -> tuple[int | None, ...]:
    """Windows from ``layer_types`` when the config lists them, else ``default``."""
    types = f.raw("layer_types")
    if types is None:
        return default
    if not isinstance(types, list) or len(types) != n_layers:
        raise ModelConfigError("layer_types", f"must list {n_layers} layer types", types)
    return tuple(window if t == "sliding_attention" else None for t in types)


def rope_layers(f: ConfigFields, n_layers: int) -> tuple[bool, ...]:
    """Whether each layer rotates q and k (SmolLM3 ``no_rope_layers``: 1 rotates, 0 is NoPE)."""
    flags = f.raw("no_rope_layers")
    if flags is None:
        interval = f.integer("no_rope_layer_interval", 4)
        return tuple(bool((i + 1) % interval) for i in range(n_layers))
    if not isinstance(flags, list) or len(flags) != n_layers or any(v not in (0, 1) for v in flags):
        raise ModelConfigError("no_rope_layers", f"must list {n_layers} flags of 0 (NoPE) or 1 (RoPE)", flags)
    return tuple(bool(v) for v in flags)
