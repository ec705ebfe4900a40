"""Multi-head latent attention (DeepSeek-V2/V3): low-rank q and compressed kv, a decoupled RoPE part.

The maths of the ``mla`` entry of :mod:`memplan.model.attention_kinds`. The down-projections
(``q_a_proj``, ``kv_a_proj_with_mqa``) and their norms are replicated under tensor parallelism; the
up-projections (``q_b_proj`` or ``q_proj``, ``kv_b_proj``) are column-parallel, the output row-parallel.
Names follow transformers' DeepSeek attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.model.param_groups import ParamGroups, TpMatrix

if TYPE_CHECKING:  # annotations only: spec imports the registry that imports this module
    from memplan.model.spec import AttentionSpec

Linear = tuple[str, int, int, bool]


def _ranks(attn: AttentionSpec) -> tuple[int, int, int]:
    """``(kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim)``, set on every latent spec (the spec checks)."""
    assert attn.kv_lora_rank is not None and attn.qk_rope_head_dim is not None
    assert attn.qk_nope_head_dim is not None
    return attn.kv_lora_rank, attn.qk_rope_head_dim, attn.qk_nope_head_dim


def params(attn: AttentionSpec, hidden: int) -> ParamGroups:
    """Weights of the down- (replicated) and up-projections (TP-sharded), latent norms and output."""
    lora, rope, nope = _ranks(attn)
    heads = attn.num_heads
    q_head = nope + rope
    bias = 1 if attn.qkv_bias else 0
    replicated = 0
    sharded = 0
    if attn.q_lora_rank:
        replicated += hidden * attn.q_lora_rank + bias * attn.q_lora_rank  # W^DQ
        replicated += attn.q_lora_rank  # q_a_layernorm
        sharded += attn.q_lora_rank * heads * q_head  # W^UQ and W^QR
    else:
        sharded += hidden * heads * q_head
    kv_a_out = lora + rope
    replicated += hidden * kv_a_out + bias * kv_a_out  # W^DKV and W^KR
    replicated += lora  # kv_a_layernorm
    sharded += lora * heads * (nope + attn.v_head_dim)  # W^UK, W^UV
    sharded += heads * attn.v_head_dim * hidden  # W^O
    if attn.out_bias:
        replicated += hidden
    return ParamGroups(tp_sharded=sharded, replicated=replicated)


def up_projection_numel(attn: AttentionSpec, hidden: int) -> int:
    """Weights of the up-projections, the GEMMs ``--recompute-modules mla_up_proj`` runs again: the q
    up-projection (``q_b_proj``; without a low-rank q, ``q_proj`` on the hidden states) and the kv
    up-projection (``kv_b_proj``), before tensor-parallel sharding."""
    lora, rope, nope = _ranks(attn)
    q_in = attn.q_lora_rank or hidden
    heads = attn.num_heads
    q = q_in * heads * (nope + rope)
    return q + lora * heads * (nope + attn.v_head_dim)


def tensors(attn: AttentionSpec) -> int:
    """q_a_proj (+bias), q_a_layernorm, q_b_proj — or q_proj alone; kv_a_proj_with_mqa (+bias),
    kv_a_layernorm, kv_b_proj; o_proj (+bias). Only the down-projections and o_proj take bias."""
    bias = 1 if attn.qkv_bias else 0
    q = 3 + bias if attn.q_lora_rank else 1
    return q + 3 + bias + (2 if attn.out_bias else 1)


def linears(attn: AttentionSpec, hidden: int) -> list[Linear]:
    """``(name, in, out, bias)`` of the down-, up- and output projections under ``self_attn``."""
    lora, rope, nope = _ranks(attn)
    q = attn.num_heads * attn.head_dim
    out: list[Linear] = []
    if attn.q_lora_rank:
        out += [("self_attn.q_a_proj", hidden, attn.q_lora_rank, attn.qkv_bias),
                ("self_attn.q_b_proj", attn.q_lora_rank, q, False)]
    else:
        out.append(("self_attn.q_proj", hidden, q, False))
    out += [("self_attn.kv_a_proj_with_mqa", hidden, lora + rope, attn.qkv_bias),
            ("self_attn.kv_b_proj", lora, attn.num_heads * (nope + attn.v_head_dim), False)]
    return out + [("self_attn.o_proj", attn.num_heads * attn.v_head_dim, hidden, attn.out_bias)]


def extra_norms(attn: AttentionSpec) -> list[tuple[str, int]]:
    """The latent norms (replicated): ``q_a_layernorm`` with a low-rank q, and ``kv_a_layernorm``."""
    out = [("self_attn.q_a_layernorm.weight", attn.q_lora_rank)] if attn.q_lora_rank else []
    return out + [("self_attn.kv_a_layernorm.weight", attn.kv_lora_rank or 0)]


def qkv_bias_sizes(attn: AttentionSpec) -> tuple[int, ...]:
    """No column-parallel q/k/v bias: a bias sits on the replicated down-projections only."""
    return ()


def matrices(attn: AttentionSpec, hidden: int) -> tuple[TpMatrix, ...]:
    """Megatron's MLA: the output (row-parallel), the down-projections (replicated) and the
    up-projections (column-parallel); no fused QKV."""
    lora, rope, nope = attn.kv_lora_rank or 0, attn.qk_rope_head_dim or 0, attn.qk_nope_head_dim or 0
    heads, q_head = attn.num_heads, nope + rope
    out = [TpMatrix(hidden, heads * attn.v_head_dim, 1)]
    if attn.q_lora_rank:
        out += [TpMatrix(attn.q_lora_rank, hidden), TpMatrix(heads * q_head, attn.q_lora_rank, 0)]
    else:
        out.append(TpMatrix(heads * q_head, hidden, 0))
    out += [TpMatrix(lora + rope, hidden), TpMatrix(heads * (nope + attn.v_head_dim), lora, 0)]
    return tuple(out)


def tp_divides_kv_heads(attn: AttentionSpec, tp: int) -> bool:
    """Keys and values are made per query head from the latent: the query-head rule covers them."""
    return True

