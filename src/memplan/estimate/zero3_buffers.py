"""DeepSpeed ZeRO-3's buffers on one GPU: gathered parameters, the computing module's gradients, the step's sub-group
gradient, the reduce bucket.

What ``--zero 3`` runs where the profile's ZeRO is DeepSpeed's (``FrameworkProfile.zero3_buffers``: DeepSpeed, the
Hugging Face Trainer; DeepSpeed 0.19.8, deepspeed/runtime/zero/), priced from the job's DeepSpeed config keys
(:class:`memplan.job.Sharding`) or DeepSpeed's defaults (:data:`memplan.profiles.zero3.DEEPSPEED_ZERO3`; ``"auto"``:
Hugging Face's values from the hidden size), each in the parameters' dtype:

* **Gathered parameters** (partitioned_param_coordinator.py). A module's parameters are all-gathered before it runs
  (``_fetch_sub_module_impl``, l. 364-378) and released after it unless used again within
  ``stage3_max_reuse_distance`` elements of the recorded trace (``__params_to_release``, l. 653-661): at the start
  of the backward, the last layers of the forward are kept, about half that distance (the trace walks them forward
  and back). With ``stage3_prefetch_bucket_size`` above 0 the prefetcher fetches ahead while fewer than
  ``stage3_max_live_parameters`` are gathered (l. 452-457), and what it skipped as already gathered is not released
  (l. 642-651), so the gathered set fills up to that cap beside the module computing. memplan prices the larger of
  the two, at most every parameter: ``min(P, max(U + min(max_live, P - U), reuse / 2))``, ``U`` the largest module
  fetched at once (DeepSpeed's own estimator's "largest layer": the most parameters one module owns, a linear, a
  layer's stacked experts or the embedding, the same size as an untied head), with
  the prefetch term 0 when prefetching is off. Alive from the forward through the backward; the backward releases
  each module after its own backward, so when the backward's epilogue reduces the last bucket
  (``independent_gradient_partition_epilogue``) none is gathered but the persistent ones (measured, docs/benchmarks.md,
  helper zero18: Z8 and Z10 at the epilogue's entry), and the optimizer step holds none.
* **The computing module's gradients**: autograd makes them in the parameters' dtype before DeepSpeed copies them
  into the bucket (stage3.py ``__add_grad_to_ipg_bucket``, l. 1621-1640): ``U`` elements during the backward.
* **The optimizer step's sub-group gradient**: the gradient partitions stay in the model's dtype
  (``grad_partitions_flat_buffer`` in ``gradient_accumulation_dtype``, stage3.py l. 791-793); the step makes each
  sub-group's fp32 gradient from a flat copy of them (l. 2683-2695), ``min(partition, sub_group_size + one
  parameter's partition)`` elements (none with the optimizer offloaded: its gradients go to CPU memory).
* **The reduce (IPG) bucket**: ``reduce_bucket_size`` elements in ``communication_data_type`` (the model's dtype by
  default) allocated once when the optimizer is built and kept (stage3.py l. 780-784, with ``contiguous_gradients``,
  DeepSpeed's default); one buffer per communication dtype (l. 477): ``overlap_comm`` moves the reduction to a side
  stream but adds no second buffer at stage 3.
* **The reduction's conversions** (``__avg_scatter_grads``, the path of DeepSpeed's default ``reduce_scatter``):
  the gradients one reduction takes (a bucket's worth, or alone a parameter larger than the bucket) copied to
  ``communication_data_type`` where it differs from the parameters' dtype, and the scattered partition converted
  to ``gradient_accumulation_dtype`` where that differs; during the backward.
* **Persistent parameters** (parameter_offload.py ``mark_persistent_parameters``): tensors of at most
  ``stage3_param_persistence_threshold`` elements (while their total stays within
  ``stage3_model_persistence_threshold``) stay gathered on every GPU but for the optimizer step (``step``
  releases every parameter with ``_partition_all_parameters``; ``_post_step`` gathers them again); the gathered
  set above counts the other parameters.
* **The coalesced all-gather's flat buffer** (partition_parameters.py ``all_gather_coalesced`` and
  ``AllGatherCoalescedHandle.wait``): a prefetch all-gathers its parameters into one flat buffer and ``wait`` copies
  each parameter out (``torch.cat``); every parameter of the call holds the same handle, so the flat buffer lives
  until the last of them is fetched. At the end of the forward the last call's buffer waits for the head: at most
  ``min(stage3_prefetch_bucket_size, stage3_max_live_parameters)`` and the parameter that crosses it, of the
  parameters not kept persistent (measured, docs/benchmarks.md, helper zero17: Z4, 5,251,072 B at the last layer's
  forward, the whole model's non-persistent parameters in one call). Not priced in the backward (Z4's backward holds
  no such buffer beside the gathered set).
* **One data-parallel rank** (partition_parameters.py ``all_gather_coalesced``): where every parameter's partition
  is the whole parameter, the engine points the parameter at its partition (``_no_gather_coalesced``): no
  gathered and no persistent copy (measured, docs/benchmarks.md, helper zero17: Z3).

Witness: DeepSpeed's real ZeRO-3 engine on CPU (world size 1, tiny Llama models; docs/benchmarks.md, helper
zero3ds14): the bucket's bytes exactly, overlap_comm on and off alike, the gathered set's maximum within 2.0% (a
reuse window alone: 4.5%), the gradient partitions' 2 bytes per parameter, the sub-group's fp32 gradient exactly at
sub_group_size 1e9 and 0 (at 5e5 under the priced upper bound); (helper ds3more14) the gradient partitions in fp32
with ``grad_accum_dtype`` fp32, the fp32 bucket's bytes, the persistent elements at four thresholds exactly, the
most elements one reduction took within 2%.

Known limitations: ``reduce_scatter: false``'s contiguous path is not priced; the cap on the prefetcher counts what is already
gathered, so the window is filled to within one module of it; a sub-group is priced at its upper bound.
"""

