"""What a fully recomputed layer's backward holds beyond the tensors its recomputed forward saved, op by op.

Under full activation checkpointing (Hugging Face's non-reentrant ``torch.utils.checkpoint``) a layer's
backward first runs its forward again, saving every tensor a kept layer saves (the allocated peak counts
them as the layer's ``full`` figure), then runs its backward proper. The worst moment of that backward is
not "two of the largest saved tensors" (the rule a layer's transient otherwise follows,
:func:`~memplan.estimate.activations.backward_transient_bytes`): a trace shows the ops one at a time,
each freeing what it no longer needs, so this module replays them on a tally of requested bytes
(:class:`~memplan.estimate.reserved_replay.Replay`, never replayed through the allocator) and takes the
most it holds above the saved tensors:

1. the gradient of the layer's output (residual dtype) arrives; under Gemma's post-feedforward norm
   (``(x_normed * (1 + weight)).type_as(x)``) its fp32 upcast too, made before the recompute starts;
2. that norm's eager backward (:func:`rms_norm_backward`): its fp32 temporaries beside its saved input;
3. the gated MLP's backward op by op (:func:`~memplan.estimate.reserved_mlp_backward.mlp_backward`,
   the reserved schedule's own op order), then the rest of the MLP block freed;
4. the eager attention core's backward op by op
   (:func:`~memplan.estimate.reserved_attention_backward.core_backward`), or under sub-module checkpoints a
   fused (SDPA) core's (:func:`~memplan.estimate.fused_core_backward.fused_core_backward`).

Autocast's 16-bit weight copies go with their weights' gradients (:mod:`~memplan.estimate.walk_copies`). The
layer's weight gradients made before the worst op are tallied apart (:class:`RecomputedBackward`): they count
only where gradients are made during the backward (``zero_grad(set_to_none=True)``).

Under torchtitan's per-op selective checkpointing (SAC) a layer's backward first makes its dropped ops
again, so the same walk applies from the whole layer's tensors; its kept ones are counted once (they are the
layer's kept figure). The cached op outputs autograd does not save (the attention scores, the down projection's
output) are gone by then: the recompute takes each from the cache and marks its entry consumed
(``torch/utils/checkpoint.py``, ``_CachedTorchDispatchMode``), so it is freed once the op after it has read it.

Under Megatron's sub-module checkpoints on an eager layer (``megatron-selective`` with ``--recompute-modules``
among ``core_attn``, ``layernorm`` and ``mlp``; :mod:`~memplan.estimate.recompute_modules`) only the checkpointed
sub-modules' forwards run again, each when autograd first reaches it: the MLP's (and the pre-MLP norm's) at
the MLP block's backward start, the input norm's and the attention core's at the attention block's, after
the MLP block's tensors are freed. The same walk applies with the layer's kept tensors taken first (its kept
figure) and each block's dropped tensors (and those only its recompute makes, such as the repeated keys and
values of every query head, or the norms' outputs in the residual dtype under autocast) taken where that
block's backward starts; the figures are above the kept ones. There an SDPA core is walked too.

The walk applies to a whole-model job on one rank's whole weights
(:func:`~memplan.estimate.reserved_mlp_backward.whole_weights`; with ``save_on_cpu`` activation offload too:
the recompute runs in the backward, outside its hooks, so what it saves stays on the GPU), to an eager
unfused attention core (or under sub-module checkpoints a fused one) and a gated MLP with separate projections,
without post-norms or with Gemma's fp32-scaled ones; elsewhere the layer keeps the general transient (None).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Any

from memplan.estimate.activations import (
    KEPT_BY,
    NORM_COMPUTE_BYTES,
    UNFUSED_ATTENTION,
    ActivationShape,
    divided,
    layer_terms,
)
from memplan.estimate.context import RunContext, StageContext
from memplan.estimate.ds_checkpointing import ds_checkpointing_applies
from memplan.estimate.memo import Same
from memplan.estimate.recomputed_tensors import (
    AT_ATTENTION,
    AT_MLP,
    EARLY,
    KEPT,
    NORMALIZED,
    saved_tensors,
)
from memplan.estimate.sac import sac_kept_terms
from memplan.estimate.terms import ATTENTION_ADAPTER_TERMS, SAVED_BY_OUTPUT_PROJECTION, Term, TermRole
from memplan.estimate.walk_copies import copy_plan

if TYPE_CHECKING:
    from memplan.estimate.reserved_replay import Block, Replay

#: The sentence --explain gives where a recomputed layer's backward was walked op by op.
NOTE = ("recomputed layers' backward walked op by op (after the recomputed forward, per-op SAC's recomputed ops, "
        "or each checkpointed sub-module's forward where its block's backward starts: the output gradient, "
        "Gemma's post-norm backward in fp32, the gated MLP's and the attention core's backward, each op "
        "freeing what it no longer needs), not priced as two of the layer's largest saved tensors")

#: ``--recompute-modules`` the walk follows (the others: the general rule).
WALKED_MODULES = frozenset({"core_attn", "layernorm", "mlp"})


@dataclass(frozen=True)
class RecomputedBackward:
    """Bytes a recomputed layer's backward holds above its saved tensors at its worst op (one rank)."""

    #: Without the layer's own weight gradients (they are counted elsewhere, or already allocated).
    transient: int
    #: Where the backward makes the gradients (none allocated before): the worst op with the layer's
    #: weight gradients made before it, less ``transient``.
    with_gradients: int


