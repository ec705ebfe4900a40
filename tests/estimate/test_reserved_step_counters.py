"""Two details of the reserved schedule's end of the backward that a trace of deepseek-v2-lite under torchtitan
(bf16-mixed, fp32 weights, fused AdamW) shows (session 13, resv13): the fused optimizer's per-tensor step counters
are their own 4-byte tensors, made before each tensor's moments, so the moments are exactly their parameters'
sizes; and the head's gradient is the fp32 cast of autocast's 16-bit product, made after the logits' gradient is
freed."""

from __future__ import annotations

from memplan.estimate.reserved_sizes import piece_sizes
from tests.estimate.test_reserved_mechanics import _schedule

MiB = 2**20


def test_step_counters_are_tensors_of_their_own() -> None:
    # units: root = embedding 100 and head 60 (bytes of both moments: 2 x 4 per element), one layer of 10;
    # the optimizer total counts three 4-byte counters beside them
    _, states, _ = piece_sizes(2 * 170 + 3 * 4, 0, 0, ((100, 60), (10,)), 1, 4)
    assert [s for unit in states for s in unit] == [4, 100, 100, 4, 10, 10, 4, 60, 60]
    _, states, _ = piece_sizes(2 * 170 + 3 * 4, 0, 0, ((100, 60), (10,)), 1)  # spread: the old layout
    assert 100 not in [s for unit in states for s in unit]


def test_the_moments_of_a_fused_optimizer_are_their_parameters_size() -> None:
    # qwen3-8b under torchtitan (fused AdamW): every moment above 1 MiB is an exact parameter size (a whole
    # number of 4-byte elements of a weight: a multiple of the hidden size), where the counters spread over the
    # moments made each a few bytes larger (the allocator then rounded each up to the next 2 MiB)
    events = _schedule("qwen3-8b", {"framework": "torchtitan", "seq": 1024, "optimizer": "adamw"})
    start = events.index(("moment", "end of backward"))
    states = [size for kind, size in events[start:events.index(("moment", "optimizer step"), start)]
              if kind == "take" and size > MiB]  # type: ignore[operator]
    assert states and all(size % (4 * 4096) == 0 for size in states)  # type: ignore[operator]


def test_the_heads_gradient_is_cast_up_after_the_logits_gradient_is_freed() -> None:
    # torchtitan bf16-mixed (autocast over fp32 weights): the head's 16-bit product (vocab x hidden x 2), the
    # logits' gradient freed, then the fp32 gradient, then the product freed
    events = _schedule("qwen3-8b", {"framework": "torchtitan", "seq": 1024, "optimizer": "adamw"})
    head = 151936 * 4096
    start = events.index(("moment", "loss"))
    takes = [i for i in range(start, len(events)) if events[i] == ("take", 2 * head)]
    assert takes, "the head's 16-bit product"
    after = events[takes[0]:takes[0] + 4]
    assert after[1][0] == "give" and after[2] == ("take", 4 * head)
