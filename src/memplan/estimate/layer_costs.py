"""What one decoder layer keeps for its backward and adds during it, under the job's activation policy.

:func:`layer_costs` gives a layer's :data:`~memplan.estimate.context.LayerCosts` (kept, full,
backward transient, made again at its worst), memoised per distinct layer kind in the run's cache;
the other functions add what a mechanic changes in one layer's figures (shared-expert overlap, the
experts' wgrad overlap, context-parallel buffers, autocast copies a recompute makes again, MTP).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import Any, cast

from memplan.estimate.activations import (
    KEPT_BY,
    NORM_COMPUTE_BYTES,
    ActivationShape,
    Term,
    attention_backward_transient_bytes,
    backward_transient_bytes,
    checkpointed_input_apart_bytes,
    dispatch_buffer_bytes,
    divided,
    layer_terms,
    layer_terms_by_block,
    node_bytes,
    output_gradient_bytes,
    recomputed_forward_transient,
)
from memplan.estimate.adapter_acts import (
    adapter_terms,
    dora_base_bytes,
    dora_forward_transient,
    dora_output_backward,
)
from memplan.estimate.autocast import (
    attention_weight_copy_numel,
    checkpointed_module_copy_numel,
    layer_weight_copy_numel,
)
from memplan.estimate.compiled import compiled_blocks, compiled_layer
from memplan.estimate.context import LayerCosts, RunContext, StageContext, kept_policy
from memplan.estimate.cp_attention import cp_backward_extra_bytes
from memplan.estimate.dora_fp32_stream import (
    FP32_STREAM,
    NO_FP32,
    adapter_input_bytes,
    fp32_blocks,
    fp32_start,
    fp32_stream_shape,
    widened_terms,
)
from memplan.estimate.ep_overlap import (
    LayerParts,
    attention_wgrad_held,
    dispatch_backward_extra,
    expert_wgrad_held,
    layer_parts,
    mlp_wgrad_held,
    shared_expert_overlap_bytes,
)
from memplan.estimate.finetune import (
    adapter_bytes,
    adapter_compute_bytes,
    dequantized_element_bytes,
    frozen_compute_bytes,
)
from memplan.estimate.frozen_copies import casts_frozen, recomputed_frozen_copies
from memplan.estimate.frozen_mlp_backward import frozen_mlp_backward
from memplan.estimate.gpt_oss_terms import forward_mask_term
from memplan.estimate.gated_mlp_outputs import gated_mlp_outputs
from memplan.estimate.grouped_experts_backward import experts_figures
from memplan.estimate.memo import Same
from memplan.estimate.mlp_backward_nodes import MLP_WALKED, mlp_backward_nodes, quantized_dora_mlp
from memplan.estimate.partial_freeze import (
    LayerFlow,
    block_terms,
    core_factor_terms,
    reads_a_gradient,
    trained_norm_copies,
)
from memplan.estimate.recompute_modules import (
    checkpoint_input_terms,
    recomputed_only_terms,
    recomputed_peak,
    term_site,
)
from memplan.estimate.sac import sac_kept_terms
from memplan.estimate.terms import TermRole
from memplan.estimate.trained_dtypes import trained_weights_shape
from memplan.frozen import frozen_dataclass
from memplan.model.linears import layer_linears
from memplan.model.spec import LayerSpec
from memplan.peft.params import Adapter
from memplan.policies import ActivationPolicy
from memplan.tuning import quant_format
from memplan.units import dtype_bytes


@frozen_dataclass
class LayerRole:
    """A fine-tuned layer's part: its adapters, what of it needs gradients (:mod:`~memplan.estimate.partial_freeze`;
    None: full training) and whether its base is quantized."""

    adapters: tuple[Adapter, ...] = ()
    flow: LayerFlow | None = None
    quantized: bool = False
    #: (attention block, MLP block) reading the fp32 stream a DoRA-adapted quantized linear starts under autocast
    #: (:mod:`~memplan.estimate.dora_fp32_stream`).
    fp32: tuple[bool, bool] = NO_FP32


_FULL_TRAINING = LayerRole()
_NOTHING = (0, 0, 0, 0)


def _role(run: RunContext, index: int | None) -> LayerRole | None:
    """The layer's fine-tuning role; None for a layer that saves nothing (nothing in or before it needs
    a gradient)."""
    counts, flows = run.counts, run.flows
    if counts is None or flows is None or index is None:
        return _FULL_TRAINING
    flow = flows[index]
    if not flow.saves:
        return None
    return LayerRole(adapters=counts.layer_adapters[index], flow=flow,
                     quantized=bool(counts.layers[index].quantized),
                     fp32=_fp32_blocks(run, counts.layer_adapters, index))


def layer_fp32_blocks(run: RunContext, index: int) -> tuple[bool, bool]:
    """(attention block, MLP block) of layer ``index`` that read DoRA's fp32 stream (:mod:`~memplan.estimate.dora_fp32_stream`)."""
    role = _role(run, index)
    return NO_FP32 if role is None else role.fp32