def rms_norm_backward(replay: Replay, fp32: int, normalized: Block | None, upcast: Block | None) -> None:
    """Gemma's eager RMSNorm backward (``(x * rsqrt(mean(x^2) + eps)) * (1 + weight)`` in fp32), op by op as a
    trace shows it (``fp32``: one fp32 tensor of the norm's input size): the incoming gradient times the
    normalized input (summed into the weight's gradient) and times ``1 + weight``; the saved normalized
    input, the product and the gradient's fp32 ``upcast`` freed; the gradient through ``rsqrt`` (two
    products, one summed); then the mean's and the square's backward (``div``, ``pow``, ``* 2``, ``* grad``:
    the worst op), the two input gradients summed."""
    product, scaled = replay.take(fp32), replay.take(fp32)
    replay.give(normalized, product, upcast)
    through, grad_x = replay.take(fp32), replay.take(fp32)
    replay.give(through, scaled)
    mean, power, doubled, grad_square = (replay.take(fp32) for _ in range(4))
    replay.give(doubled, power, mean)
    summed = replay.take(fp32)
    replay.give(grad_x, grad_square, summed)


def recomputed_backward(ctx: StageContext, index: int, copies: int) -> RecomputedBackward | None:
    """Layer ``index``'s recomputed backward walked op by op (see the module), or None where the walk does
    not apply (the layer keeps its general transient). ``copies``: the autocast weight copies its recomputed
    forward made (:func:`~memplan.estimate.layer_costs.recomputed_copies_bytes`), each freed once its
    linear's backward is done: the MLP's and the output projection's before the core's backward, the
    q/k/v projections' after it. The layer's input, which its saved tensors count, is the checkpoint's
    own kept input (the recomputed forward reads it, no copy): the figures are net of it, except under
    ``save_on_cpu``, where the input brought back from host memory is a new tensor."""
    run = ctx.run
    layer, shape = run.model.layers[index], run.shape
    whole = index in ctx.recomputed and not run.policy.partial
    sac = sac_kept_terms(layer, shape) if run.policy.kind.per_op and not whole else None
    modules = bool(run.dropped) and set(run.policy.modules) <= WALKED_MODULES and layer.moe is None
    # activation offload (save_on_cpu) leaves it: the recompute runs in the backward, outside its hooks
    # a fused core (SDPA) only under sub-module checkpoints: elsewhere its layers keep the general rule
    if (not (whole or sac is not None or modules) or shape.kernels != "eager"
            or (shape.attention not in UNFUSED_ATTENTION and not modules)
            or (layer.num_post_norms and not shape.norm_fp32_scale)):
        return None
    # the reserved schedule's op plans (and the allocator's tally) are imported only for the jobs they serve
    from memplan.estimate.reserved_mlp_backward import whole_weights

    if not whole_weights(run):
        return None
    key = (Same(run.model), index, shape, run.policy, run.job.offload.activations, run.prec.grad_bytes, copies)
    return _figures(_Keyed(key, run), "sac" if sac is not None else "modules" if modules else "whole")


