"""torch.autocast's weight copies in the reserved-memory schedule (issue 25, item 8;
:mod:`memplan.estimate.reserved_sim`).

Under ``torch.autocast`` each linear layer casts its weight to the 16-bit compute dtype when it runs
(``aten._to_copy`` in a trace, one tensor per weight) and autograd saves the copy until that layer's
backward (:func:`memplan.estimate.autocast.autocast_weight_copy_numel` says which layers keep them).
The estimate counts the decoder layers' copies in its "other" activations; the schedule instead makes
them inside each layer's forward, one tensor per linear weight (their sizes in proportion to the
layer's linear weights) spread evenly between the layer's saved tensors, and frees them with those
in its backward, so they sit in the segments beside that layer's activations as they do in a real step.
"""

from __future__ import annotations

from memplan.estimate.autocast import autocast_weight_copy_numel
from memplan.estimate.context import StageContext
from memplan.estimate.layer_costs import recomputed_copies_bytes
from memplan.estimate.stage_activations import cached_adapter_copies
from memplan.model.linears import layer_linears
from memplan.units import dtype_bytes


def _layer_copy_numel(ctx: StageContext, index: int) -> int:
    """Elements of the copies layer ``index`` keeps (every other layer counted as recomputed)."""
    run, layout = ctx.run, ctx.layout
    others = (set(layout.layer_indices) - {index}) | set(ctx.recomputed)
    return autocast_weight_copy_numel(run.model, run.job, layout, recomputed=others, policy=run.policy.kind,
                                      eager_experts=run.profile.kernels == "eager", modules=run.policy.modules)


def _split(total: int, weights: list[int]) -> list[int]:
    whole = sum(weights)
    if total <= 0 or whole <= 0:
        return [total] if total > 0 else []
    sizes = [total * w // whole for w in weights]
    sizes[-1] += total - sum(sizes)
    return [s for s in sizes if s > 0]


def layer_weight_copies(ctx: StageContext, layers: list[int]) -> list[list[int]]:
    """Per layer of ``layers`` (in order) the bytes of the weight copies its forward makes and its
    backward frees; all empty unless the job casts weights with autocast and trains the whole model
    (under fine-tuning only trained weights are cast: left in the estimate's other activations)."""
    run = ctx.run
    if run.prec.weight_copies != "autocast" or run.counts is not None:
        return [[] for _ in layers]
    compute = dtype_bytes(run.prec.compute)
    out = []
    for index in layers:
        numel = _layer_copy_numel(ctx, index) if index not in ctx.recomputed else 0
        out.append(_split(numel * compute, _saved_weights(ctx, index)))
    return out


def _saved_weights(ctx: StageContext, index: int) -> list[int]:
    """Weights (numel) of the linears whose copies layer ``index``'s autograd nodes save: every linear's, but the
    MLP's alone where the policy checkpoints the attention module (its projections' copies are cast again in the
    backward: :func:`_cached_weights`). Spread over every linear, a Hugging Face selective job's saved copies took
    the attention projections' share from the MLP's (qwen3-8b s1024: 75 MiB pieces where a trace saves the three
    96 MiB ``_to_copy`` of the MLP's weights), so the 96 MiB segments the trace's forward reserves, and its optimizer
    step's temporaries later fill, did not exist: +1.71% against the trace's simulated reserved."""
    run = ctx.run
    linears = layer_linears(run.model.layers[index], run.model.hidden_size, run.model.model_type)
    if run.policy.kind.checkpoints_attention and not run.policy.kind.per_op:
        linears = tuple(m for m in linears if m.name.startswith("mlp")) or linears
    return [m.weight_numel for m in linears]


def _cached_weights(ctx: StageContext, index: int) -> list[int]:
    """Weights (numel) of the linears whose copies layer ``index``'s checkpointed region casts: the whole
    layer's when the layer is recomputed or under per-op SAC, its attention projections when the attention
    module is checkpointed, else its MLP's (a checkpointed block)."""
    run = ctx.run
    linears = layer_linears(run.model.layers[index], run.model.hidden_size, run.model.model_type)
    kind = run.policy.kind
    if index in ctx.recomputed or kind.per_op:
        chosen = linears
    else:
        mlp = not kind.checkpoints_attention
        chosen = tuple(m for m in linears if m.name.startswith("mlp") == mlp) or linears
    return [m.weight_numel for m in chosen]


def layer_cached_copies(ctx: StageContext, layers: list[int], cache: int,
                        trained: list[list[int]] | None, *, offloaded: bool = False) -> list[list[int]]:
    """Per layer of ``layers`` (in order) the weight copies autocast's cache holds from that layer's forward
    until the forward's autocast region exits, after the loss: the copies of the linears a checkpointed
    region casts (no autograd node saves them; :func:`memplan.estimate.layer_costs.recomputed_copies_bytes`)
    and, under fine-tuning, its fp32 adapters' (:func:`memplan.estimate.stage_activations.cached_adapter_copies`,
    spread over the layer's trainable tensors ``trained[position + 1]``, :mod:`~memplan.estimate.reserved_trainable`),
    one tensor per weight. All empty unless they add up to the estimate's ``cache``
    (:attr:`~memplan.estimate.stage_activations.StageActivations.autocast_cache`: one pass over the layers).
    ``offloaded``: under ``save_on_cpu`` every layer's adapters' copies are cached, not only checkpointed ones'."""
    out = []
    for position, index in enumerate(layers):
        adapters = cached_adapter_copies(ctx, index, offloaded)
        tensors = trained[position + 1] if trained is not None else []
        out.append(_split(recomputed_copies_bytes(ctx, index), _cached_weights(ctx, index))
                   + _split(adapters, tensors or [1]))
    if not cache or sum(map(sum, out)) != cache:
        return [[] for _ in layers]
    return out
