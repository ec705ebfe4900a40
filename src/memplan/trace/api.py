"""``memplan.trace.trace(...)``: trace a training step of a model on fake tensors.

Example::

    >>> from memplan.trace import trace
    >>> result = trace("gpt2", seq=512, mbs=4, precision="fp32", optimizer="adamw", device="cpu")
    >>> result.summary.peak_allocated_bytes          # doctest: +SKIP
    4205871104
    >>> result.summary.by_category["activation"]     # doctest: +SKIP

Assumptions: the Hugging Face model is built from its config with ``transformers`` (no weights);
the batch is ``input_ids`` and ``labels`` (no padding mask); ``*-mixed`` precision is fp32 weights
under ``torch.autocast`` (the estimator's ``hf`` profile); two iterations run so the second one has
its optimizer states. Known limitations: see docs/trace.md.
"""

from __future__ import annotations

import contextlib
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from memplan.events import Trace, TraceMeta
from memplan.job import Job
from memplan.trace.build import BuiltModel, build_hf_model, quiet_transformers, unpacked_sequences
from memplan.trace.core.distributed import simulated_ranks
from memplan.trace.errors import translate_errors
from memplan.trace.finetune import param_counts, require_peft
from memplan.trace.runners.moe import static_grouped_mm
from memplan.trace.core.recorder import HOST, AllocationRecorder
from memplan.trace.core.reserved import simulate_reserved
from memplan.trace.run import StepJob, apply_recompute, hf_step_job, register_state, run_iterations
from memplan.trace.setup import TraceSetup, trace_setup
from memplan.trace.core.streams import StreamIds, fsdp_stream_ids
from memplan.trace.core.summary import TraceSummary, summarize
from memplan.trace.runners.torchtitan import TorchtitanTarget
from memplan.trace.core.tracker import ModulePath, TracingFakeMode, track_resize

__all__ = ["TraceResult", "trace", "trace_job"]

Progress = Callable[[str], None]


