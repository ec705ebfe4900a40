"""One pipeline stage: run its mechanics, enter their contributions in the ledger, take the peak and
build the :class:`~memplan.estimate.result.StageEstimate` (with the contributions' sentences)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import chain

from memplan.estimate.context import StageContext
from memplan.estimate.cuda_graphs import GraphMemory, graph_count
from memplan.estimate.dora_forward_moment import dora_moment_locals
from memplan.estimate.fp32_outputs import contributions as fp32_outputs
from memplan.estimate.frozen_core_forward import frozen_core_forward
from memplan.estimate.input_leaf import bound_embedding_output
from memplan.estimate.layer_costs import dora_transient, sink_forward_transient
from memplan.estimate.layer_walk import LayerWalk, walk_layers
from memplan.estimate.ledger import (
    ABSENT,
    ACTIVATIONS,
    COMMUNICATION,
    GRADIENTS,
    GRAPHS,
    INPUT,
    LAYER_ACTIVATIONS,
    LOGITS,
    OUTSIDE,
    TEMPORARY,
    WORKSPACE,
    Ledger,
    Peak,
)
from memplan.estimate.result import StageEstimate
from memplan.estimate.stage_activations import StageActivations, stage_activations
from memplan.estimate.stage_buffers import stage_buffers
from memplan.estimate.stage_peak import (
    LossPart,
    backward_moment,
    communication,
    forward_bindings,
    forward_peaks,
    graphs,
    loss_part,
    phase_contributions,
)
from memplan.estimate.stage_states import StageStates, model_states

#: The CUDA caching allocator's segment granularity (reserved memory is rounded up to it).
_SEGMENT = 2 * 1024 * 1024

_BASE_PHASES = ("backward", "optimizer step", "end of backward")


@dataclass(frozen=True)
class StageParts:
    """What the stage's reserved-memory schedule is built from (:func:`simulate_stage`)."""

    ctx: StageContext
    ledger: Ledger
    walk: LayerWalk
    acts: StageActivations
    loss: LossPart
    #: The walk's position of the backward's worst step (:func:`~memplan.estimate.stage_peak.backward_moment`).
    walked: int | None


def stage_estimate(ctx: StageContext, *, simulate_reserved: bool = False) -> tuple[StageEstimate, list[str]]:
    """The stage's figures at its peak, and the sentences of the contributions that made them.

    ``simulate_reserved``: the reserved figure from the allocator simulator run on the stage's
    schedule (:mod:`memplan.estimate.reserved_sim`) instead of the stated fragmentation."""
    stage, notes, parts = stage_parts(ctx)
    return simulate_stage(stage, notes, parts) if simulate_reserved else (stage, notes)


def simulate_stage(stage: StageEstimate, notes: list[str], parts: StageParts) -> tuple[StageEstimate, list[str]]:
    """The stage's figures (``stage``, ``notes``: :func:`stage_parts`'s) with the reserved figure of the
    allocator simulator run on the stage's schedule (:mod:`memplan.estimate.reserved_sim`)."""
    from memplan.estimate.reserved_sim import simulated_reserved  # the allocator model, only when asked

    sim = simulated_reserved(parts.ctx, parts.ledger, parts.walk, parts.acts, parts.loss, walked=parts.walked)
    return replace(stage, peak_reserved_bytes=sim.reserved), [*notes, sim.note]


