"""Typed results of an estimate: one :class:`StageEstimate` per pipeline stage and the whole :class:`Estimate`."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any

from memplan.categories import MemoryCategory
from memplan.frozen import frozen_dataclass
from memplan.gpus import GPU
from memplan.job import Job
from memplan.settings import InputSetting, settings_dict, unmodelled


def plain_dict(obj: Any) -> Any:
    """``dataclasses.asdict(obj)`` for frozen data whose leaves are immutable (numbers, strings,
    None, enums, tuples of them): the same result without ``asdict``'s deep copy of every leaf,
    which was a third of an estimate's time."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain_dict(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(plain_dict(v) for v in obj)
    if isinstance(obj, list):
        return [plain_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {plain_dict(k): plain_dict(v) for k, v in obj.items()}
    return obj


@frozen_dataclass(kw_only=True)
class StageEstimate:
    """Memory of one GPU of a pipeline stage at that stage's peak (bytes)."""

    stage: int
    #: Decoder layers on this stage (all virtual chunks).
    layers: int
    layer_indices: tuple[int, ...]
    #: Parameters held by one GPU of this stage before data-parallel sharding (numel).
    parameters_numel: int
    parameters_bytes: int
    #: Gradients at the peak moment: the gradient state, and where a pipelined FSDP2 stage accumulates its
    #: gradients unsharded until the last micro-batch (:mod:`memplan.estimate.pipeline_fsdp`), those too.
    gradients_bytes: int
    #: Optimizer moments plus master weights (optimizer-owned state).
    optimizer_bytes: int
    #: Master weights alone (part of optimizer_bytes).
    master_weights_bytes: int
    #: Optimizer moments alone (part of optimizer_bytes).
    optimizer_moments_bytes: int
    #: Everything saved for backward at the peak, including embedding/head/autocast copies.
    activations_bytes: int
    #: Activations held by transformer layers only (no embedding, head, loss).
    transformer_layer_activations_bytes: int
    #: Logits and cross-entropy buffers alive at the peak (zero off the last stage).
    logits_bytes: int
    #: Collective buffers (DDP buckets, FSDP/ZeRO-3 gathered blocks, reduce buckets).
    communication_bytes: int
    #: cuBLAS / Transformer Engine workspaces.
    workspace_bytes: int
    #: Short-lived buffers at the peak (backward working set, recompute, optimizer temporaries).
    temporary_bytes: int
    #: Input batch (token ids, labels, masks).
    input_bytes: int
    #: communication + workspace + temporary + input + CUDA graphs' extra (``cuda_graph_extra_bytes``).
    other_bytes: int
    #: Forwards whose activations are alive at the peak (micro-batch chunks).
    inflight_microbatches: int
    #: When the peak happens: "loss", "backward" or "optimizer step".
    peak_phase: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    #: FP8 weight copies and transposes (part of parameters_bytes).
    fp8_weights_bytes: int = 0
    #: Multi-token-prediction parameters on this stage (part of parameters_numel).
    mtp_parameters_numel: int = 0
    #: CPU memory this GPU's process needs for what was offloaded.
    cpu_parameters_bytes: int = 0
    cpu_gradients_bytes: int = 0
    cpu_optimizer_bytes: int = 0
    cpu_activations_bytes: int = 0
    #: Of ``gradients_bytes``: not allocated yet at the peak (frameworks that free gradients after
    #: each step peak at the loss or the start of the backward, before most gradients exist).
    gradients_absent_at_peak_bytes: int = 0
    #: Activations saved for backward when the newest forward ends, whatever the peak phase.
    forward_activations_bytes: int = 0
    #: Logits and loss buffers at the loss of one micro-batch (last stage), whatever the peak phase.
    loss_logits_bytes: int = 0
    #: Of those, still saved for the backward when it starts (fp32-logits: log-softmax's output).
    saved_logits_bytes: int = 0
    #: Collective buffers at their most during the step (``communication_bytes`` is at the peak).
    max_communication_bytes: int = 0
    #: bitsandbytes paged optimizer states: in CUDA unified memory (cudaMallocManaged), outside
    #: PyTorch's caching allocator, so not in the peaks above; paged to CPU under memory pressure.
    paged_optimizer_bytes: int = 0
    #: Device memory libraries allocate outside PyTorch's caching allocator (Transformer Engine
    #: userbuffers): not in the peaks above, but taken from the GPU for the whole run.
    outside_allocator_bytes: int = 0
    #: Megatron CUDA graphs (:mod:`memplan.estimate.cuda_graphs`): the private pool's size, kept for the run.
    cuda_graph_pool_bytes: int = 0
    #: Static input buffers of the graphs outside the pool (Transformer Engine's sample inputs, full-iteration
    #: batches), kept for the run.
    cuda_graph_static_bytes: int = 0
    #: At the peak: the pool beyond what its captured regions hold then (already in the other figures) plus the
    #: static buffers; part of ``peak_allocated_bytes`` (category ``buffer``).
    cuda_graph_extra_bytes: int = 0
    #: Forward and backward graphs one rank of this stage captures.
    cuda_graphs: int = 0

    @property
    def cpu_bytes(self) -> int:
        """Offloaded bytes held in CPU memory by one GPU's process."""
        return self.cpu_parameters_bytes + self.cpu_gradients_bytes + self.cpu_optimizer_bytes + self.cpu_activations_bytes

    def by_category(self) -> dict[MemoryCategory, int]:
        """Bytes live at this stage's peak per memory category; they add up to ``peak_allocated_bytes``.

        Gradients count only those allocated at the peak (a framework that frees gradients after
        each step peaks before most of them exist); optimizer moments and master weights are apart.
        """
        return {
            MemoryCategory.PARAMETER: self.parameters_bytes,
            MemoryCategory.GRADIENT: self.gradients_bytes - self.gradients_absent_at_peak_bytes,
            MemoryCategory.OPTIMIZER_STATE: self.optimizer_moments_bytes,
            MemoryCategory.MASTER_WEIGHT: self.master_weights_bytes,
            MemoryCategory.ACTIVATION: self.activations_bytes,
            MemoryCategory.LOGITS: self.logits_bytes,
            MemoryCategory.TEMPORARY: self.temporary_bytes,
            MemoryCategory.INPUT: self.input_bytes,
            MemoryCategory.BUFFER: self.cuda_graph_extra_bytes,
            MemoryCategory.COMMUNICATION: self.communication_bytes,
            MemoryCategory.WORKSPACE: self.workspace_bytes,
        }

    def highest_by_category(self) -> dict[MemoryCategory, int]:
        """The most each category holds at any time of the step (what a trace's per-category maxima
        measure): all gradients, activations when the newest forward ends, and the logits the loss
        saves for the backward (what stays alive into it, as a trace's "logits" category counts)."""
        out = self.by_category()
        out[MemoryCategory.GRADIENT] = self.gradients_bytes
        out[MemoryCategory.ACTIVATION] = self.forward_activations_bytes
        out[MemoryCategory.LOGITS] = self.saved_logits_bytes
        out[MemoryCategory.COMMUNICATION] = max(self.max_communication_bytes, self.communication_bytes)
        return out

    def to_dict(self) -> dict[str, Any]:
        data = plain_dict(self)
        data["cpu_bytes"] = self.cpu_bytes
        data["layer_indices"] = list(self.layer_indices)
        data["by_category"] = {c.value: v for c, v in self.by_category().items()}
        return data


@frozen_dataclass(kw_only=True)
class Estimate:
    """Per-GPU memory of a training job: every pipeline stage, the peak, and the assumptions."""

    model: str
    framework: str
    stages: tuple[StageEstimate, ...]
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    #: Pipeline stage whose GPUs peak highest.
    peak_stage: int
    #: Fraction of reserved memory lost to allocator fragmentation: the stated figure, or with
    #: ``reserved="simulated"`` the simulated share at the peak stage.
    fragmentation: float
    #: The sentences that explain the figures: the job's setting and each contribution's own
    #: (:mod:`memplan.estimate.ledger`), each once.
    assumptions: tuple[str, ...]
    #: Total parameters of the model (as transformers counts them).
    total_parameters: int
    #: The job that was estimated.
    job: Job
    gpu: GPU | None = None
    #: Parameters that train (adapters, fully trained modules, modules_to_save copies); all under full training.
    trainable_params: int = 0
    #: Frozen parameters (quantized ones counted by their unquantized numel); 0 under full training.
    frozen_params: int = 0
    #: What each setting of the input files (``--hf-args``, ``--deepspeed-config``...) did: modelled, no
    #: memory effect, or not modelled (:class:`~memplan.settings.InputSetting`).
    settings: tuple[InputSetting, ...] = ()

    @property
    def unmodelled_settings(self) -> tuple[str, ...]:
        """The input settings memplan read and does not model, one line each (never dropped silently)."""
        return tuple(s.describe() for s in unmodelled(self.settings))

    @property
    def peak_cpu_bytes(self) -> int:
        """CPU memory the most demanding GPU process needs for offloaded state (0 without offload)."""
        return max((s.cpu_bytes for s in self.stages), default=0)

    @property
    def paged_optimizer_bytes(self) -> int:
        """Paged optimizer states of the most demanding GPU (outside the allocator; 0 unless paged)."""
        return max((s.paged_optimizer_bytes for s in self.stages), default=0)

    @property
    def outside_allocator_bytes(self) -> int:
        """Library buffers outside PyTorch's allocator on the most demanding GPU (0 unless any)."""
        return max((s.outside_allocator_bytes for s in self.stages), default=0)

    @property
    def fits(self) -> bool | None:
        """Whether the peak reserved memory, with the library buffers outside the allocator, fits the
        GPU's usable memory (None without a GPU)."""
        if self.gpu is None:
            return None
        return self.headroom_bytes is not None and self.headroom_bytes >= 0

    @property
    def headroom_bytes(self) -> int | None:
        """Usable GPU memory left at the peak (negative: short by that much)."""
        if self.gpu is None:
            return None
        return self.gpu.usable_bytes - max(s.peak_reserved_bytes + s.outside_allocator_bytes for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; every byte value is an int."""
        data: dict[str, Any] = {
            "model": self.model,
            "framework": self.framework,
            "total_parameters": self.total_parameters,
            "trainable_params": self.trainable_params,
            "frozen_params": self.frozen_params,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_stage": self.peak_stage,
            "peak_cpu_bytes": self.peak_cpu_bytes,
            "paged_optimizer_bytes": self.paged_optimizer_bytes,
            "outside_allocator_bytes": self.outside_allocator_bytes,
            "fragmentation": self.fragmentation,
            "stages": [s.to_dict() for s in self.stages],
            "assumptions": list(self.assumptions),
            **settings_dict(self.settings),
            "job": plain_dict(self.job),
        }
        if self.gpu is not None:
            data["gpu"] = {
                "name": self.gpu.name,
                "total_bytes": self.gpu.total_bytes,
                "usable_bytes": self.gpu.usable_bytes,
                "fits": self.fits,
                "headroom_bytes": self.headroom_bytes,
            }
        return data
