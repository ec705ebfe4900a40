"""Megatron's fine-grained selective recompute (``--recompute-granularity selective
--recompute-modules ...``): which saved tensors each sub-module's checkpoint drops.

Every activation term carries a *site* (:attr:`memplan.estimate.activations.Term.site`): the part
of a Megatron layer (Transformer Engine layer spec) that saves it. A module's checkpoint keeps its
own inputs and drops what its inside saves (megatron/core/transformer, commit d98e8a6):

* ``core_attn`` — the attention core (scores, softmax, dropout; ``attention.py``): the ``core``
  recompute class, exactly as ``--recompute selective`` has always meant;
* ``layernorm`` — ``input_layernorm`` and ``pre_mlp_layernorm`` run under
  ``CheckpointWithoutOutput`` (``transformer_layer.py``): each norm's input stays, its output is
  discarded once the next block has run. The TE spec fuses those norms into ``linear_qkv`` and
  ``linear_fc1`` (``IdentityOp``), so only MLA's input norm and MoE layers' pre-MLP norm are
  separate modules that this reaches; in an eager (Hugging Face) layer every norm is one, and what
  it saves inside goes too, but its output only where the GEMMs save it as is (not autocast's
  copies; :class:`~memplan.estimate.activations.NormSites`);
* ``mla_up_proj`` — MLA's q/kv up-projections and RoPE under ``CheckpointWithoutOutput``
  (``multi_latent_attention.py``): the latents stay, the latent norms' outputs and q, k, v go;
* ``mlp`` — the dense MLP under ``tensor_parallel.checkpoint`` with its input kept: the fused
  norm's output, fc1's output and the activation's output go (MoE layers: no effect);
* ``moe`` — the whole MoE layer checkpointed (``moe_layer.py``): only its input (the pre-MLP norm's
  output) stays; router, dispatch, experts, combine and shared experts go;
* ``moe_act`` — the grouped experts' activation function (``experts.py``): its output (fc2's input)
  goes, fc1's output stays;
* ``shared_experts`` — the shared experts checkpointed on the MoE layer's input.

The dropped tensors are made again during the layer's backward: the attention block's (core,
q/k/v, input norm) before the attention backward, the MLP block's before the MLP backward. The
larger of the two is held on top of the layer's saved tensors at its backward.
"""

from __future__ import annotations

from collections.abc import Iterable

from memplan.estimate.activations import NORM_COMPUTE_BYTES, ActivationShape, Term, layer_terms
from memplan.estimate.terms import TermRole
from memplan.model.attention_kinds import attention_kind
from memplan.model.spec import LayerSpec

#: Sites each ``--recompute-modules`` choice drops (``core`` is the ``core`` recompute class).
SITES_DROPPED_BY: dict[str, frozenset[str]] = {
    "core_attn": frozenset({"core"}),
    "layernorm": frozenset({"input_norm", "pre_mlp_norm", "mlp_norm_out"}),
    "mla_up_proj": frozenset({"mla_up"}),
    "mlp": frozenset({"mlp", "mlp_norm_out"}),
    "moe": frozenset({"moe", "moe_act", "shared_experts"}),
    "moe_act": frozenset({"moe_act"}),
    "shared_experts": frozenset({"shared_experts"}),
}
#: Sites recomputed at the attention block's backward (the others at the MLP block's).
ATTENTION_SITES = frozenset({"core", "input_norm", "mla_up"})


def term_site(term: Term) -> str:
    """The site of ``term``: its own tag, or ``core`` for the attention core's terms."""
    return "core" if term.keep == "core" else term.site


def dropped_sites(modules: Iterable[str]) -> frozenset[str]:
    """Every site the checkpoints of ``modules`` drop."""
    return frozenset().union(*(SITES_DROPPED_BY[name] for name in modules))


def recomputed_peak(sized: Iterable[tuple[int, str]], dropped: frozenset[str]) -> int:
    """Bytes made again at the worst point of a layer's backward: the larger of the attention
    block's and the MLP block's dropped terms (``sized``: (bytes on one rank, site) pairs)."""
    attention = mlp = 0
    for size, site in sized:
        if site in dropped:
            if site in ATTENTION_SITES:
                attention += size
            else:
                mlp += size
    return max(attention, mlp)