from __future__ import annotations

from memplan.estimate.context import RunContext, StageContext
from memplan.estimate.finetune import adapter_bytes, frozen_bytes_per_element
from memplan.estimate.ledger import COMMUNICATION, TEMPORARY, Contribution
from memplan.estimate.precision import ResolvedPrecision
from memplan.estimate.states import StageParams, layer_numel_on_rank
from memplan.job import Job, resolved_adapter_dtype
from memplan.model.linears import layer_linears, model_parameters
from memplan.model.params import embedding_params
from memplan.model.spec import ModelSpec
from memplan.peft.params import saved_modules
from memplan.profiles.framework import FrameworkProfile, vocab_split
from memplan.profiles.zero3 import (
    hf_auto_persistence_threshold,
    hf_auto_prefetch_bucket,
    keeps_bucket,
    reduce_bucket,
    setting,
)
from memplan.units import dtype_bytes

#: fp32: the optimizer's master weights and the step's gradient (``master_weights_and_grads_dtype``).
_FP32 = 4
#: From the forward through the backward: each module is released after its own backward, so the end of the backward
#: (the epilogue's last reduction) and the optimizer step hold no gathered parameter.
_GATHERED_LIVE = ("loss", "backward")
#: Every moment but the optimizer step: ``step`` starts with ``_partition_all_parameters`` (persistent ones too) and
#: ``_post_step`` gathers the persistent ones again (stage3.py; measured, docs/benchmarks.md, helper zero17: Z4).
_PERSISTENT_LIVE = ("forward", "loss", "backward", "end of backward")


def applies(job: Job, profile: FrameworkProfile, prec: ResolvedPrecision) -> bool:
    """``--zero 3`` run by DeepSpeed (the profile's ZeRO is DeepSpeed's; not PyTorch FSDP, nor FSDP's cast copies)."""
    return (profile.zero3_buffers is not None and job.sharding.zero == 3 and job.sharding.fsdp == "none"
            and prec.weight_copies != "fsdp")


