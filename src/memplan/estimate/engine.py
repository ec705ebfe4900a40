"""The estimator: per-GPU memory of every pipeline stage of a training job. Pure Python, no torch."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from memplan.errors import JobConfigError
from memplan.estimate.activations import (
    KEPT_BY,
    ActivationShape,
    backward_transient_bytes,
    dispatch_buffer_bytes,
    divided,
    layer_terms,
    layer_terms_by_block,
)
from memplan.estimate.adapter_acts import (
    ADAPTER_BYTES,
    adapter_terms,
    dora_forward_transient,
    frozen_layer_terms,
)
from memplan.estimate.autocast import (
    attention_weight_copy_numel,
    autocast_weight_copy_numel,
    checkpointed_module_copy_numel,
    layer_weight_copy_numel,
    tied_embedding_gradient_sum_bytes,
)
from memplan.estimate.cp_attention import cp_backward_extra_bytes
from memplan.estimate.cp_attention import describe as describe_cp
from memplan.estimate.cuda_graphs import LayerCapture, graph_count, graph_memory, layer_capture
from memplan.estimate.cuda_graphs import describe as describe_cuda_graphs
from memplan.estimate.deepep import deepep_buffer_bytes
from memplan.estimate.ds_checkpointing import (
    GPU_RESIDENT_INPUTS,
    contiguous_unused_bytes,
    describe_ds_checkpointing,
    ds_checkpointing_applies,
    partition_bytes,
    place_checkpoint,
)
from memplan.estimate.ep_overlap import (
    LayerParts,
    attention_wgrad_held,
    combined_step_extra,
    dispatch_backward_extra,
    expert_wgrad_held,
    layer_parts,
    mlp_wgrad_held,
    shared_expert_overlap_bytes,
)
from memplan.estimate.ep_overlap import describe as describe_ep_overlap
from memplan.estimate.extras import (
    LOSS_NOTES,
    PACKING_NOTE,
    checkpointed_mask_bytes,
    communication_by_phase,
    communication_bytes,
    deferred_wgrad_bytes,
    embedding_activation_bytes,
    head_activation_bytes,
    input_bytes,
    logits_bytes,
    optimizer_temporary_bytes,
    rope_table_bytes,
    saved_logits_bytes,
)
from memplan.estimate.fine_offload import Offloaded, stage_offload
from memplan.estimate.fine_offload import describe as describe_fine_offload
from memplan.estimate.finetune import (
    base_in_compute_dtype,
    dequantized_weight_bytes,
    finetune_assumptions,
    finetune_counts,
    frozen_bytes_per_element,
    head_activation_bytes_finetune,
    is_finetune,
    stage_finetune,
)
from memplan.estimate.global_buffer import local_impl_requests
from memplan.estimate.hybridep import hybridep_buffer_bytes
from memplan.estimate.layout import StageLayout, pipeline_layout
from memplan.estimate.optimizers import (
    SmallTensors,
    describe_optimizer,
    in_backward_gradient_bytes,
    muon_scalar_numel,
    muon_step_bytes,
    needs_small_tensors,
    small_tensors,
    small_tensors_of_sizes,
)
from memplan.estimate.precision import ResolvedPrecision, resolve_precision
from memplan.estimate.recompute_modules import (
    checkpoint_input_terms,
    dropped_sites,
    recomputed_only_terms,
    recomputed_peak,
    term_site,
)
from memplan.estimate.recompute_modules import describe as describe_recompute
from memplan.estimate.result import Estimate, StageEstimate
from memplan.estimate.sac import sac_kept_terms
from memplan.estimate.states import (
    StageParams,
    StateBytes,
    device_step_counters,
    layer_numel_on_rank,
    padded_vocab,
    stage_params,
    state_bytes,
)
from memplan.estimate.tp_comm_overlap import describe as describe_tp_overlap
from memplan.estimate.tp_comm_overlap import ub_workspace_bytes, userbuffers_bytes
from memplan.frameworks.model_code import model_code, model_code_notes, sdpa_attention
from memplan.gpus import GPU
from memplan.job import Job, resolved_loss, resolved_optimizer_impl
from memplan.jobcheck import validate_job_for_model
from memplan.model.params import final_norm_params
from memplan.model.spec import LayerSpec, ModelSpec
from memplan.model.tensors import stage_tensors
from memplan.profiles.framework import (
    TE_CUBLAS_WORKSPACE_BYTES,
    TE_GROUPED_GEMM_WORKSPACE_BYTES,
    TE_GROUPED_GEMM_WORKSPACES,
    FrameworkProfile,
    get_profile,
    head_rows_split,
    vocab_split,
)
from memplan.peft.params import Adapter, finetune_params, first_trainable_layer
from memplan.policies import resolve_policy
from memplan.units import dtype_bytes

#: The CUDA caching allocator hands out whole segments (2 MiB granularity, allocator source
#: c10/cuda/CUDACachingAllocator.cpp kLargeBuffer/kRoundLarge) and freed blocks cannot always be
#: reused for differently sized requests. Without a trace, memplan assumes this fraction of the
#: reserved memory is lost: the middle of the 5-30% reported for LLM training (DeepSeek-V3
#: memory analysis; STAlloc). ``memplan alloc`` replaces it by a simulated figure.
DEFAULT_FRAGMENTATION = 0.10
_SEGMENT = 2 * 1024 * 1024


def estimate(
    model: ModelSpec,
    job: Job | None = None,
    *,
    gpu: GPU | None = None,
    fragmentation: float = DEFAULT_FRAGMENTATION,
) -> Estimate:
    """Estimate the per-GPU memory of training ``model`` as ``job`` describes.

    Example::

        >>> from memplan import estimate, load_model, Job, Parallelism
        >>> est = estimate(load_model("llama-3.1-8b"), Job(parallel=Parallelism(world_size=8)))
        >>> est.peak_allocated_bytes > 0
        True

    Assumptions are listed in ``Estimate.assumptions``. Known limitations: the activation terms
    follow fused kernels (Megatron/TE) or PyTorch reference modules (``kernels="eager"``
    profiles); other custom kernels save different tensors. Fragmentation is a stated fraction,
    not simulated.
    """
    job = job or Job()
    if not 0.0 <= fragmentation < 1.0:
        raise JobConfigError("--fragmentation", "must be in [0, 1)", fragmentation)
    validate_job_for_model(job, model)
    profile = get_profile(job.framework)
    prec = resolve_precision(job, profile)
    divisible = job.vocab_divisible_by or profile.vocab_divisible_by
    vocab_rows = padded_vocab(model, job.parallel.tp, divisible)
    shape = _activation_shape(model, job, profile, prec)
    layouts = pipeline_layout(model.num_layers, job.parallel, job.num_microbatches)
    cache: dict[object, LayerCosts] = {}
    stages = tuple(
        _stage_estimate(model, job, profile, prec, shape, layout, vocab_rows, fragmentation, cache)
        for layout in layouts
    )
    peak = max(stages, key=lambda s: (s.peak_allocated_bytes, -s.stage))
    counts = finetune_counts(model, job)
    return Estimate(
        model=model.name,
        framework=profile.name,
        stages=stages,
        peak_allocated_bytes=peak.peak_allocated_bytes,
        peak_reserved_bytes=peak.peak_reserved_bytes,
        peak_stage=peak.stage,
        fragmentation=fragmentation,
        assumptions=_assumptions(model, job, profile, prec, vocab_rows, fragmentation),
        total_parameters=model.total_parameters,
        trainable_params=counts.trainable if is_finetune(job) else model.total_parameters,
        frozen_params=counts.frozen if is_finetune(job) else 0,
        job=job,
        gpu=gpu,
    )


def _activation_shape(model: ModelSpec, job: Job, profile: FrameworkProfile, prec: ResolvedPrecision) -> ActivationShape:
    par = job.parallel
    seq_local = job.batch.seq_length // par.cp
    base16 = base_in_compute_dtype(model, job)
    code = model_code(job)
    return ActivationShape(
        seq=seq_local,
        kv_seq=seq_local,
        micro_batch=job.batch.micro_batch_size,
        hidden=model.hidden_size,
        tp=par.tp,
        vocab_tp=vocab_split(profile, par.tp),
        sequence_parallel=par.sequence_parallel,
        act_bytes=dtype_bytes(prec.compute),
        residual_bytes=dtype_bytes(prec.compute if base16 else prec.residual),
        attention=sdpa_attention(code, job.attention, dtype_bytes(prec.compute)),
        dropout=job.dropout > 0,
        kernels=profile.kernels,
        expert_tp=par.expert_tp,
        fp8=job.precision.fp8 is not None,
        routed_factor=rank_routed_factor(model, job),
        dispatcher=job.moe.dispatcher,
        ep=par.ep,
        norm=model.norm,
        autocast=prec.weight_copies == "autocast" and not base16,
        expert_bytes=dtype_bytes(prec.compute) if base16 else _expert_bytes(profile, prec),
        norm_fp32_scale=model.norm_fp32_scale,
        rope=model.position_embedding == "rope",
        moe_probs_at=profile.moe_probs_at,
        fused_rms_norm=code.fused_rms_norm,
        gathered_gemm_inputs=code.sp_saves_gathered_input,
        rope_buffer=code.rope_buffer,
    )


def _expert_bytes(profile: FrameworkProfile, prec: ResolvedPrecision) -> int:
    """Bytes per element of routed-expert activations: HF's grouped experts (eager profiles) cast
    their input to the weights' dtype instead of following autocast (transformers
    ``integrations/moe.py`` ``_grouped_mm``); fused kernels compute in the compute dtype."""
    if profile.kernels == "eager" and prec.weight_copies == "autocast":
        return dtype_bytes(prec.param)
    return dtype_bytes(prec.compute)


def rank_routed_factor(model: ModelSpec, job: Job) -> float:
    """Rows the busiest expert-parallel rank receives relative to balanced routing.

    ``--moe-imbalance F`` is per expert (the busiest expert gets F x the mean). A rank holding
    ``n = experts / ep`` experts gets at most the busiest one plus ``n - 1`` average ones:
    ``(F + n - 1) / n``. With ``ep = 1`` every routed token is local and the factor is 1. Capacity
    caps each expert, so also the rank (padding to capacity fills it exactly).
    """
    moe = next((layer.moe for layer in model.layers if layer.moe is not None), None)
    options = job.moe
    if moe is None:
        return 1.0
    if options.pad_to_capacity and options.capacity_factor is not None:
        return float(options.capacity_factor)
    if job.parallel.ep == 1:
        return 1.0
    per_rank = max(1, moe.num_experts // job.parallel.ep)
    return (options.routed_token_factor + per_rank - 1) / per_rank


#: Of one layer: (kept bytes under the job's recompute, full bytes without recompute, backward
#: transient, bytes made again at the worst point of its backward under selective recompute).
LayerCosts = tuple[int, int, int, int]


#: The loss a loop holds through the backward: one fp32 scalar (``nll_loss``'s output).
_LOSS_SCALAR_BYTES = 4


def _largest_saved_term(model: ModelSpec, layer_indices: Iterable[int], shape: ActivationShape) -> int:
    """The largest tensor one of ``layer_indices`` saves (one rank): what a per-tensor activation
    offload brings back to the GPU for one operator's backward (an approximation: an operator that
    saved several tensors gets all of them back at once)."""
    return max((divided(term, shape) for index in layer_indices
                for term in layer_terms(model.layers[index], shape)), default=0)


def _layer_costs(layer: LayerSpec, shape: ActivationShape, job: Job, cache: dict[object, LayerCosts],
                 index: int | None = None, model: ModelSpec | None = None) -> LayerCosts:
    """(kept, full, backward transient, recomputed at the worst point) of one layer (:data:`LayerCosts`).

    For a fine-tuning job (``index`` and ``model`` given) a frozen layer's GEMM inputs are not saved
    and its adapters' terms are added (:mod:`memplan.estimate.adapter_acts`).
    """
    adapters: tuple[Adapter, ...] = ()
    frozen = first = quantized = False
    if model is not None and index is not None and is_finetune(job):
        counts = finetune_counts(model, job)
        adapters = tuple(a for a in counts.adapters if a.module.layer == index)
        frozen = counts.layers[index].trained == 0
        quantized = bool(counts.layers[index].quantized)
        # Before the first layer with something trainable nothing requires grad and nothing is saved; that
        # layer's input (the frozen embedding's output, or a frozen layer's) needs no gradient, so what only
        # that gradient needs is not saved (checkpointing makes the input require grad: HF
        # enable_input_require_grads).
        start = first_trainable_layer(counts) if counts.root.trained + counts.root.adapter == 0 else 0
        plain = not resolve_policy(job).recomputes
        if index < start and plain:
            return (0, 0, 0, 0)
        first = index == start and counts.root.trained + counts.root.adapter == 0 and plain
    key = (id(layer), adapters, frozen, first, job.finetune.quantize_base)
    if key not in cache:
        policy = resolve_policy(job)
        mode = policy.kept_classes_key
        kept_classes, dropped = _kept_policy(job)
        attention, rest = layer_terms_by_block(layer, shape)
        # bitsandbytes' 8-bit matmul keeps its input (ctx.tensors) like a trainable linear layer.
        int8_base = quantized and job.finetune.quantize_base == "int8"
        if frozen:
            attention = frozen_layer_terms(attention, shape, first, gemm_inputs_kept=int8_base)
            rest = frozen_layer_terms(rest, shape, False, gemm_inputs_kept=int8_base)
        if adapters:
            prec = resolve_precision(job, get_profile(job.framework))
            autocast = prec.weight_copies == "autocast"
            rest = rest + adapter_terms(adapters, shape, autocast=autocast,
                                        dropout=job.finetune.lora_dropout > 0, compute_bytes=shape.act_bytes,
                                        input_needs_grad=not first,
                                        # peft's cast to the fp32 adapters is a no-op on fp32 activations
                                        uncast_input=(quantized and autocast) or shape.act_bytes == ADAPTER_BYTES,
                                        base_keeps_input=int8_base)
        blocks = (attention, rest)
        sized = [(divided(t, shape), t.keep, term_site(t)) for t in blocks[0] + blocks[1]]
        full = sum(size for size, keep, _ in sized if keep in KEPT_BY["none"])
        inputs = checkpoint_input_terms(layer, shape, policy.modules) if dropped else []
        transient = backward_transient_bytes(layer, shape, blocks, dropped, released_inputs=sum(
            divided(t, shape) for t in inputs if t.site in ("mlp", "moe")))
        sac = sac_kept_terms(layer, shape) if mode == "selective-per-op" else None
        if mode == "selective-per-op" and sac is None:
            # MoE and MLA layers are not listed op by op: Megatron's selective accounting stands in.
            kept_classes = KEPT_BY["selective"]
        kept = sum(size for size, keep, site in sized if keep in kept_classes and site not in dropped)
        if sac is not None:
            # The cached op outputs; those autograd does not save also sit beside the recomputed layer.
            kept += sum(divided(t, shape) for t in sac[0])
            transient += sum(divided(t, shape) for t in sac[1])
        if policy.name == "memory-budget":
            # torch's partitioner: at most the budget's fraction of what it saves above the region's inputs
            kept += _budget_share(full - kept, policy.memory_budget)
        rebuilt = full - kept
        if dropped:
            # only one block's recomputed tensors are alive at a time (recompute_modules.py)
            rebuilt -= sum(size for size, _, site in sized if site in dropped)
            again = [(divided(t, shape), t.site) for t in recomputed_only_terms(shape, policy.modules)]
            rebuilt += recomputed_peak([(size, site) for size, _, site in sized] + again, dropped)
            kept += sum(divided(t, shape) for t in inputs)
        cache[key] = (kept, full, transient, rebuilt)
    return cache[key]


def _kept_policy(job: Job) -> tuple[frozenset[str], frozenset[str]]:
    """(recompute classes kept, sites dropped) under the job's recompute: Megatron's selective
    recompute drops the sites of its ``--recompute-modules`` (:mod:`memplan.estimate.recompute_modules`)."""
    policy = resolve_policy(job)
    if policy.name != "megatron-selective":
        return KEPT_BY[policy.kept_classes_key], frozenset()
    return KEPT_BY["selective"] | {"core"}, dropped_sites(policy.modules)


def _budget_share(above_floor: int, budget: float | None) -> int:
    """Bytes torch's partitioner may keep above full recompute's floor under ``activation_memory_budget``
    (torch/_functorch/partitioners.py ``choose_saved_values_set``: 0 saves only the region's inputs, 1
    the default min-cut's values, and between them the knapsack keeps the saved bytes above the inputs
    within ``budget`` x (min-cut's - inputs')). The eager saved tensors bound the min-cut's from above."""
    return int(above_floor * (budget if budget is not None else 1.0))


