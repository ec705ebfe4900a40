"""Autocast's 16-bit copies of frozen weights stored in another dtype (a frozen fp32 base under ``*-mixed``).

``torch.autocast`` casts the weight of every linear layer it runs to the compute dtype (``cached_cast`` in
``aten/src/ATen/autocast_mode.h``). Its cache keeps only the copies of leaves that require grad, so a frozen
weight is cast again at every call, and the matmul's autograd node saves that copy for the input's gradient
(``mm``'s backward reads ``mat2``: ``tools/autograd/derivatives.yaml``), which autograd records only when the
linear's input requires grad. No bias copy is saved (``addmm`` keeps none of its bias). So a frozen linear
keeps its weight's 16-bit copy until its backward exactly where its input needs a gradient
(:func:`memplan.estimate.partial_freeze.reads_a_gradient`); a 16-bit frozen base in the compute dtype makes no
copy at all. Not here: quantized bases' decoder linears (bitsandbytes dequantizes instead; their unquantized head is
cast), ``modules_to_save`` copies, HF's
MoE routers and routed experts (no linear modules: HF's grouped experts cast their input, not their
weights; a router's small copy is not priced), and linears inside a checkpointed region (which saves nothing
of its forward; a fully recomputed layer's recompute makes its copies again: :func:`recomputed_frozen_copies`).
"""

from __future__ import annotations

from functools import lru_cache

from memplan.estimate.context import RunContext, StageContext
from memplan.estimate.finetune import StageFinetune
from memplan.estimate.partial_freeze import (
    BlockFlow,
    block_of,
    layer_flows,
    reads_a_gradient,
    root_flow,
    under,
)
from memplan.job import FineTuning
from memplan.model.linears import model_linears
from memplan.model.spec import ModelSpec
from memplan.peft.params import saved_modules, trained_modules
from memplan.units import normalize_dtype

__all__ = ["FROZEN_COPIES_NOTE", "frozen_weight_copies", "recomputed_frozen_copies"]

#: The --explain sentence of a job whose frozen weights autocast casts.
FROZEN_COPIES_NOTE = ("frozen weights stored in another dtype than autocast's: each frozen linear casts its weight "
                      "at every call (autocast caches copies of trainable weights only) and keeps the 16-bit copy "
                      "for its input's gradient where that input needs one (no bias copy is kept)")


def casts_frozen(run: RunContext) -> bool:
    """Whether autocast runs over frozen, unquantized weights stored in another dtype than its own."""
    job, frozen_dtype = run.job, run.job.finetune.frozen_dtype
    return not (run.counts is None or run.prec.weight_copies != "autocast" or job.finetune.quant_kind.quantizes
                or frozen_dtype is None
                or normalize_dtype(frozen_dtype) == normalize_dtype(job.precision.compute_dtype))


def _casts_unquantized_head(run: RunContext) -> bool:
    """A quantized base stored in another dtype than autocast's (``--frozen-dtype fp32``): bitsandbytes' decoder linears
    dequantize instead, but the unquantized output head is an ``nn.Linear`` autocast casts at every call (helper dq15:
    ``memplan trace``, nf4 base with an fp32 head, keeps its 16-bit copy)."""
    ft = run.job.finetune
    return (run.counts is not None and run.prec.weight_copies == "autocast" and ft.quant_kind.quantizes
            and ft.frozen_dtype is not None
            and normalize_dtype(ft.frozen_dtype) != normalize_dtype(run.job.precision.compute_dtype))


def recomputed_frozen_copies(run: RunContext, index: int) -> int:
    """Numel (one rank: the tensor-parallel linears split) of the frozen weights' 16-bit copies a fully recomputed
    layer ``index``'s recompute makes and its linears' nodes keep until their backward (0 unless autocast casts
    frozen weights): the recompute runs the layer's forward again under the forward's autocast state, with its
    input requiring grad (the checkpoint's)."""
    if not casts_frozen(run):
        return 0
    layers, _ = _copied_numel(run.model, run.job.finetune, True, (index,), own_layers=run.profile.kernels != "eager",
                              skip_attention=False, head=False)
    return layers // run.job.parallel.tp


def frozen_weight_copies(ctx: StageContext, ft: StageFinetune) -> tuple[int, int]:
    """(decoder layers', head's) numel on one rank of the frozen weights' 16-bit copies autograd keeps for the
    backward on this stage (0, 0 unless autocast runs over frozen weights stored in another dtype; a fully
    recomputed layer's: :func:`recomputed_frozen_copies`)."""
    run, layout = ctx.run, ctx.layout
    counts = run.counts
    head_only = _casts_unquantized_head(run)
    if counts is None or not (casts_frozen(run) or head_only):
        return 0, 0
    kind = run.policy.kind
    kept = () if kind.per_op or head_only else tuple(i for i in layout.layer_indices if i not in ctx.recomputed)
    layers, head = _copied_numel(run.model, run.job.finetune, run.policy.input_grads, kept,
                                 own_layers=run.profile.kernels != "eager", skip_attention=kind.checkpoints_attention,
                                 head=layout.has_head)
    root = layout.has_head or layout.has_embedding
    stage_frozen = sum(counts.layers[i].frozen for i in layout.layer_indices) + (counts.root.frozen if root else 0)
    if not stage_frozen:
        return 0, 0
    return ft.frozen * layers // stage_frozen, ft.frozen * head // stage_frozen  # one rank, as ``ft.frozen`` is


@lru_cache(maxsize=256)
def _copied_numel(model: ModelSpec, ft: FineTuning, checkpointing: bool, layers: tuple[int, ...], *,
                  own_layers: bool, skip_attention: bool, head: bool) -> tuple[int, int]:
    """Whole-model numel of the copied frozen weights of ``layers`` and of the head (``head``: on this stage)."""
    flows = layer_flows(model, ft, checkpointing, own_layers)
    skipped = trained_modules(model, ft) + saved_modules(model, ft)
    wanted = set(layers)
    total = 0
    for m in model_linears(model):
        if m.layer not in wanted or m.kind == "embedding" or under(m.name, skipped):
            continue
        block = block_of(m.name, frozenset())
        if block == "attention" and skip_attention:
            continue
        flow: BlockFlow = flows[m.layer].attention if block == "attention" else flows[m.layer].mlp
        if reads_a_gradient(flow, m.name):
            total += m.weight_numel
    root = root_flow(model, ft, checkpointing)
    trained_head = under("lm_head", skipped) or (model.tie_word_embeddings and root.embedding_trained_fully)
    if not head or trained_head or not (root.norm_input_grad or root.norm_trains):
        return total, 0
    return total, model.vocab_size * model.hidden_size  # the head's weight (vocabulary x hidden)