def _fp32_blocks(run: RunContext, adapters: tuple[tuple[Adapter, ...], ...], index: int) -> tuple[bool, bool]:
    """The blocks of layer ``index`` reading an fp32 stream on a bitsandbytes base under autocast
    (:mod:`~memplan.estimate.dora_fp32_stream`): every block of an fp32 frozen base (``--frozen-dtype fp32``: fp32 from
    the embedding), else those after a DoRA-adapted linear whose fp32 magnitude is wider than the 16-bit stream."""
    ft, shape = run.job.finetune, run.shape
    if not (ft.quant_kind.quantizes and run.prec.weight_copies == "autocast" and shape.act_bytes < NORM_COMPUTE_BYTES):
        return NO_FP32
    if shape.residual_bytes >= NORM_COMPUTE_BYTES:
        return FP32_STREAM
    if ft.peft_kind.magnitude and shape.residual_bytes < adapter_bytes(run.job):
        start = run.cache.get(_FP32_START)
        if start is None:
            start = run.cache[_FP32_START] = fp32_start(adapters)  # once per estimate, not per layer
        return fp32_blocks(adapters, index, start)
    return NO_FP32


#: The run's cache key of :func:`~memplan.estimate.dora_fp32_stream.fp32_start`.
_FP32_START = "dora fp32 stream start"


def role_shape(run: RunContext, role: LayerRole) -> ActivationShape:
    """The activation shape of a layer with ``role``: the run's, with a partially frozen layer's trained
    experts and sinks in the trained weights' dtype (:mod:`memplan.estimate.trained_dtypes`)."""
    if role.flow is None:
        return run.shape
    return trained_weights_shape(fp32_stream_shape(run.shape, role.fp32), role.flow, dtype_bytes(run.prec.param))


def layer_costs(run: RunContext, layer: LayerSpec, index: int | None = None) -> LayerCosts:
    """(kept, full, backward transient, recomputed at the worst point) of one layer.

    With ``index`` (a fine-tuning job) a frozen layer's GEMM inputs are not saved and its adapters'
    terms are added (:mod:`memplan.estimate.adapter_acts`).
    """
    role = _role(run, index)
    if role is None:
        return _NOTHING
    key = (id(layer), role)  # the run fixes everything else _layer_figures reads
    cached = run.cache.get(key)
    if cached is None:
        ft = run.job.finetune
        dequantized = dequantized_element_bytes(run.job, dtype_bytes(run.prec.compute)) if role.quantized \
            else 0
        own = adapter_compute_bytes(run.job, run.prec.weight_copies)
        cached = run.cache[key] = _layer_figures(Same(layer), role_shape(run, role), run.policy, role,
                                                 ft.quantize_base, run.prec.weight_copies == "autocast",
                                                 ft.lora_dropout > 0, own,
                                                 compiled_layer(run, layer), per_tensor_offload(run),
                                                 dequantized, frozen_compute_bytes(run.job, run.prec.weight_copies),
                                                 role.flow is not None and casts_frozen(run))
    return cached


