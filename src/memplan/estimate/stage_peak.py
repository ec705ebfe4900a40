"""A stage's candidate peak moments: the loss and its logits, a layer's backward (with the gradients
a framework that frees them has made so far), the end of the backward, the forward's end, the
collective buffers and CUDA graphs at each; the ledger takes the peak (:mod:`memplan.estimate.ledger`)."""

from __future__ import annotations

from collections.abc import Iterator

from memplan.estimate.autocast import tied_embedding_gradient_sum_bytes
from memplan.estimate.context import StageContext
from memplan.estimate.cp_attention import describe as describe_cp
from memplan.estimate.cuda_graphs import GraphMemory, graph_memory
from memplan.estimate.cuda_graphs import describe as describe_cuda_graphs
from memplan.estimate.ep_overlap import combined_step_extra
from memplan.estimate.ep_overlap import describe as describe_ep_overlap
from memplan.estimate.extras import (
    LOSS_NOTES,
    PACKING_NOTE,
    communication_by_phase,
    communication_bytes,
    deferred_wgrad_bytes,
    embedding_activation_bytes,
    head_activation_bytes,
    input_bytes,
    logits_bytes,
    loss_forward_logits_bytes,
    saved_logits_bytes,
    softcap_bytes,
)
from memplan.estimate.fsdp_forward_gather import forward_gathers
from memplan.estimate.fsdp_loss_gather import CHUNKED_NOTE, chunked_loss_block, last_gathered, loss_gather
from memplan.estimate.fsdp_units import head_unit
from memplan.estimate import (
    compiled_loss,
    ds_allreduce,
    final_norm_backward,
    fsdp_block_backward,
    hsdp,
    loss_parallel,
    pipeline_fsdp,
    recomputed_backward,
    zero3_buffers,
    zero12_bucket,
    zero12_offload_staging,
    zero12_step_gradient,
)
from memplan.estimate.finetune import head_activation_bytes_finetune
from memplan.estimate.partial_freeze import root_flow
from memplan.estimate.backward_walk import head_gradients, no_grads_yet, walked_backward
from memplan.estimate import chunked_head_backward
from memplan.estimate import step_gradients
from memplan.estimate.layer_walk import LayerWalk
from memplan.estimate.ledger import (
    ABSENT,
    ACTIVATIONS,
    COMMUNICATION,
    GRAPHS,
    INPUT,
    LAYER_ACTIVATIONS,
    LOGITS,
    TEMPORARY,
    Contribution,
    Ledger,
)
from memplan.estimate.stage_activations import StageActivations
from memplan.estimate.stage_states import StageStates
from memplan.frozen import frozen_dataclass
from memplan.job import resolved_loss
from memplan.profiles.framework import vocab_split
from memplan.units import dtype_bytes

_BACKWARD, _LOSS, _FORWARD, _END = ("backward",), ("loss",), ("forward",), ("end of backward",)
_FORWARDS = ("backward", "loss", "forward")
#: The loss a loop holds through the backward: one fp32 scalar (``nll_loss``'s output).
_LOSS_SCALAR_BYTES = 4
_AUTOCAST_CACHE_NOTE = ("torch.autocast's cache holds the 16-bit copies of the checkpointed layers' weights "
                        "until the forward's autocast region exits, after the loss's forward (nothing saves them)")


@frozen_dataclass
class LossPart:
    """The last stage's loss: logits alive at the loss, those saved into the backward, the head's
    saved activations, and what ``save_on_cpu`` moves or brings back."""

    logits: int = 0
    saved_logits: int = 0
    head: int = 0
    cpu: int = 0
    bring_back: int = 0
    #: Of ``logits``, what the loss's forward holds when it returns (its backward may hold more).
    forward_logits: int = 0
    #: torchtune's chunked loss with a trained head: its per-chunk backward's temporaries beside every layer's
    #: activations (:mod:`~memplan.estimate.chunked_head_backward`; 0: none).
    head_backward: int = 0