def _dora_transient(model: ModelSpec, job: Job, shape: ActivationShape, layout: StageLayout) -> int:
    """DoRA's forward temporaries at the stage's largest adapted linear (0 without DoRA)."""
    if job.finetune.peft != "dora":
        return 0
    layers = set(layout.layer_indices)
    adapters = tuple(a for a in finetune_counts(model, job).adapters if a.module.layer in layers)
    prec = resolve_precision(job, get_profile(job.framework))
    quantized = job.finetune.quantize_base != "none"
    return dora_forward_transient(adapters, autocast=prec.weight_copies == "autocast", compute_bytes=shape.act_bytes,
                                  base_bytes=shape.act_bytes if quantized else frozen_bytes_per_element(job))


def _recomputed_layers(layout: StageLayout, job: Job) -> set[int]:
    """Layers of this stage that run under full recompute (Megatron's uniform/block methods)."""
    rc = job.recompute
    if resolve_policy(job).name != "full":
        return set()
    if rc.method == "uniform" or rc.num_layers is None:
        return set(layout.layer_indices)
    chosen: set[int] = set()
    for chunk in layout.chunks:
        chosen.update(chunk[: rc.num_layers])
    return chosen


def _stage_estimate(
    model: ModelSpec,
    job: Job,
    profile: FrameworkProfile,
    prec: ResolvedPrecision,
    shape: ActivationShape,
    layout: StageLayout,
    vocab_rows: int,
    fragmentation: float,
    cache: dict[object, LayerCosts],
) -> StageEstimate:
    params = stage_params(model, job, layout, vocab_rows, vocab_parallel=profile.vocab_parallel)
    tensors = stage_tensors(model, layout.layer_indices, has_embedding=layout.has_embedding, has_head=layout.has_head)
    ft = stage_finetune(model, job, layout, params.total) if is_finetune(job) else None
    counters = device_step_counters(job, profile, tensors if ft is None else ft.trainable_tensors)
    small = None
    if needs_small_tensors(job):
        small = (small_tensors(model, layout.layer_indices, has_head=layout.has_head) if ft is None
                 else _trainable_small_tensors(model, job, layout))
    scalar = (muon_scalar_numel(model, job, layout.layer_indices, params.root,
                                 has_embedding=layout.has_embedding)
              if job.optimizer.name == "muon" and ft is None else 0)
    states = state_bytes(model, job, params, prec, offload_moves_gradients=profile.offload_moves_gradients,
                         step_counters=counters, small=small, finetune=ft, muon_scalar=scalar)
    largest = (_largest_tensor(model, vocab_rows, job, profile) if ft is None or ft.full or ft.copies
               else _largest_trainable(model, job, layout))
    step_temp = optimizer_temporary_bytes(job, profile, states, prec, largest)
    if job.optimizer.name == "muon" and states.optimizer_numel:
        step_temp = max(step_temp, muon_step_bytes(model, job, layout.layer_indices,
                                                    has_embedding=layout.has_embedding))
    if job.optimizer.in_backward:
        # Optimizer hook: each gradient is stepped and freed in the backward (one alive at a time),
        # and the per-parameter step's temporaries join the backward's.
        stepped = params.total if ft is None else ft.trainable
        states = replace(states, gradients=in_backward_gradient_bytes(states.gradients, stepped, largest))
    recomputed = _recomputed_layers(layout, job)
    group = (job.recompute.num_layers or 1) if job.recompute.method == "uniform" else 1

    dora = _dora_transient(model, job, shape, layout) if ft is not None else 0
    rc, tp = job.recompute, job.parallel.tp
    deepspeed_ckpt = ds_checkpointing_applies(job)
    chunk_kept: list[int] = []
    #: DeepSpeed checkpointing: per chunk, checkpointed inputs in CPU memory; the largest input.
    chunk_cpu: list[int] = []
    largest_ckpt = 0
    worst_backward = 0
    #: Per layer, in forward order: (index, bytes it keeps, bytes its backward adds at its worst).
    per_layer: list[tuple[int, int, int]] = []
    graphed = _captured_layer(model, job, shape) if job.cuda_graphs.impl in ("local", "transformer_engine") else None
    #: CUDA graphs: per chunk, the captured regions' saved bytes and captured layers; the worst captured backward.
    chunk_graph: list[int] = []
    chunk_graph_layers: list[int] = []
    graph_worst_backward = 0
    #: Combined 1F1B: each layer split into the schedule's nodes (:mod:`memplan.estimate.ep_overlap`).
    ep_parts: list[LayerParts] = []
    for chunk in layout.chunks:
        kept = cpu_kept = 0
        chunk_graph.append(0)
        chunk_graph_layers.append(0)
        for position, index in enumerate(chunk):
            keep, full, transient, rebuilt = _layer_costs(model.layers[index], shape, job, cache, index, model)
            keep, full = _with_shared_expert_overlap(model.layers[index], shape, job, keep, full)
            transient += _cp_backward_extra(model, job, shape, index)
            if ft is None:
                transient += _recomputed_copies_bytes(model, job, profile, prec, index, recomputed)
            else:
                transient += dequantized_weight_bytes(model, job, index, dtype_bytes(prec.compute))
            if index in recomputed:
                # the recomputed forward rebuilds DoRA's weights too (its temporaries, then the backward's)
                layer_keep, layer_worst = keep, group * full + max(transient, dora)
                if position % group:
                    # uniform groups: one checkpoint per group of layers keeps only the group's input
                    # (megatron/core/transformer/transformer_block.py ``_checkpointed_forward``)
                    layer_keep = 0
                elif deepspeed_ckpt:
                    placed = place_checkpoint(keep, partition=rc.partition_activations, cpu=rc.cpu_checkpointing,
                                              tp=tp)
                    layer_keep, cpu_kept = placed.gpu_keep, cpu_kept + placed.cpu_keep
                    layer_worst += placed.backward_extra
                    largest_ckpt = max(largest_ckpt, keep)
            elif resolve_policy(job).partial:
                # The recomputed modules (the attention core, the attention module, or under per-op
                # SAC the rest of the layer) are made again during this layer's backward.
                layer_keep, layer_worst = keep, rebuilt + transient
            else:
                layer_keep, layer_worst = full, transient
            layer_worst += _experts_wgrad_extra(model.layers[index], shape, job, full, transient)
            if job.overlap.ep_a2a:
                ep_parts.append(_ep_parts(model.layers[index], shape, job, layer_keep, layer_worst))
            kept += layer_keep
            worst_backward = max(worst_backward, layer_worst)
            per_layer.append((index, layer_keep, layer_worst))
            if graphed is not None:
                graph_keep, graph_worst = graphed(index, layer_keep, layer_worst, index in recomputed)
                chunk_graph[-1] += graph_keep
                chunk_graph_layers[-1] += graph_keep > 0 or graph_worst > 0
                graph_worst_backward = max(graph_worst_backward, graph_worst)
        chunk_kept.append(kept)
        chunk_cpu.append(cpu_kept)
    inflight = layout.inflight_microbatches
    mtp_acts = 0
    if layout.has_head and job.mtp_layers:
        mtp_acts = job.mtp_layers * _mtp_activation_bytes(model, shape, job, cache)
        chunk_kept[-1] += mtp_acts
    layer_acts = sum(chunk_kept[c] for c in layout.inflight_chunks)
    cpu_acts = sum(chunk_cpu[c] for c in layout.inflight_chunks)
    if job.offload.module_names:
        moved = _fine_offload(model, job, shape, layout, recomputed)
        layer_acts, cpu_acts, worst_backward = (layer_acts - moved.cpu_bytes, cpu_acts + moved.cpu_bytes,
                                                worst_backward + moved.reload_bytes)
    unused_buffers = 0
    if deepspeed_ckpt:
        counts = [sum(1 for p, i in enumerate(chunk) if i in recomputed and p % group == 0) for chunk in layout.chunks]
        warmup = sum(counts[c] for c in layout.inflight_chunks)
        if rc.cpu_checkpointing and not rc.partition_activations:
            # the offload engine's newest input and the one being copied stay on the GPU
            resident = min(GPU_RESIDENT_INPUTS, warmup) * largest_ckpt
            layer_acts += resident
            cpu_acts -= min(1, warmup) * largest_ckpt
        unused_buffers = contiguous_unused_bytes(rc, partition_bytes(largest_ckpt, tp), warmup,
                                                 min((n for n in counts if n), default=0))
        if rc.cpu_checkpointing:
            cpu_acts, unused_buffers = cpu_acts + unused_buffers, 0
    per_tensor_offload = job.offload.activations and profile.activation_offload == "per-tensor"
    if job.offload.activations and layer_acts and not per_tensor_offload:
        # Saved activations stream to CPU memory after each layer's forward; the GPU keeps the
        # layer being computed and the one being copied.
        on_gpu = min(layer_acts, 2 * max(_layer_costs(model.layers[i], shape, job, cache, i, model)[0] for i in layout.layer_indices))
        cpu_acts = layer_acts - on_gpu
        layer_acts = on_gpu
    other_acts = embedding_activation_bytes(shape) * inflight if layout.has_embedding else 0
    if layout.layer_indices:
        # Shared by the stage's layers: RoPE tables and checkpointed masks (eager profiles).
        shared = rope_table_bytes(model, shape) + checkpointed_mask_bytes(model, shape, resolve_policy(job).keeps_mask)
        other_acts += shared * inflight
    head_copy = 0
    if prec.weight_copies == "autocast":
        # torch.autocast casts the weights linear layers read (the decoder's and the output
        # head's) and autograd saves the 16-bit copies; embedding tables and norms are not cast.
        head = _head_numel(model, profile, job, vocab_rows) if layout.has_head else 0
        policy = resolve_policy(job)
        layers = autocast_weight_copy_numel(model, job, layout, recomputed=recomputed, mode=policy.kept_classes_key,
                                            eager_experts=profile.kernels == "eager", modules=policy.modules)
        if ft is not None:
            # Only fully trained (fp32) weights are cast; 16-bit frozen weights are used as they are, and
            # the adapters' copies are part of their layers' terms.
            head, layers = 0, ft.full
        other_acts += (layers + head) * dtype_bytes(prec.compute)
        head_copy = head * dtype_bytes(prec.compute)
    offload_bring_back = 0
    if per_tensor_offload:
        # save_on_cpu: every tensor autograd saves (the layers' and checkpointed layers' inputs, the
        # embedding output, autocast's weight copies) is in host memory; the backward brings back one
        # operator's at a time. Checkpointed layers share their RoPE tables (and eager masks) as
        # checkpoint arguments, which stay on the GPU until the backward.
        held = 0
        if resolve_policy(job).name == "full" and recomputed and layout.layer_indices:
            held = (rope_table_bytes(model, shape) + checkpointed_mask_bytes(model, shape, True)) * inflight
        cpu_acts += layer_acts + other_acts - held
        # a recomputed layer gets back only its checkpointed input, which its recompute then saves
        # (made in the backward, outside save_on_cpu: already in the layer's backward working set);
        # any other layer, the largest tensor it saved
        plain = [index for index, _, _ in per_layer if index not in recomputed]
        offload_bring_back = _largest_saved_term(model, plain, shape)
        layer_acts, other_acts, head_copy = 0, held, 0
    inputs = input_bytes(shape, job.framework, job.parallel.cp) * inflight if (layout.has_embedding or layout.has_head) else 0
    comm_at = communication_by_phase(job, profile, params, prec, communication_bytes(job, profile, params, states, prec),
                                     tied=model.tie_word_embeddings)
    workspace = _profile_workspace(job, profile) + fp8_scaling_bytes(job, model, layout) + grouped_gemm_workspace_bytes(
        job, model, layout) + global_buffer_bytes(job, model, layout, shape)
    if layout.layer_indices and job.transformer_impl != "local":
        # made by the first overlapped TE GEMM (local layers have none; the userbuffers exist anyway)
        workspace += ub_workspace_bytes(job.overlap)
    outside = userbuffers_bytes(job.overlap, tokens=shape.seq * shape.micro_batch, hidden=model.hidden_size,
                                tp=job.parallel.tp, fp8=job.precision.fp8 is not None,
                                world_size=job.parallel.world_size)
    outside += _flex_dispatch_buffer_bytes(model, job, layout, shape)
    static = states.parameters + states.gradients + states.master + states.optimizer + workspace

    # Candidate peaks: the loss of the newest micro-batch (last stage), the backward of a layer
    # with every in-flight forward alive, and the optimizer step (activations freed).
    loss = resolved_loss(job)
    head_acts = head_activation_bytes(shape) if layout.has_head else 0
    if layout.has_head and ft is not None:
        head_acts = head_activation_bytes_finetune(model, job, shape)
    softcap = model.final_logit_softcap is not None
    # Each MTP depth computes its own logits and loss; all are alive until the backward.
    depths = (1 + job.mtp_layers) if layout.has_head else 0
    logits = logits_bytes(job, loss, shape, vocab_rows, softcap) * depths
    saved_logits = saved_logits_bytes(job, loss, shape, vocab_rows, softcap) * depths
    if per_tensor_offload:
        # what the loss saves goes to host memory too; the loss backward brings it back
        cpu_acts += saved_logits + head_acts
        offload_bring_back = max(offload_bring_back, saved_logits)
        # only the loss value itself (an fp32 scalar per loss, held by the loop) stays on the GPU
        saved_logits, head_acts = _LOSS_SCALAR_BYTES * depths, 0
    if layout.has_head:
        head_acts += deferred_wgrad_bytes(job, shape, vocab_rows)
    # Frameworks that free gradients after each step (zero_grad(set_to_none=True)) hold none
    # during the forward, the loss and the start of the backward of a step's only micro-batch;
    # the backward then builds them up while it frees activations: the head's gradient first.
    no_grads_yet = profile.frees_gradients and job.num_microbatches == 1
    absent = states.gradients if no_grads_yet else 0
    # The output head's gradient (a tied one waits in autograd's buffer) and the final norm's; the
    # embedding's gradient comes last, after every layer.
    head_numel = (_head_numel(model, profile, job, vocab_rows) + final_norm_params(model)) if layout.has_head else 0
    head_grads = states.gradients * head_numel // max(params.total, 1) if no_grads_yet and ft is None else 0
    backward_layers, backward_temp = layer_acts, worst_backward + head_grads
    in_backward_temp = step_temp if job.optimizer.in_backward else 0
    if no_grads_yet and layout.inflight_microbatches == 1 and len(layout.chunks) == 1 and not job.offload.activations:
        backward_layers, backward_temp = _backward_walk(model, job, states, params, per_layer, layer_acts, head_grads)
    backward_temp += in_backward_temp + offload_bring_back
    # Megatron's combined 1F1B (--overlap-moe-expert-parallel-comm): the next micro-batch's forward runs
    # layer by layer beside this backward, so its layer (and that micro-batch's batch and embedding
    # output) is alive beside it, at the layer pair's worst moment (memplan.estimate.ep_overlap).
    ep_layer = combined_step_extra(ep_parts, early_release=job.overlap.early_attn_release) if job.overlap.ep_a2a \
        else 0
    ep_inputs = input_bytes(shape, job.framework, job.parallel.cp) if job.overlap.ep_a2a and (
        layout.has_embedding or layout.has_head) else 0
    if job.overlap.ep_a2a and layout.has_embedding:
        ep_layer += embedding_activation_bytes(shape)
    candidates = {
        # A layer's backward: the head's backward has run, so what the final norm, the head (its
        # autocast weight copy included) and the loss saved is released, and its gradient exists.
        "backward": (backward_layers + other_acts - head_copy + ep_layer, 0, backward_temp + ep_inputs, absent),
        "optimizer step": (0, 0, step_temp, 0),
        # The end of the backward: every gradient, activations freed, a tied embedding's two
        # gradients being summed.
        "end of backward": (0, 0, 0 if ft is not None and ft.full == 0 else tied_embedding_gradient_sum_bytes(
            model, layout, vocab_rows, vocab_split(profile, job.parallel.tp), _summed_grad_bytes(job, profile, prec)), 0),
    }
    if layout.has_head:
        candidates["loss"] = (layer_acts + other_acts + head_acts + unused_buffers, logits, 0, absent)
    if unused_buffers:
        # DeepSpeed's contiguous checkpoint buffers not yet filled, until the next backward drops them
        candidates["forward"] = (layer_acts + other_acts + unused_buffers, 0, 0, absent)
        comm_at = {**comm_at, "forward": comm_at["loss"]}
    if dora and not recomputed:
        # DoRA's weight temporaries in the last layer's forward, the layers' activations held
        candidates["forward"] = (layer_acts + other_acts, 0, dora, absent)
        comm_at = {**comm_at, "forward": comm_at["loss"]}
    graphs = graph_memory(job.cuda_graphs, layout, shape, candidates, comm_at, chunk_graph, chunk_graph_layers,
                          graph_worst_backward, inputs, cp=job.parallel.cp, num_microbatches=job.num_microbatches)
    phase, (acts, logit_b, temp, not_yet) = max(
        candidates.items(), key=lambda kv: sum(kv[1][:3]) - kv[1][3] + comm_at[kv[0]] + graphs.extra_at(kv[0]))
    comm = comm_at[phase]
    if phase in ("optimizer step", "end of backward"):
        layer_at_peak, inputs_at_peak, acts = 0, 0, 0
    else:
        layer_at_peak, inputs_at_peak = layer_acts, inputs
    if phase == "backward" and job.overlap.ep_a2a:
        # the next micro-batch's layer and batch (counted with the temporaries to pick the phase)
        layer_at_peak += ep_layer
        temp, inputs_at_peak = temp - ep_inputs, inputs_at_peak + ep_inputs
    graph_extra = graphs.extra_at(phase)
    peak_alloc = static + comm - not_yet + acts + logit_b + temp + inputs_at_peak + graph_extra
    reserved = _reserved(peak_alloc, fragmentation)
    return StageEstimate(
        stage=layout.stage,
        layers=layout.num_layers,
        layer_indices=layout.layer_indices,
        parameters_numel=params.total,
        parameters_bytes=states.parameters,
        gradients_bytes=states.gradients,
        optimizer_bytes=states.optimizer + states.master,
        master_weights_bytes=states.master,
        optimizer_moments_bytes=states.optimizer,
        activations_bytes=acts,
        transformer_layer_activations_bytes=layer_at_peak,
        logits_bytes=logit_b,
        communication_bytes=comm,
        workspace_bytes=workspace,
        temporary_bytes=temp,
        input_bytes=inputs_at_peak,
        other_bytes=comm + workspace + temp + inputs_at_peak + graph_extra,
        inflight_microbatches=inflight,
        peak_phase=phase,
        peak_allocated_bytes=peak_alloc,
        peak_reserved_bytes=reserved,
        fp8_weights_bytes=states.fp8_weights,
        mtp_parameters_numel=params.mtp,
        cpu_parameters_bytes=states.cpu_parameters,
        cpu_gradients_bytes=states.cpu_gradients,
        cpu_optimizer_bytes=states.cpu_optimizer,
        cpu_activations_bytes=cpu_acts,
        gradients_absent_at_peak_bytes=not_yet,
        forward_activations_bytes=layer_acts + other_acts + head_acts + unused_buffers,
        loss_logits_bytes=logits,
        saved_logits_bytes=saved_logits,
        max_communication_bytes=max(comm_at.values()),
        paged_optimizer_bytes=states.paged_optimizer,
        outside_allocator_bytes=outside,
        cuda_graph_pool_bytes=graphs.pool,
        cuda_graph_static_bytes=graphs.static,
        cuda_graph_extra_bytes=graph_extra,
        cuda_graphs=graph_count(job.cuda_graphs.impl, sum(chunk_graph_layers), pp=job.parallel.pp,
                                num_microbatches=job.num_microbatches) if layout.layer_indices else 0,
    )