@lru_cache(maxsize=4096)
def _layer_figures(layer: Same, shape: ActivationShape, policy: ActivationPolicy, role: LayerRole,
                   quantize_base: str, autocast: bool, lora_dropout: bool, adapter_bytes: int,
                   compiled: bool = False, offloaded: bool = False, dequantized: int = 0,
                   bias_bytes: int = 0, frozen_cast: bool = False) -> LayerCosts:
    """:func:`layer_costs` of one layer kind: memoised across estimates (a fit search prices the same
    layer kinds under many layouts; the key holds the layer itself, compared by identity). ``compiled``:
    the layer keeps torch.compile's partitioner's saved set (:mod:`memplan.estimate.compiled`); ``offloaded``:
    ``save_on_cpu`` holds what it saves in host memory; ``dequantized``: bytes per element of its base weights
    dequantized (0: not quantized); ``bias_bytes``: its frozen biases' (DoRA's base result minus the bias);
    ``frozen_cast``: autocast casts its frozen weights (stored in another dtype), so a recompute makes their 16-bit
    copies again (:func:`~memplan.estimate.frozen_copies.recomputed_frozen_copies`)."""
    spec = cast(LayerSpec, layer.obj)
    attention, rest = compiled_blocks(spec, shape) if compiled else _role_blocks(
        layer, shape, role, quantize_base, autocast, lora_dropout, adapter_bytes, bias_bytes)
    blocks = (list(attention), list(rest))
    # a recomputed layer on a base whose matmul saves nothing (4-bit) runs down_proj's backward before its
    # recompute
    first = policy.kind.checkpoints_layers and not quant_format(quantize_base).keeps_gemm_inputs
    return _priced(spec, shape, policy, blocks, offloaded,
                   None if compiled else _mlp_walked(spec, shape, blocks[1], role.flow, dequantized,
                                                     policy.kind.checkpoints_layers, first, frozen_cast,
                                                     adapter_bytes))


def _mlp_walked(layer: LayerSpec, shape: ActivationShape, rest: list[Term], flow: LayerFlow | None, dequantized: int,
                recomputed: bool, recomputed_first: bool, frozen_cast: bool, adapter_bytes: int) -> int | None:
    """The MLP block's backward walked op by op above the layer's saved tensors: a frozen gated MLP's
    (:mod:`~memplan.estimate.frozen_mlp_backward`), else a trained or GPT-2 one's node by node
    (:mod:`~memplan.estimate.mlp_backward_nodes`, without the weight gradients made); None: the general rule.
    ``frozen_cast`` and ``recomputed``: the recompute made the frozen output projection's 16-bit copy again (counted
    with the layer's recomputed copies), which its node frees; ``adapter_bytes``: the adapters' (DoRA's magnitude
    nodes)."""
    frozen = frozen_mlp_backward(layer, shape, rest, flow, dequantized, recomputed_first)
    if frozen is not None:
        return frozen
    again = (layer.mlp.intermediate_size * shape.hidden // shape.tp * shape.act_bytes
             if frozen_cast and recomputed and layer.mlp is not None else 0)
    if dequantized and flow is not None:
        return quantized_dora_mlp(layer, shape, rest)
    nodes = mlp_backward_nodes(layer, shape, rest, flow, recomputed=recomputed, dequantized=dequantized,
                               frozen_copy=again, adapter_bytes=adapter_bytes)
    return None if nodes is None else nodes.transient


def layer_blocks(run: RunContext, layer: LayerSpec,
                 index: int | None = None) -> tuple[ActivationShape, tuple[list[Term], list[Term]]] | None:
    """The (attention, rest) terms :func:`layer_costs` prices for the layer's role, with the role's activation
    shape; None for a layer that saves nothing."""
    role = _role(run, index)
    if role is None:
        return None
    shape, ft = role_shape(run, role), run.job.finetune
    if compiled_layer(run, layer):
        return shape, compiled_blocks(layer, shape)
    attention, rest = _role_blocks(Same(layer), shape, role, ft.quantize_base, run.prec.weight_copies == "autocast",
                                   ft.lora_dropout > 0, adapter_compute_bytes(run.job, run.prec.weight_copies),
                                   frozen_compute_bytes(run.job, run.prec.weight_copies))
    return shape, (list(attention), list(rest))


@lru_cache(maxsize=4096)
def _role_blocks(layer: Same, shape: ActivationShape, role: LayerRole, quantize_base: str, autocast: bool,
                 lora_dropout: bool, adapter_bytes: int, bias_bytes: int) -> tuple[tuple[Term, ...], tuple[Term, ...]]:
    """:func:`_blocks` of one layer kind in one role, memoised across layers and estimates as
    :func:`_layer_figures` is (the key holds the layer itself, compared by identity): a recomputed fine-tuned
    layer's moments ask for its terms up to four times beside :func:`_layer_figures`, and building them is most of such
    an estimate's work."""
    attention, rest = _blocks(cast(LayerSpec, layer.obj), shape, role, quantize_base=quantize_base,
                              autocast=autocast, lora_dropout=lora_dropout, adapter_bytes=adapter_bytes,
                              bias_bytes=bias_bytes)
    return tuple(attention), tuple(rest)


