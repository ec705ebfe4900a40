"""Model states of a fine-tuning job: trainable and frozen weights, adapters, quantized base weights.

What trains comes from :mod:`memplan.peft.params`; this module prices it on one GPU of a stage:

* frozen weights keep no gradient, master copy or optimizer state; unquantized frozen weights are
  stored in ``--frozen-dtype`` (default the compute dtype: a base loaded with ``torch_dtype=bfloat16``);
* peft adapters (``lora_A``/``lora_B``, DoRA magnitudes) are in ``--adapter-dtype`` (:func:`adapter_bytes`),
  by default the framework's fp32: peft creates them beside the base weight and
  ``get_peft_model(autocast_adapter_dtype=True)`` upcasts 16-bit adapters to fp32; their gradients and
  torch optimizer states follow that dtype;
* fully trained modules follow the job's precision as full training does; ``modules_to_save`` copies
  are deep copies of the frozen module, in its dtype, with gradients and optimizer moments in it too;
* bitsandbytes 4-bit (``Linear4bit``) and 8-bit (``Linear8bitLt``) replace the frozen decoder linear
  weights, priced by their format's entry (:mod:`memplan.tuning.quant_formats`); embeddings, norms, routers, fused experts and the
  output head stay unquantized.
"""

from __future__ import annotations

from memplan.estimate.activations import NORM_COMPUTE_BYTES, ActivationShape, eager_norm_terms
from memplan.estimate.adapter_acts import on_module
from memplan.estimate.layout import StageLayout
from memplan.estimate.partial_freeze import root_flow
from memplan.estimate.precision import ResolvedPrecision
from memplan.estimate.terms import NORMALIZED
from memplan.frozen import frozen_dataclass
from memplan.job import Job, resolved_adapter_dtype
from memplan.model.linears import model_parameters
from memplan.model.spec import ModelSpec
from memplan.peft.default_targets import auto_targets, peft_has_default
from memplan.peft.params import (
    FinetuneParams,
    PartCounts,
    converts_moe_targets,
    finetune_params,
    saved_modules,
)
from memplan.units import dtype_bytes, normalize_dtype


def adapter_bytes(job: Job) -> int:
    """Bytes per element of the adapters' weights, gradients and torch optimizer states
    (``--adapter-dtype``, default the framework's: fp32 as peft's ``autocast_adapter_dtype=True``)."""
    return dtype_bytes(resolved_adapter_dtype(job))


def adapter_compute_bytes(job: Job, weight_copies: str | None) -> int:
    """Bytes per element the adapters compute in (what they save and make in a forward and backward): their own
    (:func:`adapter_bytes`), but the compute dtype where FSDP's mixed precision casts the weights
    (``weight_copies`` ``"fsdp"``, :attr:`memplan.estimate.precision.ResolvedPrecision.weight_copies`). FSDP2 casts
    every sharded parameter whose dtype differs from ``MixedPrecisionPolicy.param_dtype`` to it for the unsharded
    compute copy, trainable or not (``FSDPParam.init_dtype_attrs`` and ``init_all_gather_outputs``,
    torch/distributed/fsdp/_fully_shard/_fsdp_param.py; FSDP1's ``MixedPrecision.param_dtype`` casts the flat
    parameter alike), so peft's ``x.to(lora_A.weight.dtype)`` (``_cast_input_dtype``) leaves the 16-bit input as
    it is, and lora_A/lora_B (and DoRA's magnitude) run and save in 16 bits. The sharded adapters, their gradients
    after the reduce-scatter (``reduce_dtype`` then ``orig_dtype``) and optimizer states keep :func:`adapter_bytes`."""
    if weight_copies == "fsdp":
        return dtype_bytes(job.precision.compute_dtype)
    return adapter_bytes(job)