def _with_shared_expert_overlap(layer: LayerSpec, shape: ActivationShape, job: Job, keep: int,
                                full: int) -> tuple[int, int]:
    """(kept, full) with ``--moe-shared-expert-overlap``'s gathered shared-expert input (kept unless
    recompute drops the layer's body or its MoE block)."""
    extra = shared_expert_overlap_bytes(layer, shape) if job.overlap.shared_expert_overlap else 0
    if not extra:
        return keep, full
    _, dropped = _kept_policy(job)
    kept_too = resolve_policy(job).name != "full" and "moe" not in dropped
    return keep + (extra if kept_too else 0), full + extra


def _experts_wgrad_extra(layer: LayerSpec, shape: ActivationShape, job: Job, full: int, transient: int) -> int:
    """``--overlap-dispatch-backward-with-experts-wgrad``: what an MoE layer's dispatch backward holds
    beyond its worst backward step (Transformer Engine's grouped-GEMM experts only)."""
    if not job.overlap.experts_wgrad_overlap or layer.moe is None or not job.moe.grouped_gemm:
        return 0
    parts = layer_parts(layer, shape, kept=full, transient=transient, dispatch=dispatch_buffer_bytes(layer, shape),
                        is_kept=lambda term: True, held_mlp=expert_wgrad_held(layer, shape))
    return dispatch_backward_extra(parts)


