"""transformers' grouped experts in the reserved schedule (session 14, c5moe14): a recomputed layer's backward runs
the ledger's own walk of the experts op by op (it was one block of the ledger's transient, the layer's gradients made
at once after it), and a forward that frees what it makes (``save_on_cpu``) keeps each experts' tensor alive as
``grouped_mm_experts_forward`` holds it. deepseek-v2-lite cut to 4 layers, torchtitan, ``save_on_cpu``, full
recompute, s4096 b2: +6.22% against the trace's simulated reserved before, -0.73% after; the same under Hugging Face
without offload (SDPA): +13.98% before, +7.44% after."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.estimate.test_reserved_mechanics import _schedule, replayed_estimate

MiB = 2**20
FLAGS = {"framework": "torchtitan", "attention": "sdpa", "precision": "bf16-mixed", "optimizer": "adamw",
         "seq": 4096, "mbs": 2, "offload_activations": True, "recompute": "full", "gpus": 1}
#: deepseek-v2-lite at s4096 b2 (fp32 experts under autocast): 8,192 tokens x 6 picks routed rows of 2,048 (384 MiB),
#: fc1's output (2 x 1,408 columns, 528 MiB), the activation and the product (264 MiB); the down and gate-up
#: weights' fp32 gradients (64 experts: 704 and 1,408 MiB).
ROWS, FC1, ACT, DOWN, GATE_UP = 384 * MiB, 528 * MiB, 264 * MiB, 704 * MiB, 1408 * MiB
MOE_LAYERS = 26


def _stretch(flags: dict[str, object], first: str, last: str, which: int = 1) -> list[tuple[str, object]]:
    """The schedule's events from its ``which``-th moment ``first`` to the ``which``-th moment ``last``."""
    events = _schedule("deepseek-v2-lite", flags)
    start = [i for i, e in enumerate(events) if e == ("moment", first)][which]
    end = [i for i, e in enumerate(events) if e == ("moment", last)][which]
    return [e for e in events[start:end] if e[0] != "moment"]


#: Hugging Face's non-reentrant checkpoint without activation offload (the checkpoint's input kept on the GPU).
HF = {**FLAGS, "framework": "hf", "offload_activations": False, "recompute_layers": 1}


@pytest.mark.parametrize("flags", [FLAGS, HF], ids=["torchtitan-save_on_cpu", "hf"])
def test_a_recomputed_layers_experts_backward_runs_op_by_op(flags: dict[str, object]) -> None:
    events = _stretch(flags, "loss", "end of backward")
    # per MoE layer: the combine's clone, the zeros it is put back into, the clone freed, the product's two gradients;
    # the down GEMM's input gradient and weight gradient; ...; the gate-up GEMM's rows gradient and weight gradient
    combine = [("take", ROWS), ("take", ROWS), ("give", ROWS), ("take", ROWS), ("take", ROWS)]
    big = [(kind, int(size)) for kind, size in events if int(size) >= ACT]  # type: ignore[call-overload]
    assert sum(big[i:i + 5] == combine for i in range(len(big))) == MOE_LAYERS
    assert sum(big[i:i + 2] == [("take", ACT), ("take", DOWN)] for i in range(len(big))) == MOE_LAYERS
    assert sum(big[i:i + 2] == [("take", ROWS), ("take", GATE_UP)] for i in range(len(big))) == MOE_LAYERS


def test_a_save_on_cpu_forward_holds_the_experts_tensors_as_the_function_does() -> None:
    events = _schedule("deepseek-v2-lite", FLAGS)
    events = events[:events.index(("moment", "forward"))]  # the setup and the first step's forward
    big = [(kind, int(size)) for kind, size in events if size in (ROWS, FC1, ACT)]  # not the parameters'
    # the dispatched rows, fc1's output, the activation and the product alive at once, then fc1's output and the
    # activation freed; the outputs, their weighted product and the rows put back (a trace's 384, 528, 264, 264, 384,
    # 384, 384 MiB)
    layer = [("take", ROWS), ("take", FC1), ("take", ACT), ("take", ACT), ("give", ACT), ("give", FC1),
             ("take", ROWS)]
    assert sum(big[i:i + 7] == layer for i in range(len(big))) == MOE_LAYERS


def test_a_checkpointed_group_keeps_its_block() -> None:
    # two layers in one checkpoint: not laid out (the walk's combine not in the schedule)
    events = _stretch({**FLAGS, "recompute_layers": 2}, "loss", "end of backward")
    big = [(kind, int(size)) for kind, size in events if int(size) >= ACT]  # type: ignore[call-overload]
    assert [("take", ROWS), ("take", ROWS), ("give", ROWS)] not in [big[i:i + 3] for i in range(len(big))]
    # the one-block path instead: per MoE layer one block, larger than any tensor the walk lays out, taken and freed
    walked = {ROWS, FC1, ACT, DOWN, GATE_UP}
    block, count = Counter(size for kind, size in big if kind == "take" and size > FC1 and size not in walked
                           ).most_common(1)[0]
    assert count == MOE_LAYERS and big.count(("give", block)) == MOE_LAYERS


def test_an_eager_core_keeps_the_general_path() -> None:
    # the eager softmax backward is the general path's plan (reserved_backward): the experts are not walked there
    walk = [("take", ACT // 2), ("take", DOWN)]  # mbs 1: the down GEMM's input gradient, then its weight's
    for attention, walked in (("sdpa", True), ("eager", False)):
        events = _stretch({**HF, "attention": attention, "mbs": 1}, "loss", "end of backward")
        pairs = [(kind, int(size)) for kind, size in events if int(size) >= MiB]  # type: ignore[call-overload]
        assert (walk in [pairs[i:i + 2] for i in range(len(pairs))]) is walked


def test_the_combines_first_product_gradient_is_freed_and_the_second_lives_on() -> None:
    # a trace of deepseek-v2-lite cut to 4 layers (HF, SDPA, full recompute, s4096 x 2): of the product's two
    # gradients, the first ``mul`` is freed before the down GEMM's backward, the second after its weight's gradient
    # (tprsv14, session 14: +7.44% -> -0.59% against the trace's simulated reserved)
    from memplan.alloc.schedule import STREAM_BITS

    ops = replayed_estimate("deepseek-v2-lite", HF)[0][0].ops
    size = [op >> STREAM_BITS if op >= 0 else -1 for op in ops]
    combines = [i for i in range(len(ops) - 4)
                if size[i:i + 2] == [ROWS, ROWS] and ops[i + 2] == ~i and size[i + 3:i + 5] == [ROWS, ROWS]]
    assert len(combines) == 2 * MOE_LAYERS  # two steps
    for at in combines:
        first, second = at + 3, at + 4
        down = next(i for i in range(at, len(ops)) if size[i] == DOWN)
        freed = {~op for op in ops[at:down] if op < 0}
        assert first in freed and second not in freed