def per_tensor_offload(run: RunContext) -> bool:
    """Whether the job packs every tensor autograd saves to host memory as it is saved (``save_on_cpu``: the
    hf and torchtitan profiles)."""
    return run.job.offload.activations and run.profile.activation_offload == "per-tensor"


def _blocks(layer: LayerSpec, shape: ActivationShape, role: LayerRole, *, quantize_base: str, autocast: bool,
            lora_dropout: bool, adapter_bytes: int, bias_bytes: int = 0) -> tuple[list[Term], list[Term]]:
    """(attention, rest) terms of the layer for its fine-tuning role."""
    attention, rest = layer_terms_by_block(layer, shape)
    flow = role.flow
    if flow is None:
        return attention, rest  # full training: no adapters, no fp32 stream
    # bitsandbytes' 8-bit matmul keeps its input (ctx.tensors) like a trainable linear layer.
    int8_base = role.quantized and quant_format(quantize_base).keeps_gemm_inputs
    attention = core_factor_terms(block_terms(attention, shape, flow.attention, gemm_inputs_kept=int8_base),
                                    layer.attention, shape, flow.attention)
    rest = _int8_mlp_terms(layer, rest, shape, flow) if int8_base else block_terms(rest, shape, flow.mlp)
    if autocast and not shape.autocast:
        extra = trained_norm_copies(layer, shape, flow)
        attention, rest = attention + extra[0], rest + extra[1]
    if role.fp32[0]:
        attention = widened_terms(attention, shape, gemm_inputs=int8_base)
    if role.fp32[1]:
        rest = widened_terms(rest, shape, gemm_inputs=int8_base)
    if not flow.mlp.linears_train:
        rest = gated_mlp_outputs(rest, shape, role.adapters, input_grad=reads_a_gradient(flow.mlp, "gate_proj"),
                                 gemm_inputs=int8_base, dora_fp32=role.quantized and autocast and not role.fp32[1]
                                 and shape.residual_bytes < min(NORM_COMPUTE_BYTES, adapter_bytes))
    outputs = (reads_a_gradient(flow.attention, "o_proj"), reads_a_gradient(flow.mlp, "down_proj"))
    for wide in (0,) if role.fp32 == NO_FP32 else (0, NORM_COMPUTE_BYTES):
        # an fp32 input (a quantized base's fp32 stream): each lora_A casts its own 16-bit copy
        adapters = tuple(a for a in role.adapters if adapter_input_bytes(a, role.fp32) == wide)
        rest = rest + (adapter_terms(adapters, shape, autocast=autocast, dropout=lora_dropout,
                                     compute_bytes=shape.act_bytes, input_needs_grad=flow.attention.input_grad,
                                     # peft's cast to the fp32 adapters is a no-op on fp32 activations
                                     uncast_input=not wide and ((role.quantized and autocast)
                                                                or shape.act_bytes == adapter_bytes),
                                     base_keeps_input=int8_base and not wide, adapter_bytes=adapter_bytes,
                                     bias_bytes=bias_bytes, input_bytes=wide,
                                     mlp_input_needs_grad=flow.mlp.input_grad, output_inputs_grad=outputs)
                       if adapters else [])
    return attention, rest


#: What an MoE block's bitsandbytes 8-bit linears read (the shared expert's: plain ``nn.Linear`` modules,
#: replaced); the routed experts' fused weights and the router stay unquantized and keep no input of their own.
_SHARED_EXPERT_INPUTS = frozenset({TermRole.SHARED_EXPERT_FC2, TermRole.SHARED_EXPERT_NORM_COPIES})


def _int8_mlp_terms(layer: LayerSpec, rest: list[Term], shape: ActivationShape,
                    flow: LayerFlow) -> list[Term]:
    """The MLP/MoE block's terms for ``flow`` on an 8-bit base: bitsandbytes' ``MatMul8bitLt`` keeps its input
    (``ctx.tensors``) like a trained linear, so the inputs of the block's quantized linears are kept; an MoE
    block's routed experts and router are not quantized, so theirs only where the frozen block keeps them."""
    kept = block_terms(rest, shape, flow.mlp, gemm_inputs_kept=True)
    if layer.moe is None:
        return kept
    plain = block_terms(rest, shape, flow.mlp)
    shared = layer.moe.shared_expert is not None
    return [t for t in kept if t in plain or t.role in _SHARED_EXPERT_INPUTS
            or (shared and t.role is TermRole.NORM_OUTPUT)]