def loss_part(ctx: StageContext, acts: StageActivations, st: StageStates) -> LossPart:
    """The loss of the newest micro-batch on the stage with the head (each MTP depth has its own)."""
    run, layout = ctx.run, ctx.layout
    if not layout.has_head:
        return LossPart()
    job, shape = run.job, run.shape
    loss = resolved_loss(job)
    head = head_activation_bytes(shape) if st.ft is None else head_activation_bytes_finetune(
        run.model, job, shape, run.policy.input_grads)
    softcap = run.model.final_logit_softcap is not None
    # the soft-cap's tanh output is held by autograd alone (the chain rebinds the logits): under save_on_cpu it
    # is packed to host memory, not on the GPU beside the cross-entropy's tensors, and comes back only for
    # tanh's own backward (with the loss's other saved tensors, ``bring_back``)
    held_softcap = softcap and not acts.per_tensor_offload
    depths = 1 + job.mtp_layers
    logits = logits_bytes(job, loss, shape, run.vocab_rows, held_softcap) * depths
    if loss_parallel.applies(job, run.profile):
        logits = max(logits, loss_parallel.loss_parallel_bytes(shape, run.vocab_rows) * depths)
    saved = saved_logits_bytes(job, loss, shape, run.vocab_rows, softcap) * depths
    forward = min(logits, loss_forward_logits_bytes(job, loss, shape, run.vocab_rows, held_softcap) * depths)
    if compiled_loss.priced(run):  # --compile with a compiled cross-entropy (one depth, eager losses aside)
        logits, saved = compiled_loss.compiled_loss_bytes(shape, run.vocab_rows, softcap_bytes(shape, run.vocab_rows, softcap),
                                                          compiled_loss.loss_chunks(run))
        forward = saved
    cpu = bring_back = 0
    if acts.per_tensor_offload:
        # what the loss saves goes to host memory too; the loss backward brings it back, and only
        # the loss value itself (an fp32 scalar per loss, held by the loop) stays on the GPU
        cpu, bring_back = saved + head, saved
        saved, head = _LOSS_SCALAR_BYTES * depths, 0
    head += deferred_wgrad_bytes(job, shape, run.vocab_rows)
    # the head's per-chunk backward: what the final norm and the head saved still held (on the GPU)
    chunked = chunked_head_backward.chunked_head_backward_bytes(run, head + acts.head_copy, held_softcap) \
        if loss == "chunked" else 0
    chunked += chunked_head_backward.fsdp_buffers_shift(ctx, st) if chunked else 0  # FSDP2's buffers there
    return LossPart(logits=logits, saved_logits=saved, head=head, cpu=cpu, bring_back=bring_back,
                    forward_logits=forward, head_backward=chunked)


def forward_bindings(bound: int, held: int) -> Iterator[Contribution]:
    """What the modeling code keeps bound at the last layer's forward moment, beside its temporaries, each with its
    sentence: the embedding's output (``bound``: :func:`~memplan.estimate.input_leaf.bound_embedding_output`) and, at
    DoRA's step on the MLP's output projection or an attention input projection, the tensors its decoder layer holds
    there less its saved tensors not made yet (``held``, negative where those outweigh:
    :func:`~memplan.estimate.dora_forward_moment.dora_moment_locals`)."""
    yield Contribution(TEMPORARY, bound, _FORWARD, note=(
        f"the model's forward keeps the embedding's output bound until it returns (transformers' inputs_embeds): "
        f"{bound / 2**20:,.1f} MiB at the last layer's forward, where no saved tensor holds it" if bound else ""))
    yield Contribution(TEMPORARY, held, _FORWARD, note=(
        f"DoRA's weight-norm step in the last layer (its MLP output projection, or its first adapted attention input "
        f"projection): the tensors the decoder layer binds there and nothing saves (its input, the block's input, the "
        f"residual after attention, the masks), less that layer's saved tensors not made yet: {held / 2**20:+,.1f} MiB"
        if held else ""))