def _ep_parts(layer: LayerSpec, shape: ActivationShape, job: Job, keep: int, worst: int) -> LayerParts:
    """A layer split into the combined 1F1B schedule's nodes, with its delayed-wgrad holdings."""
    kept_classes, dropped = _kept_policy(job)
    delay = job.overlap.delay_wgrad
    return layer_parts(layer, shape, kept=keep, transient=worst, dispatch=dispatch_buffer_bytes(layer, shape),
                       is_kept=lambda t: t.keep in kept_classes and term_site(t) not in dropped,
                       held_mlp=mlp_wgrad_held(layer, shape) if delay else 0,
                       held_attn=attention_wgrad_held(layer, shape) if delay else 0)


def _captured_layer(model: ModelSpec, job: Job, shape: ActivationShape) -> LayerCapture:
    """:func:`memplan.estimate.cuda_graphs.layer_capture` for the job's recompute."""
    kept_classes, dropped = _kept_policy(job)
    return layer_capture(model, job.cuda_graphs, shape, kept_classes=kept_classes, dropped=dropped)


def _fine_offload(model: ModelSpec, job: Job, shape: ActivationShape, layout: StageLayout,
                  recomputed: set[int]) -> Offloaded:
    """:func:`memplan.estimate.fine_offload.stage_offload` for the job's recompute."""
    kept_classes, dropped = _kept_policy(job)
    return stage_offload(model, job.offload, shape, layout, recomputed, kept_classes=kept_classes, dropped=dropped)


