"""The optimizer step's temporaries in the reserved-memory schedule (issue 25, item 8;
:mod:`memplan.estimate.reserved_sim`).

PyTorch's foreach AdamW (``torch/optim/adam.py``, ``_multi_tensor_adam``) runs each of its
out-of-place foreach ops over the whole parameter group: ``torch._foreach_sqrt(exp_avg_sqs)`` returns
one new tensor per parameter, each the size of that parameter's ``exp_avg_sq``, as a trace of the step
allocates them. The schedule therefore lays the estimate's step temporaries out as rounds of one
state-sized tensor per trainable tensor, in parameter order, as many rounds as the estimate's bytes
hold (the last round partial), instead of cutting the bytes in proportion to the parameters' sizes
(which makes blocks no step allocates, and segments to hold them).
"""

from __future__ import annotations

#: More rounds than this (states far smaller than the temporaries): not a foreach step's layout.
MAX_ROUNDS = 8


def foreach_temporaries(total: int, states: list[list[int]]) -> list[list[int]] | None:
    """``total`` bytes of step temporaries laid out per unit as rounds of one tensor per state size in
    ``states`` (per unit, one optimizer state per trainable tensor: the ``exp_avg_sq`` sizes); None
    when the states cannot hold them in :data:`MAX_ROUNDS` rounds (no states, or a stateless step)."""
    per_round = sum(map(sum, states))
    if per_round <= 0 or total > MAX_ROUNDS * per_round:
        return None
    out: list[list[int]] = [[] for _ in states]
    left = total
    while left > 0:
        for unit, sizes in zip(out, states, strict=True):
            for size in sizes:
                piece = min(size, left)
                if piece > 0:
                    unit.append(piece)
                    left -= piece
    return out
