"""Multi-head and grouped-query attention: q, k, v and output projections (Llama-style names).

The maths of the ``mha`` and ``gqa`` entries of :mod:`memplan.model.attention_kinds`: parameter
groups, parameter tensors, linear modules and 2-D weights of one attention block. Grouped keys and
values only change the k and v widths (``num_kv_heads * head_dim``), so both kinds share them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.model.param_groups import ParamGroups, TpMatrix

if TYPE_CHECKING:  # annotations only: spec imports the registry that imports this module
    from memplan.model.spec import AttentionSpec

Linear = tuple[str, int, int, bool]


def params(attn: AttentionSpec, hidden: int) -> ParamGroups:
    """Weights of the projections (column-parallel q, k, v; row-parallel output), the q/k norms and sinks."""
    q_out = attn.num_heads * attn.head_dim
    kv_out = attn.num_kv_heads * attn.head_dim
    v_out = attn.num_kv_heads * attn.v_head_dim
    sharded = hidden * (q_out + kv_out + v_out) + attn.num_heads * attn.v_head_dim * hidden
    if attn.qkv_bias:
        sharded += q_out + kv_out + v_out
    replicated = hidden if attn.out_bias else 0
    if attn.qk_norm:
        replicated += sum(attn.qk_norm_widths)
    replicated += sum(numel for _, numel in extra_norms(attn))
    return ParamGroups(tp_sharded=sharded, replicated=replicated)


def tensors(attn: AttentionSpec) -> int:
    """Parameter tensors: q, k, v apart (one when fused) and the output, each with its bias, q/k norms, sinks."""
    projections = 1 if attn.fused_qkv else 3
    count = projections * (2 if attn.qkv_bias else 1)
    count += 2 if attn.out_bias else 1
    return count + (2 if attn.qk_norm else 0) + len(extra_norms(attn))


def linears(attn: AttentionSpec, hidden: int) -> list[Linear]:
    """``(name, in, out, bias)`` of the projections under ``self_attn`` (``qkv_proj`` when fused)."""
    q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    v, o_in = attn.num_kv_heads * attn.v_head_dim, attn.num_heads * attn.v_head_dim
    if attn.fused_qkv:
        qkv = [("self_attn.qkv_proj", hidden, q + kv + v, attn.qkv_bias)]
    else:
        qkv = [("self_attn.q_proj", hidden, q, attn.qkv_bias),
               ("self_attn.k_proj", hidden, kv, attn.qkv_bias),
               ("self_attn.v_proj", hidden, v, attn.qkv_bias)]
    return qkv + [("self_attn.o_proj", o_in, hidden, attn.out_bias)]


def extra_norms(attn: AttentionSpec) -> list[tuple[str, int]]:
    """No norms besides the q/k norms; gpt-oss's attention sinks (one logit per query head, replicated,
    read by no GEMM) are the block's other 1-D parameter."""
    return [("self_attn.sinks", attn.num_heads)] if attn.sinks else []


def qkv_bias_sizes(attn: AttentionSpec) -> tuple[int, ...]:
    """The q, k and v biases (column-parallel, split by TP)."""
    if not attn.qkv_bias:
        return ()
    kv = attn.num_kv_heads * attn.head_dim
    return (attn.num_heads * attn.head_dim, kv, kv)


def matrices(attn: AttentionSpec, hidden: int) -> tuple[TpMatrix, ...]:
    """Megatron's fused QKV (column-parallel; its parts q, k, v) and the output projection (row-parallel)."""
    q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    return (TpMatrix(q + 2 * kv, hidden, 0, parts=(q, kv, kv)),
            TpMatrix(hidden, attn.num_heads * attn.v_head_dim, 1))


def up_projection_numel(attn: AttentionSpec, hidden: int) -> int:
    """No up-projections: q, k and v are projected from the hidden states directly."""
    return 0


def tp_divides_kv_heads(attn: AttentionSpec, tp: int) -> bool:
    """TP must divide the key/value heads or be a multiple of them (each rank holds whole kv heads)."""
    return not (attn.num_kv_heads % tp and tp % attn.num_kv_heads)