@frozen_dataclass
class StageFinetune:
    """Numel (and quantized bytes) of one GPU of a stage, split by what trains."""

    #: Base weights trained fully (the job's precision).
    full: int
    #: Adapter parameters (in the adapter dtype).
    adapter: int
    #: Frozen unquantized weights (``frozen_dtype``).
    frozen: int
    #: Bytes of the quantized frozen weights.
    quantized_bytes: int
    #: Numel of the quantized frozen weights.
    quantized_numel: int
    #: Largest quantized weight of the stage (numel): the dequantized temporary of its forward/backward.
    largest_quantized: int
    #: Trainable parameter tensors (each gets its own optimizer step counter).
    trainable_tensors: int = 0
    #: ``modules_to_save`` copies: peft deep-copies the frozen module, so they keep its dtype
    #: (``frozen_dtype``), and so do their gradients and torch optimizer moments.
    copies: int = 0
    #: The most adapter parameters one decoder layer of the stage holds (numel): what an FSDP unit all-gathers
    #: beside the layer's base weights.
    layer_adapters: int = 0
    #: The most trainable parameters one decoder layer of the stage holds (numel): the only ones FSDP makes
    #: gradients for and reduce-scatters (``FSDPParamGroup.post_backward`` collects the parameters with a grad).
    layer_trainable: int = 0

    @property
    def trainable(self) -> int:
        return self.full + self.adapter + self.copies


def stage_finetune(model: ModelSpec, job: Job, layout: StageLayout, local_total: int) -> StageFinetune:
    """What one GPU of ``layout`` holds, split by training role.

    ``local_total`` is the stage's parameters on one rank (TP/EP-divided) from the full-training
    accounting; every role is scaled by ``local_total / stage total`` (TP and EP divide all roles
    alike). The embedding, head and final norm count on the stage that holds the head.
    """
    counts = finetune_params(model, job.finetune)
    parts: list[PartCounts] = [counts.layers[i] for i in layout.layer_indices]
    if layout.has_head or layout.has_embedding:
        parts.append(counts.root)
    base = sum(p.trained + p.frozen + sum(p.quantized) for p in parts)
    scale = local_total / base if base else 0.0
    ft = job.finetune
    quantized = [(n, rows) for p in parts for n, rows in zip(p.quantized, p.quantized_rows, strict=True)]
    q_bytes = sum(ft.quant_kind.weight_bytes(n, rows, ft.double_quant) for n, rows in quantized)
    return StageFinetune(
        full=int(sum(p.trained for p in parts) * scale),
        copies=int(sum(p.copies for p in parts) * scale),
        adapter=int(sum(p.adapter for p in parts) * scale),
        frozen=int(sum(p.frozen for p in parts) * scale),
        quantized_bytes=int(q_bytes * scale),
        quantized_numel=int(sum(n for n, _ in quantized) * scale),
        largest_quantized=int(max((n for n, _ in quantized), default=0) * scale),
        trainable_tensors=_adapter_tensors(counts, layout, ft.peft_kind.magnitude) + _copy_tensors(model, job, layout),
        layer_adapters=int(max((counts.layers[i].adapter for i in layout.layer_indices), default=0) * scale),
        layer_trainable=int(max((p.trained + p.adapter + p.copies for p in parts[:len(layout.layer_indices)]),
                                default=0) * scale),
    )


def _copy_tensors(model: ModelSpec, job: Job, layout: StageLayout) -> int:
    """Parameter tensors of the stage's ``modules_to_save`` copies (a tied head's copy has its own weight)."""
    layers = set(layout.layer_indices)
    root = layout.has_head or layout.has_embedding
    count = 0
    for module in saved_modules(model, job.finetune):
        tensors = [p for p in model_parameters(model) if p.module == module or p.module.startswith(module + ".")]
        if not tensors and module == "lm_head":
            count += 1 if root else 0
        count += sum(1 for p in tensors if (p.layer in layers) or (p.layer is None and root))
    return count


def _adapter_tensors(counts: FinetuneParams, layout: StageLayout, dora: bool) -> int:
    """Adapter tensors on the stage: lora_A, lora_B (and a DoRA magnitude) per adapted module."""
    layers = set(layout.layer_indices)
    root = layout.has_head or layout.has_embedding
    per = 3 if dora else 2
    return per * sum(1 for a in counts.adapters
                     if (a.module.layer in layers) or (a.module.layer is None and root))


def frozen_bytes_per_element(job: Job) -> int:
    """Bytes per element of frozen, unquantized weights."""
    return dtype_bytes(job.finetune.frozen_dtype or job.precision.compute_dtype)