def checkpoint_input_terms(layer: LayerSpec, shape: ActivationShape, modules: Iterable[str]) -> list[Term]:
    """What a sub-module checkpoint keeps as its inputs beyond the terms it leaves in place, on a layer of
    eager (Hugging Face) modules, where every norm is its own module outside the checkpointed block.

    * ``mlp`` / ``moe``: the block's input is the pre-MLP norm's output in the residual stream's dtype,
      kept by the checkpoint instead of the 16-bit copies its GEMMs would save (dense: the norm-output
      terms are dropped with the MLP; MoE: the pre-MLP norm's 16-bit term stays, the excess is added);
    * ``core_attn``: the attention function's inputs; under autocast RoPE returns q and k in the
      residual dtype (fp32 x fp32 tables), which the checkpoint keeps instead of SDPA's 16-bit copies;
    * ``mla_up_proj``: the q and kv latents (transformers' eager latent norms keep fp32 copies of them
      instead, which go with the stretch).

    Megatron's Transformer Engine layers fuse the norms into the GEMMs (no separate input): nothing.
    Each term's site is the checkpoint keeping it (``mlp``, ``moe``, ``core``).
    """
    if shape.kernels != "eager":
        return []
    names = set(modules)
    sbh = shape.seq * shape.micro_batch * shape.hidden
    excess = shape.residual_bytes - shape.act_bytes
    terms: list[Term] = []
    # ``layernorm`` discards the pre-MLP norm's output, which these checkpoints keep as their input.
    discarded = "layernorm" in names
    if "mlp" in names and layer.moe is None and not discarded:
        terms.append(Term("mlp checkpoint input (pre-MLP norm output)", shape.residual_bytes * sbh, "sp", "input",
                           site="mlp"))
    if "moe" in names and layer.moe is not None and excess > 0 and not discarded:
        # under autocast the router's 16-bit copy goes with the block (site moe); the fp32 output stays
        terms.append(Term("MoE checkpoint input (pre-MLP norm output)", shape.residual_bytes * sbh, "sp", "input",
                           site="moe"))
    attn = layer.attention
    if "mla_up_proj" in names and attention_kind(attn).latent:
        # The stretch's inputs: the kv latent with the rope key (kv_a_proj_with_mqa's output) and the q
        # latent (q_a_proj's output; without a low-rank q, q_proj's input is the attention input, kept anyway).
        latents = (attn.kv_lora_rank or 0) + (attn.qk_rope_head_dim or 0) + (attn.q_lora_rank or 0)
        terms.append(Term("mla_up_proj checkpoint inputs (the q and kv latents)",
                          shape.act_bytes * shape.seq * shape.micro_batch * latents, "rep", "input"))
    if "core_attn" in names and excess > 0 and shape.rope and not attention_kind(attn).latent:
        width = (attn.num_heads + attn.num_kv_heads) * attn.head_dim
        terms.append(Term("attention core checkpoint inputs: q, k from RoPE in the residual dtype (beyond their "
                          "16-bit copies)", excess * shape.seq * shape.micro_batch * width, "tp", "input"))
    return terms


