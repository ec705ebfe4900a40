"""Mechanic: where a stage's saved activations live at the end of its forwards.

From the layer walk (:mod:`memplan.estimate.layer_walk`): the in-flight chunks' layers, the MTP
modules, what the embedding, the shared RoPE tables and masks and the autocast weight copies save,
and what CPU offloading moves off the GPU (fine-grained module offload, DeepSpeed checkpointing,
layer-pipelined offload, PyTorch's ``save_on_cpu``).
"""

from __future__ import annotations

from memplan.estimate import input_leaf, offload_weights
from memplan.estimate.autocast import autocast_weight_copy_numel
from memplan.estimate.compiled import keeps_masks
from memplan.estimate.context import StageContext
from memplan.estimate.ds_checkpointing import (
    GPU_RESIDENT_INPUTS,
    contiguous_unused_bytes,
    describe_ds_checkpointing,
    ds_checkpointing_applies,
    partition_bytes,
)
from memplan.estimate.extras import checkpointed_mask_bytes, embedding_activation_bytes, rope_table_bytes
from memplan.estimate.finetune import StageFinetune, adapter_bytes
from memplan.estimate.frozen_copies import FROZEN_COPIES_NOTE, frozen_weight_copies
from memplan.estimate.input_leaf import input_leaf_bytes, leaf_apart_bytes
from memplan.estimate.layer_costs import (
    largest_saved_term,
    layer_costs,
    mtp_activation_bytes,
    per_tensor_offload,
)
from memplan.estimate.layer_walk import LayerWalk
from memplan.estimate.partial_freeze import any_attention_saves, uncast_trained_numel, uncopied_trained_numel
from memplan.estimate.trained_dtypes import uncopied_expert_numel
from memplan.frozen import frozen_dataclass
from memplan.profiles.framework import head_rows_split
from memplan.units import dtype_bytes

#: The --explain sentence of the autocast copies ``save_on_cpu`` cannot take off the GPU.
OFFLOADED_COPIES_NOTE = ("save_on_cpu with torch.autocast: the 16-bit weight copies autograd saves go to host "
                         "memory, but autocast's cache keeps every one on the GPU until the forward's autocast "
                         "region exits, after the loss's forward")


@frozen_dataclass
class StageActivations:
    """The stage's saved activations at the end of its in-flight forwards (one rank)."""

    #: The decoder layers' (and MTP modules') on the GPU.
    layers: int
    #: Embedding output, shared RoPE tables and masks, autocast weight copies.
    other: int
    #: Of ``other``: the output head's autocast weight copy (released before a layer's backward).
    head_copy: int
    #: In CPU memory.
    cpu: int
    #: DeepSpeed's contiguous checkpoint buffers not yet filled.
    unused_buffers: int
    #: The worst layer backward, with fine-grained offload's reloads.
    worst_backward: int
    #: ``save_on_cpu``: the largest saved tensor a layer backward brings back (0 otherwise).
    bring_back: int
    per_tensor_offload: bool
    notes: tuple[str, ...] = ()
    #: Autocast weight copies no autograd node saves (checkpointed layers' and modules'): held by
    #: autocast's cache until the forward's autocast region exits, after the loss (0 without autocast).
    autocast_cache: int = 0
    #: Of ``other``: the 4-D masks checkpointed layers keep (one per kind of layer), each released in the backward
    #: after its last user's (:mod:`memplan.estimate.mask_lifetime`).
    masks: int = 0


