"""GaLore AdamW (``--optimizer galore-adamw --galore-rank N``; package ``galore-torch``, ``GaLoreAdamW``).

GaLore (Zhao et al., 2024) keeps Adam's moments of a low-rank projection of each projected weight's
gradient. ``galore_torch/galore_projector.py`` (proj_type ``std``, Hugging Face's default) projects a
``rows x cols`` gradient on its smaller side: with ``r = min(rank, rows, cols)``,

* ``rows >= cols``: ``P = Vh[:r]`` (``r x cols``), projected gradient ``G P^T`` (``rows x r``);
* ``rows < cols``: ``P = U[:, :r]`` (``rows x r``), projected gradient ``P^T G`` (``r x cols``);

so each projected weight keeps two moments of ``r * max(rows, cols)`` elements in the gradient's dtype,
and ``P``: with a 16-bit gradient a cast copy of ``r * min(rows, cols)`` elements; with an fp32 gradient
``P`` is a *view* of the SVD's factor, which keeps its whole ``min(rows, cols)^2`` storage alive. Every other
parameter keeps AdamW's two full moments. Which weights are projected: the ``nn.Linear`` weights of the
decoder layers' attention and MLP, as Hugging Face's ``optim_target_modules=["attn", "mlp"]`` selects them
(``transformers.trainer_optimizer._setup_low_rank_optimizer``: Linear modules whose name contains a target).

The step is a per-parameter loop. A projected weight's first step (and every ``update_proj_gap`` steps)
runs ``torch.linalg.svd`` on an fp32 copy of the gradient; then ``denom`` and the normalized low-rank
update, its projection back and its ``scale`` copy (two full ``rows x cols`` tensors). An unprojected
parameter's step makes ``denom`` and ``exp_avg / denom``: two temporaries of its size. Not priced: the
SVD solver's own workspace (cuSOLVER on CUDA).

Runs where Hugging Face's Trainer (or a plain PyTorch loop) runs it, unsharded: the projection needs each
whole 2-D gradient, which ZeRO's flat partitions, FSDP's shards and tensor parallelism do not give.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memplan.errors import ConfigError, UnsupportedError
from memplan.optimizers.kind import (
    DialectNames,
    OptimizerKind,
    OptimizerSettings,
    OptimizerStates,
    StateQuery,
    StepQuery,
    TraceRequest,
    import_package,
)

if TYPE_CHECKING:
    from memplan.model.linears import LinearModule

__all__ = ["GALORE_ADAMW", "GALORE_TARGETS", "galore_matrix_elements", "galore_step_bytes", "galore_targets"]

#: Hugging Face ``optim_target_modules`` memplan prices: Linear modules whose name contains one of these.
GALORE_TARGETS = ("attn", "mlp")
#: Hugging Face's defaults for ``optim_args`` ``scale`` and ``proj_type``. The tracer refreshes the projections
#: every step (``update_proj_gap=1``; Hugging Face's default is 200) so that its second iteration runs the SVD
#: with every state allocated, as step 200, 400 ... of a real run do; the first step's refresh finds the
#: states half built.
_TRACED_PROJ_GAP, _SCALE, _PROJ_TYPE = 1, 0.25, "std"
_FP32 = 4


def galore_matrix_elements(rows: int, cols: int, rank: int, *, fp32: bool) -> tuple[int, int]:
    """(elements kept for the projection ``P``, elements of one moment) of a projected ``rows x cols`` weight.

    A 16-bit gradient's ``P`` is a compact cast copy (``r x min side``). An fp32 gradient's ``P`` is a view
    of the SVD's square factor (``Vh[:r]`` of ``k x cols``, ``U[:, :r]`` of ``rows x k``, ``k = min side``):
    the whole ``k x k`` storage stays alive."""
    r, k = min(rank, rows, cols), min(rows, cols)
    return (k * k if fp32 else r * k), r * max(rows, cols)


def _svd_bytes(rows: int, cols: int, rank: int, grad_bytes: int) -> int:
    """Peak temporaries of refreshing one projection (``get_orthogonal_matrix``): an fp32 copy of a 16-bit
    gradient, ``U`` and ``Vh`` (``full_matrices=False``: ``max x k`` and ``k x k``, fp32), ``S`` (k), and the
    discarded factor scaled by ``diag(S[:r])`` (``r x r`` and ``max x r``, fp32). With an fp32 gradient the
    ``k x k`` factor is the state ``P`` views, so not a temporary (and there is no copy). The previous ``P``
    stays in the projector until the new one is returned: one more ``P`` while a refresh runs."""
    k, r, big = min(rows, cols), min(rank, rows, cols), max(rows, cols)
    sixteen_bit = grad_bytes != _FP32
    copies = _FP32 * (rows * cols + k * k) if sixteen_bit else 0
    previous = galore_matrix_elements(rows, cols, rank, fp32=not sixteen_bit)[0] * grad_bytes
    return copies + _FP32 * (big * k + k + r * r + r * big) + previous


def galore_step_bytes(shapes: tuple[tuple[int, int], ...], rank: int, grad_bytes: int, *, before: int = 0) -> int:
    """Peak bytes the projected weights' steps allocate beyond the states, in the order they step.

    ``GaLoreAdamW.step`` is a loop whose locals outlive an iteration: while weight ``i`` projects (the SVD at
    step 0 and every ``update_proj_gap`` steps, :func:`_svd_bytes`), the previous weight's ``denom``
    (``r x max``) and its projected-back, scaled update (``rows x cols``) are still referenced. The update:
    the projected gradient and ``denom`` beside those leftovers, then three ``r x max`` tensors and the
    projection back and its scaled copy (two ``rows x cols``). ``before``: elements of the unprojected
    parameter stepped just before the first weight (an untied output head: its ``denom`` and update are left).
    """
    peak, leftover = 0, 2 * before * grad_bytes
    for rows, cols in shapes:
        r, big = min(rank, rows, cols), max(rows, cols)
        low = r * big * grad_bytes
        peak = max(peak, leftover + max(_svd_bytes(rows, cols, rank, grad_bytes), 2 * low),
                   3 * low + 2 * rows * cols * grad_bytes)
        leftover = low + rows * cols * grad_bytes
    return peak


def galore_targets(linears: tuple[LinearModule, ...]) -> tuple[LinearModule, ...]:
    """The weights Hugging Face's GaLore projects: ``nn.Linear`` modules whose name contains a target
    (GPT-2's ``Conv1D`` layers are not ``nn.Linear``; MoE routers and stacked experts are not linear layers)."""
    return tuple(m for m in linears if m.kind == "linear" and any(t in m.name for t in GALORE_TARGETS))


def _states(query: StateQuery) -> OptimizerStates:
    rank = query.settings.galore_rank
    targets = galore_targets(query.small.linears)
    if query.small.linears and not targets:
        raise ConfigError("--optimizer", "galore-adamw projects nn.Linear weights of attention and MLP modules and "
                          "this model has none (GPT-2's are Conv1D): Hugging Face refuses it too", "galore-adamw")
    shapes = tuple((m.out_features, m.in_features) for m in targets)
    projected = kept = 0
    for rows, cols in shapes:
        p_elements, moment = galore_matrix_elements(rows, cols, rank, fp32=query.state_bytes == _FP32)
        projected += rows * cols
        kept += p_elements + 2 * moment
    full = max(query.numel - projected, 0)
    return OptimizerStates(device_bytes=(2 * full + kept) * query.state_bytes,
                           step_bytes=galore_step_bytes(shapes, rank, query.state_bytes, before=query.small.head))


def _unprojected_step(query: StepQuery) -> int:
    """``denom`` and ``exp_avg / denom`` of the largest tensor (an unprojected one: the embedding or head)."""
    return 2 * query.largest_tensor * query.state_bytes


def _describe(settings: OptimizerSettings) -> str:
    return (f"galore-adamw: rank-{settings.galore_rank} GaLore projection of the attention and MLP weights "
            "(a projection matrix and two low-rank moments each, in the gradient's dtype), full AdamW moments "
            "for the rest; the SVD step of the largest projected weight priced, not the solver's workspace")


def _build(request: TraceRequest) -> Any:
    """``GaLoreAdamW`` with Hugging Face's two parameter groups (the targets carry the rank)."""
    import torch
    from transformers.trainer_utils import check_target_module_exists

    galore = import_package("galore_torch", package="galore-torch", optimizer="galore-adamw", extra="galore")
    if request.model is None:
        raise UnsupportedError("--optimizer galore-adamw: GaLore picks its weights by module; trace it with the "
                               "model (ctx.make_optimizer(model)), not --optimizer-in-backward")
    trained = {id(p) for p in request.params}
    names = {name + ".weight" for name, module in request.model.named_modules()
             if isinstance(module, torch.nn.Linear) and check_target_module_exists(list(GALORE_TARGETS), name)}
    targets = [p for n, p in request.model.named_parameters() if n in names and id(p) in trained]
    others = [p for n, p in request.model.named_parameters() if n not in names and id(p) in trained]
    projected = {"params": targets, "rank": request.settings.galore_rank, "update_proj_gap": _TRACED_PROJ_GAP,
                 "scale": _SCALE, "proj_type": _PROJ_TYPE}
    return galore.GaLoreAdamW([{"params": others}, projected], lr=request.learning_rate, no_deprecation_warning=True)


GALORE_ADAMW = OptimizerKind(
    name="galore-adamw", summary="GaLore AdamW (galore-torch): low-rank projected moments of the attention and MLP "
                                 "weights, --galore-rank N",
    states=_states, step_temporaries=_unprojected_step, describe=_describe, small_tensors=True,
    frameworks=frozenset({"hf"}),
    framework_rule=("galore-adamw cannot run under --framework {framework}: GaLore runs where Hugging Face's Trainer "
                    "(optim galore_adamw) or a plain PyTorch loop runs galore-torch; Megatron-LM's --optimizer, "
                    "DeepSpeed's optimizer.type and torchtitan's optimizer registry have no GaLore (use --framework hf)"),
    full_training_rule=("galore-adamw projects the gradients of fully trained weights; it is not priced with "
                        "adapters, frozen or quantized weights"),
    unsharded_rule=("galore-adamw projects each whole 2-D gradient (an SVD per weight); ZeRO, FSDP and tensor "
                    "parallelism split them: use --zero 0 --fsdp none --tp 1"),
    implementations=("for-loop",),
    knobs=("galore_rank",),
    dialects=DialectNames(hf=(("galore_adamw", "auto"),), hf_optim_args=(("rank", "galore_rank"),),
                          hf_optim_args_no_effect=("update_proj_gap", "scale")),
    build=_build,
)
