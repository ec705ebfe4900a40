"""Parameter counts derived from a :class:`~memplan.model.spec.ModelSpec`.

Counts are split by how tensor parallelism treats them, so the estimator can divide them
without knowing the architecture:

* ``tp_sharded`` — column/row-parallel weights (and column-parallel biases): divided by TP;
* ``replicated`` — norms, row-parallel output biases, routers, MLA down-projections: every TP rank
  holds all of them;
* ``expert`` — routed-expert weights: divided by expert parallelism (EP) and expert TP (ETP).

``shared_expert`` says how much of ``tp_sharded`` belongs to shared experts, which a job may place
with the routed experts instead (``--shared-expert-parallel expert``).

Totals here must equal what ``transformers`` builds from the same config (tested), so the
vocabulary is the config's own; framework padding of the vocabulary is applied by the estimator.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from memplan.model.attention_kinds import attention_kind
from memplan.model.param_groups import ParamGroups

if TYPE_CHECKING:  # annotations only: spec imports this module in its cached properties
    from memplan.model.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, MoESpec


def attention_params(attn: AttentionSpec, hidden: int) -> ParamGroups:
    """Weights of one attention block (projections, q/k and latent norms; not the pre-norm), by its kind."""
    return attention_kind(attn).params(attn, hidden)


def mlp_params(mlp: MLPSpec, hidden: int) -> ParamGroups:
    """Weights of one dense MLP: (gate,) up (column-parallel) and down (row-parallel)."""
    n_in = 2 if mlp.gated else 1
    sharded = (n_in + 1) * hidden * mlp.intermediate_size
    replicated = 0
    if mlp.bias:
        sharded += n_in * mlp.intermediate_size
        replicated += hidden
    return ParamGroups(tp_sharded=sharded, replicated=replicated)


def moe_params(moe: MoESpec, hidden: int) -> ParamGroups:
    """Weights of one MoE block: router (replicated), routed experts, shared expert(s)."""
    replicated = hidden * moe.num_experts
    if moe.router_bias and not moe.router_bias_is_buffer:
        replicated += moe.num_experts
    expert = moe.num_experts * mlp_params(moe.expert, hidden).total
    groups = ParamGroups(replicated=replicated, expert=expert)
    if moe.shared_expert is not None:
        shared = mlp_params(moe.shared_expert, hidden)
        groups = groups + ParamGroups(tp_sharded=shared.total, shared_expert=shared.total)
    if moe.shared_expert_gate:
        groups = groups + ParamGroups(replicated=hidden)
    return groups


def norm_params(hidden: int, norm_bias: bool) -> int:
    """Parameters of one LayerNorm/RMSNorm over the hidden state."""
    return hidden * (2 if norm_bias else 1)


@lru_cache(maxsize=4096)
def layer_params(layer: LayerSpec, hidden: int, norm_bias: bool) -> ParamGroups:
    """All weights of one decoder layer, grouped by sharding."""
    groups = attention_params(layer.attention, hidden)
    if layer.moe is not None:
        groups = groups + moe_params(layer.moe, hidden)
    else:
        assert layer.mlp is not None
        groups = groups + mlp_params(layer.mlp, hidden)
    return groups + ParamGroups(replicated=layer.num_hidden_norms * norm_params(hidden, norm_bias))


def embedding_params(model: ModelSpec, vocab_rows: int | None = None) -> int:
    """Token-embedding weights (``vocab_rows`` defaults to the config's vocabulary)."""
    return (vocab_rows or model.vocab_size) * model.hidden_size


def position_embedding_params(model: ModelSpec) -> int:
    """Learned absolute position table (GPT-2); zero for RoPE models."""
    if model.position_embedding != "learned":
        return 0
    return model.max_position_embeddings * model.hidden_size


def head_params(model: ModelSpec, vocab_rows: int | None = None) -> int:
    """Output-projection weights that are not shared with the embedding."""
    if model.tie_word_embeddings:
        return 0
    return (vocab_rows or model.vocab_size) * model.hidden_size


def final_norm_params(model: ModelSpec) -> int:
    return norm_params(model.hidden_size, model.norm_bias)


def per_layer_param_counts(model: ModelSpec) -> tuple[int, ...]:
    """Total parameters of each decoder layer, in order."""
    return tuple(layer_params(layer, model.hidden_size, model.norm_bias).total for layer in model.layers)


def total_params(model: ModelSpec, *, include_mtp: bool = False) -> int:
    """Every trainable parameter, counted as ``transformers`` builds the model.

    Multi-token-prediction modules are not built by ``transformers``; ``include_mtp`` adds them
    (each: one extra decoder layer like the last, two norms and a 2h->h projection).
    """
    count = embedding_params(model) + position_embedding_params(model) + head_params(model)
    count += final_norm_params(model) + sum(per_layer_param_counts(model))
    if include_mtp:
        count += model.mtp_layers * mtp_module_params(model)
    return count


def mtp_module_params(model: ModelSpec) -> int:
    """One DeepSeek-V3 MTP module: two RMSNorms, a 2h->h projection, one decoder layer, a final norm."""
    hidden = model.hidden_size
    last = layer_params(model.layers[-1], hidden, model.norm_bias).total
    return 3 * norm_params(hidden, model.norm_bias) + 2 * hidden * hidden + last


def active_params(model: ModelSpec) -> int:
    """Parameters touched per token (routed experts count ``top_k`` of ``num_experts``)."""
    count = total_params(model)
    for layer in model.layers:
        if layer.moe is not None:
            one = mlp_params(layer.moe.expert, model.hidden_size).total
            count -= (layer.moe.num_experts - layer.moe.top_k) * one
    return count


@lru_cache(maxsize=4096)
def layer_non_gemm_params(layer: LayerSpec, hidden: int, norm_bias: bool) -> int:
    """Weights of a layer that no matrix multiply reads as a weight (norms, router), all replicated.

    FP8 training casts every other weight of the layer for its FP8 GEMMs; these stay 16-bit.
    """
    count = layer.num_hidden_norms * norm_params(hidden, norm_bias)
    attn = layer.attention
    if attn.qk_norm:
        count += sum(attn.qk_norm_widths)
    count += attention_kind(attn).extra_norm_numel(attn)
    if layer.moe is not None:
        count += hidden * layer.moe.num_experts
    return count