@dataclass(frozen=True)
class TraceResult:
    """A traced training step: the event log and what it says."""

    #: The allocation/free log (see :mod:`memplan.events`), ready for ``write_trace``.
    trace: Trace
    #: Peak and breakdowns, computed from ``trace``.
    summary: TraceSummary
    #: The job that was traced.
    options: TraceSetup
    #: Model name (preset, config folder or script).
    model: str
    #: Seconds spent building and tracing.
    timings: dict[str, float] = field(default_factory=dict)
    #: ``flags``: the job is ``options.job``; ``script``: a job function without a context built
    #: its own job, so ``options.job`` was not used (only the run settings were).
    job_source: str = "flags"
    #: ``--compile``: what AOT autograd's min-cut partitioner saved in each compiled layer, by module path
    #: (:meth:`memplan.trace.runners.partitioner.CompiledLayers.to_dict`).
    compiled_layers: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the summary plus ``model``, ``options`` (the job and run settings) and ``timings``."""
        options = self.options.to_dict()
        if self.job_source == "script":
            options = {"job": None, "job_source": "the script's own job function", "run": options["run"]}
        out = {"model": self.model, **self.summary.to_dict(), "options": options,
               "timings_s": {k: round(v, 3) for k, v in self.timings.items()}}
        if self.compiled_layers:
            out["compiled_layers"] = self.compiled_layers
        return out


def trace(model: str | Callable[..., Any], *, job: Job | None = None, seq: int | None = None,
          mbs: int | None = None, precision: str | None = None, optimizer: str | None = None,
          recompute: str | None = None, attention: str | None = None, framework: str | None = None,
          fsdp: int | str | None = None, tp: int | None = None, device: str = "cuda", iterations: int = 2,
          moe_routing: str = "balanced", top: int = 10, progress: Progress | None = None,
          **job_flags: Any) -> TraceResult:
    """Trace ``iterations`` training iterations of ``model`` on fake tensors and summarise them.

    ``model`` is a preset name, a path to a Hugging Face ``config.json`` (or its folder), or a job
    function (see :mod:`memplan.trace.script`), called inside the fake mode so its tensors are
    fake. The job is described as on the command line — ``job=`` a :class:`~memplan.job.Job`
    and/or job flags by name (``seq``, ``mbs``, ``precision``, ``fsdp``, ``tp``, any other flag of
    :mod:`memplan.jobflags` as a keyword); unset flags take the Job's defaults (sequence 4096,
    bf16-mixed, AdamW with the framework's implementation), the framework is ``hf`` unless given.
    Sizes are bytes.
    """
    flags = {"seq": seq, "mbs": mbs, "precision": precision, "optimizer": optimizer, "recompute": recompute,
             "attention": attention, "framework": framework, "fsdp": fsdp, "tp": tp, **job_flags}
    setup = trace_setup(job, **{k: v for k, v in flags.items() if v is not None}, device=device,
                        iterations=iterations, moe_routing=moe_routing)
    return trace_job(model, setup, top=top, progress=progress)


def trace_job(model: str | Callable[[], Any] | TorchtitanTarget, options: TraceSetup, *, top: int = 10,
              progress: Progress | None = None) -> TraceResult:
    """:func:`trace` with a ready :class:`TraceSetup`; ``model`` may also be the target of
    ``memplan trace --torchtitan`` (:func:`memplan.trace.runners.torchtitan_setup.torchtitan_setup`)."""
    say = progress or (lambda _message: None)
    require_peft(options.job.finetune)
    job_source = "flags"
    if callable(model):
        from memplan.trace.script import check_script_flags, takes_context

        check_script_flags(model, options)
        job_source = "flags" if takes_context(model) else "script"
    if isinstance(model, str) and options.job.recompute.modules is not None:
        # Megatron's refusals of --recompute-modules for this model, before anything is built
        from memplan.jobcheck import check_recompute_modules
        from memplan.model import load_model

        check_recompute_modules(options.job, load_model(model))
    timings: dict[str, float] = {}
    started = time.perf_counter()
    mode = TracingFakeMode(allow_non_fake_inputs=True)
    packed_mask = options.job.batch.packing and options.job.attention != "flash"
    with quiet_transformers(), unpacked_sequences(not packed_mask), static_grouped_mm(), translate_errors(model), \
            simulated_ranks(options) as mesh, mode:
        say("building the model on fake tensors")
        name, job, heads, compiled = _prepare(model, options, mesh, mode)
        timings["build"] = time.perf_counter() - started
        say(f"tracing {options.iterations} training iterations")
        recorder = _trace_steps(mode, job, options, heads)
    timings["trace"] = time.perf_counter() - started - timings["build"]
    meta = TraceMeta(source="memplan trace", device=options.device, rank=0, world_size=options.world_size,
                     iterations=options.iterations, extra=_meta_extra(name, options))
    result_trace = Trace(events=recorder.events(drop_host=options.device == "cuda"), meta=meta)
    counts = param_counts(job.model)
    summary = replace(summarize(result_trace, top=top), trainable_params=counts.trainable,
                      frozen_params=counts.frozen)
    if options.device == "cuda":
        say("replaying the trace through the caching-allocator simulator")
        summary = replace(summary, reserved=simulate_reserved(result_trace))
        timings["simulate"] = time.perf_counter() - started - timings["build"] - timings["trace"]
    return TraceResult(result_trace, summary, options, name, timings, job_source,
                       compiled.to_dict() if compiled is not None else {})


def _prepare(model: Any, options: TraceSetup, mesh: Any,
             mode: TracingFakeMode) -> tuple[str, StepJob, frozenset[str], Any]:
    from memplan.trace.core.distributed import parallelize
    from memplan.trace.runners.moe import static_routing

    if isinstance(model, TorchtitanTarget):  # memplan trace --torchtitan: torchtitan's own code builds the step
        job = model.step_job(options)
        return model.name, job, model.head_modules(job.model), None
    if callable(model):
        from memplan.trace.script import job_from_callable

        name, job = job_from_callable(model, options, mesh)
        heads: frozenset[str] = frozenset()
    else:
        built: BuiltModel = build_hf_model(model, options)
        if options.moe_routing == "balanced":
            static_routing(built.model)
        autocast = mesh is None or options.fsdp == 1 or options.fsdp_autocast
        apply_recompute(built.model, options.policy, cuda_autocast=options.device == "cuda" and options.mixed and autocast)
        parallelize(built.model, options, mesh)
        job = hf_step_job(built.model, options, autocast=autocast)
        name, heads = built.name, built.head_modules
    compiled = None
    if options.job.compile:  # each decoder layer as AOT autograd's partitioned graphs
        from memplan.trace.runners.partitioner import compile_layers, compiled_layer_modules

        compiled = compile_layers(compiled_layer_modules(job.model), quiet=mode.unrecorded)
        if _traces_compiled_loss(options, job):  # the cross-entropy as its partitioned graphs too
            from memplan.trace.runners.compiled_loss import compile_loss

            compile_loss(job.model, compiled, quiet=mode.unrecorded)
        elif _compiles_chunked_loss(options, job):  # torchtune's compute_cross_entropy, per chunk
            from memplan.trace.runners.compiled_loss import compile_chunk_cross_entropy

            compile_chunk_cross_entropy(job.loss_fn, compiled, quiet=mode.unrecorded)
    return name, job, heads, compiled


def _traces_compiled_loss(options: TraceSetup, job: StepJob) -> bool:
    """The job compiles its loss and the step's loss is the Hugging Face model's own (``hf_loss``, or the same
    after the forward: ``LossAfterForward``)."""
    from memplan.estimate.compiled_loss import job_compiles_loss
    from memplan.profiles import get_profile
    from memplan.trace.run import LossAfterForward, hf_loss

    return (job.loss_fn is hf_loss or isinstance(job.loss_fn, LossAfterForward)) and job_compiles_loss(options.job, get_profile(options.job.framework))


def _compiles_chunked_loss(options: TraceSetup, job: StepJob) -> bool:
    """The job compiles its loss and the step's loss is torchtune's chunked cross-entropy."""
    from memplan.estimate.compiled_loss import job_compiles_loss
    from memplan.profiles import get_profile
    from memplan.trace.standins.chunked_loss import ChunkedOutputLoss

    return isinstance(job.loss_fn, ChunkedOutputLoss) and job_compiles_loss(options.job, get_profile(options.job.framework))


def _trace_steps(mode: TracingFakeMode, job: StepJob, options: TraceSetup,
                 heads: frozenset[str]) -> AllocationRecorder:
    host_step = options.device == "cuda" and options.resolved_optimizer_impl != "fused"
    streams = StreamIds()
    with ModulePath() as module_path:
        recorder = AllocationRecorder(module_of=module_path, head_modules=heads, stream_of=streams)
        register_state(recorder, job)
        mode.recorder = recorder
        try:
            with track_resize(recorder), fsdp_stream_ids(streams), _cuda_dispatch(options, recorder), \
                    _deepspeed_checkpointing(options, recorder):
                run_iterations(job, options.iterations, recorder, host_step=host_step,
                               offload_activations=options.job.offload.activations)
        finally:
            mode.recorder = None
    return recorder


def _deepspeed_checkpointing(options: TraceSetup, recorder: AllocationRecorder) -> Any:
    """``--framework deepspeed --recompute full``: DeepSpeed's checkpoint on fake tensors
    (:mod:`memplan.trace.runners.ds_checkpoint`)."""
    if options.job.framework != "deepspeed" or options.policy.name != "full":
        return contextlib.nullcontext()
    from memplan.trace.runners.ds_checkpoint import deepspeed_on_fake_tensors

    return deepspeed_on_fake_tensors(recorder, host=options.device == "cuda")


def _cuda_dispatch(options: TraceSetup, recorder: AllocationRecorder) -> Any:
    """``--device cuda``: SDPA and RMSNorm run CUDA's kernels (:mod:`memplan.trace.cuda.dispatch`);
    what CUDA keeps in host memory is left out of the trace."""
    if options.device != "cuda":
        return contextlib.nullcontext()
    from memplan.trace.cuda.dispatch import cuda_dispatch

    return cuda_dispatch(on_host=lambda tensor: recorder.mark(tensor.untyped_storage(), HOST))


def _meta_extra(name: str, options: TraceSetup) -> dict[str, Any]:
    import memplan

    return {"model": name, "options": options.to_dict(), "torch": torch.__version__,
            "memplan": getattr(memplan, "__version__", ""), "python": platform.python_version(),
            "size_rounding": "cuda-512" if options.device == "cuda" else "none"}
