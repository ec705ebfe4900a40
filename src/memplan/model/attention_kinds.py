"""Attention kinds: what each kind of self-attention means to memplan, in one registry.

A layer's :class:`~memplan.model.spec.AttentionSpec` names its kind (``mha`` or ``mla``); grouped
keys and values (fewer kv heads than query heads) make an ``mha`` layer grouped-query attention.
:func:`attention_kind` resolves a spec to its :class:`AttentionKind` entry, and every other module
asks the entry (its facts and its maths: parameters, tensors, linear modules, 2-D weights, TP rule)
instead of comparing kind names; a reader builds a spec with an entry's :attr:`~AttentionKind.spec_kind`.
Adding a kind is one entry here, a module of its maths (as :mod:`memplan.model.attention_dense` and
:mod:`memplan.model.attention_latent`), and its tests.

A sliding window (``AttentionSpec.sliding_window``) is not a kind: it bounds the keys any kind
attends to, and the estimator reads it where a mask or the key length depends on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from memplan.errors import ModelConfigError
from memplan.frozen import frozen_dataclass
from memplan.model import attention_dense, attention_latent
from memplan.model.param_groups import ParamGroups, TpMatrix

if TYPE_CHECKING:  # annotations only: spec imports this module to check its kind
    from memplan.model.spec import AttentionSpec

__all__ = ["ATTENTION_KINDS", "GQA", "MHA", "MLA", "SPEC_KINDS", "AttentionKind", "attention_kind"]

#: ``(name, in_features, out_features, bias)`` of one linear module, relative to its layer.
Linear = tuple[str, int, int, bool]


@frozen_dataclass
class AttentionKind:
    """One kind of self-attention: the facts the estimator prices it by and its maths."""

    name: str
    description: str
    #: The word ``AttentionSpec.kind`` carries for it (``gqa`` is an ``mha`` spec with fewer kv heads).
    spec_kind: str
    #: Weights of one block grouped by sharding (projections, q/k and latent norms; not the pre-norm).
    params: Callable[[AttentionSpec, int], ParamGroups]
    #: Parameter tensors of one block (what per-tensor optimizer state counts).
    tensors: Callable[[AttentionSpec], int]
    #: The block's linear modules as transformers names them, ``(hidden) -> [(name, in, out, bias)]``.
    linears: Callable[[AttentionSpec, int], list[Linear]]
    #: 1-D parameters of the block besides q/k norms, ``[(parameter name, numel)]`` (replicated, not GEMM
    #: weights): MLA's latent norms, attention sinks.
    extra_norms: Callable[[AttentionSpec], list[tuple[str, int]]]
    #: Sizes of the column-parallel q/k/v biases (1-D tensors split by TP).
    qkv_bias_sizes: Callable[[AttentionSpec], tuple[int, ...]]
    #: The block's 2-D weights as Megatron-LM holds them under tensor parallelism.
    matrices: Callable[[AttentionSpec, int], tuple[TpMatrix, ...]]
    #: Weights of the up-projections ``--recompute-modules mla_up_proj`` runs again (0: none).
    up_projection_numel: Callable[[AttentionSpec, int], int]
    #: Whether a TP size keeps whole key/value heads on every rank.
    tp_divides_kv_heads: Callable[[AttentionSpec, int], bool]
    #: Spec fields that must be positive integers for this kind, and those that may also be None.
    required_fields: tuple[str, ...] = ()
    optional_fields: tuple[str, ...] = ()
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

    def extra_norm_numel(self, attn: AttentionSpec) -> int:
        """Elements of :attr:`extra_norms`."""
        return sum(numel for _, numel in self.extra_norms(attn))


def _dense(name: str, description: str, *, grouped_kv: bool) -> AttentionKind:
    d = attention_dense
    return AttentionKind(name=name, description=description, spec_kind="mha", grouped_kv=grouped_kv,
                         params=d.params, tensors=d.tensors, linears=d.linears, extra_norms=d.extra_norms,
                         qkv_bias_sizes=d.qkv_bias_sizes, matrices=d.matrices,
                         up_projection_numel=d.up_projection_numel, tp_divides_kv_heads=d.tp_divides_kv_heads)


MHA = _dense("mha", "multi-head attention: as many key/value heads as query heads", grouped_kv=False)
GQA = _dense("gqa", "grouped-query attention: key/value heads shared by groups of query heads "
                    "(one: multi-query)", grouped_kv=True)
_l = attention_latent
MLA = AttentionKind(name="mla", description="multi-head latent attention (DeepSeek-V2/V3): queries and "
                                            "keys/values up-projected from low-rank latents, a decoupled RoPE part",
                    spec_kind="mla", params=_l.params, tensors=_l.tensors, linears=_l.linears,
                    extra_norms=_l.extra_norms, qkv_bias_sizes=_l.qkv_bias_sizes, matrices=_l.matrices,
                    up_projection_numel=_l.up_projection_numel, tp_divides_kv_heads=_l.tp_divides_kv_heads,
                    required_fields=("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim"),
                    optional_fields=("q_lora_rank",),
                    latent=True, separate_input_norm=True, full_head_rope=False, per_op_sac=False)

ATTENTION_KINDS: dict[str, AttentionKind] = {k.name: k for k in (MHA, GQA, MLA)}
#: The words ``AttentionSpec.kind`` may carry.
SPEC_KINDS: tuple[str, ...] = tuple(dict.fromkeys(k.spec_kind for k in ATTENTION_KINDS.values()))


def attention_kind(attn: AttentionSpec) -> AttentionKind:
    """The registry entry of one layer's attention."""
    if attn.kind not in SPEC_KINDS:
        raise ModelConfigError("attention.kind", f"must be one of {', '.join(SPEC_KINDS)}", attn.kind)
    kind = ATTENTION_KINDS[attn.kind]
    if kind is MHA and attn.num_kv_heads < attn.num_heads:
        return GQA
    return kind