def _priced(layer: LayerSpec, shape: ActivationShape, policy: ActivationPolicy,
            blocks: tuple[list[Term], list[Term]], offloaded: bool = False,
            frozen_mlp: int | None = None) -> LayerCosts:
    """The layer's figures from its terms under the activation policy (``frozen_mlp``: the MLP block's backward
    walked op by op, :func:`_mlp_walked`, None where the general rule prices it)."""
    kept_classes, dropped = kept_policy(policy)
    sized = [(divided(t, shape), t.keep, term_site(t)) for t in blocks[0] + blocks[1]]
    full = sum(size for size, keep, _ in sized if keep in KEPT_BY["none"])
    inputs = checkpoint_input_terms(layer, shape, policy.modules) if dropped else []
    # transformers' grouped experts' backward op by op (or its combine's step alone), beside what the layer holds
    experts = experts_figures(layer, shape, blocks[1], dropped, policy.kind.checkpoints_layers)
    transient = backward_transient_bytes(layer, shape, blocks, dropped, released_inputs=sum(
        divided(t, shape) for t in inputs if t.site in ("mlp", "moe")), offloaded=offloaded,
        walked=(frozenset() if frozen_mlp is None else MLP_WALKED) | (experts.walked if experts else frozenset()))
    transient = max(transient, frozen_mlp or 0)
    if policy.kind.checkpoints_layers:
        # a recomputed layer's forward runs again in its backward (gpt-oss's sink attention holds more then;
        # a layer a block-wise policy leaves alone is priced the same: at most its PV cast copy too high)
        transient = max(transient, recomputed_forward_transient(layer, shape, blocks[1], blocks[0]))
    sac = sac_kept_terms(layer, shape) if policy.kind.per_op else None
    if policy.kind.per_op and sac is None:
        # MoE and MLA layers are not listed op by op: Megatron's selective accounting stands in.
        kept_classes = KEPT_BY["selective"]
    kept = sum(size for size, keep, site in sized if keep in kept_classes and site not in dropped)
    if sac is not None:
        # The cached op outputs; those autograd does not save also sit beside the recomputed layer.
        kept += sum(divided(t, shape) for t in sac[0])
        transient += sum(divided(t, shape) for t in sac[1])
    if policy.kind.budget:
        # torch's partitioner: at most the budget's fraction of what it saves above the region's inputs
        kept += budget_share(full - kept, policy.memory_budget)
    # (the checkpointed attention module reads its input again: where that is a tensor apart, not made again)
    rebuilt = full - kept + checkpointed_input_apart_bytes(blocks[0] + blocks[1], shape, kept_classes)
    if dropped:
        # only one block's recomputed tensors are alive at a time (recompute_modules.py)
        rebuilt -= sum(size for size, _, site in sized if site in dropped)
        again = [(divided(t, shape), t.site) for t in recomputed_only_terms(layer, shape, policy.modules)]
        rebuilt += recomputed_peak([(size, site) for size, _, site in sized] + again, dropped)
        kept += sum(divided(t, shape) for t in inputs)
    if policy.kind.checkpoints_attention:
        # the checkpointed attention module is made again where its block's backward starts, after the MLP block's:
        # beside the attention block's own moments only (the layer's worst above its kept tensors: rebuilt + transient)
        transient = max(transient - rebuilt, attention_backward_transient_bytes(layer, shape, blocks, offloaded))
    if experts is not None:  # beside what the partial policy has made again by then
        transient = max(transient, experts.transient - (rebuilt if policy.partial else 0))
    return kept, full, transient, rebuilt


def budget_share(above_floor: int, budget: float | None) -> int:
    """Bytes torch's partitioner may keep above full recompute's floor under ``activation_memory_budget``
    (torch/_functorch/partitioners.py ``choose_saved_values_set``: 0 saves only the region's inputs, 1
    the default min-cut's values, and between them the knapsack keeps the saved bytes above the inputs
    within ``budget`` x (min-cut's - inputs')). The eager saved tensors bound the min-cut's from above."""
    return int(above_floor * (budget if budget is not None else 1.0))


