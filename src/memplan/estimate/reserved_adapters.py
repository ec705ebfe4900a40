"""A LoRA adapter's forward in a checkpointed layer, for the reserved-memory schedule (issue 25, item 8;
:mod:`memplan.estimate.reserved_sim`).

peft's ``Linear.forward`` (``tuners/lora/layer.py``) runs the frozen base layer, casts the input to the
adapter's dtype (``_cast_input_dtype``; bitsandbytes' layers under autocast pass it on uncast:
``lora/bnb.py``), applies ``lora_dropout``, then adds ``lora_B(lora_A(x)) * scaling`` to the base result and
casts the sum back to the base result's dtype. Under ``torch.autocast`` ``lora_A`` casts its fp32 input
back to 16 bits. In a checkpointed layer's forward (no grad) autograd saves none of it, so each tensor is
freed when its last reader has run. A trace of qwen2.5-7b (LoRA all-linear, bf16-mixed, full recompute,
s4096) shows it per adapter: base ``mm``, the fp32 ``_to_copy`` of the input (held to the sum),
``lora_A``'s 16-bit ``_to_copy`` (freed after its ``mm``), ``lora_B``'s ``mm``, the ``mul`` by the scaling,
the ``add``; ``down_proj``'s fp32 input copy alone is 296 MiB at s4096, and the MLP adapters hold four
148 MiB tensors at once. The schedule made none of them (a fine-tuned layer's forward made only what it
keeps), so it reserved no segment of their sizes: the trace's simulated reserved was 7.8% above the
schedule's.

Each adapter is laid out as a run of entries ``(size, ADAPTER, step)`` (:data:`STEPS`), placed at the end of
its block (attention or MLP), each step freeing what the real forward frees there (:func:`adapter_step`).
Not laid out: DoRA adapters (their own transient: :func:`~memplan.estimate.adapter_acts.dora_forward_transient`),
peft's ``ParamWrapper`` adapters on fused experts, tensor parallelism (the sizes are not divided), and the
forward of a layer that is not recomputed (it saves some of these; the schedule keeps its kept tensors only).
"""

from __future__ import annotations

from memplan.estimate.activations import DROPOUT_MASK_BYTES
from memplan.estimate.adapter_acts import in_mlp_block, m_is_parameter
from memplan.estimate.context import StageContext
from memplan.estimate.finetune import adapter_compute_bytes
from memplan.estimate.reserved_replay import Block, Replay
from memplan.estimate.reserved_terms import ADAPTER, RELEASE
from memplan.peft.params import Adapter

#: The steps of one adapter's forward, in order (the third field of its entries): the base result, the
#: input cast to the adapter dtype, the dropout output and its mask, lora_A's 16-bit copy of its input,
#: lora_A's and lora_B's outputs, the scaled product, the sum (last, or followed by its cast back).
STEPS = ("base", "cast", "dropout", "mask", "copy", "lora_a", "lora_b", "scaled", "sum", "sum kept", "back")
_BASE, _CAST, _DROPOUT, _MASK, _COPY, _LORA_A, _LORA_B, _SCALED, _SUM, _SUM_KEPT, _BACK = range(len(STEPS))


def with_adapters(ctx: StageContext, index: int, tensors: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``tensors`` (a checkpointed layer's forward: :func:`~memplan.estimate.reserved_forward.layer_blocks`) with
    the layer's LoRA adapters' forward entries before the end of their block: the attention block's (its first
    release) and the MLP's (the last one)."""
    run = ctx.run
    if run.counts is None or run.job.parallel.tp > 1 or index not in ctx.recomputed or run.policy.partial:
        return tensors
    adapters = [a for a in run.counts.layer_adapters[index] if a.experts == 1 and not a.dora and not m_is_parameter(a)]
    mlp = [entry for a in adapters if in_mlp_block(a) for entry in adapter_entries(ctx, a)]
    attention = [entry for a in adapters if not in_mlp_block(a) for entry in adapter_entries(ctx, a)]
    releases = [i for i, t in enumerate(tensors) if t[1] == RELEASE]
    if not adapters or not releases:
        return tensors
    first, last = releases[0], releases[-1]
    if first == last:
        return tensors[:last] + attention + mlp + tensors[last:]
    return tensors[:first] + attention + tensors[first:last] + mlp + tensors[last:]


def adapter_entries(ctx: StageContext, adapter: Adapter) -> list[tuple[int, int, int]]:
    """One adapter's forward as ``(size, ADAPTER, step)`` entries (the steps of zero size left out)."""
    run, shape = ctx.run, ctx.run.shape
    tokens, compute = shape.seq * shape.micro_batch, shape.act_bytes
    own = adapter_compute_bytes(run.job, run.prec.weight_copies)
    autocast = run.prec.weight_copies == "autocast"
    m = adapter.module
    # bitsandbytes' layers under autocast pass x on uncast; elsewhere peft casts it to the adapter dtype
    cast = own if own != compute and not (autocast and run.job.finetune.quant_kind.quantizes) else 0
    lora_in = cast or compute
    lora = compute if autocast else lora_in
    dropout = run.job.finetune.lora_dropout > 0
    total = max(compute, lora)  # type promotion of the base result and the scaled product
    sizes = [tokens * m.out_features * compute, tokens * m.in_features * cast,
             tokens * m.in_features * lora_in if dropout else 0,
             tokens * m.in_features * DROPOUT_MASK_BYTES if dropout else 0,
             tokens * m.in_features * compute if autocast and lora_in != compute else 0,
             tokens * adapter.rank * lora, tokens * m.out_features * lora, tokens * m.out_features * lora]
    entries = [(size, ADAPTER, step) for step, size in enumerate(sizes) if size > 0]
    if total == compute:
        return entries + [(tokens * m.out_features * total, ADAPTER, _SUM)]
    out = tokens * m.out_features
    return entries + [(out * total, ADAPTER, _SUM_KEPT), (out * compute, ADAPTER, _BACK)]


def adapter_step(replay: Replay, size: int, step: int, temps: dict[int, Block | None]) -> None:
    """Make step ``step`` (:data:`STEPS`) of an adapter's forward, of ``size`` bytes, freeing what the real
    forward frees there; ``temps`` carries the adapter's live tensors between steps."""
    block = replay.take(size)
    if step == _MASK:
        replay.give(block)
    elif step == _LORA_A:
        replay.give(temps.pop(_COPY, None), temps.pop(_DROPOUT, None))
    elif step in (_LORA_B, _SCALED):
        replay.give(temps.pop(step - 1, None))
    elif step in (_SUM, _SUM_KEPT):
        replay.give(temps.pop(_SCALED, None), temps.pop(_BASE, None), temps.pop(_CAST, None))
        if step == _SUM:
            replay.give(block)
            return
    elif step == _BACK:
        replay.give(temps.pop(_SUM_KEPT, None), block)
        return
    if step != _MASK:
        temps[step] = block
