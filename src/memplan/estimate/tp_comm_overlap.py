"""Transformer Engine's tensor-parallel communication overlap (Megatron ``--tp-comm-overlap``).

Megatron calls ``transformer_engine.pytorch.module.base.initialize_ub`` once at start-up
(megatron/training/initialize.py ``_initialize_tp_communicators``) with the buffer shape
``[seq * micro_batch / cp, hidden]``, the default dtype bf16, one quantization mode (FP8 when
``--fp8-format`` is set, plus a bf16 one under ``--first-last-layers-bf16``) and the YAML of
``--tp-comm-overlap-cfg``. For each quantization mode TE builds one communicator per GEMM it knows
(twelve: ``qkv/proj/fc1/fc2`` x ``fprop/dgrad/wgrad``), each with its own userbuffer:

* ``ring_exchange`` (``CommOverlapP2P``): the buffer, or for a reduce-scatter ``2 tp - 1`` chunks
  of ``buffer / tp`` (the received GEMM chunks; common/comm_gemm_overlap/comm_gemm_overlap.cpp,
  ``CommOverlapP2PBase::initialize``);
* ``pipeline``, ``bulk`` and ``external`` (``CommOverlap``): the buffer (``CommOverlapBase::initialize``).

A buffer is uint8 when the mode is FP8 and the GEMM's ``fp8_buf`` is set (the all-gather GEMMs; a
YAML may add it to a ``pipeline`` GEMM), else bf16. Each communicator also registers a control
region of flags and peer pointers (userbuffers-host.cpp ``create_communicator_grouped2``:
``LOCALSIZE`` plus two 64 KiB flag pages and send/receive ids).

All of this is allocated by userbuffers with ``cuMemCreate`` or ``cudaMalloc``, outside PyTorch's
caching allocator: it takes GPU memory but is absent from ``torch.cuda.max_memory_allocated``. What
the allocator does see is the cuBLAS workspace of the overlapped GEMMs: ``general_gemm`` with a
communicator takes ``get_cublas_workspace(device, ub=True, ...)``, one tensor of
``_NUM_MAX_UB_STREAMS`` (3) x ``get_cublas_workspace_size_bytes()`` (32 MiB + 1 KiB on Hopper),
cached for the run beside the plain 32 MiB workspace (transformer_engine/pytorch/cpp_extensions/gemm.py,
TE >= 2.11; TE 2.0-2.10 grew the one shared workspace to the same 3x size in ``initialize_ub``).

Known limitations: the driver's allocation granularity (cuMem / multicast rounding of each
region) and the atomic-GEMM counters and temporaries are not priced.
"""

from __future__ import annotations

from memplan.frozen import frozen_dataclass
from memplan.job import CommOverlap, UbMethod
from memplan.units import MiB

#: ``_NUM_MAX_UB_STREAMS`` (transformer_engine/pytorch/cpp_extensions/gemm.py).
UB_STREAMS = 3
#: ``get_cublas_workspace_size_bytes()`` on Hopper (compute capability >= 9), TE >= 2.10.
TE_WORKSPACE_BYTES_HOPPER = 32 * MiB + 1024
#: ``initialize_ub``'s ``dtype`` default (bf16); Megatron passes none.
UB_DTYPE_BYTES = 2
#: FP8 userbuffers are uint8.
UB_FP8_BYTES = 1

#: TE's defaults (``initialize_ub``): method of each GEMM, and which ones reduce-scatter / all-gather.
DEFAULT_METHODS: dict[str, UbMethod] = {
    **dict.fromkeys(("qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad"), "ring_exchange"),
    **dict.fromkeys(("proj_fprop", "fc2_fprop"), "pipeline"),
    **dict.fromkeys(("qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad"), "bulk"),
    **dict.fromkeys(("proj_wgrad", "fc2_wgrad"), "external"),
}
_ALL_GATHER = ("qkv_fprop", "qkv_dgrad", "proj_dgrad", "proj_wgrad", "fc1_fprop", "fc1_dgrad", "fc2_dgrad",
               "fc2_wgrad")
_REDUCE_SCATTER = ("proj_fprop", "fc2_fprop", "qkv_wgrad", "fc1_wgrad")

#: userbuffers.h: NVTE_MAX_REGIONS, NVTE_MAX_NVLINK, NVTE_MAX_SMS, NVTE_MAX_OPS, NVTE_MAX_PEERS,
#: NVTE_REG0_OPFLAGS and the number of ``req_type`` operations (``userbuffers_op_types``).
_MAX_REGIONS, _MAX_NVLINK, _MAX_SMS, _MAX_OPS, _MAX_PEERS, _OPFLAGS, _OP_TYPES = 32, 32, 32, 32, 8192, 1024, 5
#: ``LOCALSIZE``: 4 bytes x (NVTE_REG0_OFFSET + NVTE_REG0_FLAGS), the control region of a communicator.
CONTROL_REGION_BYTES = 4 * (
    (2 * _MAX_REGIONS) * _MAX_NVLINK + 2 * (2 * _MAX_NVLINK * _MAX_SMS + _MAX_OPS) + _MAX_PEERS
    + _OPFLAGS * _OP_TYPES + _MAX_PEERS * _MAX_REGIONS * 3
)
#: Two GPU pages of flags (``flags_baseptr``, GPU_PAGE_SIZE = 64 KiB).
FLAG_PAGES_BYTES = 2 * 64 * 1024