def largest_saved_term(run: RunContext, layer_indices: Iterable[int]) -> int:
    """The most one backward node of ``layer_indices`` saved (one rank): what a per-tensor activation
    offload brings back to the GPU for it; of a term that lumps tensors (:class:`~memplan.estimate.terms.Term`'s
    ``tensors``), the ``node_saves`` of them one node saved (otherwise an approximation: an operator that saved
    several terms' tensors gets back only the largest)."""
    shape = run.shape
    return max((node_bytes(term, shape) * term.node_saves for index in layer_indices
                for term in layer_terms(run.model.layers[index], shape)), default=0)


def with_shared_expert_overlap(run: RunContext, layer: LayerSpec, keep: int, full: int) -> tuple[int, int]:
    """(kept, full) with ``--moe-shared-expert-overlap``'s gathered shared-expert input (kept unless
    recompute drops the layer's body or its MoE block)."""
    extra = shared_expert_overlap_bytes(layer, run.shape) if run.job.overlap.shared_expert_overlap else 0
    if not extra:
        return keep, full
    kept_too = not run.policy.kind.checkpoints_layers and "moe" not in run.dropped
    return keep + (extra if kept_too else 0), full + extra


def experts_wgrad_extra(run: RunContext, layer: LayerSpec, full: int, transient: int) -> int:
    """``--overlap-dispatch-backward-with-experts-wgrad``: what an MoE layer's dispatch backward holds
    beyond its worst backward step (Transformer Engine's grouped-GEMM experts only)."""
    if not run.job.overlap.experts_wgrad_overlap or layer.moe is None or not run.job.moe.grouped_gemm:
        return 0
    shape = run.shape
    parts = layer_parts(layer, shape, kept=full, transient=transient, dispatch=dispatch_buffer_bytes(layer, shape),
                        is_kept=lambda term: True, held_mlp=expert_wgrad_held(layer, shape))
    return dispatch_backward_extra(parts)


def ep_parts(run: RunContext, layer: LayerSpec, keep: int, worst: int) -> LayerParts:
    """A layer split into the combined 1F1B schedule's nodes, with its delayed-wgrad holdings."""
    shape, kept_classes, dropped = run.shape, run.kept_classes, run.dropped
    delay = run.job.overlap.delay_wgrad
    return layer_parts(layer, shape, kept=keep, transient=worst, dispatch=dispatch_buffer_bytes(layer, shape),
                       is_kept=lambda t: t.keep in kept_classes and term_site(t) not in dropped,
                       held_mlp=mlp_wgrad_held(layer, shape) if delay else 0,
                       held_attn=attention_wgrad_held(layer, shape) if delay else 0)


def cp_backward_extra(run: RunContext, index: int) -> int:
    """Transformer Engine's context-parallel buffers in the attention backward of layer ``index``
    (profiles with ``te_context_parallel``): its own ``--cp-comm-type`` when one is given per layer,
    else the worst of them."""
    job, shape = run.job, run.shape
    kinds = job.overlap.cp_comm_types
    if not run.profile.te_context_parallel or job.parallel.cp == 1:
        return 0
    if len(kinds) == run.model.num_layers:
        kinds = (kinds[index],)
    return max(cp_backward_extra_bytes(run.model.layers[index].attention, kind, cp=job.parallel.cp,
                                       tokens=shape.seq * shape.micro_batch, tp=job.parallel.tp,
                                       act_bytes=shape.act_bytes) for kind in kinds)


def recomputed_copies_bytes(ctx: StageContext, index: int) -> int:
    """Autocast weight copies a checkpointed region makes again when it is recomputed in the
    backward (the recompute runs under the forward's autocast state; torch.utils.checkpoint), alive
    until that region's backward is done: the whole layer under full recompute, its attention
    projections when the attention module is checkpointed."""
    run = ctx.run
    if run.prec.weight_copies != "autocast":
        return 0
    kind, eager = run.policy.kind, run.profile.kernels == "eager"
    if index in ctx.recomputed or kind.per_op:
        numel = layer_weight_copy_numel(run.model, run.job, index, eager_experts=eager)
    elif kind.checkpoints_attention:
        numel = attention_weight_copy_numel(run.model, run.job, index)
    elif run.policy.modules:
        numel = checkpointed_module_copy_numel(run.model, run.job, index, run.policy.modules, eager_experts=eager)
    else:
        return 0
    if run.counts is not None:
        # fine-tuning: fully trained weights are kept in fp32 and cast; frozen ones only when stored in another dtype
        part = run.counts.layers[index]
        numel = numel * part.trained // (part.trainable + part.frozen_total) if part.trained else 0
        numel += recomputed_frozen_copies(run, index) if index in ctx.recomputed else 0
    return numel * dtype_bytes(run.prec.compute)