def stage_activations(ctx: StageContext, walk: LayerWalk, ft: StageFinetune | None) -> StageActivations:
    run, layout = ctx.run, ctx.layout
    job, inflight_chunks = run.job, layout.inflight_chunks
    notes: list[str] = []
    if layout.has_head and job.mtp_layers:
        walk.chunk_kept[-1] += job.mtp_layers * mtp_activation_bytes(run)
    layers = sum(walk.chunk_kept[c] for c in inflight_chunks)
    cpu = sum(walk.chunk_cpu[c] for c in inflight_chunks)
    worst = walk.worst_backward
    if job.offload.module_names:
        # imported here: only jobs with fine-grained offloading need it (memplan's start-up)
        from memplan.estimate.fine_offload import describe as describe_fine_offload
        from memplan.estimate.fine_offload import stage_offload

        off = job.offload
        moved = stage_offload(run.model, off, run.shape, layout, set(ctx.recomputed), kept_classes=run.kept_classes,
                              dropped=run.dropped)
        layers, cpu, worst = layers - moved.cpu_bytes, cpu + moved.cpu_bytes, worst + moved.reload_bytes
        notes.append(describe_fine_offload(off.module_names, min_numel=off.min_tensor_numel,
                                           fraction=off.group_fraction, delta=off.pp_delta_bytes))
    layers, cpu, unused = _deepspeed_checkpoints(ctx, walk, layers, cpu)
    rc = job.recompute
    if rc.partition_activations or rc.cpu_checkpointing:
        notes.append(describe_ds_checkpointing(job) or "")
    per_tensor = per_tensor_offload(run)
    if job.offload.activations and layers and not per_tensor:
        # Saved activations stream to CPU memory after each layer's forward; the GPU keeps the
        # layer being computed and the one being copied.
        on_gpu = min(layers, 2 * max(layer_costs(run, run.model.layers[i], i)[0] for i in layout.layer_indices))
        cpu, layers = layers - on_gpu, on_gpu
    rope, masks = _shared_tables(ctx)
    other, head_copy, saved_copies, frozen_copies = _other_activations(ctx, ft, rope + masks)
    if leaf_apart_bytes(ctx):
        notes.append(input_leaf.NOTE)
    if frozen_copies:
        notes.append(FROZEN_COPIES_NOTE)
    bring_back = 0
    if per_tensor:
        held, bring_back, weight_back = _save_on_cpu(ctx, walk)
        cpu += layers + other - held
        if weight_back:
            notes.append(offload_weights.NOTE)
        layers, other, head_copy, masks = 0, held, 0, _held_masks(ctx)
        if saved_copies:
            notes.append(OFFLOADED_COPIES_NOTE)
    cache = _autocast_cache(ctx, walk, per_tensor, saved_copies)
    return StageActivations(layers=layers, other=other, head_copy=head_copy, cpu=cpu, unused_buffers=unused,
                            worst_backward=worst, bring_back=bring_back, per_tensor_offload=per_tensor,
                            notes=tuple(notes), autocast_cache=cache, masks=masks)


def _save_on_cpu(ctx: StageContext, walk: LayerWalk) -> tuple[int, int, bool]:
    """``save_on_cpu``: every tensor autograd saves (the layers' and checkpointed layers' inputs, the
    embedding output, autocast's weight copies) is in host memory; the backward brings back one
    operator's at a time. Returns (what stays on the GPU: the RoPE tables and eager masks checkpointed
    layers share as checkpoint arguments, held until the backward; the largest tensor a layer brings
    back: a recomputed layer gets back only its checkpointed input, which its recompute then saves,
    made in the backward outside save_on_cpu and already in its backward working set; any other
    layer, the largest tensor it saved, a weight included (:mod:`memplan.estimate.offload_weights`);
    whether that weight is the largest)."""
    run, layout = ctx.run, ctx.layout
    held = 0
    if run.policy.kind.checkpoints_layers and ctx.recomputed and layout.layer_indices:
        held = rope_table_bytes(run.model, run.shape) * layout.inflight_microbatches + _held_masks(ctx)
    # the embedding's output leaf (input_leaf): AccumulateGrad keeps it on the GPU whatever save_on_cpu copies
    held += input_leaf_bytes(ctx)
    kept = [i for i, _, _ in walk.per_layer if i not in ctx.recomputed]
    saved, weight = largest_saved_term(run, kept), offload_weights.largest_saved_weight(run, kept)
    return held, max(saved, weight), weight > saved