def _backward_walk(model: ModelSpec, job: Job, states: StateBytes, params: StageParams,
                   per_layer: list[tuple[int, int, int]], layer_acts: int, head_grads: int) -> tuple[int, int]:
    """(layer activations still kept, temporaries incl. gradients made so far) at the worst layer of
    a backward that starts without gradients (``zero_grad(set_to_none=True)``, one micro-batch).

    The backward visits the layers last to first; when it reaches a layer, the later layers have
    released what they kept and made their gradients. Where a layer keeps less than its gradients
    weigh (recompute, short sequences) the worst layer is the first one, otherwise the last one.
    """
    per_param = states.gradients / max(params.total, 1)
    remaining, made = layer_acts, head_grads
    best = (layer_acts, head_grads)
    best_total = -1
    for index, kept, worst in reversed(per_layer):
        if remaining + made + worst > best_total:
            best_total, best = remaining + made + worst, (remaining, made + worst)
        remaining -= kept
        dense, expert = layer_numel_on_rank(model.layer_param_groups[index], job)
        made += int((dense + expert) * per_param)
    return best


def _flex_dispatch_buffer_bytes(model: ModelSpec, job: Job, layout: StageLayout, shape: ActivationShape) -> int:
    """DeepEP's or HybridEP's buffer, made by the first flex dispatch of a stage with MoE layers
    (outside the allocator)."""
    if job.framework != "megatron" or job.moe.dispatcher != "flex" or job.overlap.flex_backend == "ncclep":
        return 0
    moe_layers = [model.layers[i].moe for i in layout.layer_indices if model.layers[i].moe is not None]
    if not moe_layers:
        return 0
    group = job.parallel.expert_tp * job.parallel.ep
    if job.overlap.flex_backend == "hybridep":
        local = max(m.num_experts for m in moe_layers) // job.parallel.ep
        return hybridep_buffer_bytes(hidden=model.hidden_size, tokens=shape.local_tokens, local_experts=local,
                                     group=group)
    return deepep_buffer_bytes(hidden=model.hidden_size, act_bytes=shape.act_bytes, group=group,
                               num_sms=job.overlap.flex_num_sms)