def module_unit(ctx: StageContext, params: StageParams) -> int:
    """The most parameters one module owns, which DeepSpeed fetches at once: a linear of a decoder layer, a layer's
    stacked experts or, on a stage holding it, the embedding (an untied head is a module of the same size)."""
    run = ctx.run
    model, tp = run.model, run.job.parallel.tp
    embedding = embedding_params(model, run.vocab_rows) // vocab_split(run.profile, tp)
    unit = min(params.root, embedding)
    for index in ctx.layout.layer_indices:
        layer = model.layers[index]
        linears = layer_linears(layer, model.hidden_size, model.model_type)
        unit = max(unit, max((m.weight_numel for m in linears), default=0) // tp)
        if layer.moe is not None:
            unit = max(unit, layer_numel_on_rank(model.layer_param_groups[index], run.job)[1])
    return unit


def gathered_elements(total: int, unit: int, prefetch: int, max_live: int, reuse: int) -> int:
    """Parameters gathered at once (see the module docstring)."""
    ahead = min(max_live, total - unit) if prefetch > 0 else 0
    return min(total, max(unit + ahead, reuse // 2))


def sub_group_elements(partition: int, sub_group_size: int, largest_param_partition: int) -> int:
    """The largest optimizer sub-group: ``sub_group_size`` and the parameter that crosses it, at most the partition."""
    return min(partition, sub_group_size + largest_param_partition)


def persistent_elements(numels: tuple[int, ...], param_threshold: int, model_threshold: int | None) -> int:
    """Parameters DeepSpeed keeps gathered for good (parameter_offload.py ``mark_persistent_parameters``): in
    ``named_parameters`` order, each of at most ``param_threshold`` elements while the total stays within
    ``model_threshold`` (None: no cap, DeepSpeed's ``sys.maxsize``)."""
    total = 0
    for numel in numels:
        if model_threshold is not None and numel + total > model_threshold:
            continue
        if numel <= param_threshold:
            total += numel
    return total


def largest_tensor(ctx: StageContext) -> int:
    """The largest parameter tensor this GPU holds (a tensor, not a module: transformers' stacked experts are one
    tensor per projection): its stage's layers' split by tensor parallelism, and the root's (embedding, head, final
    norm) split as the vocabulary is, on a stage holding either end. Stacked experts are not split by expert
    parallelism here: an upper bound under EP."""
    run, layout = ctx.run, ctx.layout
    tp, layers = run.job.parallel.tp, set(layout.layer_indices)
    root = vocab_split(run.profile, tp) if layout.has_embedding or layout.has_head else 0
    return max((t.numel // tp if t.layer is not None else t.numel // root for t in model_parameters(run.model)
                if (t.layer in layers if t.layer is not None else root)), default=0)


def model_numels(model: ModelSpec) -> tuple[int, ...]:
    """The model's parameter tensors' sizes in ``named_parameters`` order (the embedding, each layer's, the rest)."""
    tensors = list(enumerate(model_parameters(model)))
    order = sorted(tensors, key=lambda it: (it[1].layer if it[1].layer is not None else (-1 if it[0] == 0 else 1 << 62),
                                            it[0]))
    return tuple(t.numel for _, t in order)


def _persistent(ctx: StageContext) -> tuple[int, Contribution | None]:
    """Small parameters kept whole on every GPU beside their partitions (``stage3_param_persistence_threshold``,
    DeepSpeed's 1e5; Hugging Face's \"auto\" 10 x hidden), from the first forward on, but for the optimizer step."""
    run = ctx.run
    sh, d = run.job.sharding, run.profile.zero3_buffers
    assert d is not None, "applies() checks the profile runs DeepSpeed's ZeRO-3"
    threshold, where = setting(sh.param_persistence_threshold, d.param_persistence_threshold,
                                hf_auto_persistence_threshold(run.model.hidden_size))
    cap_all = sh.model_persistence_threshold
    elements = persistent_elements(model_numels(run.model), threshold, cap_all)
    adapters = persistent_elements(adapter_numels(run), threshold, None if cap_all is None else cap_all - elements)
    if not elements and not adapters:
        return 0, None
    cap = "" if cap_all is None else f", at most {cap_all:,} in all"
    dtype = resolved_adapter_dtype(run.job)
    peft = (f" and {adapters:,} elements of peft adapter tensors in their {dtype} (peft adds them after zero.Init; "
            "deepspeed.initialize partitions and marks them like the rest; adapter tensors above the threshold are "
            "not priced as gathered)") if adapters else ""
    nbytes = dtype_bytes(run.prec.param) * elements + adapter_bytes(run.job) * adapters
    return elements, Contribution(COMMUNICATION, nbytes, _PERSISTENT_LIVE, note=(
        f"DeepSpeed ZeRO-3 persistent parameters: {elements:,} elements of tensors of at most {threshold:,} "
        f"(stage3_param_persistence_threshold, {where}{cap}) stay gathered on every GPU ({run.prec.param}){peft} but "
        "for the optimizer step, which releases every parameter first and gathers them again after"))


def adapter_numels(run: RunContext) -> tuple[int, ...]:
    """The peft adapter tensors' sizes (lora_A ``(E*r, in)``, lora_B ``(out, E*r)``, DoRA's magnitude); none under
    full training."""
    if run.counts is None:
        return ()
    out: list[int] = []
    for a in run.counts.adapters:
        m, r = a.module, a.experts * a.rank
        out += [r * m.in_features, r * m.out_features] + ([m.out_features] if a.dora else [])
    return tuple(out)


def _only_adapters_train(run: RunContext) -> bool:
    """Fine-tuning where nothing of the base model trains (peft adapters only, no ``modules_to_save`` copy)."""
    counts = run.counts
    return counts is not None and not counts.root.trained and not counts.root.copies and not any(
        p.trained or p.copies for p in counts.layers)


def frozen_root_elements(run: RunContext) -> int:
    """The embedding's and head's elements not kept persistent when they train nothing, which no layer's backward
    holds gathered (partition_parameters.py / partitioned_param_coordinator.py): a frozen embedding's output needs no
    gradient, so no backward hook fetches it and the trace has no later use (released after the forward); the head's
    backward runs first and releases it. 0 under full training or with the root trained (measured, docs/
    benchmarks.md, helper zlora17: Z5 at a layer's backward entry holds neither). A peft ``modules_to_save`` copy
    training leaves them frozen all the same: the copy replaces the original in the forward (the original is never
    gathered), a head copy's backward runs first and releases it, an embedding copy's runs after every layer's
    (measured, helper zero18b: Z11b at a layer's backward entry holds neither the embedding nor the head)."""
    counts = run.counts
    if counts is None or counts.root.trained or counts.root.adapter:
        return 0
    split = vocab_split(run.profile, run.job.parallel.tp)
    root = tuple(t.numel // split for t in model_parameters(run.model) if t.layer is None)
    return sum(root) - persistent_elements(root, *_persistence(run))


def _shards(run: RunContext) -> int:
    """The GPUs one parameter is partitioned over (DeepSpeed's data-parallel group)."""
    return max(1, run.job.parallel.data_parallel * run.job.parallel.cp)


def _points_at_partition(run: RunContext) -> bool:
    """One data-parallel rank with the partitions on the GPU: the engine points each parameter at its partition.
    With ``offload_param`` the partitions are in host memory (``_partition_param`` moves them to ``remote_device``,
    persistent ones excepted) and ``NoGatherHandle`` copies each fetched one to the GPU: a gathered copy as on more
    ranks (partition_parameters.py, DeepSpeed 0.19.8)."""
    return _shards(run) == 1 and not run.job.offload.params


#: One data-parallel rank, partitions on the GPU: the partition is the whole parameter and nothing is gathered.
_UNGATHERED = Contribution(COMMUNICATION, 0, note=(
    "DeepSpeed ZeRO-3 on one data-parallel rank: each parameter's partition is the whole parameter, so the engine "
    "points the parameter at its partition instead of all-gathering a copy (partition_parameters.py "
    "all_gather_coalesced -> _no_gather_coalesced), and its persistent parameters are no copy either: no gathered "
    "or persistent parameters are priced"))


def flat_gather_elements(ctx: StageContext, params: StageParams) -> int:
    """The elements of the prefetcher's last coalesced all-gather still held at the end of the forward (see the
    module): at most what one call fetches, ``min(stage3_prefetch_bucket_size, stage3_max_live_parameters)`` and the
    parameter that crosses it, of the parameters not kept persistent; 0 on one data-parallel rank or with the
    prefetcher off."""
    run = ctx.run
    sh, d = run.job.sharding, run.profile.zero3_buffers
    if d is None or not applies(run.job, run.profile, run.prec) or _shards(run) == 1:
        return 0
    prefetch = setting(sh.prefetch_bucket_size, d.prefetch_bucket_elements, hf_auto_prefetch_bucket(
        run.model.hidden_size))[0]
    if prefetch <= 0:
        return 0
    live = setting(sh.max_live_parameters, d.max_live_parameters, 0)[0]
    persistent = persistent_elements(model_numels(run.model), *_persistence(run))
    return min(max(0, params.total - persistent), min(prefetch, live) + module_unit(ctx, params))


def _persistence(run: RunContext) -> tuple[int, int | None]:
    sh, d = run.job.sharding, run.profile.zero3_buffers
    assert d is not None, "applies() checks the profile runs DeepSpeed's ZeRO-3"
    threshold = setting(sh.param_persistence_threshold, d.param_persistence_threshold,
                        hf_auto_persistence_threshold(run.model.hidden_size))[0]
    return threshold, sh.model_persistence_threshold


def _flat_gather(ctx: StageContext, params: StageParams) -> Contribution | None:
    """The coalesced all-gather's flat buffer beside the parameters' own copies at the end of the forward."""
    elements = flat_gather_elements(ctx, params)
    if not elements:
        return None
    prec = ctx.run.prec.param
    return Contribution(COMMUNICATION, dtype_bytes(prec) * elements, ("forward",), note=(
        f"DeepSpeed ZeRO-3 prefetch: the flat buffer of its last coalesced all-gather ({elements:,} {prec} elements, "
        "at most stage3_prefetch_bucket_size and one parameter) is held until every parameter it brought is used, "
        "beside their own copies: alive at the end of the forward, freed once the head is fetched"))


def reduced_elements(total: int, bucket: int, unit: int) -> int:
    """Gradients one reduction takes at most: a bucket's worth, or alone the parameter that does not fit in one."""
    return min(total, max(bucket, unit))


def communication_dtype(run: RunContext) -> str:
    """The dtype DeepSpeed's gradient collectives run in: ``communication_data_type``, else the model's (engine.py
    ``communication_data_type``: fp16 or bf16 where enabled, else fp32); every stage reads it here."""
    return run.job.sharding.communication_data_type or run.prec.param


def reduction_copy(run: RunContext, total: int, bucket: int, unit: int, reduced: str) -> tuple[int, int, str]:
    """(the gradients one reduction takes at most (:func:`reduced_elements`), the bytes of their copy in the
    communication dtype, 0 where that is ``reduced``, the dtype they are reduced in, and that dtype): ZeRO-1/2's
    ``average_tensor`` and ZeRO-3's ``__avg_scatter_grads`` both copy with ``tensor.to(communication_data_type)``."""
    comm = communication_dtype(run)
    elements = reduced_elements(total, bucket, unit)
    return elements, (elements * dtype_bytes(comm) if comm != reduced else 0), comm


def _bucket(ctx: StageContext, bucket: int, where: str) -> Contribution:
    """The reduce bucket in ``communication_data_type`` (the model's dtype by default)."""
    comm = communication_dtype(ctx.run)
    return Contribution(COMMUNICATION, dtype_bytes(comm) * bucket, note=(
        f"DeepSpeed ZeRO-3 reduce bucket: reduce_bucket_size {bucket:,} elements ({where}) in {comm} "
        f"(communication_data_type), allocated when the optimizer is built and kept (contiguous_gradients; "
        "overlap_comm adds no second buffer at stage 3)"))


def _conversions(ctx: StageContext, params: StageParams, bucket: int, unit: int) -> Contribution | None:
    """The reduction's dtype conversions (stage3.py ``__avg_scatter_grads``, the path DeepSpeed's default
    ``reduce_scatter`` takes): the bucket's gradients copied to ``communication_data_type`` where it differs from the
    parameters' dtype, and the scattered partitions to the gradient partitions' dtype where that differs."""
    run = ctx.run
    filled, copy, comm = reduction_copy(run, params.total, bucket, unit, run.prec.param)
    grad, param = run.prec.grad, run.prec.param
    if comm == param and comm == grad:
        return None
    part = -(-filled // max(1, run.job.parallel.data_parallel * run.job.parallel.cp))
    size = copy + (dtype_bytes(grad) * part if comm != grad else 0)
    return Contribution(TEMPORARY, size, ("backward", "end of backward"), (
        f"DeepSpeed ZeRO-3 reduction of up to {filled:,} gradient elements (a bucket, or one larger parameter): "
        + (f"their copy in {comm} (communication_data_type)" if comm != param else "")
        + (" and " if comm != param and comm != grad else "")
        + (f"the scattered partition ({part:,} elements) converted to {grad} (gradient_accumulation_dtype)"
           if comm != grad else "")))


def flat_fp32_bytes(grad_bytes: int) -> int:
    """Bytes per element where a DeepSpeed step flattens gradients (a copy in their dtype) and casts the copy to fp32,
    both alive at the cast (``flatten(...).to(fp32)``; one fp32 tensor where the gradients are fp32 already)."""
    return _FP32 + (grad_bytes if grad_bytes != _FP32 else 0)


def _sub_group_gradient(ctx: StageContext, partition: int, unit: int, setting: tuple[int, str]) -> Contribution:
    """The optimizer step's fp32 gradient of its largest sub-group, made from the flattened 16-bit gradient partition
    (stage3.py ``_prepare_fp32_grad_for_sub_group``: ``flatten(...).to(fp32)``, both alive at that instant); a
    sub-group closes once it reaches ``sub_group_size`` (``_create_fp16_sub_groups``), so it may exceed it by one
    parameter's partition (at most the largest module's)."""
    run = ctx.run
    size, where = setting
    elements = sub_group_elements(partition, size, -(-unit // _shards(run)))
    return Contribution(TEMPORARY, flat_fp32_bytes(dtype_bytes(run.prec.grad)) * elements, ("optimizer step",), (
        f"DeepSpeed ZeRO-3 optimizer step: the fp32 gradient of its largest sub-group ({elements:,} of the partition's "
        f"{partition:,} elements; sub_group_size {size:,}, {where}) made from a flat {run.prec.grad} copy of the "
        "gradient partition"))


def _frozen_root_backward(gathered: Contribution, backward: int, frozen: int, c: int) -> list[Contribution]:
    """The gathered set, the backward's without a frozen embedding and head (:func:`frozen_root_elements`)."""
    if not frozen or backward * c >= gathered.nbytes:
        return [gathered]
    forward = tuple(p for p in gathered.live if p in ("forward", "loss"))
    return [gathered._replace(live=forward), Contribution(COMMUNICATION, c * backward, ("backward",), (
        f"DeepSpeed ZeRO-3 in the backward with the embedding and head frozen: {backward:,} elements gathered, "
        f"without their {frozen:,} (a frozen embedding has no backward to fetch it for and is released after the "
        "forward; the head's backward runs first and releases it; a modules_to_save copy replaces its original, "
        "which is never gathered, and is released after its own backward)"))]


def _module_gradient(run: RunContext, unit: int, c: int) -> list[Contribution]:
    """The gradients of the module whose backward runs before DeepSpeed copies them into the bucket: the largest
    module's, or where only peft adapters train, the largest adapter tensor's, split by tensor parallelism as its
    base linear (frozen modules make none; measured, docs/benchmarks.md, helper zlora17: Z5); beside the adapters a
    ``modules_to_save`` copy's whole gradient, through the backward (:func:`_copy_gradient`)."""
    if _only_adapters_train(run) or _only_adapters_and_copies_train(run):
        largest = max(adapter_numels(run), default=0) // run.job.parallel.tp
        dtype = resolved_adapter_dtype(run.job)
        adapters = Contribution(COMMUNICATION, adapter_bytes(run.job) * largest, ("backward", "end of backward"), (
            f"DeepSpeed ZeRO-3 with only peft adapters (and modules_to_save copies) training: the frozen modules make "
            "no gradient; the largest "
            f"adapter tensor's ({largest:,} elements, {dtype}) before it is copied into the reduce bucket"))
        return [adapters] + ([] if _only_adapters_train(run) else [_copy_gradient(run)])
    return [Contribution(COMMUNICATION, c * unit, ("backward", "end of backward"), (
        f"DeepSpeed ZeRO-3: the gradients of the module whose backward runs ({unit:,} elements, {run.prec.param}) "
        "before they are copied into the reduce bucket"))]


def _only_adapters_and_copies_train(run: RunContext) -> bool:
    """Fine-tuning where peft adapters and ``modules_to_save`` copies of the embedding or head train, no base
    parameter (a decoder layer's copy keeps the largest module's gradient: not measured)."""
    counts = run.counts
    return counts is not None and not counts.root.trained and not any(p.trained or p.copies for p in counts.layers)


def _copy_gradient(run: RunContext) -> Contribution:
    """The largest ``modules_to_save`` copy's whole gradient in the copy's dtype (the frozen base's), held from its
    backward through the layers' (measured, docs/benchmarks.md, helper zero18b: Z11b's head copy, 512,000 B of bf16
    at each layer's backward entry, gone in the reduction epilogue); split as its original (TP, vocabulary)."""
    split = vocab_split(run.profile, run.job.parallel.tp)
    tensors = model_parameters(run.model)
    sizes = [0]
    for module in saved_modules(run.model, run.job.finetune):
        mine = [t for t in tensors if t.module == module or t.module.startswith(module + ".")]
        numel = sum(t.numel // (run.job.parallel.tp if t.layer is not None else split) for t in mine)
        sizes.append(numel or (embedding_params(run.model) // split if module == "lm_head" else 0))  # a tied head
    nbytes = frozen_bytes_per_element(run.job)
    return Contribution(COMMUNICATION, nbytes * max(sizes), ("backward",), (
        f"DeepSpeed ZeRO-3: the largest peft modules_to_save copy's whole gradient ({max(sizes):,} elements, "
        f"{nbytes} B each, the frozen base's dtype), held from the copy's backward through the layers' and reduced "
        "in the epilogue"))


def contributions(ctx: StageContext, params: StageParams, partition: int, forward: bool) -> list[Contribution]:
    """The buffers as contributions, each with its sentence (``partition``: the elements this GPU's optimizer steps)."""
    run = ctx.run
    sh, d, hidden, prec = run.job.sharding, run.profile.zero3_buffers, run.model.hidden_size, run.prec
    assert d is not None, "applies() checks the profile runs DeepSpeed's ZeRO-3"
    c = dtype_bytes(prec.param)
    prefetch, pf_from = setting(sh.prefetch_bucket_size, d.prefetch_bucket_elements, hf_auto_prefetch_bucket(hidden))
    live, live_from = setting(sh.max_live_parameters, d.max_live_parameters, 0)
    reuse, reuse_from = setting(sh.max_reuse_distance, d.max_reuse_distance, 0)
    bucket, bucket_from = reduce_bucket(sh, d, hidden)
    unit = module_unit(ctx, params)
    if _points_at_partition(run):
        out = [_UNGATHERED]
        kept = None
    else:
        persistent, kept = _persistent(ctx)
        elements = gathered_elements(max(0, params.total - persistent), unit, prefetch, live, reuse)
        gathered = Contribution(COMMUNICATION, c * elements, _GATHERED_LIVE + (("forward",) if forward else ()), (
            f"DeepSpeed ZeRO-3 gathered parameters ({prec.param}): {elements:,} of the {params.total - persistent:,} "
            "elements not kept persistent, "
            f"the larger of the module computing ({unit:,}) with what the prefetcher fetches ahead up to "
            f"stage3_max_live_parameters {live:,} ({live_from}; stage3_prefetch_bucket_size {prefetch:,}, "
            f"{pf_from}, 0 turns it off) and the parameters kept for reuse, about half of stage3_max_reuse_distance "
            f"{reuse:,} ({reuse_from}); from the forward through the backward, none left at its end (each module is "
            "released after its own backward)"))
        frozen = frozen_root_elements(run)
        out = _frozen_root_backward(gathered, min(elements, max(0, params.total - persistent - frozen)), frozen, c)
    out += _module_gradient(run, unit, c)
    if not run.job.offload.optimizer:
        out.append(_sub_group_gradient(ctx, partition, unit, setting(sh.sub_group_size, d.sub_group_size, 0)))
    out += [c for c in (kept, _conversions(ctx, params, bucket, unit), _flat_gather(ctx, params) if forward else None)
            if c is not None]
    if not keeps_bucket(sh, d):
        return out
    return out + [_bucket(ctx, bucket, bucket_from)]