class _Keyed:
    """A memo key: the values the walk reads (``key``), carrying the run that supplies them (not compared), so
    that estimates of one model under one shape and policy (a fit search's layouts) walk each layer once."""

    __slots__ = ("key", "run")

    def __init__(self, key: tuple[object, ...], run: RunContext) -> None:
        self.key, self.run = key, run

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Keyed) and other.key == self.key


@lru_cache(maxsize=1024)
def _figures(keyed: _Keyed, mode: str) -> RecomputedBackward | None:
    """:func:`recomputed_backward`'s figures (``mode``: ``whole`` recomputed layer, per-op ``sac`` layer, or
    sub-``modules`` checkpointed)."""
    from memplan.estimate.reserved_mlp_backward import layer_gradient_sizes

    run, index, copies = keyed.run, keyed.key[1], keyed.key[6]
    assert isinstance(index, int) and isinstance(copies, int)
    layer, shape = run.model.layers[index], run.shape
    tensors = saved_tensors(run, index)
    without = _walk(run, index, copies, None, tensors)
    if without is None:
        return None
    with_grads = _walk(run, index, copies, layer_gradient_sizes(run.model, index, run.prec.grad_bytes), tensors)
    extra = 0  # sub-modules: the walk starts from the kept tensors alone; per-op SAC: see the module
    if mode == "whole" and not run.job.offload.activations:
        # the checkpoint's kept input is among the saved tensors (under save_on_cpu it is in host memory: the
        # copy brought back is the recompute's own)
        extra = -checkpoint_input_bytes(layer_terms(layer, shape), shape)
    return RecomputedBackward(transient=without + extra, with_gradients=max(0, (with_grads or 0) - without))


def checkpoint_input_bytes(terms: Sequence[Term], shape: ActivationShape) -> int:
    """The bytes of a recomputed layer's saved ``terms`` that are the checkpoint's kept input itself, which the
    recomputed forward reads (non-reentrant ``torch.utils.checkpoint`` calls the layer on the same tensor): its
    ``input``-kept terms, except a pre-norm's input term where it stands for another tensor of the same bytes. An
    eager RMSNorm (transformers' ``LlamaRMSNorm``, ``Gemma2RMSNorm``, ``GptOssRMSNorm``) on a 16-bit input saves
    its fp32 copy and the normalized tensor, never the input (:func:`~memplan.estimate.activations.eager_norm_terms`:
    the norm-input term stands for the 16-bit normalized tensor, or that share of an fp32 one): the recompute makes
    that tensor anew beside the checkpoint's input."""
    stand_in = (shape.kernels == "eager" and shape.norm == "rmsnorm" and not shape.fused_rms_norm
                and shape.residual_bytes < NORM_COMPUTE_BYTES)
    return sum(divided(t, shape) for t in terms
               if t.keep == "input" and not (stand_in and t.role is TermRole.NORM_INPUT))


def brought_back_input(run: RunContext, index: int) -> int:
    """Under ``save_on_cpu``, layer ``index``'s checkpointed input as the recompute brings it back: non-reentrant
    ``torch.utils.checkpoint`` saves the layer's inputs through the outer saved-tensor hooks (``_NoopSaveInputs``),
    so they sit in host memory and return as new tensors when the recompute starts, alive while the recomputed
    forward runs. Its bytes beyond what the layer's saved terms count as that input itself
    (:func:`checkpoint_input_bytes`: a frozen norm's input is the checkpoint's alone, a 16-bit RMSNorm's
    norm-input term stands for its normalized tensor); 0 without ``save_on_cpu``."""
    if not run.job.offload.activations:
        return 0
    from memplan.estimate.layer_costs import layer_blocks

    found = layer_blocks(run, run.model.layers[index], index)
    if found is None:
        return 0
    shape, blocks = found
    terms = blocks[0] + blocks[1]
    kept = sum(divided(t, shape) for t in terms if t.keep in KEPT_BY["full"])
    return max(0, kept - checkpoint_input_bytes(terms, shape))


