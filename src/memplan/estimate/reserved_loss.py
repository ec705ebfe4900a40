"""The loss in the reserved-memory schedule (issue 25, item 8; :mod:`memplan.estimate.reserved_sim`):
the logits' tensors as a trace of an fp32 cross-entropy allocates them, forward and backward, and
a soft-capped head's (Gemma 2's ``cap * tanh(logits / cap)``) 16-bit chain around them."""

from __future__ import annotations

from collections.abc import Callable

from memplan.alloc.blocks import Block
from memplan.estimate.context import StageContext
from memplan.estimate.layer_costs import per_tensor_offload
from memplan.estimate.ledger import Ledger
from memplan.estimate.reserved_replay import Replay
from memplan.estimate.stage_peak import LossPart


def _fp32_logits(ctx: StageContext) -> int:
    """Bytes of one fp32 logits tensor of the rank's vocabulary (the loss's upcast, its log-softmax, the
    log-softmax's gradient): the vocabulary split as the framework's head splits it (``vocab_tp``; Hugging
    Face's TP plan gathers the head's output, so each rank's loss sees the whole vocabulary)."""
    shape = ctx.run.shape
    return shape.seq * shape.micro_batch * ctx.run.vocab_rows * 4 // max(shape.vocab_tp or shape.tp, 1)


def _logit_tensors(one: int, total: int) -> list[int]:
    """The loss's logits as the tensors the loss holds: pieces of ``one`` fp32 logits tensor, the
    remainder (16-bit logits, smaller parts) last."""
    if one <= 0 or total <= one:
        return [total]
    return [one] * (total // one) + [total % one]


def softcapped(ctx: StageContext, loss: LossPart) -> bool:
    """Whether the schedule lays the loss out as a soft-capped head's (:func:`_softcapped`): the model caps
    its logits, in a 16-bit dtype, and the loss saves the tanh output beside the fp32 log-softmax (under
    ``save_on_cpu`` both in host memory: what its backward brings back)."""
    one = _fp32_logits(ctx)
    half = one * ctx.run.shape.act_bytes // 4
    saved = loss.bring_back if per_tensor_offload(ctx.run) else loss.saved_logits
    return (ctx.run.model.final_logit_softcap is not None and 0 < half < one
            and saved == one + half and loss.logits - loss.saved_logits >= one)


def schedule_loss(ctx: StageContext, ledger: Ledger, loss: LossPart, replay: Replay, check: bool,
                  edges: tuple[list[Block | None], Callable[[], object]]) -> Block | None:
    """The loss as a trace of an fp32 cross-entropy shows it: forward, the 16-bit logits, their fp32 upcast
    and the log-softmax it saves (the upcast freed, then autocast's ``cache`` as its region exits, then the
    16-bit logits as the loop drops the model's output); backward, the NLL's and
    the log-softmax's fp32 gradients beside the saved tensors (the estimate's loss moment), then the
    16-bit gradient. A loss whose figure holds less than one fp32 gradient beside what it saves
    (chunked, fused, vocabulary-parallel) is its tensors at once.

    ``edges``: what the end of the forward frees (autocast's cache, FSDP2's last all-gather output as the root's
    forward ends) and what the start of the backward does (FSDP2's prefetch of the last layer's all-gather, made
    before the loss's backward).

    Returns the 16-bit gradient of the logits (None: none made), still alive: autograd holds it while the
    head's weight gradient is made, so the caller frees it after making that gradient. A trace shows it
    (gpt-oss-20b's ``_to_copy`` of the logits gradient, then the head's ``mm``, then the free); freed before,
    the head's gradient found room in a score segment that the trace's cannot offer it, and gpt-oss-20b cut to
    4 layers (s4096 b1 bf16, ``--recompute-method block --recompute-layers 2``) was +5.8% against the trace's
    simulated reserved once the MLP block's gradients are made after its saved tensors are freed, -0.1% now."""
    cache, backward = edges
    one = _fp32_logits(ctx)
    grads = loss.logits - loss.saved_logits
    if one <= 0 or grads < one or not loss.saved_logits:
        blocks = replay.take_all(_logit_tensors(one, loss.logits))
        replay.give(*cache)
        backward()
        replay.moment(ledger, "loss", check)
        replay.give(*blocks)
        return None
    half = one * ctx.run.shape.act_bytes // 4
    if softcapped(ctx, loss):
        return _softcapped(replay, (one, half, grads), (backward, lambda: replay.moment(ledger, "loss", check)),
                           cache, per_tensor_offload(ctx.run))
    low, upcast = replay.take(half), replay.take(one)
    kept = replay.take_all(_logit_tensors(one, loss.saved_logits))
    replay.give(upcast, *cache, low)
    backward()
    made = replay.take_all(_logit_tensors(one, grads))
    replay.moment(ledger, "loss", check)
    replay.give(made[0], *kept)
    grad = replay.take(half)
    replay.give(*made[1:])
    return grad


def _softcapped(replay: Replay, sizes: tuple[int, int, int],
                hooks: tuple[Callable[[], object], Callable[[], None]], cache: list[Block | None],
                offloaded: bool) -> Block | None:
    """A soft-capped fp32 cross-entropy as a trace of HF Gemma 2 allocates it (``sizes``: one fp32 logits
    tensor, one 16-bit one, the gradients' bytes). Forward, in the 16-bit dtype: the head's logits, their
    ``/ cap`` (the logits freed), ``tanh`` (saved; the quotient freed), ``* cap``; then the fp32 upcast and
    the log-softmax it saves, the upcast, autocast's ``cache`` and the capped logits freed. Backward: the NLL's and the
    log-softmax's fp32 gradients (the loss moment), the log-softmax output freed, then one 16-bit tensor
    per op back down the chain (the cast, ``* cap``, ``tanh_backward``, ``/ cap``), each freeing the one
    before, the saved ``tanh`` output freed after its backward; the last is the gradient the head's backward
    reads, returned alive (:func:`schedule_loss`).

    ``offloaded`` (``save_on_cpu``): the same ops, but the ``tanh`` output and the log-softmax are freed on the
    GPU once made and used (autograd holds their host copies); the backward brings the log-softmax back (one of
    the gradients' fp32 tensors: the estimate's loss counts it there) and the ``tanh`` output before its
    backward. A trace of gemma-2-2b (seq 4096 x 2) makes them so: the chain's two 16-bit tensors alive at once
    reserve a second logits-sized segment in the first step, which the optimizer states then share. ``hooks``: the
    backward's start (:func:`schedule_loss`) and the loss moment."""
    one, half, grads = sizes
    logits, quotient = replay.take(half), replay.take(half)
    replay.give(logits)
    tanh = replay.take(half)
    replay.give(quotient)
    capped = replay.take(half)
    if offloaded:
        replay.give(tanh)
        tanh = None
    upcast = replay.take(one)
    kept = replay.take(one)
    if offloaded:
        replay.give(kept)
        kept = None
    replay.give(upcast, *cache, capped)
    backward, moment = hooks
    backward()
    made = replay.take_all(_logit_tensors(one, grads))
    moment()
    replay.give(made[0], kept)
    cast = replay.take(half)
    replay.give(*made[1:])
    scaled = replay.take(half)
    replay.give(cast)
    if offloaded:
        tanh = replay.take(half)  # brought back for its backward
    inner = replay.take(half)
    replay.give(scaled, tanh)
    grad = replay.take(half)
    replay.give(inner)
    return grad
