"""Resolve ``--precision`` and the dtype overrides into the dtypes a framework really keeps."""

from __future__ import annotations

from memplan.frozen import frozen_dataclass
from memplan.job import Job, Precision
from memplan.profiles import FrameworkProfile
from memplan.units import dtype_bytes


@frozen_dataclass
class ResolvedPrecision:
    """Concrete dtypes of every model-state tensor, with where each choice came from."""

    #: dtype of the stored (possibly sharded) weights.
    param: str
    #: dtype the matmuls read weights in and activations are stored in.
    compute: str
    grad: str
    #: dtype of a separate master copy, or None when the stored weights are the master.
    master: str | None
    optimizer_state: str
    #: 16-bit copies of the weights made per use: "autocast" (saved for backward) or
    #: "fsdp" (all-gathered per block), or None.
    weight_copies: str | None
    #: Residual-stream dtype (fp32 under fp32-weight autocast).
    residual: str
    notes: tuple[str, ...]

    #: dtype FSDP2 reduce-scatters the gradients in (``MixedPrecisionPolicy.reduce_dtype``); None: ``grad``.
    reduce: str | None = None

    param_bytes: int = 0
    grad_bytes: int = 0
    #: 0 when there is no separate master copy.
    master_bytes: int = 0
    state_bytes: int = 0
    act_bytes: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_bytes", dtype_bytes(self.param))
        object.__setattr__(self, "grad_bytes", dtype_bytes(self.grad))
        object.__setattr__(self, "master_bytes", dtype_bytes(self.master) if self.master else 0)
        object.__setattr__(self, "state_bytes", dtype_bytes(self.optimizer_state))
        object.__setattr__(self, "act_bytes", dtype_bytes(self.compute))

    @property
    def reduce_bytes(self) -> int:
        """Bytes per element of FSDP's reduce-scatter input (``reduce``, else ``grad``)."""
        return dtype_bytes(self.reduce) if self.reduce else self.grad_bytes


def _pytorch_mixed_weights(job: Job, profile: FrameworkProfile) -> str:
    """How fp32-weight mixed precision casts in plain PyTorch: FSDP2's ``MixedPrecisionPolicy``
    when the weights are FSDP-sharded (torchtitan; accelerate's FSDP2), ``torch.autocast``
    otherwise, and ``none`` where the profile applies no autocast with TP or PP
    (:attr:`FrameworkProfile.autocast_with_tp_or_pp`: torchtitan's ``maybe_enable_amp``)."""
    if job.sharding.fsdp != "none":
        return "fsdp-cast"
    par = job.parallel
    if not profile.autocast_with_tp_or_pp and par.cp == 1 and (par.tp > 1 or par.pp > 1):
        return "none"
    return "autocast"


def resolve_precision(job: Job, profile: FrameworkProfile) -> ResolvedPrecision:
    """The dtypes ``job`` keeps under ``profile`` (explicit ``--*-dtype`` flags win)."""
    p = job.precision
    compute = p.compute_dtype
    notes: list[str] = []
    reduce: str | None = None
    if not p.is_mixed:
        param = grad = state = compute
        master = None
        copies = None
        residual = compute
        notes.append(f"pure {compute}: weights, gradients and optimizer moments all in {compute}")
        if profile.autocast_16bit_weights and compute != "fp32":
            notes.append(f"not modelled: the trainer's --{compute} runs the forward under torch.autocast({compute}) "
                         f"over the {compute} model too (accelerate's native_amp), where ops on autocast's fp32 lists "
                         "(layer_norm, pow, softmax without a dtype) return fp32; priced without that autocast")
    elif profile.mixed_weights == "master-copy":
        param = compute
        grad = profile.mixed_grad_dtype or compute
        master, state, copies, residual = "fp32", "fp32", None, compute
        notes.append(
            f"{p.name} ({profile.name}): {compute} weights in the model, fp32 master copy and fp32 "
            f"moments in the optimizer, gradients kept in {grad}"
        )
    elif _pytorch_mixed_weights(job, profile) == "none":
        param = grad = state = compute = "fp32"
        master, copies, residual = None, None, "fp32"
        notes.append(
            f"{p.name} ({profile.name}): no mixed precision with TP {job.parallel.tp} / PP {job.parallel.pp} and no "
            "FSDP (torchtitan's maybe_enable_amp applies neither autocast nor FSDP's MixedPrecisionPolicy): fp32 "
            "weights, gradients, optimizer moments and activations"
        )
    else:
        param, grad, master, state = "fp32", "fp32", None, "fp32"
        if _pytorch_mixed_weights(job, profile) == "autocast":
            copies, residual = "autocast", "fp32"
            notes.append(
                f"{p.name} ({profile.name}): fp32 weights are the master copy; torch.autocast makes "
                f"{compute} weight copies that autograd saves for backward; residual stream in fp32"
            )
        else:
            copies, residual = "fsdp", compute
            notes.append(
                f"{p.name} ({profile.name}): sharded fp32 weights; FSDP all-gathers {compute} copies "
                "of each block for its forward and backward"
            )
            reduce = _fsdp_reduce(profile, compute, notes)
    grad, state, master = _explicit_dtypes(p, param, grad, state, master, notes)
    return ResolvedPrecision(
        param=param,
        compute=compute,
        grad=grad,
        master=master,
        optimizer_state=state,
        weight_copies=copies,
        residual=residual,
        notes=tuple(notes),
        reduce=reduce,
    )


def _fsdp_reduce(profile: FrameworkProfile, compute: str, notes: list[str]) -> str | None:
    """The reduce-scatter's dtype where the profile's FSDP reduces in the compute dtype (accelerate's
    ``MixedPrecisionPolicy(param_dtype=reduce_dtype)``, the forward under autocast), noted; None: the gradients'."""
    if profile.fsdp_reduce_dtype != "compute":
        return None
    notes.append(f"FSDP reduce-scatters the gradients in {compute} (MixedPrecisionPolicy reduce_dtype) and casts "
                 "the sharded ones to fp32" + (f"; the forward runs under torch.autocast({compute})"
                                               if profile.fsdp_autocast else ""))
    return compute


def _explicit_dtypes(p: Precision, param: str, grad: str, state: str, master: str | None,
                     notes: list[str]) -> tuple[str, str, str | None]:
    """(gradient, optimizer state, master) dtypes after the explicit ``--*-dtype`` flags, noted."""
    if p.grad_dtype:
        grad = p.grad_dtype
        notes.append(f"gradients kept in {grad} (--grad-dtype)")
    if p.optimizer_state_dtype:
        state = p.optimizer_state_dtype
        notes.append(f"optimizer moments in {state} (--optimizer-state-dtype)")
    if p.master_dtype:
        master = None if p.master_dtype == param else p.master_dtype
        notes.append(f"master weights in {p.master_dtype} (--master-dtype)")
    return grad, state, master