@frozen_dataclass
class Userbuffer:
    """One GEMM's communicator as ``initialize_ub`` configures it."""

    name: str
    method: UbMethod
    reduce_scatter: bool
    fp8_buf: bool


def userbuffer_plan(overlap: CommOverlap) -> tuple[Userbuffer, ...]:
    """Every communicator ``initialize_ub`` makes for one quantization mode, after the YAML's changes.

    As TE does: a ``qkv_dgrad`` / ``fc1_dgrad`` moved off ``bulk`` becomes a reduce-scatter and its
    ``wgrad`` an all-gather that is not FP8; a YAML entry replaces the default method (and
    ``is_reduce_scatter``); ``fp8_buf`` is kept for the all-gather GEMMs and may be added only to a
    GEMM TE's method lists have under ``pipeline``.
    """
    given = {o.name: o for o in overlap.tp_overrides}
    all_gather, reduce_scatter = list(_ALL_GATHER), list(_REDUCE_SCATTER)
    pipeline = {name for name, method in DEFAULT_METHODS.items() if method == "pipeline"}
    for dgrad in ("qkv_dgrad", "fc1_dgrad"):
        entry = given.get(dgrad)
        if entry is not None and entry.method not in (None, "bulk"):
            wgrad = dgrad.replace("dgrad", "wgrad")
            reduce_scatter.remove(wgrad)
            all_gather.remove(dgrad)
            reduce_scatter.append(dgrad)
            if entry.method == "pipeline":
                pipeline.add(dgrad)
    out = []
    for name, default in DEFAULT_METHODS.items():
        entry = given.get(name)
        method = entry.method if entry is not None and entry.method is not None else default
        is_rs = name in reduce_scatter
        if entry is not None and entry.is_reduce_scatter is not None:
            is_rs = entry.is_reduce_scatter
        fp8_buf = name in all_gather or bool(entry is not None and entry.fp8_buf and name in pipeline)
        out.append(Userbuffer(name, method, is_rs, fp8_buf))
    return tuple(out)


def buffer_bytes(ub: Userbuffer, *, tokens: int, hidden: int, tp: int, fp8: bool) -> int:
    """The userbuffer of one communicator: ``[tokens, hidden]``, or ``2 tp - 1`` chunks for a
    ring-exchange reduce-scatter."""
    full = tokens * hidden * (UB_FP8_BYTES if fp8 and ub.fp8_buf else UB_DTYPE_BYTES)
    if ub.method == "ring_exchange" and ub.reduce_scatter:
        return full // tp * (2 * tp - 1)
    return full


def communicator_overhead_bytes(world_size: int) -> int:
    """A communicator's control region, flag pages and send/receive ids (int32 per rank; per region)."""
    return CONTROL_REGION_BYTES + FLAG_PAGES_BYTES + 4 * world_size * (1 + _MAX_REGIONS)


def userbuffers_bytes(overlap: CommOverlap, *, tokens: int, hidden: int, tp: int, fp8: bool,
                      world_size: int) -> int:
    """Device memory of every userbuffer communicator (outside PyTorch's allocator); 0 without overlap."""
    if not overlap.tp:
        return 0
    modes = [fp8] + ([False] if fp8 and overlap.tp_bf16_set else [])
    plan = userbuffer_plan(overlap)
    per_comm = communicator_overhead_bytes(world_size)
    return sum(buffer_bytes(ub, tokens=tokens, hidden=hidden, tp=tp, fp8=mode) + per_comm
               for mode in modes for ub in plan)


def ub_workspace_bytes(overlap: CommOverlap) -> int:
    """The overlapped GEMMs' cuBLAS workspace (in PyTorch's allocator); 0 without overlap."""
    return UB_STREAMS * TE_WORKSPACE_BYTES_HOPPER if overlap.tp else 0


def describe(overlap: CommOverlap, *, tokens: int, hidden: int, tp: int, fp8: bool, world_size: int) -> str:
    """The assumption line of ``--tp-comm-overlap``."""
    plan = userbuffer_plan(overlap)
    methods = ", ".join(f"{ub.name} {ub.method}" for ub in plan)
    total = userbuffers_bytes(overlap, tokens=tokens, hidden=hidden, tp=tp, fp8=fp8, world_size=world_size)
    return (f"TP communication overlap (Transformer Engine userbuffers, {overlap.tp_config_note or 'TE default methods'}): "
            f"{len(plan)} communicators of [{tokens}, {hidden}] buffers ({methods}; "
            f"{'uint8 for the all-gather GEMMs' if fp8 else 'bf16'}), {total / MiB:.1f} MiB allocated by userbuffers "
            "outside PyTorch's allocator (outside_allocator_bytes); the overlapped GEMMs' cuBLAS workspace of "
            f"{UB_STREAMS} x {TE_WORKSPACE_BYTES_HOPPER / MiB:.0f} MiB is in the allocator (workspace)")