def _held_masks(ctx: StageContext) -> int:
    """Under ``save_on_cpu``: the 4-D masks checkpointed layers keep on the GPU as checkpoint arguments."""
    run, layout = ctx.run, ctx.layout
    if not (run.policy.kind.checkpoints_layers and ctx.recomputed and layout.layer_indices):
        return 0
    return checkpointed_mask_bytes(run.model, run.shape, True) * layout.inflight_microbatches


def _autocast_cache(ctx: StageContext, walk: LayerWalk, offloaded: bool, saved_copies: int) -> int:
    """The weight copies autocast's cache alone keeps alive at the loss.

    torch.autocast caches the 16-bit copy of every fp32 weight that requires a gradient (a leaf, cast
    under grad mode or not) until the outermost autocast region exits; the loops compute the loss
    inside it (torchtitan's ``maybe_enable_amp``, the HF model's forward), so at the loss the copies
    of checkpointed layers, which nothing saves, are alive too (the same ones their recompute makes
    again: the walk's ``recomputed_copies``), with their fp32 adapters' under fine-tuning. Under
    ``save_on_cpu`` (``offloaded``) the copies autograd saves (``saved_copies``) go to host memory,
    but the cache still holds their GPU originals: every layer's and the head's."""
    run = ctx.run
    adapters = sum(cached_adapter_copies(ctx, i, offloaded) for i in ctx.layout.layer_indices) \
        if run.counts is not None else 0
    return walk.recomputed_copies + adapters + (saved_copies if offloaded else 0)


def cached_adapter_copies(ctx: StageContext, index: int, offloaded: bool = False) -> int:
    """A checkpointed layer's adapter weight copies (fp32 adapters under autocast: lora_A and lora_B are
    linears, their copies cached like the base weights'), which its layer terms do not count; with
    ``offloaded`` (``save_on_cpu``: its layer terms are in host memory) any layer's."""
    run = ctx.run
    if run.counts is None:
        return 0
    compute = dtype_bytes(run.prec.compute)
    if (run.prec.weight_copies != "autocast" or adapter_bytes(run.job) == compute
            or not (offloaded or index in ctx.recomputed or run.policy.kind.per_op)):
        return 0
    return run.counts.layers[index].adapter * compute


def _deepspeed_checkpoints(ctx: StageContext, walk: LayerWalk, layers: int, cpu: int) -> tuple[int, int, int]:
    """(layers on the GPU, CPU bytes, unused contiguous buffers) with DeepSpeed's checkpointing switches."""
    if not ds_checkpointing_applies(ctx.job, ctx.policy):
        return layers, cpu, 0
    rc, layout = ctx.job.recompute, ctx.layout
    counts = [sum(1 for p, i in enumerate(chunk) if i in ctx.recomputed and p % ctx.group == 0)
              for chunk in layout.chunks]
    warmup = sum(counts[c] for c in layout.inflight_chunks)
    if rc.cpu_checkpointing and not rc.partition_activations:
        # the offload engine's newest input and the one being copied stay on the GPU
        layers += min(GPU_RESIDENT_INPUTS, warmup) * walk.largest_ckpt
        cpu -= min(1, warmup) * walk.largest_ckpt
    unused = contiguous_unused_bytes(rc, partition_bytes(walk.largest_ckpt, ctx.job.parallel.tp), warmup,
                                     min((n for n in counts if n), default=0))
    if rc.cpu_checkpointing:
        cpu, unused = cpu + unused, 0
    return layers, cpu, unused


def _shared_tables(ctx: StageContext) -> tuple[int, int]:
    """(RoPE tables, checkpointed masks) shared by the stage's layers (eager profiles), for its in-flight
    micro-batches."""
    run, layout = ctx.run, ctx.layout
    model, shape, inflight = run.model, run.shape, layout.inflight_microbatches
    if not layout.layer_indices or not (run.counts is None or any_attention_saves(
            model, run.job.finetune, run.policy.input_grads, layout.layer_indices)):
        return 0, 0
    masks = checkpointed_mask_bytes(model, shape, run.policy.keeps_mask or keeps_masks(run))
    return rope_table_bytes(model, shape) * inflight, masks * inflight