def _cp_backward_extra(model: ModelSpec, job: Job, shape: ActivationShape, index: int) -> int:
    """Transformer Engine's context-parallel buffers in the attention backward of layer ``index``
    (Megatron only): its own ``--cp-comm-type`` when one is given per layer, else the worst of them."""
    kinds = job.overlap.cp_comm_types
    if job.framework != "megatron" or job.parallel.cp == 1:
        return 0
    if len(kinds) == model.num_layers:
        kinds = (kinds[index],)
    return max(cp_backward_extra_bytes(model.layers[index].attention, kind, cp=job.parallel.cp,
                                       tokens=shape.seq * shape.micro_batch, tp=job.parallel.tp,
                                       act_bytes=shape.act_bytes) for kind in kinds)


def _recomputed_copies_bytes(model: ModelSpec, job: Job, profile: FrameworkProfile, prec: ResolvedPrecision,
                             index: int, recomputed: set[int]) -> int:
    """Autocast weight copies a checkpointed region makes again when it is recomputed in the
    backward (the recompute runs under the forward's autocast state; torch.utils.checkpoint), alive
    until that region's backward is done: the whole layer under full recompute, its attention
    projections when the attention module is checkpointed."""
    if prec.weight_copies != "autocast":
        return 0
    mode = resolve_policy(job).kept_classes_key
    if index in recomputed or mode == "selective-per-op":
        numel = layer_weight_copy_numel(model, job, index, eager_experts=profile.kernels == "eager")
    elif mode == "selective-attention-module":
        numel = attention_weight_copy_numel(model, job, index)
    elif resolve_policy(job).modules:
        numel = checkpointed_module_copy_numel(model, job, index, resolve_policy(job).modules,
                                               eager_experts=profile.kernels == "eager")
    else:
        return 0
    return numel * dtype_bytes(prec.compute)


def _mtp_activation_bytes(model: ModelSpec, shape: ActivationShape, job: Job, cache: dict[object, LayerCosts]) -> int:
    """One MTP module per micro-batch: its decoder layer (shaped like the last), two input norms,
    the concatenated 2h input of its projection, and the embedding lookup it reads."""
    keep, full, _, _ = _layer_costs(model.layers[-1], shape, job, cache)
    layer = keep if resolve_policy(job).recomputes else full
    sbh = shape.seq * shape.micro_batch * shape.hidden
    sp = shape.tp if shape.sequence_parallel else 1
    norms = 2 * shape.residual_bytes * sbh // sp
    projection_input = 2 * shape.act_bytes * sbh // sp
    return layer + norms + projection_input


#: Transformer Engine's per-GEMM FP8 scaling state: amax history and scale for the input, the
#: weight and the output gradient, fp32 (history length 1024 by TE's default recipe).
FP8_AMAX_HISTORY = 1024


def fp8_scaling_bytes(job: Job, model: ModelSpec, layout: StageLayout) -> int:
    """FP8 scaling state of the stage's linear layers (delayed scaling): small but real."""
    if job.precision.fp8 is None:
        return 0
    gemms_per_layer = 4  # qkv (or q/kv down/up), output projection, fc1, fc2
    tensors = 3
    return layout.num_layers * gemms_per_layer * tensors * (FP8_AMAX_HISTORY + 2) * 4


def grouped_gemm_workspace_bytes(job: Job, model: ModelSpec, layout: StageLayout) -> int:
    """Transformer Engine's per-stream cuBLAS workspaces of its grouped GEMM (``--moe-grouped-gemm``),
    allocated once a stage runs its experts (:data:`TE_GROUPED_GEMM_WORKSPACES`)."""
    if not job.moe.grouped_gemm or job.framework != "megatron":
        return 0
    if not any(model.layers[i].moe is not None for i in layout.layer_indices):
        return 0
    return TE_GROUPED_GEMM_WORKSPACES * TE_GROUPED_GEMM_WORKSPACE_BYTES


def _profile_workspace(job: Job, profile: FrameworkProfile) -> int:
    """The profile's library workspaces; Megatron's local layers run torch matmuls only, so Transformer
    Engine's cuBLAS workspace (``get_workspace``) is never made under ``--transformer-impl local``."""
    if job.framework == "megatron" and job.transformer_impl == "local":
        return profile.workspace_bytes - TE_CUBLAS_WORKSPACE_BYTES
    return profile.workspace_bytes


def global_buffer_bytes(job: Job, model: ModelSpec, layout: StageLayout, shape: ActivationShape) -> int:
    """Megatron's ``"mpu"`` global memory buffer: the largest request of the all-gather MoE dispatcher
    and, under ``--transformer-impl local``, of the layers' sequence-parallel gathers and unfused
    attention scores (:mod:`memplan.estimate.global_buffer`)."""
    moe = moe_allgather_buffer_bytes(job, model, layout, shape)
    if job.framework != "megatron" or job.transformer_impl != "local":
        return moe
    return max(moe, local_impl_requests(model, layout.layer_indices, shape, eager_attention=job.attention == "eager"))


