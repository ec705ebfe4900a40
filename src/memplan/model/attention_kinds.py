"""Attention kinds: what each kind of self-attention means to the estimator, in one registry.

A layer's :class:`~memplan.model.spec.AttentionSpec` names its kind (``mha`` or ``mla``); grouped
keys and values (fewer kv heads than query heads) make an ``mha`` layer grouped-query attention.
:func:`attention_kind` resolves a spec to its :class:`AttentionKind` entry, and the estimator asks
the entry's fields instead of comparing kind names. Adding a kind is one entry here (plus its
parameter count in :mod:`memplan.model.params`) and its tests.

A sliding window (``AttentionSpec.sliding_window``) is not a kind: it bounds the keys any kind
attends to, and the estimator reads it where a mask or the key length depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.model.spec import AttentionSpec


@dataclass(frozen=True)
class AttentionKind:
    """One kind of self-attention and the facts the estimator prices it by."""

    name: str
    description: str
    #: Queries and keys/values are up-projected from compressed latents (the q and kv "down" and "up"
    #: projections: Megatron's ``mla_up_proj`` recompute site; transformers' DeepSeek attention).
    latent: bool = False
    #: Keys and values have fewer heads than queries and are repeated per query head where a kernel
    #: needs them so (transformers ``repeat_kv``).
    grouped_kv: bool = False
    #: The pre-attention norm is a module of its own rather than fused into the qkv projection
    #: (Megatron's TE layer spec fuses it except under MLA, gpt_layer_specs.py).
    separate_input_norm: bool = False
    #: The RoPE cos/sin tables span the whole head (a decoupled rope part keeps its own).
    full_head_rope: bool = True
    #: torchtitan's per-op selective checkpointing lists this kind's ops (memplan.estimate.sac).
    per_op_sac: bool = True

    def input_projections(self, attn: AttentionSpec) -> int:
        """Projections reading the input norm's output: q, k, v apart (1 when fused); under latent
        attention the q and kv down-projections."""
        if self.latent:
            return 2
        return 1 if attn.fused_qkv else 3


MHA = AttentionKind(name="mha", description="multi-head attention: as many key/value heads as query heads")
GQA = AttentionKind(name="gqa", description="grouped-query attention: key/value heads shared by groups of query "
                                            "heads (one: multi-query)", grouped_kv=True)
MLA = AttentionKind(name="mla", description="multi-head latent attention (DeepSeek-V2/V3): queries and keys/values "
                                            "up-projected from low-rank latents, a decoupled RoPE part",
                    latent=True, separate_input_norm=True, full_head_rope=False, per_op_sac=False)

ATTENTION_KINDS: dict[str, AttentionKind] = {k.name: k for k in (MHA, GQA, MLA)}


def attention_kind(attn: AttentionSpec) -> AttentionKind:
    """The registry entry of one layer's attention."""
    if attn.kind == "mha":
        return GQA if attn.num_kv_heads < attn.num_heads else MHA
    return ATTENTION_KINDS[attn.kind]