def frozen_compute_bytes(job: Job, weight_copies: str | None) -> int:
    """Bytes per element the frozen, unquantized weights compute in: their own (:func:`frozen_bytes_per_element`), but
    the compute dtype where FSDP's mixed precision casts the weights (``weight_copies`` ``"fsdp"``): FSDP2's unsharded
    copy takes ``MixedPrecisionPolicy.param_dtype`` for every floating parameter, trained or not, as
    :func:`adapter_compute_bytes` says of the adapters (so DoRA's ``weight.to(x.dtype)`` casts nothing there)."""
    if weight_copies == "fsdp":
        return dtype_bytes(job.precision.compute_dtype)
    return frozen_bytes_per_element(job)


def is_finetune(job: Job) -> bool:
    """The job freezes something or adds adapters (:attr:`FineTuning.partial`)."""
    return job.finetune.partial


def finetune_counts(model: ModelSpec, job: Job) -> FinetuneParams:
    """Trainable and frozen parameters of the whole model (full training: everything trainable)."""
    return finetune_params(model, job.finetune)


def base_in_compute_dtype(model: ModelSpec, job: Job) -> bool:
    """The frozen base (embedding included) is stored in the 16-bit compute dtype: hidden states and
    the residual stream are 16-bit and ``torch.autocast`` has no weight or input of theirs to cast (a
    trained norm or head further on does not change the embedding's output)."""
    if not is_finetune(job):
        return False
    compute = job.precision.compute_dtype
    return (dtype_bytes(compute) < 4 and frozen_bytes_per_element(job) == dtype_bytes(compute)
            and not root_flow(model, job.finetune, False).embedding_trained_fully)


def dequantized_element_bytes(job: Job, compute_bytes: int) -> int:
    """Bytes per element of a base weight bitsandbytes dequantizes (``--quant-compute-dtype``, else the
    compute dtype's ``compute_bytes``); 0 when the base is not quantized."""
    if not job.finetune.quant_kind.quantizes:
        return 0
    dtype = job.finetune.quant_compute_dtype
    return dtype_bytes(dtype) if dtype else compute_bytes


