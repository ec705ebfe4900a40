"""Context-parallel attention buffers of Transformer Engine, per ``--cp-comm-type``.

Megatron runs context parallelism through TE's ``DotProductAttention`` (transformer_engine/pytorch/
attention/dot_product_attention/context_parallel.py). What each implementation saves for the
backward has the numel of what attention without CP saves on the local ``s / cp`` tokens, so the
kept activations memplan prices do not change:

* ``p2p`` (``AttnFuncWithCPAndKVP2P``): q, the last K/V received in the ring (as large as the local
  K/V), the output and one log-sum-exp;
* ``allgather`` (``AttnFuncWithCPAndKVAllGather``): the local q, k, v, the output and the two
  half-sequence log-sum-exps;
* ``a2a`` (``AttnFuncWithCPAndQKVOA2A``): q, k, v after the all-to-all (full sequence, ``h / cp``
  heads: the same numel), the output before its all-to-all back and the log-sum-exp.

What differs is the backward's working set, beyond the gradients of q, k, v that attention
without CP produces (memplan's generic backward transient), with Q, K, V, O the bytes of the local
query, key, value and output tensors and KV = K + V:

* ``p2p``: a dq accumulator (Q) and two double buffers ``[kv, dkv]`` for the ring (4 KV);
* ``allgather``: dq (Q), the re-gathered k and v (cp KV), full-sequence dk/dv accumulators (cp KV)
  and, while they are reordered, a copy of dk (cp K) before the reduce-scatter;
* ``a2a``: the incoming output gradient after its all-to-all (O) and the dq/dk/dv made before the
  all-to-all back (Q + KV);
* ``a2a+p2p``: both (the p2p ring over the outer group keeps the local numel).

The forward's per-step buffers (the ring's K/V copies, per-step outputs and log-sum-exps; the
all-gathered K/V) are freed when the attention's forward returns and are not a candidate peak.
Known limitations: FP8 dot-product attention (``--fp8-dot-product-attention``) keeps its buffers in
other dtypes and is not priced; THD (packed) layouts are priced as BSHD.
"""

from __future__ import annotations

from memplan.model.spec import AttentionSpec


def cp_backward_extra_bytes(attn: AttentionSpec, comm_type: str, *, cp: int, tokens: int, tp: int,
                            act_bytes: int) -> int:
    """Bytes the backward of one attention core adds under context parallelism (0 when ``cp`` is 1).

    ``tokens``: this rank's tokens of one micro-batch (``s / cp * b``); heads divide by ``tp``.
    """
    if cp == 1:
        return 0
    heads, kv_heads = attn.num_heads // tp, max(1, attn.num_kv_heads // tp)
    q = tokens * heads * attn.head_dim * act_bytes
    k = tokens * kv_heads * attn.head_dim * act_bytes
    kv = k + tokens * kv_heads * attn.v_head_dim * act_bytes
    out = tokens * heads * attn.v_head_dim * act_bytes
    p2p = q + 4 * kv
    a2a = out + q + kv
    by_type = {"p2p": p2p, "allgather": q + 2 * cp * kv + cp * k, "a2a": a2a, "a2a+p2p": a2a + p2p}
    return by_type[comm_type]


def describe(comm_types: tuple[str, ...], cp: int) -> str:
    """The assumption line of context parallelism."""
    kinds = "/".join(dict.fromkeys(comm_types))
    return (f"context parallelism {cp} ({kinds}, Transformer Engine): each rank keeps the attention tensors of its "
            f"s/{cp} tokens (what TE saves has that numel for every comm type); the attention backward adds TE's CP "
            "buffers (p2p: dq accumulator + 2 x [kv, dkv] ring buffers; allgather: re-gathered k/v, full-sequence "
            "dk/dv and a reordered copy; a2a: all-to-all copies of dout and dq/dk/dv)")
