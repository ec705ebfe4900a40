"""Partial freezing: what autograd saves when only some parameters need gradients.

Autograd saves a tensor for the backward only when the gradient it serves is needed: a linear
saves its input only when its weight requires grad, a norm its normalized input only when its weight
does, and an operation whose inputs all need no gradient (and that owns no trainable weight) records
nothing at all. Whether a tensor needs a gradient flows forward through the model, so this module
walks the decoder blocks in order (the attention block, then the MLP/MoE block of each layer) and
gives each its :class:`BlockFlow`:

* the embedding's output needs a gradient when the embedding (or a tied head, the same weight)
  trains, or under checkpointing (Hugging Face's ``enable_input_require_grads`` makes the checkpointed
  input require grad);
* a block's output needs a gradient when its input does, or when it holds a trainable weight (a
  trained linear or norm, an adapter, a ``modules_to_save`` copy);
* a block whose output needs no gradient saves nothing; one whose input needs none keeps nothing for
  its input's gradient (its pre-norm's fp32 copy and ``1/rms``);
* a frozen linear keeps no input; a trained norm behind frozen linears keeps its normalized input.

:func:`layer_flows` is a pure function of the model and the fine-tuning job (memoised); the final
norm and head read :func:`root_flow`.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from memplan.estimate.activations import (NORM_COMPUTE_BYTES, UNFUSED_ATTENTION, ActivationShape, Term,
                                         layer_terms_by_block, norm_keeps_input)
from memplan.estimate.moe_freeze import is_routed_experts, is_sinks, moe_term_kept
from memplan.estimate.terms import NORM_TERMS, NORMALIZED, TermRole
from memplan.frozen import frozen_dataclass
from memplan.job import FineTuning
from memplan.model.linears import ParamTensor, model_linears, model_parameters
from memplan.model.attention_kinds import attention_kind
from memplan.model.spec import AttentionSpec, LayerSpec, ModelSpec
from memplan.peft.params import finetune_params, saved_modules, trained_modules

__all__ = ["BlockFlow", "LayerFlow", "RootFlow", "after_attention_core", "any_attention_saves", "block_of", "block_terms", "is_norm", "layer_flows",
           "reads_a_gradient", "root_flow", "trained_norm_copies", "uncopied_trained_numel", "under",
           "unkeyed_query_terms", "core_factor_terms", "qk_norm_share_terms"]

#: Per-layer norms that belong to the attention block although their name is not under it: the
#: pre-attention norm, and Gemma 2's post-attention norm (its MLP has a ``pre_feedforward_layernorm``).
_ATTENTION_NORMS = frozenset({"input_layernorm", "ln_1", "attention_norm"})
_ATTENTION_WORDS = ("attn", "attention")
#: A block's output projections: an adapter there alone makes nothing before it need a gradient.
_BLOCK_OUTPUT_LINEARS = frozenset({"o_proj", "dense", "c_proj", "down_proj", "dense_4h_to_h", "w2", "out_proj"})


@frozen_dataclass
class BlockFlow:
    """One block (attention, or MLP/MoE) of a decoder layer under partial freezing."""

    #: The block's input requires grad (an earlier trainable weight, a trained embedding, checkpointing).
    input_grad: bool = True
    #: Some linear weight of the block trains fully (its GEMM inputs are saved).
    linears_train: bool = True
    #: A norm weight of the block trains (its normalized input is saved).
    norm_trains: bool = True
    #: An adapter or ``modules_to_save`` copy sits in the block.
    adapted: bool = False
    #: Such an adapter reads the block's input (q/k/v, gate/up): what follows it needs a gradient; an
    #: adapter on the block's output projection alone leaves the rest of the block without one.
    adapted_input: bool = False
    #: An MoE block whose only trained weights are its routed experts (router and shared expert frozen).
    only_experts: bool = False
    #: The attention's keys need a gradient: the block's input or norm does, or a linear making the keys trains
    #: or carries an adapter (eager attention's ``q @ k^T`` saves q only for the keys' gradient).
    keys_grad: bool = True
    #: The attention's queries need a gradient (as ``keys_grad``, for the linears making the queries): ``q @ k^T``
    #: saves the keys only for the queries' gradient.
    queries_grad: bool = True
    #: The attention's values need a gradient (as ``keys_grad``, for the linears making the values): the PV matmul
    #: saves the probabilities only for the values' gradient.
    values_grad: bool = True
    #: The block's output projection (``o_proj``, a dense MLP's ``down_proj``) trains fully or is copied: it saves
    #: its input (False only for a frozen one of a known name).
    output_linear_trains: bool = True
    #: An MoE block whose routed experts are frozen.
    frozen_experts: bool = False
    #: MLA's latents (``q``, ``kv``) whose down-projection trains or carries an adapter or copy.
    latents: frozenset[str] = frozenset()
    #: The block's only fully trained linears are its output projection (``o_proj``, a dense MLP's ``down_proj``):
    #: on an input needing no gradient, nothing before it needs one (it saves its own input alone).
    output_linear_only: bool = False

    @property
    def inner_grad(self) -> bool:
        """Something before the block's output projection needs a gradient (its input or norm does, an adapter or
        copy reads its input, or a linear other than the output projection trains)."""
        return (self.input_grad or self.norm_trains or self.adapted_input
                or (self.linears_train and not self.output_linear_only))

    def latent_grad(self, role: TermRole) -> bool:
        """An MLA latent norm term (``role``) is kept: its latent needs a gradient (the block's input or a
        norm does, or the latent's down-projection trains or is adapted); a frozen latent norm on a latent
        needing none saves nothing (transformers' eager RMSNorm under ``no`` gradient)."""
        name = {TermRole.Q_LATENT_NORM: "q", TermRole.KV_LATENT_NORM: "kv"}.get(role)
        return name is None or self.input_grad or self.norm_trains or name in self.latents

    @property
    def routing_grad(self) -> bool:
        """The routing weights need a gradient: something before or in the router trains (an MoE block
        that trains only its experts, on an input needing none, keeps none of the router's tensors, nor
        the expert outputs the weighted combine would keep for them)."""
        return self.input_grad or self.norm_trains or self.adapted or not self.only_experts

    @property
    def experts_save(self) -> bool:
        """The routed experts record their tensors: they train, or their input (the norm's output) needs a
        gradient (frozen experts on an input needing none, under a trained router, keep nothing of theirs:
        only the outputs the weighted combine keeps for the routing weights' gradient)."""
        return self.input_grad or self.norm_trains or self.adapted or not self.frozen_experts

    @property
    def saves(self) -> bool:
        """Anything in the block records tensors for the backward."""
        return self.input_grad or self.linears_train or self.norm_trains or self.adapted

    @property
    def frozen(self) -> bool:
        """Neither its linears nor its norm train: only what the input's gradient needs is saved."""
        return not (self.linears_train or self.norm_trains)


@frozen_dataclass
class LayerFlow:
    attention: BlockFlow
    mlp: BlockFlow
    #: The layer's routed experts (HF's grouped expert weights) train fully, in the job's precision.
    trained_experts: bool = False
    #: The layer's attention sinks (gpt-oss's ``sinks`` parameter) train fully, in the job's precision.
    trained_sinks: bool = False

    @property
    def saves(self) -> bool:
        return self.attention.saves or self.mlp.saves

    @property
    def output_grad(self) -> bool:
        return self.saves


@frozen_dataclass
class RootFlow:
    """The embedding, final norm and head."""

    #: The embedding (or a tied head, the same weight) trains: the first layer's input needs a gradient.
    embedding_trains: bool
    #: The final norm's input needs a gradient (something before it trains).
    norm_input_grad: bool
    #: The final norm's weight trains (it keeps its normalized input).
    norm_trains: bool
    #: The head trains (fully, as a copy, or through an adapter): it keeps its input.
    head_trains: bool
    #: The embedding weight itself trains fully (stored in the job's precision, so its output is not in
    #: the 16-bit base's dtype); an adapter or a ``modules_to_save`` copy leaves it in the base's dtype.
    embedding_trained_fully: bool = False


def block_of(name: str, layer_names: frozenset[str]) -> str:
    """'attention' or 'mlp' for a parameter's module name inside a decoder layer."""
    last = name.rpartition(".")[2]
    gemma_style = any(n.endswith("pre_feedforward_layernorm") for n in layer_names)
    if last in _ATTENTION_NORMS or (gemma_style and last == "post_attention_layernorm"):
        return "attention"
    parts = name.split(".")
    if any(w in p for p in parts for w in _ATTENTION_WORDS) and last not in ("post_attention_layernorm",):
        return "attention"
    return "mlp"


def after_attention_core(name: str) -> bool:
    """Whether a decoder layer's parameter ``name`` (relative to the layer) gets its gradient after the attention
    core's backward: the pre-attention norm's, and the attention module's other than its output projection's
    (Llama's ``self_attn.q_proj``, GPT-2's ``attn.c_attn``, GPT-NeoX's ``attention.query_key_value``, the sinks,
    q/k norms); a norm directly under the layer that is not a pre-attention norm (``post_attention_layernorm``,
    GPT-2's ``ln_2``) and the MLP's come before it."""
    parts = name.split(".")[:-1] or name.split(".")
    if parts[0] in _ATTENTION_NORMS:
        return True
    return (any(w in parts[0] for w in _ATTENTION_WORDS) and not is_norm(parts[0])
            and parts[-1] not in _BLOCK_OUTPUT_LINEARS)


def is_norm(module: str) -> bool:
    """A norm module (its last name: ``*norm*``, GPT-2's ``ln_*``)."""
    last = module.rpartition(".")[2]
    return "norm" in last or last.startswith("ln")


def under(module: str, names: tuple[str, ...]) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


@frozen_dataclass
class _Trainable:
    """Per slot (decoder layer or root) and block: trained linears, trained norms, adapted."""

    linears: frozenset[tuple[int | None, str]]
    norms: frozenset[tuple[int | None, str]]
    adapted: frozenset[tuple[int | None, str]]
    #: Blocks with an adapter (or copy) on a linear reading the block's input.
    adapted_input: frozenset[tuple[int | None, str]]
    #: Root modules trained fully or through an adapter (the weight itself gets a gradient).
    root_modules: frozenset[str]
    #: Root modules with a ``modules_to_save`` copy.
    root_copies: frozenset[str]
    #: Root modules trained fully (their weights follow the job's precision, fp32 under mixed precision).
    root_full: frozenset[str] = frozenset()
    #: Layers whose routed experts (the ``experts`` module's grouped weights) train fully.
    experts: frozenset[int] = frozenset()
    #: Layers whose attention sinks train fully.
    sinks: frozenset[int] = frozenset()
    #: Layers where an MLP/MoE-block weight other than the routed experts and the norms trains.
    other_mlp: frozenset[int] = frozenset()
    #: Layers where a linear making the attention's keys trains, is copied or carries an adapter.
    keys: frozenset[int] = frozenset()
    #: ... the attention's queries, and its values.
    queries: frozenset[int] = frozenset()
    values: frozenset[int] = frozenset()
    #: Blocks whose output projection (a name in ``_BLOCK_OUTPUT_LINEARS``) is frozen and not copied.
    frozen_outputs: frozenset[tuple[int | None, str]] = frozenset()
    #: (layer, ``q`` / ``kv``): an MLA down-projection that trains, is copied or carries an adapter.
    latents: frozenset[tuple[int, str]] = frozenset()
    #: Blocks with a fully trained linear that is not their output projection.
    inner_linears: frozenset[tuple[int | None, str]] = frozenset()


def _mark_attention_inputs(module: str, layer: int, factors: dict[str, set[int]], latents: set[tuple[int, str]]
                           ) -> None:
    """Record that ``module`` (trained, copied or adapted) gives the layer's keys, queries or values (``factors``
    by name) or an MLA latent a gradient."""
    name = module.rpartition(".")[2]
    for factor, linears in _FACTOR_LINEARS.items():
        if name in linears:
            factors[factor].add(layer)
    if name in _LATENT_DOWN:
        latents.add((layer, _LATENT_DOWN[name]))


@lru_cache(maxsize=64)
def _module_names_by_layer(params: tuple[ParamTensor, ...]) -> dict[int | None, frozenset[str]]:
    """The modules of each layer (None: outside the layers) that hold the model's parameters."""
    by_layer: dict[int | None, set[str]] = {}
    for p in params:
        by_layer.setdefault(p.layer, set()).add(p.module)
    return {k: frozenset(v) for k, v in by_layer.items()}


def _mark_adapters(model: ModelSpec, ft: FineTuning, names: dict[int | None, frozenset[str]],
                   sets: tuple[set[str], set[tuple[int | None, str]], set[tuple[int | None, str]]],
                   factors: dict[str, set[int]], latents: set[tuple[int, str]]) -> None:
    """Record the adapters' modules: ``sets`` (root modules, adapted blocks, blocks adapted at their input)."""
    root, adapted, adapted_input = sets
    for m in (a.module for a in finetune_params(model, ft).adapters):
        if m.layer is None:
            root.add(m.name)
            continue
        key = (m.layer, block_of(m.name, names[m.layer]))
        adapted.add(key)
        _mark_attention_inputs(m.name, m.layer, factors, latents)
        if m.name.rpartition(".")[2] not in _BLOCK_OUTPUT_LINEARS:
            adapted_input.add(key)


def _trainable(model: ModelSpec, ft: FineTuning) -> _Trainable:
    everything = ft.resolved_trainable == "all"
    full = trained_modules(model, ft)
    copies = saved_modules(model, ft)
    params = model_parameters(model)
    names = _module_names_by_layer(params)
    linears: set[tuple[int | None, str]] = set()
    norms: set[tuple[int | None, str]] = set()
    adapted: set[tuple[int | None, str]] = set()
    adapted_input: set[tuple[int | None, str]] = set()
    root: set[str] = set()
    root_copies: set[str] = set()
    root_full: set[str] = set()
    experts: set[int] = set()
    sinks: set[int] = set()
    other_mlp: set[int] = set()
    factors: dict[str, set[int]] = {"keys": set(), "queries": set(), "values": set()}
    latents: set[tuple[int, str]] = set()
    inner: set[tuple[int | None, str]] = set()
    frozen_outputs: set[tuple[int | None, str]] = set()
    for p in params:
        trains = everything or under(p.module, full)
        copied = under(p.module, copies)
        if trains and p.layer is not None and is_routed_experts(p.module):
            experts.add(p.layer)
        if trains and p.layer is not None and is_sinks(p.name):
            sinks.add(p.layer)
        if (trains and p.layer is not None and not is_routed_experts(p.module) and not is_norm(p.module)
                and block_of(p.module, names[p.layer]) == "mlp"):
            other_mlp.add(p.layer)
        if p.layer is None:
            if trains:
                root.add(p.module)
                root_full.add(p.module)
            if copied:
                root_copies.add(p.module)
            continue
        key = (p.layer, block_of(p.module, names[p.layer]))
        if trains or copied:
            _mark_attention_inputs(p.module, p.layer, factors, latents)
        if trains:
            (norms if is_norm(p.module) else linears).add(key)
            if not is_norm(p.module) and p.module.rpartition(".")[2] not in _BLOCK_OUTPUT_LINEARS:
                inner.add(key)
        elif not copied and p.module.rpartition(".")[2] in _BLOCK_OUTPUT_LINEARS:
            frozen_outputs.add(key)
        if copied:
            adapted.add(key)
            adapted_input.add(key)
    _mark_adapters(model, ft, names, (root, adapted, adapted_input), factors, latents)
    root_copies.update(m for m in copies if m == "lm_head")  # a tied head's copy has its own weight
    return _Trainable(frozenset(linears), frozenset(norms), frozenset(adapted), frozenset(adapted_input),
                      frozenset(root), frozenset(root_copies), frozenset(root_full), frozenset(experts),
                      frozenset(sinks), frozenset(other_mlp), frozenset(factors["keys"]),
                      frozenset(factors["queries"]), frozenset(factors["values"]), frozenset(frozen_outputs),
                      frozenset(latents), frozenset(inner))


def _is_embedding(module: str) -> bool:
    last = module.rpartition(".")[2]
    return "emb" in last or last in ("wte", "wpe")


def _embedding_trains(model: ModelSpec, t: _Trainable) -> bool:
    """The embedding's output requires grad: its weight trains (or a tied head's, the same weight), or
    an adapter or ``modules_to_save`` copy of it does."""
    root = t.root_modules | {m for m in t.root_copies if m != "lm_head"}
    return any(_is_embedding(m) for m in root) or (model.tie_word_embeddings
                                                   and any(m.startswith("lm_head") for m in t.root_modules))


@lru_cache(maxsize=64)
def layer_flows(model: ModelSpec, ft: FineTuning, checkpointing: bool, own_layers: bool = False
                ) -> tuple[LayerFlow, ...]:
    """Each decoder layer's :class:`LayerFlow` under fine-tuning ``ft`` (``checkpointing``: the activation
    policy makes the first layer's input require grad, :attr:`~memplan.policies.ActivationPolicy.input_grads`).

    A parallel-residual layer (GPT-NeoX's ``use_parallel_residual``) feeds its MLP the layer input, not the
    attention's output: the MLP block's input needs a gradient only when the layer's does. ``own_layers``:
    the framework builds its own sequential layers whatever the family (Megatron's fused ones)."""
    t = _trainable(model, ft)
    grad = checkpointing or _embedding_trains(model, t)
    out = []
    for index in range(model.num_layers):
        layer_input_grad = grad
        blocks = []
        for block in ("attention", "mlp"):
            key = (index, block)
            moe = block == "mlp" and model.layers[index].moe is not None
            flow = BlockFlow(input_grad=grad, linears_train=key in t.linears, norm_trains=key in t.norms,
                             adapted=key in t.adapted, adapted_input=key in t.adapted_input,
                             only_experts=moe and index in t.experts and index not in t.other_mlp,
                             frozen_experts=moe and index not in t.experts,
                             keys_grad=grad or key in t.norms or index in t.keys,
                             queries_grad=grad or key in t.norms or index in t.queries,
                             values_grad=grad or key in t.norms or index in t.values,
                             output_linear_trains=key not in t.frozen_outputs,
                             latents=frozenset(n for i, n in t.latents if i == index),
                             output_linear_only=not moe and key in t.linears and key not in t.inner_linears)
            parallel = model.layers[index].parallel_residual and not own_layers
            grad = layer_input_grad if parallel and block == "attention" else flow.saves
            blocks.append(flow)
        out.append(LayerFlow(blocks[0], blocks[1], trained_experts=index in t.experts, trained_sinks=index in t.sinks))
        grad = out[-1].output_grad
    return tuple(out)


@lru_cache(maxsize=64)
def root_flow(model: ModelSpec, ft: FineTuning, checkpointing: bool) -> RootFlow:
    """The final norm's and head's part (see :class:`RootFlow`); an embedding copy (``modules_to_save``)
    makes its output need a gradient too."""
    t = _trainable(model, ft)
    flows = layer_flows(model, ft, checkpointing)
    embedding = _embedding_trains(model, t)
    before = flows[-1].output_grad if flows else (checkpointing or embedding)
    norm = any(is_norm(m) for m in t.root_modules)
    head = (any(m.startswith("lm_head") for m in t.root_modules | t.root_copies)
            or (model.tie_word_embeddings and embedding))
    full = any(_is_embedding(m) for m in t.root_full) or (
        model.tie_word_embeddings and any(m.startswith("lm_head") for m in t.root_full))
    return RootFlow(embedding_trains=embedding, norm_input_grad=before, norm_trains=norm, head_trains=head,
                    embedding_trained_fully=full)


def block_terms(terms: list[Term], shape: ActivationShape, flow: BlockFlow, *,
                gemm_inputs_kept: bool = False) -> list[Term]:
    """What one block saves under ``flow`` (its full-training ``terms`` otherwise).

    A block that saves nothing keeps nothing. Frozen linears keep no GEMM input (flash/SDPA attention
    still keeps its own output, which the output projection reads, unless it reads a copy: a
    :attr:`~memplan.estimate.terms.TermRole.KERNEL_OUTPUT` term counts the kernel's) unless ``gemm_inputs_kept``
    (bitsandbytes' 8-bit matmul saves its input in ``ctx.tensors``). A frozen pre-norm keeps no
    normalized tensor (nor Gemma's fp32 one, nor the per-head q/k norms'); a trained one behind frozen
    linears keeps it (the GEMM input's size when the term list has none of its own). A block whose input
    needs no gradient keeps nothing of its pre-norm's input (its terms of a role in
    :data:`~memplan.estimate.terms.NORM_TERMS`). An MoE block that trains only its routed experts on such
    an input keeps neither the frozen router's input and scores nor the expert outputs kept for the routing
    weights' gradient (:attr:`BlockFlow.routing_grad`); one that trains its router but not its experts keeps
    nothing the experts would save for themselves (:attr:`BlockFlow.experts_save`).
    """
    if not flow.saves or not (flow.input_grad or flow.linears_train or flow.norm_trains or flow.adapted_input):
        return []  # nothing of the base path needs a gradient (the adapters' own terms are counted apart)
    if flow.input_grad and flow.linears_train and flow.norm_trains:
        return terms
    if not flow.inner_grad:  # the output projection trains alone on an input needing no gradient: its input only
        return [t for t in terms if t.role in _OUTPUT_LINEAR_INPUTS]
    own_norm = [t for t in terms if t.role in NORM_TERMS]
    has_normalized = any(t.role in NORMALIZED for t in own_norm)
    # an fp32 normalized tensor of a 16-bit input is priced as the norm-input term plus its excess (``beyond``)
    beyond = has_normalized and shape.norm_fp32_scale and not norm_keeps_input(shape)
    # a fused kernel saves its output, the output projection's input unless that reads a copy (a term of its own)
    kernel_keeps_input = shape.attention != "eager" and not any(t.role is TermRole.KERNEL_OUTPUT for t in terms)
    out: list[Term] = []
    for t in terms:
        if not flow.latent_grad(t.role):
            continue
        mine = t.role in NORM_TERMS
        if mine and not flow.input_grad:
            out.extend(_norm_term_without_input_grad(t, flow, has_normalized, beyond))
            continue
        if flow.linears_train:
            if t.role in _OUTPUT_LINEAR_INPUTS and not flow.output_linear_trains and not (
                    gemm_inputs_kept or (kernel_keeps_input and t.role is TermRole.OUTPUT_PROJECTION_INPUT)):
                continue  # a frozen output projection keeps no input, whatever else of the block trains
            if mine and t.role is TermRole.NORM_INPUT and not flow.norm_trains:
                # a frozen norm keeps nothing for its weight's gradient: as behind frozen linears
                kept = _frozen_term(t, shape, False, False)
                out.extend([kept] if kept is not None else [])
                continue
            if moe_term_kept(t.role, routing_grad=flow.routing_grad, experts_save=flow.experts_save):
                out.append(t)
            continue
        if mine and flow.norm_trains and beyond and t.role is TermRole.NORM_INPUT:
            # the input-dtype part of the trained norm's fp32 normalized tensor, as where the input needs no gradient
            out.append(_body_term(t))
            continue
        kept = _frozen_term(t, shape, mine and flow.norm_trains and not has_normalized, gemm_inputs_kept or (
            kernel_keeps_input and t.role is TermRole.OUTPUT_PROJECTION_INPUT))
        if kept is not None:
            if t.role in NORMALIZED and not (mine and flow.norm_trains):
                continue  # kept only for a trained norm weight's gradient
            out.append(kept)
    return out


def _norm_term_without_input_grad(t: Term, flow: BlockFlow, has_normalized: bool, beyond: bool) -> list[Term]:
    """What the block's pre-norm term ``t`` keeps where nothing upstream needs a gradient: nothing for its input's; a
    trained linear keeps its input, and a trained norm (``weight * x_normed``) the normalized tensor
    (:func:`block_terms`: ``beyond``, the fp32 normalized tensor of a 16-bit input priced as the input term plus its
    excess)."""
    stand_in = flow.norm_trains and not has_normalized  # x_normed in the 16-bit input dtype
    reads = flow.linears_train and flow.routing_grad  # a trained linear (not the experts alone) reads it
    if (t.gemm_input and (reads or stand_in)) or (flow.norm_trains and t.role in NORMALIZED):
        return [t]
    if t.role is TermRole.NORM_INPUT and ((stand_in and flow.linears_train) or (beyond and flow.norm_trains)):
        # beside the GEMM input; or the input-dtype part of the trained norm's fp32 normalized tensor
        # (gpt-oss's and Gemma's ``weight * x_normed`` in fp32), kept whole though the input is not
        return [_body_term(t)]
    return []


def _body_term(t: Term) -> Term:
    """``t`` kept in the layer's body (a norm-input term standing for its part of a trained norm's normalized
    tensor, kept though the input is not)."""
    return Term(t.name, t.bytes, t.region, "body", site=t.site, role=t.role)


def unkeyed_query_terms(terms: list[Term], attn: AttentionSpec, shape: ActivationShape, flow: BlockFlow) -> list[Term]:
    """An unfused attention block whose keys need no gradient (LoRA on q_proj and v_proj where the block's
    input needs none): ``q @ k^T`` saves each factor only for the other's gradient (``matmul``'s backward), so
    q is not saved; the ``q, k, v`` term loses q's bytes. Left as is with q/k norms or MLA (their terms differ)."""
    if (flow.keys_grad or shape.attention not in UNFUSED_ATTENTION or attn.qk_norm
            or attention_kind(attn).latent):
        return terms
    q = shape.act_bytes * shape.seq * shape.micro_batch * attn.num_heads * attn.head_dim
    return [Term(f"{t.name} (no q: the keys need no gradient)", t.bytes - q, t.region, t.keep, site=t.site,
                 role=t.role) if t.role is TermRole.QKV else t for t in terms]


#: The q/k norms' terms whose bytes go with the q and k widths (rows for the 1/rms).
_QK_NORM_ROLES = frozenset({TermRole.QK_NORMS, TermRole.QK_NORMS_FP32, TermRole.QK_NORMS_RSTD})


def qk_norm_share_terms(terms: list[Term], attn: AttentionSpec, flow: BlockFlow) -> list[Term]:
    """The per-head q/k norms (Qwen3, OLMo 2, Gemma 3) where the keys or the queries need no gradient (LoRA on
    q_proj,v_proj or k_proj,v_proj where the block's input needs none, no norm of the block trained): such a norm's
    input needs no gradient and its weight is frozen, so it saves nothing (neither its fp32 input copy nor its
    1/rms); the q/k norm terms keep the other factor's share (widths for the tensors, rows for the 1/rms). A trace
    of the qwen3_moe toy (LoRA q,v, int8 base) holds in layer 0 q_norm's fp32 copy and 1/rms only."""
    if not attn.qk_norm or (flow.keys_grad and flow.queries_grad):
        return terms
    q_width, k_width = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    q_rows, k_rows = (attn.num_heads, attn.num_kv_heads) if attn.qk_norm_per_head else (1, 1)
    kept = (q_width * flow.queries_grad + k_width * flow.keys_grad, q_width + k_width)
    kept_rows = (q_rows * flow.queries_grad + k_rows * flow.keys_grad, q_rows + k_rows)
    which = "keys" if not flow.keys_grad else "queries"
    which = "keys nor queries" if not (flow.keys_grad or flow.queries_grad) else which
    out = []
    for t in terms:
        if t.role in _QK_NORM_ROLES:
            num, den = kept_rows if t.role is TermRole.QK_NORMS_RSTD else kept
            if num == 0:
                continue
            t = Term(f"{t.name} (no {which} norm: they need no gradient)", t.bytes * num // den, t.region, t.keep,
                     site=t.site, role=t.role)
        out.append(t)
    return out


def core_factor_terms(terms: list[Term], attn: AttentionSpec, shape: ActivationShape, flow: BlockFlow) -> list[Term]:
    """An unfused attention core's two matmuls where a factor needs no gradient: each saves a factor only for the
    other's gradient (``matmul``'s backward). Keys needing none: q is not saved (:func:`unkeyed_query_terms`).
    Queries needing none (DoRA/LoRA on k_proj,v_proj where the block's input needs none): ``q @ k^T`` saves no
    keys, neither the rotated k (the ``q, k, v`` term loses its bytes) nor ``repeat_kv``'s copies of them (the
    repeated term loses the keys' share). Values needing none (LoRA on q_proj,o_proj there): the PV matmul saves
    no probabilities, so the 16-bit cast of the fp32 softmax output (made for it) is not kept; the softmax keeps
    its own output for its backward. A trace of the llama toy (eager, bf16-mixed) holds in layer 0 two repeat_kv
    copies and no cast with DoRA on q_proj,o_proj, and no copy of the keys with DoRA on k_proj,v_proj."""
    terms = unkeyed_query_terms(qk_norm_share_terms(terms, attn, flow), attn, shape, flow)
    if shape.attention not in UNFUSED_ATTENTION or attention_kind(attn).latent:
        return terms
    if not flow.values_grad:
        terms = [t for t in terms if t.role is not TermRole.SOFTMAX_CAST]
    if flow.queries_grad or attn.qk_norm:
        return terms
    k = shape.act_bytes * shape.seq * shape.micro_batch * attn.num_kv_heads * attn.head_dim
    out = []
    for t in terms:
        if t.role is TermRole.QKV:
            t = Term(f"{t.name} (no k: the queries need no gradient)", t.bytes - k, t.region, t.keep, site=t.site,
                     role=t.role)
        elif t.role is TermRole.REPEATED_KV:
            t = Term(f"{t.name} (values only)", t.bytes * attn.v_head_dim // (attn.head_dim + attn.v_head_dim),
                     t.region, t.keep, site=t.site, role=t.role)
        elif t.role is TermRole.KEYS_CAST:
            continue
        out.append(t)
    return out


def _frozen_term(t: Term, shape: ActivationShape, normalized_stand_in: bool, gemm_inputs_kept: bool) -> Term | None:
    """A term of a block whose linears are frozen (input needing a gradient): None when not saved."""
    if t.gemm_input:
        if gemm_inputs_kept or normalized_stand_in:
            return t
        return None
    if t.role is TermRole.NORM_INPUT:
        if norm_keeps_input(shape):
            return t  # an fp32 residual (no fp32 copy), or a LayerNorm outside autocast: the norm keeps the input
        return Term(t.name, t.bytes, t.region, "layer_ckpt_input", role=t.role) if t.keep == "input" else None
    if t.role is TermRole.QK_NORMS and shape.kernels == "eager":
        # Eager per-head norms keep an fp32 copy of their input and the normalized tensor; only the first
        # serves the input's gradient.
        return Term(t.name, t.bytes * NORM_COMPUTE_BYTES // (NORM_COMPUTE_BYTES + shape.act_bytes), t.region, t.keep,
                    role=t.role)
    return t


#: Linear layers whose output holds the attention's keys (fused q/k/v projections included).
_KEY_LINEARS = frozenset({"k_proj", "qkv_proj", "c_attn", "query_key_value", "W_pack", "wk", "wqkv",
                          "kv_a_proj_with_mqa", "kv_b_proj"})
_FUSED_QKV = frozenset({"qkv_proj", "c_attn", "query_key_value", "W_pack", "wqkv"})
#: ... the keys', the queries' and the values' linears (MLA's latents are left to ``_LATENT_DOWN``).
_FACTOR_LINEARS = {"keys": _KEY_LINEARS,
                   "queries": _FUSED_QKV | {"q_proj", "wq", "q_a_proj", "q_b_proj"},
                   "values": _FUSED_QKV | {"v_proj", "wv", "kv_a_proj_with_mqa", "kv_b_proj"}}
#: MLA's down-projections by the latent they make.
_LATENT_DOWN = {"q_a_proj": "q", "kv_a_proj_with_mqa": "kv"}
#: The roles of the terms holding a block's output projection's input (attention's, a dense MLP's).
_OUTPUT_LINEAR_INPUTS = frozenset({TermRole.OUTPUT_PROJECTION_INPUT, TermRole.MLP_FC2})
#: Linear layers that read their block's input (through its pre-norm).
_BLOCK_INPUT_LINEARS = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "q_a_proj", "kv_a_proj_with_mqa",
                                  "c_attn", "query_key_value", "gate_proj", "up_proj", "gate_up_proj", "c_fc",
                                  "dense_h_to_4h", "w1", "w3"})