def dequantizing_op_bytes(counts: FinetuneParams, job: Job, index: int, shape: ActivationShape,
                          compute_bytes: int) -> int:
    """The most one quantized linear's backward op of layer ``index`` holds (one rank), an op of its own:
    bitsandbytes dequantizes the weight (``MatMul8bitLt``: ``CB.to(A.dtype, copy=True)``; ``MatMul4Bit``:
    ``dequantize_4bit(W)``, in ``--quant-compute-dtype`` when set), multiplies the arrived gradient of the
    output by it into the gradient of the input, and frees it (``bitsandbytes/autograd/_functions.py``).
    Beside the layer's saved tensors that op holds the dequantized weight and the two gradients (in the
    activations' dtype); no other backward op of the layer holds them (the general transient's "two largest
    saved tensors" is another op). Under TP every figure is one rank's share. ``counts``: the job's
    fine-tuning counts (the run context's, derived once per job)."""
    part = counts.layers[index]
    if not part.quantized:
        return 0
    per_element = dequantized_element_bytes(job, compute_bytes)
    tokens = shape.seq * shape.micro_batch
    return max(numel * per_element + tokens * (numel // rows + rows) * shape.act_bytes
               for numel, rows in zip(part.quantized, part.quantized_rows, strict=True)) // job.parallel.tp


def zero3_flat_master(job: Job, prec: ResolvedPrecision) -> bool:
    """DeepSpeed's ZeRO-3 optimizer (the profile's ZeRO is DeepSpeed's, ``--zero 3``, not FSDP) steps an fp32 flat
    copy of every trained partition (stage3.py ``fp32_partitioned_groups_flat``, made with ``.float()``) and keeps
    the gradient partitions in ``gradient_accumulation_dtype`` (``grad_partitions_flat_buffer``, the model's dtype
    by default), whatever the trained parameter's own dtype: fp32 adapters too (measured, docs/benchmarks.md, helper
    zlora17: Z5's fp32 LoRA tensors, a 65,536 B master and a bf16 gradient partition per rank)."""
    from memplan.profiles.framework import get_profile

    sh = job.sharding
    return (get_profile(job.framework).zero3_buffers is not None and sh.zero == 3 and sh.fsdp == "none"
            and prec.weight_copies != "fsdp")


def _auto_targets_note(model_type: str) -> str:
    """What ``--lora-targets auto`` adapted, and where that choice comes from."""
    names = ",".join(auto_targets(model_type))
    if peft_has_default(model_type):
        refused = (" (peft 0.21 under transformers 5 refuses a LoraConfig without target_modules for this MoE "
                   "type: pass them)" if converts_moe_targets(model_type) else "")
        return f"--lora-targets auto: {names}, peft's default target modules for {model_type}{refused}"
    return (f"--lora-targets auto: {names}; peft has no default target modules for {model_type} (its LoraConfig "
            "asks for target_modules), so these are memplan's choice: give --lora-targets to price yours")


def _adapter_dtype_source(job: Job, prec: ResolvedPrecision) -> str:
    """Where the adapters' dtype comes from, and their gradients' and optimizer states' dtypes: theirs, or the
    weights' fp32 master and moments where a 16-bit adapter is in the weights' dtype under a separate master copy
    (:func:`memplan.estimate.states.state_bytes`)."""
    from memplan.profiles.framework import get_profile

    profile = get_profile(job.framework)
    dtype = resolved_adapter_dtype(job)
    why = "(--adapter-dtype; peft's autocast_adapter_dtype=True gives fp32)"
    if job.finetune.adapter_dtype == "auto" and profile.adapter_dtype == "model":
        why = ("(--adapter-dtype auto: peft's fp32, as a ZeRO-3 model is built under zero.Init, whose parameters the "
               "engine does not cast)" if job.sharding.zero == 3 else
               "(--adapter-dtype auto: the engine casts every parameter to the model's dtype after peft, "
               "deepspeed.initialize's _cast_module_mixed_precision)")
    if prec.master and dtype_bytes(dtype) == prec.param_bytes:
        return f"{why}, gradients in that dtype, a {prec.master} master copy and {prec.optimizer_state} optimizer state"
    if zero3_flat_master(job, prec):
        return (f"{why}; DeepSpeed ZeRO-3's optimizer keeps an fp32 master copy of their partition "
                f"(fp32_partitioned_groups_flat) and their gradient partition in {prec.grad} "
                "(gradient_accumulation_dtype), optimizer state in that dtype")
    return f"{why}, gradients and optimizer state in that dtype"


def _fsdp_compute_note(job: Job, prec: ResolvedPrecision) -> str:
    """The sentence for adapters FSDP's mixed precision casts (:func:`adapter_compute_bytes`); empty elsewhere."""
    if adapter_compute_bytes(job, prec.weight_copies) == adapter_bytes(job):
        return ""
    compute = job.precision.compute_dtype
    return (f"FSDP's mixed precision all-gathers the {resolved_adapter_dtype(job)} adapters in {compute} with the "
            f"rest of each unit (MixedPrecisionPolicy.param_dtype), so they run and save in {compute}: peft's cast "
            f"of the input to the adapter dtype is a no-op; the sharded adapters, their gradients after the "
            f"reduce-scatter and their optimizer states stay {resolved_adapter_dtype(job)}")


def finetune_assumptions(model: ModelSpec, job: Job, prec: ResolvedPrecision) -> list[str]:
    """The PEFT and quantization facts an estimate used, one line each (``prec``: the job's resolved precision)."""
    if not is_finetune(job):
        return []
    ft = job.finetune
    counts = finetune_params(model, ft)
    frozen_dtype = ft.frozen_dtype or job.precision.compute_dtype
    out = [(f"fine-tuning: {counts.trainable:,} trainable and {counts.frozen:,} frozen parameters; frozen weights "
            f"keep no gradient, master copy or optimizer state and are stored in {frozen_dtype}")]
    if ft.peft_kind.adapters:
        out.append(f"peft {ft.peft}: {len(counts.adapters)} adapters (rank {ft.lora_rank}"
                   + (f", pattern {ft.lora_rank_pattern}" if ft.lora_rank_pattern else "")
                   + f") in {resolved_adapter_dtype(job)} {_adapter_dtype_source(job, prec)}; each saves its input cast to the "
                   "adapter dtype (a 16-bit copy under autocast), lora_A's output"
                   + (", its dropout mask" if ft.lora_dropout > 0 else "")
                   + (", and DoRA's base and LoRA results" if ft.peft_kind.magnitude else "")
                   + "; frozen linear layers save no input (bitsandbytes 8-bit layers keep theirs); peft's "
                   "bitsandbytes layers under autocast skip the fp32 cast and keep the 16-bit input once per "
                   "shared input")
        if ft.lora_targets == "auto":
            out.append(_auto_targets_note(model.model_type))
        fsdp_note = _fsdp_compute_note(job, prec)
        if fsdp_note:
            out.append(fsdp_note)
        if ft.peft_kind.magnitude:
            out.append("DoRA's forward temporaries (peft rebuilds the adapted weight on every forward: the identity "
                       "matrix, lora_A's output of it, the combined weight and its norm) are priced at the stage's "
                       "largest adapted linear, at the last layer's forward and where a recompute makes them again")
        if not all(on_module(a) for a in counts.adapters):
            out.append("adapters on fused MoE expert parameters and routers (peft ParamWrapper) are counted as "
                       "parameters; their merged-weight activations are not priced")
    out.append("without checkpointing, layers before the first one with something trainable save nothing, and "
               "that layer's input needs no gradient (nor do its input norm's saved tensors)")
    if ft.modules_to_save:
        out.append(f"modules_to_save {ft.modules_to_save}: a trainable copy beside the frozen original, in its "
                   "dtype, with gradients and optimizer moments in that dtype")
    if ft.quant_kind.quantizes:
        out.append(ft.quant_kind.sentence(ft.double_quant))
        if normalize_dtype(job.precision.compute_dtype) != "fp32" and (
                ft.peft_kind.magnitude or normalize_dtype(frozen_dtype) == "fp32"):
            out.append(_FP32_STREAM_NOTE)
    return out


#: The --explain sentence of a quantized base whose stream can be fp32 under autocast (:mod:`~memplan.estimate.
#: dora_fp32_stream`).
_FP32_STREAM_NOTE = ("under autocast peft's bitsandbytes layers return their sum uncast, so after a DoRA-adapted linear "
                     "(fp32 magnitude; not q/k/v) or from an fp32 frozen embedding the residual stream is fp32 and "
                     "bitsandbytes' outputs follow it: fp32 gate/up/activation outputs, one 16-bit lora_A copy per "
                     "adapter, DoRA's fp32 base result")


def head_activation_bytes_finetune(model: ModelSpec, job: Job, shape: ActivationShape, checkpointing: bool) -> int:
    """What the final norm and the output head save when part of the model is frozen
    (:func:`memplan.estimate.partial_freeze.root_flow`): the eager norm's fp32 copy of its input and
    ``1/rms`` when its input needs a gradient (an fp32 input itself: ``input.to(float32)`` makes no copy); its
    normalized tensor when its weight trains (an eager RMSNorm's ``weight * x_normed`` keeps ``x_normed``, in
    the input dtype); the head's input only when the head (or a ``modules_to_save`` copy of it) trains."""
    flow = root_flow(model, job.finetune, checkpointing)
    sbh = shape.seq * shape.micro_batch * shape.hidden
    divisor = shape.tp if shape.sequence_parallel else 1
    eager = eager_norm_terms(shape, "final", shape.residual_bytes)
    norm = [t for t in eager if (flow.norm_trains if t.role in NORMALIZED else flow.norm_input_grad)]
    out = sum(t.bytes for t in norm) // divisor
    if eager and flow.norm_trains and shape.residual_bytes < 4:
        out += shape.residual_bytes * sbh // divisor  # x_normed in the 16-bit input dtype
    if not eager and (flow.norm_input_grad or flow.norm_trains):
        out += shape.residual_bytes * sbh // divisor  # a fused or LayerNorm final norm keeps its input
    if eager and flow.norm_input_grad and shape.residual_bytes >= NORM_COMPUTE_BYTES:
        out += shape.residual_bytes * sbh // divisor  # an eager RMSNorm keeps an fp32 input itself (no copy made)
    if flow.head_trains:
        out += shape.act_bytes * sbh
    return out