def moe_allgather_buffer_bytes(job: Job, model: ModelSpec, layout: StageLayout, shape: ActivationShape) -> int:
    """Megatron's all-gather token dispatcher gathers every token of its expert-TP x EP group into the
    global memory buffer, which is kept for the rest of the run.

    ``MoEAllGatherTokenDispatcher.token_dispatch`` calls ``gather_from_sequence_parallel_region(...,
    use_global_buffer=True)`` (megatron/core/transformer/moe/token_dispatcher.py): the output is a view
    of ``GlobalMemoryBuffer.get_tensor(..., "mpu")`` (megatron/core/utils.py), a tensor the buffer
    allocates at the largest size asked for and never frees. Its size: the MoE layer's tokens on one
    rank (``s/cp * b``, divided by TP under sequence parallelism) times ``etp * ep`` rows of the hidden
    size in the activation dtype; no gather (and no buffer) when ``etp * ep == 1``. With
    ``--transformer-impl local`` the same buffer also serves the unfused attention scores and the
    sequence-parallel all-gathers of the linear layers (the largest wins: :func:`global_buffer_bytes`).
    """
    if job.framework != "megatron" or job.moe.dispatcher != "allgather":
        return 0
    group = job.parallel.expert_tp * job.parallel.ep
    if group == 1 or not any(model.layers[i].moe is not None for i in layout.layer_indices):
        return 0
    return shape.local_tokens * group * shape.hidden * shape.act_bytes


def _summed_grad_bytes(job: Job, profile: FrameworkProfile, prec: ResolvedPrecision) -> int:
    """Bytes per element of the gradients autograd sums for a tied embedding: the stored gradient's
    dtype, or under PyTorch FSDP2 the unsharded parameters' (compute) dtype, before the reduce-scatter."""
    if job.sharding.fsdp != "none" and profile.torch_optimizer:
        return dtype_bytes(prec.compute)
    return prec.grad_bytes


def _head_numel(model: ModelSpec, profile: FrameworkProfile, job: Job, vocab_rows: int) -> int:
    """The output head's weight on one TP rank."""
    return vocab_rows * model.hidden_size // head_rows_split(profile, job.parallel.tp, model.tie_word_embeddings)


def _stage_adapters(model: ModelSpec, job: Job, layout: StageLayout) -> list[Adapter]:
    layers = set(layout.layer_indices)
    root = layout.has_head or layout.has_embedding
    return [a for a in finetune_params(model, job.finetune).adapters
            if (a.module.layer in layers) or (a.module.layer is None and root)]


def _adapter_tensor_sizes(adapter: Adapter) -> tuple[int, ...]:
    """lora_A, lora_B (and a DoRA magnitude) of one adapter, numel each."""
    m, rank = adapter.module, adapter.rank * adapter.experts
    return (rank * m.in_features, m.out_features * rank) + ((m.out_features,) if adapter.dora else ())


def _trainable_small_tensors(model: ModelSpec, job: Job, layout: StageLayout) -> SmallTensors:
    """bitsandbytes' small-tensor split of a PEFT stage's adapters (each often under the paging threshold)."""
    adapters = _stage_adapters(model, job, layout)
    vectors = sum(a.module.out_features for a in adapters if a.dora)
    return small_tensors_of_sizes((n for a in adapters for n in _adapter_tensor_sizes(a)), vectors=vectors)


def _largest_trainable(model: ModelSpec, job: Job, layout: StageLayout) -> int:
    """Largest trainable adapter tensor of a PEFT stage (fully trained modules: the largest tensor bound)."""
    sizes = [n for a in _stage_adapters(model, job, layout) for n in _adapter_tensor_sizes(a)]
    return max(sizes, default=0)


def _largest_tensor(model: ModelSpec, vocab_rows: int, job: Job, profile: FrameworkProfile) -> int:
    return vocab_rows * model.hidden_size // vocab_split(profile, job.parallel.tp)