def reads_a_gradient(flow: BlockFlow, linear: str) -> bool:
    """The input of the linear layer ``linear`` (its dotted name) in a block with ``flow`` requires grad: for a
    linear reading the block's input (through its pre-norm), where that input or the norm needs one; for any other
    (an output projection), where anything before it in the block does (an adapter or trained linear included)."""
    if linear.rpartition(".")[2] in _BLOCK_INPUT_LINEARS:
        return flow.input_grad or flow.norm_trains
    return flow.inner_grad


@lru_cache(maxsize=256)
def uncopied_trained_numel(model: ModelSpec, ft: FineTuning, checkpointing: bool, layers: tuple[int, ...],
                           own_layers: bool = False) -> int:
    """Weights of fully trained linears among ``layers`` whose input needs no gradient: autocast casts them,
    but autograd keeps the 16-bit copy only for the input's gradient, so it is not saved (the linears
    reading a block's input when nothing before them, the block's norm included, needs a gradient; an output
    projection trained alone on such an input: :func:`reads_a_gradient`; ``own_layers`` as for :func:`layer_flows`)."""
    if ft.resolved_trainable == "all":
        return 0
    flows = layer_flows(model, ft, checkpointing, own_layers)
    full = trained_modules(model, ft)
    wanted = set(layers)
    total = 0
    for m in model_linears(model):
        if m.layer not in wanted or not under(m.name, full):
            continue
        flow = flows[m.layer].attention if block_of(m.name, frozenset()) == "attention" else flows[m.layer].mlp
        if not reads_a_gradient(flow, m.name):
            total += m.weight_numel
    return total