def stage_parts(ctx: StageContext) -> tuple[StageEstimate, list[str], StageParts]:
    """The stage's figures with the fixed reserved figure, their sentences, and what its reserved-memory
    schedule is built from."""
    st = model_states(ctx)
    # the last layer's forward temporaries (DoRA's weights; gpt-oss's sink attention, 0 when recomputed):
    # not alive at once, so the larger
    # (and a frozen eager core's forward moment under partial freezing)
    dora, core = (dora_transient(ctx), frozen_core_forward(ctx)) if st.ft is not None else (0, 0)
    forward_extra = max(dora, sink_forward_transient(ctx), core)
    walk = walk_layers(ctx, forward_extra)
    acts = stage_activations(ctx, walk, st.ft)
    loss = loss_part(ctx, acts, st)
    forward = forward_peaks(acts, forward_extra, ctx, st)
    ledger = Ledger(_BASE_PHASES + (("loss",) if ctx.layout.has_head else ()) + (("forward",) if forward else ()))
    comm, max_comm = communication(ctx, st, acts, forward, loss)
    moment = backward_moment(ctx, st, walk, acts, loss)
    # at that moment the model's forward keeps the embedding's output bound, where nothing saves it
    # and DoRA's step at the last layer's MLP output projection the tensors the modeling code binds there
    bound = bound_embedding_output(ctx) if forward_extra else 0
    held = dora_moment_locals(ctx, dora) if forward_extra and dora == forward_extra else 0
    ledger.extend(chain(st.contributions, stage_buffers(ctx),
                        phase_contributions(ctx, st, walk, acts, loss, forward_extra, moment),
                        forward_bindings(bound, held) if bound or held else (), comm, fp32_outputs(ctx)))  # one entry pass (the mechanics are pure: the order of the calls does not matter)
    inputs = ledger.total(INPUT, "loss") if ctx.layout.has_embedding or ctx.layout.has_head else 0
    memory = graphs(ctx, ledger, walk, inputs)
    peak = ledger.peak()
    stage = _stage_figures(ctx, st, acts, loss, ledger, peak, max_comm, memory,
                           captured_layers=sum(walk.chunk_graph_layers))
    return stage, [*ledger.notes(), *acts.notes], StageParts(ctx, ledger, walk, acts, loss, moment[2])


def _stage_figures(ctx: StageContext, st: StageStates, acts: StageActivations, loss: LossPart, ledger: Ledger,
                   peak: Peak, max_comm: int, memory: GraphMemory, *, captured_layers: int) -> StageEstimate:
    layout, states, job = ctx.layout, st.states, ctx.job
    at = peak.by_category  # every reported category is a key (Ledger.peak)
    workspace = ledger.total(WORKSPACE)
    other = at[COMMUNICATION] + workspace + at[TEMPORARY] + at[INPUT] + at[GRAPHS]
    return StageEstimate(
        stage=layout.stage, layers=layout.num_layers, layer_indices=layout.layer_indices,
        parameters_numel=st.params.total, parameters_bytes=states.parameters, gradients_bytes=at[GRADIENTS],
        optimizer_bytes=states.optimizer + states.master, master_weights_bytes=states.master,
        optimizer_moments_bytes=states.optimizer,
        activations_bytes=at[ACTIVATIONS], transformer_layer_activations_bytes=at[LAYER_ACTIVATIONS],
        logits_bytes=at[LOGITS], communication_bytes=at[COMMUNICATION], workspace_bytes=workspace,
        temporary_bytes=at[TEMPORARY], input_bytes=at[INPUT], other_bytes=other,
        inflight_microbatches=layout.inflight_microbatches, peak_phase=peak.phase,
        peak_allocated_bytes=peak.allocated, peak_reserved_bytes=reserved_bytes(peak.allocated, ctx.run.fragmentation),
        fp8_weights_bytes=states.fp8_weights, mtp_parameters_numel=st.params.mtp,
        cpu_parameters_bytes=states.cpu_parameters, cpu_gradients_bytes=states.cpu_gradients,
        cpu_optimizer_bytes=states.cpu_optimizer, cpu_activations_bytes=acts.cpu + loss.cpu,
        gradients_absent_at_peak_bytes=at[ABSENT],
        forward_activations_bytes=acts.layers + acts.other + loss.head + acts.unused_buffers,
        loss_logits_bytes=loss.logits, saved_logits_bytes=loss.saved_logits, max_communication_bytes=max_comm,
        paged_optimizer_bytes=states.paged_optimizer, outside_allocator_bytes=ledger.total(OUTSIDE),
        cuda_graph_pool_bytes=memory.pool, cuda_graph_static_bytes=memory.static,
        cuda_graph_extra_bytes=at[GRAPHS],
        cuda_graphs=graph_count(job.cuda_graphs.impl, captured_layers, pp=job.parallel.pp,
                                num_microbatches=job.num_microbatches) if layout.layer_indices else 0,
    )


def reserved_bytes(allocated: int, fragmentation: float) -> int:
    """Reserved memory: ``allocated / (1 - fragmentation)`` rounded up to whole 2 MiB segments."""
    reserved = int(allocated / (1.0 - fragmentation))
    return -(-reserved // _SEGMENT) * _SEGMENT