def _reserved(allocated: int, fragmentation: float) -> int:
    reserved = int(allocated / (1.0 - fragmentation))
    return -(-reserved // _SEGMENT) * _SEGMENT


def _assumptions(
    model: ModelSpec,
    job: Job,
    profile: FrameworkProfile,
    prec: ResolvedPrecision,
    vocab_rows: int,
    fragmentation: float,
) -> tuple[str, ...]:
    par, b = job.parallel, job.batch
    out = [f"framework profile '{profile.name}': {profile.description}"]
    out += list(prec.notes)
    out.append(
        f"layout: {par.world_size} GPUs = dp {par.data_parallel} x tp {par.tp} x pp {par.pp} x cp {par.cp}"
        + (f", vpp {par.vpp} (interleaved 1F1B)" if par.vpp > 1 else (", 1F1B pipeline schedule" if par.pp > 1 else ""))
        + (", sequence parallel" if par.sequence_parallel else "")
        + (f", ep {par.ep}, etp {par.expert_tp}, expert-dp {par.expert_dp}" if model.is_moe else "")
    )
    out.append(
        f"batch: micro-batch {b.micro_batch_size} x sequence {b.seq_length}, "
        f"{job.num_microbatches} micro-batch(es) per step per DP rank"
    )
    if vocab_rows != model.vocab_size:
        divisible = job.vocab_divisible_by or profile.vocab_divisible_by
        out.append(f"vocabulary {model.vocab_size} padded to {vocab_rows} rows (multiple of {divisible} x tp)")
    sh = job.sharding
    if sh.fsdp != "none":
        out.append(f"FSDP {sh.fsdp} shard: weights, gradients and optimizer states sharded over data parallelism")
    elif sh.zero:
        out.append(f"ZeRO stage {sh.zero}: " + ("optimizer states", "optimizer states and gradients", "optimizer states, gradients and weights")[sh.zero - 1] + " sharded over data parallelism")
    elif sh.distributed_optimizer:
        out.append("distributed optimizer: master weights and moments sharded over DP x CP; full gradient buffer kept")
    else:
        out.append("no optimizer-state sharding: every DP rank keeps full model states")
    opt = job.optimizer
    impl = resolved_optimizer_impl(job)
    out.append(f"optimizer {opt.name} ({impl} implementation)" + (f", momentum {opt.momentum}" if opt.name == "sgd" else ""))
    if describe_optimizer(job):
        out.append(describe_optimizer(job))
    code = model_code(job)
    out += model_code_notes(code, job.attention, dtype_bytes(prec.compute), par.sequence_parallel)
    if job.attention == "eager" and profile.kernels == "eager":
        out.append("eager attention (transformers eager_attention_forward): per head the fp32 s x s softmax output and "
                   "its cast to the compute dtype are kept (and dropout mask/output), GQA keys/values copied per query "
                   "head (repeat_kv), soft-capped scores' tanh output where the model caps them")
    elif job.attention == "eager":
        out.append("eager attention: the s x s softmax output (and dropout mask/output) is kept per head")
    elif sdpa_attention(code, job.attention, dtype_bytes(prec.compute)) != "math":  # (math: the model code's note)
        out.append(f"{job.attention} attention: no s x s score matrix is kept, only the fp32 log-sum-exp per head and token")
    out.append(_describe_policy(model, job, profile, prec))
    if describe_ds_checkpointing(job):
        out.append(describe_ds_checkpointing(job))
    out.append("dropout masks kept (1 byte per element)" if job.dropout > 0 else "no dropout: no masks kept")
    fp32_routers = any(layer.moe is not None and layer.moe.router_fp32 for layer in model.layers)
    if fp32_routers and job.framework == "hf" and prec.param_bytes < 4:
        out.append("transformers keeps the MoE router weights in fp32 (_keep_in_fp32_modules_strict): their weights, "
                   "gradients and optimizer states are priced at 4 bytes, and each router's fp32 copy of its input as "
                   "an activation" + ("; fine-tuning: frozen routers are priced at the base's dtype"
                                      if is_finetune(job) else ""))
    if model.is_moe:
        moe = job.moe
        routing = "balanced routing" if moe.routed_token_factor == 1.0 else (
            f"the busiest expert gets {moe.routed_token_factor:g}x its mean share of tokens"
            + (f" (capacity factor {moe.capacity_factor:g})" if moe.capacity_factor else ""))
        out.append(
            f"MoE: {routing}; {moe.dispatcher} dispatcher; experts on each rank run on tokens x top-k x etp rows "
            f"at f/etp width; shared experts {'split by TP' if moe.shared_expert_parallel == 'tp' else 'placed with the routed experts'}"
        )
    if model.is_moe and job.moe.dispatcher == "flex" and job.framework == "megatron":
        out.append("flex dispatcher: " + (
            f"DeepEP's buffer on the etp x ep group of {par.expert_tp * par.ep} ranks ({job.overlap.flex_num_sms or 20} "
            "SMs; NVLink receive slots, 32 MiB workspace, RDMA slots past 8 ranks) allocated outside PyTorch's "
            "allocator (outside_allocator_bytes)" if job.overlap.flex_backend == "deepep" else
            f"HybridEP's shared dispatch/combine buffer on the etp x ep group of {par.expert_tp * par.ep} ranks "
            "(every token of the group able to land on one rank: 16-bit tokens, fp32 probabilities per local "
            "expert and domain rank, FP8 scales, flags), 8 ranks per NVLink domain, allocated outside PyTorch's "
            "allocator (outside_allocator_bytes); RDMA staging across domains not priced"
            if job.overlap.flex_backend == "hybridep" else
            f"{job.overlap.flex_backend}'s buffers are not priced") + "; tokens priced as the all-to-all dispatcher's")
    if job.transformer_impl == "local":
        out.append("--transformer-impl local: Megatron's global memory buffer holds the largest of the layers' "
                   "sequence-parallel input gathers, the unfused attention's raw scores and the all-gather MoE "
                   "dispatcher's tokens (workspace); its layers run torch matmuls, so Transformer Engine's cuBLAS "
                   "workspace is not made")
    ov = job.overlap
    out += describe_ep_overlap(ep_a2a=ov.ep_a2a, delay_wgrad=ov.delay_wgrad, early_release=ov.early_attn_release,
                               experts_wgrad=ov.experts_wgrad_overlap and model.is_moe,
                               shared_overlap=ov.shared_expert_overlap and any(
                                   layer.moe is not None and layer.moe.shared_expert is not None
                                   for layer in model.layers))
    if par.cp > 1 and profile.name == "megatron":
        out.append(describe_cp(job.overlap.cp_comm_types, par.cp))
    if job.overlap.tp:
        out.append(describe_tp_overlap(job.overlap, tokens=b.seq_length // par.cp * b.micro_batch_size,
                                       hidden=model.hidden_size, tp=par.tp, fp8=job.precision.fp8 is not None,
                                       world_size=par.world_size))
    fine = job.offload
    if fine.module_names:
        out.append(describe_fine_offload(fine.module_names, min_numel=fine.min_tensor_numel,
                                         fraction=fine.group_fraction, delta=fine.pp_delta_bytes))
    if job.cuda_graphs.impl != "none":
        out.append(describe_cuda_graphs(job.cuda_graphs.impl, job.cuda_graphs.module_names))
    if job.mtp_layers:
        out.append(f"{job.mtp_layers} multi-token-prediction module(s) on the last stage: a decoder layer shaped like the last, "
                   "a 2h->h projection, norms, their own logits and loss, and a copy of the embedding")
    if job.precision.fp8:
        out.append(
            f"FP8 ({job.precision.fp8}): linear-layer inputs saved in FP8; "
            + ("weights kept in FP8 with an FP8 transpose" if job.precision.fp8_params
               else "an FP8 copy and transpose of every GEMM weight cached per step beside the 16-bit weight")
        )
    off = job.offload
    if off.any:
        moved = [w for w, on in (("optimizer state", off.optimizer), ("weights", off.params), ("activations", off.activations)) if on]
        out.append("offloaded to CPU memory: " + ", ".join(moved)
                   + (f" ({off.optimizer_fraction:.0%} of the optimizer state)" if off.optimizer and off.optimizer_fraction < 1 else ""))
    loss = resolved_loss(job)
    out.append(f"loss path '{loss}': logits of the newest micro-batch on the last stage")
    if loss in LOSS_NOTES:
        out.append(LOSS_NOTES[loss])
    if b.packing:
        out.append(PACKING_NOTE)
    out.append(f"activations kept as saved by {profile.kernels} kernels")
    if model.is_moe and profile.kernels == "eager" and prec.weight_copies == "autocast":
        out.append("MoE experts (transformers grouped_mm) are not autocast ops: they run in the fp32 weights' dtype "
                   "with no 16-bit weight copies; the router's linear is cast")
    if model.tie_word_embeddings and profile.frees_gradients:
        out.append("tied embedding: its two gradients (head and embedding) are summed at the end of the backward "
                   "(two weight-sized temporaries)")
    out += finetune_assumptions(model, job)
    out.append(f"reserved = allocated / (1 - {fragmentation:.2f}) rounded to 2 MiB segments (assumed allocator fragmentation)")
    return tuple(out)


def layer_activation_costs(model: ModelSpec, job: Job, index: int) -> tuple[int, int, int]:
    """(bytes kept under the job's recompute, bytes kept without recompute, backward transient) of
    decoder layer ``index`` for one micro-batch on one rank: the per-layer figures the estimate sums."""
    profile = get_profile(job.framework)
    shape = _activation_shape(model, job, profile, resolve_precision(job, profile))
    return _layer_costs(model.layers[index], shape, job, {}, index, model)[:3]


def _describe_policy(model: ModelSpec, job: Job, profile: FrameworkProfile, prec: ResolvedPrecision) -> str:
    """The assumption line of the job's activation policy (:mod:`memplan.policies`)."""
    policy = resolve_policy(job)
    if policy.name == "attention-module":
        return ("selective recompute: every attention module (self_attn) is checkpointed (non-reentrant "
                "torch.utils.checkpoint); its input and the attention mask are kept, its saved tensors and autocast "
                "weight copies are made again in its backward")
    if policy.name == "megatron-selective":
        shape = _activation_shape(model, job, profile, prec)
        sites = {term_site(t) for layer in {id(x): x for x in model.layers}.values() for t in layer_terms(layer, shape)}
        return describe_recompute(policy.modules, sites)
    if policy.name == "torchtitan-sac":
        return ("selective recompute: torchtitan's per-op selective activation checkpointing (SelectiveAC) of every "
                "decoder layer: its input and the outputs of the saved ops are kept (matmuls except every second "
                "mm of each layer call, the attention kernel's output and log-sum-exp; with a bias a linear is an "
                "addmm, always kept), the rest is recomputed in its backward"
                + ("; MoE/MLA layers are not modelled op by op: the attention core's recompute stands in"
                   if any(layer.moe is not None or layer.attention.kind == "mla" for layer in model.layers)
                   else ""))
    if policy.name == "attention-core":
        return "selective recompute: the attention core is recomputed; its inputs are kept"
    if policy.name == "memory-budget":
        return (f"torchtitan memory_budget {policy.memory_budget:g} (torch.compile's partitioner, "
                "activation_memory_budget): an upper bound — each layer keeps its input plus the budget's fraction of "
                "the rest of what eager autograd saves (the partitioner's knapsack keeps at most that fraction of its "
                "default min-cut's saved bytes above the compiled region's inputs; the min-cut saves no more than "
                "eager autograd); compiled kernels' fusion is not modelled")
    if policy.name == "full":
        grouped = policy.method == "uniform" and (policy.num_layers or 1) > 1
        return (f"full recompute ({policy.method}, {policy.num_layers or 'all'} layers): "
                + (f"each checkpointed group of {policy.num_layers} layers keeps only its input and is recomputed "
                   "whole in its backward" if grouped else "recomputed layers keep only their input") + ("; their autocast weight copies are not kept (autocast's cache is cleared when the "
                                 "forward ends) and are made again by the recompute"
                                 if prec.weight_copies == "autocast" else ""))
    return "no recompute: every layer keeps what autograd saves for its backward"