def checkpointed_sink_forward(run: RunContext, index: int, copies: int) -> tuple[int, int]:
    """Hugging Face's selective recompute (the attention module checkpointed) of gpt-oss's eager sink attention:
    the module's forward made again where the attention block's backward starts, at its sink softmax's cast, above
    the layer's kept tensors (with what the q, k and v projections' adapters save, made again before the core); and the layer's gradients made before it (0 where the backward does not make them).

    By then the MLP block's backward is done: its saved tensors are freed and its and the pre-MLP norm's gradients
    made. The recompute holds the attention block's dropped terms but the output projection's input (made after the
    core), the sink forward's locals (:func:`~memplan.estimate.gpt_oss_terms.sink_forward_extra`), the q, k and v
    projections' autocast weight copies (``copies`` less the output projection's), the residual stream's gradient
    and, where the residual is wider than the compute dtype, the attention output's gradient cast by the residual
    add's backward. (0, 0) elsewhere."""
    layer, job = run.model.layers[index], run.job
    from memplan.estimate.activations import has_eager_core, output_gradient_bytes

    # the sink forward's locals are an eager core's (a flash or SDPA core makes no score matrix)
    if not (run.policy.kind.checkpoints_attention and layer.attention.sinks and has_eager_core(run.shape)):
        return 0, 0
    from memplan.estimate.gpt_oss_terms import sink_forward_extra
    from memplan.estimate.layer_costs import layer_blocks
    from memplan.estimate.reserved_mlp_backward import attention_split, layer_gradient_sizes, whole_weights

    found = layer_blocks(run, layer, index)
    if found is None:
        return 0, 0
    shape, (attention, mlp) = found
    attn, hidden, kept = layer.attention, run.model.hidden_size, run.kept_classes
    # the q/k/v adapters' saved tensors (among the MLP-block terms) are made again with their projections, before the core
    again = sum(divided(t, shape) for t in attention
                if t.keep not in kept and t.role is not TermRole.OUTPUT_PROJECTION_INPUT) + sum(
        divided(t, shape) for t in mlp if t.keep not in kept and t.role in ATTENTION_ADAPTER_TERMS)
    freed = sum(divided(t, shape) for t in mlp if t.keep in kept)
    output = attn.num_heads * attn.v_head_dim * hidden
    cast = output_gradient_bytes(shape, hidden) * shape.act_bytes // shape.residual_bytes \
        if shape.act_bytes < shape.residual_bytes else 0
    moment = max(0, divided(sink_forward_extra(attn, shape), shape) + again - freed + cast
                 + output_gradient_bytes(shape, hidden) + max(0, copies - output * shape.act_bytes))
    if (job.sharding.zero >= 2 or job.sharding.fsdp != "none" or job.offload.optimizer or job.optimizer.in_backward
            or not whole_weights(run)):
        return moment, 0
    sizes = layer_gradient_sizes(run.model, index, run.prec.grad_bytes)
    split = attention_split(run.model, index, len(sizes))
    made = sum(sizes[i] for i in split[0]) - output * run.prec.grad_bytes if split is not None else 0
    return moment, max(0, made)