def phase_contributions(ctx: StageContext, st: StageStates, walk: LayerWalk, acts: StageActivations,
                        loss: LossPart, forward_extra: int, moment: BackwardMoment) -> Iterator[Contribution]:
    """What is alive at each candidate moment beyond the model states and workspaces (``moment``: the backward's
    worst step, :func:`backward_moment`)."""
    run, layout = ctx.run, ctx.layout
    job = run.job
    absent = no_grads_yet(ctx)  # gradients freed after the previous step, not made again yet
    yield Contribution(ABSENT, st.states.gradients if absent else 0, _FORWARDS,
                       note=step_gradients.note(ctx) if absent else "")
    yield Contribution(LAYER_ACTIVATIONS, acts.layers, _FORWARDS)
    yield Contribution(ACTIVATIONS, acts.layers, ("loss", "forward"))
    yield Contribution(ACTIVATIONS, acts.other - acts.head_copy, _FORWARDS)
    # the head's autocast weight copy: made by the head's linear, in the loss (after the last layer's forward)
    yield Contribution(ACTIVATIONS, acts.head_copy, _LOSS)
    yield Contribution(ACTIVATIONS, acts.unused_buffers, ("loss", "forward"))
    yield Contribution(ACTIVATIONS, loss.head, _LOSS)
    yield Contribution(LOGITS, loss.logits, _LOSS)
    # autocast's cached copies: alive until the loss's forward returns, gone in its backward
    yield Contribution(TEMPORARY, max(0, acts.autocast_cache - (loss.logits - loss.forward_logits)), _LOSS,
                       note=_AUTOCAST_CACHE_NOTE if acts.autocast_cache else "")
    yield Contribution(TEMPORARY, acts.autocast_cache, _FORWARD)
    yield from (Contribution(LOGITS, 0, _LOSS, note=note) for note in _loss_notes(ctx))
    yield from _backward(ctx, walk, moment)
    fsdp = fsdp_block_backward.block_backward(ctx, st, walk)  # FSDP2's tensors at a block's backward: the sentence
    if fsdp is not None:
        yield from fsdp.contributions(moment[2])
    # the last layer's forward temporaries (DoRA's weights, gpt-oss's sink attention),
    # the layers' activations held
    yield Contribution(TEMPORARY, forward_extra if not ctx.recomputed else 0, _FORWARD)
    yield Contribution(TEMPORARY, _tied_sum(ctx, st), _END, note=(
        "tied embedding: its two gradients (head and embedding) are summed at the end of the backward "
        "(two weight-sized temporaries)" if run.model.tie_word_embeddings and run.profile.frees_gradients else ""))
    inputs = 0
    if layout.has_embedding or layout.has_head:
        inputs = input_bytes(run.shape, run.profile.full_batch_tensors, job.parallel.cp)
    # The batch: counted at the peak, not in choosing it.
    yield Contribution(INPUT, inputs * layout.inflight_microbatches, _FORWARDS, weighs=False,
                       note=PACKING_NOTE if job.batch.packing else "")
    if job.overlap.ep_a2a:
        # Megatron's combined 1F1B (--overlap-moe-expert-parallel-comm): the next micro-batch's forward runs
        # layer by layer beside this backward, so its layer (and that micro-batch's batch and embedding
        # output) is alive beside it, at the layer pair's worst moment (memplan.estimate.ep_overlap).
        ep_layer = combined_step_extra(walk.ep_parts, early_release=job.overlap.early_attn_release)
        if layout.has_embedding:
            ep_layer += embedding_activation_bytes(run.shape)
        yield Contribution(ACTIVATIONS, ep_layer, _BACKWARD)
        yield Contribution(LAYER_ACTIVATIONS, ep_layer, _BACKWARD)
        yield Contribution(INPUT, inputs, _BACKWARD)
    for note in _overlap_notes(ctx):
        yield Contribution(ACTIVATIONS, 0, _BACKWARD, note=note)


def forward_peaks(acts: StageActivations, forward_extra: int, ctx: StageContext, st: StageStates) -> bool:
    """Whether the end of the forward is a candidate peak: DeepSpeed's contiguous checkpoint buffers
    not yet filled, ZeRO-3's last prefetch buffer, or the last layer's forward temporaries (DoRA's weights, gpt-oss's
    sink attention)."""
    return (bool(acts.unused_buffers) or bool(forward_extra and not ctx.recomputed)
            or zero3_buffers.flat_gather_elements(ctx, st.params) > 0)


def _backward(ctx: StageContext, walk: LayerWalk, moment: BackwardMoment) -> Iterator[Contribution]:
    """The backward's worst step (:func:`backward_moment`)."""
    layers, temp, _, final_norm = moment
    if final_norm:
        yield Contribution(TEMPORARY, 0, _BACKWARD, note=final_norm_backward.NOTE)
    yield Contribution(ACTIVATIONS, layers, _BACKWARD, note=_policy_independent_note(ctx))
    yield Contribution(TEMPORARY, temp, _BACKWARD, note=recomputed_backward.NOTE if walk.walked else "")


#: :func:`backward_moment`'s (activations, temporaries, the walk's position of its layer or None, whether it is the
#: final norm's).
BackwardMoment = tuple[int, int, int | None, bool]


