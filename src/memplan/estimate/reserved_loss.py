"""The loss in the reserved-memory schedule (issue 25, item 8; :mod:`memplan.estimate.reserved_sim`):
the logits' tensors as a trace of an fp32 cross-entropy allocates them, forward and backward."""

from __future__ import annotations

from memplan.estimate.context import StageContext
from memplan.estimate.ledger import Ledger
from memplan.estimate.reserved_replay import Replay
from memplan.estimate.stage_peak import LossPart


def _fp32_logits(ctx: StageContext) -> int:
    """Bytes of one fp32 logits tensor of the rank's vocabulary (the loss's upcast, its log-softmax, the
    log-softmax's gradient)."""
    run = ctx.run
    return run.shape.seq * run.shape.micro_batch * run.vocab_rows * 4 // max(run.job.parallel.tp, 1)


def _logit_tensors(one: int, total: int) -> list[int]:
    """The loss's logits as the tensors the loss holds: pieces of ``one`` fp32 logits tensor, the
    remainder (16-bit logits, smaller parts) last."""
    if one <= 0 or total <= one:
        return [total]
    return [one] * (total // one) + [total % one]


def schedule_loss(ctx: StageContext, ledger: Ledger, loss: LossPart, replay: Replay, check: bool) -> None:
    """The loss as a trace of an fp32 cross-entropy shows it: forward, the 16-bit logits, their fp32 upcast
    and the log-softmax it saves (the upcast and the 16-bit logits freed after); backward, the NLL's and
    the log-softmax's fp32 gradients beside the saved tensors (the estimate's loss moment), then the
    16-bit gradient. A loss whose figure holds less than one fp32 gradient beside what it saves
    (chunked, fused, vocabulary-parallel) is its tensors at once."""
    one = _fp32_logits(ctx)
    grads = loss.logits - loss.saved_logits
    if one <= 0 or grads < one or not loss.saved_logits:
        blocks = replay.take_all(_logit_tensors(one, loss.logits))
        replay.moment(ledger, "loss", check)
        replay.give(*blocks)
        return
    half = one * ctx.run.shape.act_bytes // 4
    low, upcast = replay.take(half), replay.take(one)
    kept = replay.take_all(_logit_tensors(one, loss.saved_logits))
    replay.give(upcast, low)
    made = replay.take_all(_logit_tensors(one, grads))
    replay.moment(ledger, "loss", check)
    replay.give(made[0], *kept)
    replay.give(replay.take(half), *made[1:])