def unwalked_backward(run: RunContext, index: int, transient: int, reread: bool) -> tuple[int, int]:
    """An unwalked recomputed layer's ``transient`` with the residual stream's gradient beside the eager softmax
    backward (the layer's output gradient summed with the MLP block's input gradient, waiting for the attention
    block's: one hidden state in the residual dtype, :mod:`~memplan.estimate.made_gradients`), net of the
    checkpointed input where the recomputed forward reads it (``reread``: its saved tensors for the layer's role
    count it again); the recomputed forward's own moment (gpt-oss's sink attention) net of that input too (its
    pre-norm reads the checkpoint's input, counted with what the layer keeps), with the output
    gradient beside it (the recompute starts once that gradient has arrived) and what the backward made before it
    first unpacked a saved tensor (:func:`~memplan.estimate.grouped_experts_backward.recompute_head_bytes`); where the
    recompute stops early at a LoRA/DoRA adapter of the MLP (:func:`_lora_tail`), that moment with the output gradient,
    net of the input too. Under ``save_on_cpu`` (not ``reread``) both forward moments also hold the checkpoint's input
    brought back to the GPU as a new tensor (:func:`brought_back_input`). Returns the largest of these and the input's
    bytes taken off (the moments of gradients made early are net of them too)."""
    from memplan.estimate.activations import (
        output_gradient_bytes,
        recomputed_forward_transient,
        softmax_backward_bytes,
    )
    from memplan.estimate.grouped_experts_backward import recompute_head_bytes
    from memplan.estimate.layer_costs import layer_blocks

    layer = run.model.layers[index]
    found = layer_blocks(run, layer, index)
    if found is None:
        return transient, 0
    shape, blocks = found
    again = checkpoint_input_bytes(blocks[0] + blocks[1], shape) if reread else 0
    gradient = output_gradient_bytes(shape, run.model.hidden_size)
    softmax = softmax_backward_bytes(layer, shape, blocks)
    residual = softmax and softmax + gradient
    # the recomputed forward runs once the layer's output gradient has arrived, and what the nodes before the first
    # saved tensor's unpacking made: beside it
    forward = recomputed_forward_transient(layer, shape, blocks[1], blocks[0])
    back = 0 if reread else brought_back_input(run, index)  # under save_on_cpu, beside the recomputed forward
    forward = forward and forward + gradient + recompute_head_bytes(layer, shape) + back - again
    tail = _lora_tail(run, index, shape, blocks[1])
    tail = tail and tail + gradient - again + back
    return max(transient - again, residual - again, forward, tail), again


def _lora_tail(run: RunContext, index: int, shape: ActivationShape, mlp_terms: list[Term]) -> int:
    """What layer ``index``'s recomputed forward holds where it stops, at a LoRA or DoRA adapter on the MLP's output
    projection or inside its input projection (:func:`~memplan.estimate.lora_recompute_tail.lora_recompute_tail`, which reads
    the MLP-block terms ``mlp_terms``; without the output gradient; ``--lora-dropout`` priced there), for an
    eager dense layer on one rank without dropout, post-norms nor a quantized base, checkpointed by
    the non-reentrant ``torch.utils.checkpoint`` (a reentrant checkpoint, DeepSpeed's among them, runs the whole
    forward again before the backward: no early stop) without FP8; else 0."""
    job, layer = run.job, run.model.layers[index]
    ft = job.finetune
    from memplan.estimate.layer_costs import layer_fp32_blocks

    # a quantized base: where the MLP reads DoRA's fp32 stream (:mod:`~memplan.estimate.dora_fp32_stream`) only
    fp32 = layer_fp32_blocks(run, index)[1] if ft.quant_kind.quantizes else False
    if (run.counts is None or not ft.peft_kind.adapters or (ft.quant_kind.quantizes and not fp32) or shape.dropout
            or layer.moe is not None or layer.num_post_norms or shape.kernels != "eager" or job.parallel.tp > 1
            or job.recompute.reentrant or job.precision.fp8 is not None or ds_checkpointing_applies(job, run.policy)):
        return 0
    from memplan.estimate.activations import norm_output_bytes
    from memplan.estimate.layer_costs import dora_forward_sizes
    from memplan.estimate.lora_recompute_tail import lora_recompute_tail

    tokens, hidden = shape.seq * shape.micro_batch, run.model.hidden_size
    sizes = dora_forward_sizes(run)  # the adapters' and DoRA's base weight's bytes, as the forward prices them
    # the residual stream's partial sum, unless the MLP's pre-norm saves that very tensor (a norm without an fp32 copy
    # of its input: its input term counts it; an fp32 stream's), and the attention's output where the layer's forward
    # keeps it
    kept = sum(divided(t, shape) for t in mlp_terms if t.role is TermRole.NORM_INPUT)
    residual = 0 if fp32 else max(0, tokens * hidden * shape.residual_bytes - kept)
    return lora_recompute_tail(run.counts.layer_adapters[index], tokens=tokens,
                               residual=residual + (tokens * hidden * shape.act_bytes if layer.attention_output_local
                                                    else 0),
                               mlp_input=tokens * hidden * (NORM_COMPUTE_BYTES if fp32 else norm_output_bytes(shape)),
                               byte_sizes=(shape.act_bytes, sizes["adapter_bytes"], sizes["base_bytes"]),
                               autocast=run.prec.weight_copies == "autocast", mlp_terms=mlp_terms,
                               dropout=ft.lora_dropout > 0,
                               fp32_input=fp32, base_keeps_input=ft.quant_kind.keeps_gemm_inputs)