def trained_norm_copies(layer: LayerSpec, shape: ActivationShape, flow: LayerFlow) -> tuple[list[Term], list[Term]]:
    """(attention, rest) terms a 16-bit base under autocast adds where a block's norm and linears train:
    the trained norm's weight is fp32, so its output is fp32 and each linear reading it casts and saves
    its own 16-bit copy (as under full training with fp32 weights), beyond the one copy the 16-bit
    base's terms count. None where the norm casts its scaled output to its input's dtype (Gemma's and
    gpt-oss's RMSNorm, ``norm_fp32_scale``): the linears share that 16-bit output."""
    attention, rest = layer_terms_by_block(layer, replace(shape, autocast=True))

    def copies(terms: list[Term], block: BlockFlow) -> list[Term]:
        if not (block.norm_trains and block.linears_train) or shape.norm_fp32_scale:
            return []  # (a norm that scales in fp32 casts its output back to the input dtype: 16-bit)
        return [t for t in terms if t.role is TermRole.NORM_COPIES]
    return copies(attention, flow.attention), copies(rest, flow.mlp)


def any_attention_saves(model: ModelSpec, ft: FineTuning, checkpointing: bool, layers: tuple[int, ...]) -> bool:
    """Some attention block among ``layers`` records tensors before its output projection under fine-tuning ``ft``
    (RoPE's products save the shared tables where q or k needs a gradient; an output projection trained alone on an
    input needing none saves its own input only)."""
    flows = layer_flows(model, ft, checkpointing)
    return any(flows[i].attention.inner_grad for i in layers)


