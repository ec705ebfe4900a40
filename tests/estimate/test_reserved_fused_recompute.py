"""A fused-core (SDPA) layer recomputed whole: its MLP's backward op by op in the reserved schedule (session 14,
tprsv14). A trace of llama-3.2-1b under Hugging Face's TP 2, bf16 autocast and full recompute makes each MLP
projection's fp32 weight gradient (32 MiB on a rank) between the frees of the recomputed MLP's tensors, one after the
other; the schedule made the layer's gradients at once after the whole transient (+7.97% against the trace's
simulated reserved, +0.48% after)."""

from __future__ import annotations

from tests.estimate.test_reserved_mechanics import _schedule

T2 = {"framework": "hf", "tp": 2, "gpus": 2, "precision": "bf16-mixed", "attention": "sdpa", "seq": 2048,
      "recompute": "full"}
MLP_GRAD = 8192 * 2048 // 2 * 4  # llama-3.2-1b's gate, up or down weight in fp32, split over two ranks


def _backward(flags: dict[str, object]) -> list[tuple[str, int]]:
    events = _schedule("llama-3.2-1b", flags)
    start = [i for i, e in enumerate(events) if e == ("moment", "loss")][1]
    end = [i for i, e in enumerate(events) if e == ("moment", "end of backward")][1]
    return [(kind, int(size)) for kind, size in events[start:end] if kind in ("take", "give")]  # type: ignore[call-overload]


def test_the_recomputed_mlps_gradients_are_made_between_its_frees() -> None:
    events = _backward(T2)
    grads = [i for i, e in enumerate(events) if e == ("take", MLP_GRAD)]
    assert len(grads) == 3 * 16
    assert all(events[i + 1][0] == "give" for i in grads)  # each projection's 16-bit gradient freed after it


def test_under_autocast_each_projection_frees_its_weight_copy_before_its_gradient() -> None:
    half = MLP_GRAD // 2  # the 16-bit weight copy on one rank, its 16-bit gradient, the product and its gradient
    events = _backward(T2)
    first = events.index(("take", MLP_GRAD))  # the down projection's: its 16-bit gradient, its input's gradient,
    # the product and the weight copy freed, the fp32 gradient, the 16-bit one freed
    assert events[first - 4:first + 2] == [("take", half), ("take", half), ("give", half), ("give", half),
                                           ("take", MLP_GRAD), ("give", half)]