def recomputed_dora_forward(run: RunContext, index: int, forward_extra: int) -> int:
    """The DoRA forward temporaries (``forward_extra``: the stage's largest) that layer ``index``'s recompute holds
    beside its saved tensors: where the recompute stops inside DoRA on the MLP's output projection (:func:`_lora_tail`
    prices that projection's DoRA forward with what is made by then), the other adapters' only (a layer without
    sinks: the tail's layers are dense), which run before the output projection saves its input and its adapter's
    tensors (less those); else ``forward_extra``."""
    from memplan.estimate.layer_costs import dora_forward_sizes, layer_blocks

    found = layer_blocks(run, run.model.layers[index], index) if forward_extra and run.counts is not None else None
    if found is None or not _lora_tail(run, index, found[0], found[1][1]):
        return forward_extra
    from memplan.estimate.adapter_acts import dora_forward_before_output

    assert run.counts is not None
    later = sum(divided(t, found[0]) for t in found[1][1] if t.role in SAVED_BY_OUTPUT_PROJECTION)
    return max(0, dora_forward_before_output(run.counts.layer_adapters[index], **dora_forward_sizes(run)) - later)


def _walk(run: RunContext, index: int, copies: int, grads: Sequence[int] | None,
          tensors: list[tuple[int, int, int]]) -> int | None:
    """The most the layer's backward holds above its kept ``tensors`` (:func:`~memplan.estimate.recomputed_tensors.saved_tensors`; ``grads``: the sizes
    of the layer's gradients, made where autograd makes them; None: not counted), or None when a plan does
    not apply."""
    from memplan.estimate.reserved_replay import Replay

    replay = Replay(repeat=False)

    def made(positions: Sequence[int] | None) -> None:
        if grads is not None and positions is not None:
            replay.take_all([grads[p] for p in positions])

    saved = walk_events(run, (index, copies), tensors, replay, (made, _nothing), None)
    return None if saved is None else replay.peak_requested - saved


def walk_events(run: RunContext, layer_copies: tuple[int, int], tensors: list[tuple[int, int, int]], replay: Replay,
                hooks: tuple[Callable[[Sequence[int] | None], None], Callable[[], None]],
                kept: tuple[Sequence[Block | None], list[Block | None], list[Block | None]] | None) -> int | None:
    """The walk's events on ``replay`` (``layer_copies``: layer index, recomputed copies' bytes; ``hooks``: gradients
    made at positions, the ledger's moment before the core, an eager core's at its worst op), or None where a plan
    does not apply; returns the bytes requested once the kept tensors are there (``kept``: the reserved schedule's
    blocks of them, slots, freed before the core and after; None: the walk takes them and the forward's saved
    autocast copies)."""
    from memplan.estimate.reserved_mlp_backward import SLOTS, mlp_backward

    (index, copies), shape = layer_copies, run.shape
    plans = _plans(run, index, tensors)
    if plans is None:
        return None
    mlp, core = plans
    slots: list[Any] = [None] * len(SLOTS)  # the op-by-op plans' slots (their Block type is the schedule's int)
    freed: tuple[list[Block | None], list[Block | None]] = ([], [])  # before the core's backward, after it
    normalized: list[Block | None] = []

    def take(when: int) -> None:
        """Take the tensors the walk makes at ``when`` into their slots or free lists."""
        chosen = [(size, role) for size, role, at in tensors if at == when]
        for (_, role), block in zip(chosen, replay.take_all([size for size, _ in chosen])):
            if role >= 0:
                slots[role] = block
            else:
                (normalized if role == NORMALIZED else freed[0 if role == EARLY else 1]).append(block)

    # autocast's weight copies (walk_copies): the saved ones among the kept tensors, a recomputed layer's before the
    # backward starts, a sub-module checkpoint's (the MLP's) with its recompute; each freed with its gradient
    plan, held = copy_plan(run, index, copies), dict[int, "Block | None"]()
    if kept is None:
        take(KEPT)
        _take_copies(replay, plan.saved, plan.saved_late, held, freed[1])
    else:
        slots[:] = kept[0]
        freed[0].extend(kept[1])
        freed[1].extend(kept[2])
    saved = replay.requested
    tokens_hidden = shape.seq * shape.micro_batch * run.model.hidden_size
    if not run.dropped:
        _take_copies(replay, plan.recomputed, plan.recomputed_late, held, freed[1])
    incoming = replay.take(tokens_hidden * shape.residual_bytes)
    if run.model.layers[index].num_post_norms:
        fp32 = tokens_hidden * NORM_COMPUTE_BYTES
        rms_norm_backward(replay, fp32, normalized[0] if normalized else None, replay.take(fp32))
    if run.dropped:
        _take_copies(replay, plan.recomputed, plan.recomputed_late, held, freed[0])
    take(AT_MLP)

    def made(positions: Sequence[int] | None) -> None:
        replay.give(*(held.pop(p, None) for p in positions or ()))
        hooks[0](positions)

    mlp_backward(replay, mlp, slots, made)
    replay.give(*freed[0])
    take(AT_ATTENTION)
    core(replay, slots=slots, made=made, peak=hooks[1])
    replay.give(incoming, *freed[1], *held.values())
    return saved