def backward_moment(ctx: StageContext, st: StageStates, walk: LayerWalk, acts: StageActivations,
                    loss: LossPart) -> BackwardMoment:
    """(activations, temporaries, the walk's position of its layer or None, whether it is the final norm's) of the
    backward's worst step: a layer's (the head's backward has run, so what the final norm, the head (its autocast
    weight copy included) and the loss saved is released, and its gradient exists;
    :func:`~memplan.estimate.backward_walk.walked_backward`) or, before them, the final norm's backward beside every
    layer's saved activations (:mod:`~memplan.estimate.final_norm_backward`; position None: the reserved schedule
    checks it before the last layer's backward)."""
    moment = walked_backward(ctx, st, walk, acts)
    # save_on_cpu: the loss's saved tensors come back for the head's backward, done before any layer's (the loss
    # moment's logits price that backward) where the backward is walked
    back = acts.bring_back if moment.walked else max(acts.bring_back, loss.bring_back)
    layers, temp = moment.layers, moment.temp + (st.step_temp if ctx.run.job.optimizer.in_backward else 0) + back
    norm = final_norm_backward.final_norm_backward_bytes(ctx)
    head_grads = head_gradients(ctx, st)
    if norm and acts.layers + head_grads + norm > layers + temp:
        return acts.layers, head_grads + norm, None, True
    if loss.head_backward and acts.layers + loss.head_backward > layers + temp:  # torchtune's chunked loss's head
        return acts.layers, loss.head_backward, None, False
    return layers, temp, moment.position, False


def communication(ctx: StageContext, st: StageStates, acts: StageActivations, forward: bool,
                  loss: LossPart) -> tuple[list[Contribution], int]:
    """The collective buffers alive at each moment (the end of the forward: as at the loss), and
    their most during the step; FSDP under a pipeline schedule: :mod:`memplan.estimate.pipeline_fsdp`; DeepSpeed's
    ZeRO-3: :mod:`memplan.estimate.zero3_buffers`; its ZeRO-1/2: :mod:`memplan.estimate.zero12_bucket`,
    :mod:`memplan.estimate.zero12_step_gradient`, :mod:`memplan.estimate.zero12_offload_staging`; without ZeRO:
    :mod:`memplan.estimate.ds_allreduce`; FSDP2's last all-gather output at a loss inside the model's forward:
    :mod:`memplan.estimate.fsdp_loss_gather`; its forward's copy-outs: :mod:`memplan.estimate.fsdp_forward_gather`."""
    run = ctx.run
    if pipeline_fsdp.applies(ctx, st):
        return _with_most(list(pipeline_fsdp.pipeline_fsdp_contributions(ctx, st, acts)))
    if run.profile.zero3_buffers is not None and zero3_buffers.applies(run.job, run.profile, run.prec):
        return _with_most(zero3_buffers.contributions(ctx, st.params, st.states.optimizer_numel, forward))
    if zero12_bucket.applies(run.job, run.profile):
        return _with_most(zero12_bucket.contributions(ctx, st) + zero12_step_gradient.contributions(ctx, st)
                          + zero12_offload_staging.contributions(ctx, st))
    if run.profile.stage0_allreduce_elements and ds_allreduce.applies(run.job, run.profile):
        return _with_most(ds_allreduce.contributions(ctx, st))
    head = head_unit(ctx)
    comm_at = communication_by_phase(run.job, run.profile, st.params, run.prec,
                                     communication_bytes(run.job, run.profile, st.params, st.states, run.prec),
                                     tied=run.model.tie_word_embeddings, head=head)
    gathers = forward_gathers(ctx, st.params, head)
    out = [Contribution(COMMUNICATION, size, (phase, "forward") if phase == "loss" and forward and not gathers.most
                        else (phase,)) for phase, size in comm_at.items()]
    if gathers.most:  # the last layer's forward: its parameters and all-gather output beside the kept units
        out.append(Contribution(COMMUNICATION, gathers.last_layer, ("forward",), note=gathers.note))
    most = max(*comm_at.values(), gathers.most)
    gathered = last_gathered(ctx, head) if run.profile.loss_in_model_forward else 0  # (the default job's fast path)
    block = chunked_loss_block(ctx, head, comm_at["loss"], st.params.root * dtype_bytes(run.prec.compute)) \
        if run.job.sharding.fsdp != "none" and run.profile.torch_optimizer else 0
    if block:
        out.append(Contribution(COMMUNICATION, -block, ("loss",), note=CHUNKED_NOTE))
    if gathered:
        gather = loss_gather(gathered, loss.logits, loss.forward_logits, acts.autocast_cache)
        out.append(Contribution(COMMUNICATION, gather.at_loss, ("loss",), note=gather.note))
        most = max(most, comm_at["loss"] + gather.nbytes)
    note = pipeline_fsdp.finetune_note(ctx, st)
    out += [note] if note is not None else []
    # the backward's last unit: the embedding's where the head is a unit apart, else the root
    held = hsdp.contributions(ctx, st, st.params.root - (head or 0)) if run.job.sharding.fsdp == "hybrid" else []
    if held:
        out, at_once = _with_most(out + held)
        most = max(most, at_once)
    return out, most