def _other_activations(ctx: StageContext, ft: StageFinetune | None, shared: int) -> tuple[int, int, int, int]:
    """(embedding, ``shared`` tables and masks, autocast copies; of them the head's copy; of them the
    copies autocast's cache holds too, the head's included; of them the frozen weights' copies)."""
    run, layout = ctx.run, ctx.layout
    model, shape, inflight = run.model, run.shape, layout.inflight_microbatches
    other = embedding_activation_bytes(shape) * inflight if layout.has_embedding else 0
    other += leaf_apart_bytes(ctx) + shared
    if run.prec.weight_copies != "autocast":
        return other, 0, 0, 0
    # torch.autocast casts the weights linear layers read (the decoder's and the output
    # head's) and autograd saves the 16-bit copies; embedding tables and norms are not cast.
    head = head_numel(ctx) if layout.has_head else 0
    layers = autocast_weight_copy_numel(model, run.job, layout, recomputed=set(ctx.recomputed),
                                        policy=run.policy.kind,
                                        eager_experts=run.profile.kernels == "eager", modules=run.policy.modules)
    frozen_layers = frozen_head = 0
    if ft is not None:
        # Only fully trained (fp32) weights are cast and cached; frozen ones stored in another dtype are cast at
        # each call, uncached (frozen_copies); 16-bit frozen weights are used as they are, and the adapters'
        # copies are part of their layers' terms.
        head, layers = 0, ft.full - _uncopied(ctx, ft)
        frozen_layers, frozen_head = frozen_weight_copies(ctx, ft)
    compute = dtype_bytes(run.prec.compute)
    frozen = (frozen_layers + frozen_head) * compute
    cached = (layers + head) * compute
    return other + cached + frozen, (head + frozen_head) * compute, cached, frozen


def _uncopied(ctx: StageContext, ft: StageFinetune) -> int:
    """Of the stage's fully trained weights (``ft.full``, one rank), those whose autocast copy is not saved:
    the recomputed layers' (made again in the backward), those whose input needs no gradient
    (:func:`memplan.estimate.partial_freeze.uncopied_trained_numel`), the norms and embedding table autocast never
    casts (:func:`~memplan.estimate.partial_freeze.uncast_trained_numel`) and, under eager kernels, HF's grouped
    experts' (never copied: :func:`memplan.estimate.trained_dtypes.uncopied_expert_numel`); scaled to one
    rank as ``ft.full`` is."""
    run, counts = ctx.run, ctx.run.counts
    if counts is None:
        return 0
    recomputed = [i for i in ctx.layout.layer_indices if i in ctx.recomputed]
    kept = tuple(i for i in ctx.layout.layer_indices if i not in ctx.recomputed)
    ft_job = run.job.finetune
    own_layers = run.profile.kernels != "eager"
    numel = (uncopied_trained_numel(run.model, ft_job, run.policy.input_grads, kept, own_layers)
             + sum(counts.layers[i].trained for i in recomputed)
             + uncast_trained_numel(run.model, ft_job, kept, ctx.layout.has_embedding, ctx.layout.has_head))
    if run.profile.kernels == "eager":
        numel += uncopied_expert_numel(run.model, ft_job, kept)
    if not numel:
        return 0
    root = counts.root.trained if ctx.layout.has_head or ctx.layout.has_embedding else 0
    trained = root + sum(counts.layers[i].trained for i in ctx.layout.layer_indices)
    return ft.full * numel // trained if trained else 0


def head_numel(ctx: StageContext) -> int:
    """The output head's weight on one TP rank."""
    model = ctx.model
    return ctx.run.vocab_rows * model.hidden_size // head_rows_split(ctx.profile, ctx.job.parallel.tp,
                                                                     model.tie_word_embeddings)