def mtp_activation_bytes(run: RunContext) -> int:
    """One MTP module per micro-batch: its decoder layer (shaped like the last), two input norms,
    the concatenated 2h input of its projection, and the embedding lookup it reads."""
    keep, full, _, _ = layer_costs(run, run.model.layers[-1])
    layer = keep if run.policy.recomputes else full
    shape = run.shape
    sbh = shape.seq * shape.micro_batch * shape.hidden
    sp = shape.tp if shape.sequence_parallel else 1
    norms = 2 * shape.residual_bytes * sbh // sp
    projection_input = 2 * shape.act_bytes * sbh // sp
    return layer + norms + projection_input


def sink_forward_transient(ctx: StageContext) -> int:
    """What the stage's last layer holds beyond its saved tensors in its forward, every layer's activations
    kept (gpt-oss's eager sink attention: its masked scores and max-subtracted logits, the MLP block and the
    output projection's adapters not run yet: the role's MLP-block terms, less the q/k/v adapters'; the layer's input, bound until the attention block's residual add, where its role saves it nowhere: a
    trained layer on a frozen base); 0 for other layers, and where layers are recomputed or the attention core is
    not kept."""
    run = ctx.run
    if ctx.recomputed or not ctx.layout.layer_indices or "core" not in run.kept_classes:
        return 0
    index = ctx.layout.layer_indices[-1]
    layer = run.model.layers[index]
    found = layer_blocks(run, layer, index) if layer.attention.sinks else None  # the role's terms
    if found is None:
        return 0
    shape, blocks = found
    extra = recomputed_forward_transient(layer, shape, blocks[1], blocks[0])
    if not extra:
        return 0
    unsaved = 0 if any(t.keep == "input" for t in blocks[0]) else output_gradient_bytes(shape, run.model.hidden_size)
    return extra + unsaved + divided(forward_mask_term(run.model, run.shape), run.shape)


def dora_recompute_head(run: RunContext, index: int) -> int:
    """What a checkpointed layer's backward makes before its recompute where its last linear carries DoRA
    (:func:`~memplan.estimate.adapter_acts.dora_output_backward`; 0 otherwise)."""
    if not run.job.finetune.peft_kind.magnitude or run.counts is None:
        return 0
    layer = run.model.layers[index]
    linears = layer_linears(layer, run.model.hidden_size, run.model.model_type)
    if not linears:
        return 0
    # on DoRA's fp32 stream the MLP's output projection returns its fp32 sum uncast (dora_fp32_stream)
    wide = layer_fp32_blocks(run, index)[1]
    return dora_output_backward(run.counts.layer_adapters[index], last_linear=linears[-1].name,
                                tokens=run.shape.local_tokens,
                                compute_bytes=run.shape.act_bytes,
                                adapter_bytes=adapter_compute_bytes(run.job, run.prec.weight_copies), uncast=wide)


def dora_transient(ctx: StageContext) -> int:
    """DoRA's forward temporaries at the stage's largest adapted linear (0 without DoRA)."""
    run = ctx.run
    if not run.job.finetune.peft_kind.magnitude or run.counts is None:
        return 0
    layers = set(ctx.layout.layer_indices)
    adapters = tuple(a for a in run.counts.adapters if a.module.layer in layers)
    return dora_forward_transient(adapters, **dora_forward_sizes(run))


def dora_forward_sizes(run: RunContext) -> dict[str, Any]:
    """The job's keyword arguments of :func:`~memplan.estimate.adapter_acts.dora_forward_transient` (autocast, the
    activations', base weight's and adapters' bytes per element, one micro-batch's tokens), for each of its callers."""
    return {"autocast": run.prec.weight_copies == "autocast", "compute_bytes": run.shape.act_bytes,
            "base_bytes": dora_base_bytes(quantized=run.job.finetune.quant_kind.quantizes,
                                          frozen_bytes=frozen_compute_bytes(run.job, run.prec.weight_copies)),
            "tokens": run.shape.seq * run.shape.micro_batch,
            "adapter_bytes": adapter_compute_bytes(run.job, run.prec.weight_copies)}