def _with_most(held: list[Contribution]) -> tuple[list[Contribution], int]:
    """``held`` and the most of its communication buffers alive at one moment."""
    most = max(sum(c.nbytes for c in held if c.category == COMMUNICATION and c.live_at(phase))
               for phase in ("loss", "backward", "end of backward", "optimizer step"))
    return held, most


#: A stage without CUDA graphs (graph_memory's figures for ``--cuda-graph-impl none``).
_NO_GRAPHS = GraphMemory()


def graphs(ctx: StageContext, ledger: Ledger, walk: LayerWalk, inputs: int) -> GraphMemory:
    """CUDA graphs' pool and static buffers (:mod:`memplan.estimate.cuda_graphs`), added to the ledger."""
    job = ctx.job
    if job.cuda_graphs.impl == "none":  # nothing captured: no pool, no static buffers, no sentence
        return _NO_GRAPHS
    weighed = ledger.weighed()
    memory = graph_memory(job.cuda_graphs, ctx.layout, ctx.shape, weighed, walk.chunk_graph, walk.chunk_graph_layers,
                          walk.graph_worst_backward, inputs, cp=job.parallel.cp, num_microbatches=job.num_microbatches)
    note = describe_cuda_graphs(job.cuda_graphs.impl, job.cuda_graphs.module_names)
    ledger.add(*(Contribution(GRAPHS, memory.extra_at(phase), (phase,)) for phase in ledger.phases))
    ledger.add(Contribution(GRAPHS, 0, _BACKWARD, note=note))
    return memory


def _tied_sum(ctx: StageContext, st: StageStates) -> int:
    """The end of the backward: a tied embedding's two gradients being summed (none when the tied
    weight does not train fully)."""
    run = ctx.run
    if st.ft is not None and (st.ft.full == 0
                              or not root_flow(run.model, run.job.finetune, False).embedding_trained_fully):
        return 0
    return tied_embedding_gradient_sum_bytes(run.model, ctx.layout, run.vocab_rows,
                                             vocab_split(run.profile, run.job.parallel.tp), _summed_grad_bytes(ctx))


def _summed_grad_bytes(ctx: StageContext) -> int:
    """Bytes per element of the gradients autograd sums for a tied embedding: the stored gradient's
    dtype, or under PyTorch FSDP2 the unsharded parameters' (compute) dtype, before the reduce-scatter."""
    if ctx.job.sharding.fsdp != "none" and ctx.profile.torch_optimizer:
        return dtype_bytes(ctx.prec.compute)
    return ctx.prec.grad_bytes


def _loss_notes(ctx: StageContext) -> list[str]:
    job = ctx.job
    loss = resolved_loss(job)
    out = [f"loss path '{loss}': logits of the newest micro-batch on the last stage"]
    if loss in LOSS_NOTES and not compiled_loss.priced(ctx.run):  # a compiled loss says what it keeps instead
        out.append(LOSS_NOTES[loss])
    if loss_parallel.applies(job, ctx.profile):
        out.append(loss_parallel.NOTE)
    if loss == "chunked" and ctx.layout.has_head and chunked_head_backward.applies(ctx.run):
        out.append(chunked_head_backward.NOTE)
        out += [chunked_head_backward.FSDP_NOTE] if job.sharding.fsdp != "none" and ctx.profile.torch_optimizer else []
    if job.mtp_layers:
        out.append(f"{job.mtp_layers} multi-token-prediction module(s) on the last stage: a decoder layer shaped like "
                   "the last, a 2h->h projection, norms, their own logits and loss, and a copy of the embedding")
    return out


def _policy_independent_note(ctx: StageContext) -> str:
    """Context parallelism's attention buffers in a layer's backward (Transformer Engine)."""
    par = ctx.job.parallel
    if par.cp > 1 and ctx.profile.te_context_parallel:
        return describe_cp(ctx.job.overlap.cp_comm_types, par.cp)
    return ""


def _overlap_notes(ctx: StageContext) -> list[str]:
    model, ov = ctx.model, ctx.job.overlap
    return describe_ep_overlap(ep_a2a=ov.ep_a2a, delay_wgrad=ov.delay_wgrad, early_release=ov.early_attn_release,
                               experts_wgrad=ov.experts_wgrad_overlap and model.is_moe,
                               shared_overlap=ov.shared_expert_overlap and any(
                                   layer.moe is not None and layer.moe.shared_expert is not None
                                   for layer in model.layers))