@lru_cache(maxsize=256)
def trained_tensors(model: ModelSpec, ft: FineTuning, index: int) -> tuple[bool, ...] | None:
    """Per parameter tensor of layer ``index`` (:func:`~memplan.model.linears.model_parameters` order), whether
    ``--trainable`` trains it fully (autograd makes its own gradient in the layer's backward); None where the layer
    has no such tensor, or holds an adapter or a ``modules_to_save`` copy (their gradients are other tensors')."""
    full, copies = trained_modules(model, ft), saved_modules(model, ft)
    if any(a.module.layer == index for a in finetune_params(model, ft).adapters):
        return None
    params = [p for p in model_parameters(model) if p.layer == index]
    if any(under(p.module, copies) for p in params):
        return None
    trained = tuple(under(p.module, full) for p in params)
    return trained if any(trained) else None


@lru_cache(maxsize=256)
def uncast_trained_numel(model: ModelSpec, ft: FineTuning, layers: tuple[int, ...], embedding: bool,
                         final_norm: bool) -> int:
    """Weights ``--trainable`` trains fully among ``layers`` (and the root's: an untied embedding table with
    ``embedding``, the final norm with ``final_norm``) that autocast never casts: the norms' weights and the embedding
    table (``F.embedding`` and the norms' products are not on torch.autocast's lower-precision list, so no 16-bit copy
    is made, cached or saved; a tied table is the head's weight, which the head's linear casts). A trace of a gpt-oss
    toy training embed_tokens and layers.1.input_layernorm (bf16-mixed) holds no 16-bit copy of either."""
    if ft.resolved_trainable in ("all", "adapters"):
        return 0
    full, wanted = trained_modules(model, ft), set(layers)
    total = 0
    for p in model_parameters(model):
        if not under(p.module, full):
            continue
        if p.layer is None:
            table = embedding and _is_embedding(p.module) and not model.tie_word_embeddings
            total += p.numel if table or (final_norm and is_norm(p.module)) else 0
        elif p.layer in wanted and is_norm(p.module):
            total += p.numel
    return total