def _plans(run: RunContext, index: int, tensors: list[tuple[int, int, int]]) -> tuple[Any, Callable[..., None]] | None:
    """The gated MLP's op-by-op plan and the core's backward step for the walk of layer ``index`` (its
    ``tensors``' sizes in their slots), or None where either does not apply."""
    from memplan.estimate.reserved_mlp_backward import SLOTS, layer_gradient_sizes, mlp_plan

    count = len(layer_gradient_sizes(run.model, index, 0))
    sized: list[int | None] = [None] * len(SLOTS)
    for size, role, _ in tensors:
        if role >= 0:
            sized[role] = size
    mlp = mlp_plan(run, index, sized, count, lambda size: size)
    core = _core_step(run, index, sized, count)
    return None if mlp is None or core is None else (mlp, core)


def _take_copies(replay: Replay, sized: Sequence[tuple[int, int]], late: int, held: dict[int, Block | None],
                 freed: list[Block | None]) -> None:
    """Take autocast copies: ``sized`` (gradient position, bytes) into ``held``, each freed with that gradient;
    ``late`` bytes into ``freed``."""
    held.update((position, replay.take(size)) for position, size in sized)
    freed.append(replay.take(late))


def _core_step(run: RunContext, index: int, sized: Sequence[int | None],
               count: int) -> Callable[..., None] | None:
    """The attention core's backward for the walk (called with the replay and ``slots``, ``made``, ``peak``): an
    eager core's op by op (:func:`~memplan.estimate.reserved_attention_backward.core_backward`, the ledger's moment at
    its worst op), else a fused kernel's (:func:`_fused_core`); None where its plan does not apply."""
    if run.shape.attention in UNFUSED_ATTENTION:
        from memplan.estimate.reserved_attention_backward import core_backward, core_plan

        plan = core_plan(run, index, sized, count)
        return None if plan is None else partial(core_backward, plan=plan)  # its moment at its two fp32 tensors
    from memplan.estimate.fused_core_backward import fused_core_plan

    fused = fused_core_plan(run, index, sized, count)
    return None if fused is None else partial(_fused_core, plan=fused)


def _fused_core(replay: Replay, plan: Any, slots: Sequence[Any], made: Callable[[Sequence[int]], None],
                peak: Callable[[], None]) -> None:
    """A fused core's backward (:func:`~memplan.estimate.fused_core_backward.fused_core_backward`), the ledger's
    moment (``peak``) before it."""
    from memplan.estimate.fused_core_backward import fused_core_backward

    peak()
    fused_core_backward(replay, plan, slots, made)


def _nothing() -> None:
    """No ledger moment inside the walk (the eager core's backward marks one in the reserved schedule)."""