def recomputed_only_terms(layer: LayerSpec, shape: ActivationShape, modules: Iterable[str]) -> list[Term]:
    """Tensors a checkpoint makes again in the backward that no term of the layer stands for.

    * ``layernorm`` on an eager RMSNorm with a 16-bit input: without recompute the norm saves its fp32
      copy and its normalized tensor in the input dtype, the latter priced by the ``norm input`` term
      (same bytes, :func:`~memplan.estimate.activations.eager_norm_terms`); under the checkpoint the
      ``norm input`` term is the input itself, kept, and the normalized tensor comes back with the
      recompute, once per norm (the input norm at the attention backward, the pre-MLP norm at the MLP's);
    * ``layernorm`` on an eager norm under autocast: the norm's output in the residual dtype (its GEMMs save their
      own 16-bit copies of it, so no term counts it) comes back with the recompute and lives until the norm's
      backward, once per norm (under ``mlp`` too the pre-MLP norm's is the MLP checkpoint's input, which the
      forward discarded);
    * ``core_attn`` on an eager core with grouped keys and values: the checkpoint keeps its inputs (q, k, v,
      the KV heads' keys and values among them) and ``repeat_kv`` makes its copies for every query head
      again, the KV heads' share too, which the ``repeat_kv copies`` term (the extra heads' share: without
      recompute no other tensor holds the rotated keys and the values) leaves out.
    """
    names = set(modules)
    terms: list[Term] = []
    if ("layernorm" in names and shape.kernels == "eager" and shape.norm == "rmsnorm"
            and shape.residual_bytes < NORM_COMPUTE_BYTES):
        sbh = shape.seq * shape.micro_batch * shape.hidden
        terms += [Term(f"{prefix} norm normalized input, recomputed", shape.residual_bytes * sbh, "sp", "body",
                       site=site, role=TermRole.NORM_NORMALIZED)
                  for prefix, site in (("attention", "input_norm"), ("mlp", "pre_mlp_norm"))]
    if "layernorm" in names and shape.kernels == "eager" and shape.autocast:
        sbh = shape.seq * shape.micro_batch * shape.hidden
        terms += [Term(f"{prefix} norm output in the residual dtype, recomputed", shape.residual_bytes * sbh, "sp",
                       "body", site=site) for prefix, site in (("attention", "input_norm"), ("mlp", "pre_mlp_norm"))]
    attn = layer.attention
    if "core_attn" in names and attn is not None and attn.num_heads > attn.num_kv_heads:
        extra = attn.num_heads - attn.num_kv_heads
        terms += [Term("keys and values of the KV heads, repeated again (repeat_kv in the recomputed core)",
                       t.bytes * attn.num_kv_heads // extra, t.region, "core", site="core")
                  for t in layer_terms(layer, shape) if t.role is TermRole.REPEATED_KV]
    return terms


def ineffective_modules(modules: Iterable[str], sites: Iterable[str]) -> tuple[str, ...]:
    """``modules`` that drop nothing the model saves (moe on a dense model, layernorm where TE
    fuses every norm into a GEMM): no-ops, as in Megatron."""
    present = set(sites)
    return tuple(name for name in modules if not SITES_DROPPED_BY[name] & present)


#: What each module's checkpoint makes again, for the estimate's assumptions.
RECOMPUTES = {
    "core_attn": "the attention core (scores, softmax, dropout)",
    "layernorm": "the separate norms (under Transformer Engine MLA's input norm and MoE layers' pre-MLP norm; "
                 "in an eager layer every input and pre-MLP norm): what they save and their outputs where the "
                 "next GEMMs save them as is",
    "mla_up_proj": "MLA's up-projections and RoPE (q, k, v and the latent norms' outputs)",
    "mlp": "the dense MLP from its input",
    "moe": "the whole MoE layer from its input",
    "moe_act": "the experts' activation output (and an eager gated activation's act(gate))",
    "shared_experts": "the shared experts from their input",
}


def describe(modules: tuple[str, ...], sites: Iterable[str]) -> str:
    """The assumption line for Megatron's selective recompute of ``modules`` on a model whose
    terms have ``sites``."""
    if not modules:
        return "selective recompute with no --recompute-modules: nothing is recomputed"
    text = (f"selective recompute (Megatron --recompute-modules {' '.join(modules)}): recomputed are "
            + "; ".join(RECOMPUTES[name] for name in modules)
            + "; their inputs are kept, and the larger of the attention block's and the MLP block's recomputed "
            "tensors is made again during each layer's backward")
    idle = ineffective_modules(modules, sites)
    if idle:
        text += (f"; {', '.join(idle)}: no effect on this model (it has no such separately recomputed part under "
                 "Transformer Engine's layer spec; Megatron accepts the name and does nothing)")
    return text
