"""The head's gradient in the reserved schedule under Hugging Face's tensor parallelism (session 14, c5moe14).
autocast's copy of the head's weight, and so the ``mm`` that makes its gradient before the ``_to_copy`` back to fp32,
is the weight on one rank: a head tied to an embedding that TP does not split is whole
(:func:`~memplan.estimate.stage_activations.head_numel`), where the schedule sized it vocab x hidden / TP (a trace of
llama-3.2-1b at TP 2: a 501 MiB ``mm``). An untied head is split while the embedding stays whole: the gradient made
after the loss is the head's share (a trace of qwen2.5-7b cut to 4 layers at TP 2: 1,040 MiB), the embedding's whole
one comes at the end (2,079 MiB); the schedule took the largest root gradient, the embedding's, for the head's
(that cell -4.56% against the trace's simulated reserved before, -0.07% after)."""

from __future__ import annotations

from tests.estimate.test_reserved_mechanics import _schedule

HF_TP2 = {"framework": "hf", "tp": 2, "gpus": 2, "precision": "bf16-mixed", "seq": 1024}


def _after_loss(model: str) -> list[tuple[str, int]]:
    events = _schedule(model, HF_TP2)
    start = events.index(("moment", "loss"))
    return [(kind, int(size)) for kind, size in events[start + 1:start + 12] if kind != "moment"]  # type: ignore[call-overload]


def test_a_tied_heads_product_is_the_whole_weight() -> None:
    head = 128256 * 2048  # llama-3.2-1b ties its head to the embedding, which HF's TP plan keeps whole
    events = _after_loss("llama-3.2-1b")
    product = events.index(("take", 2 * head))
    assert events[product + 1][0] == "give" and events[product + 2] == ("take", 4 * head)
    assert ("give", 2 * head) in events[product + 3:]


def test_an_untied_heads_product_is_its_rank_share() -> None:
    head = 151936 * 4096 // 2  # qwen3-8b's own head, split over the two ranks
    events = _after_loss("qwen3-8b")
    product = events.index(("take", 2 * head))
    assert events[product + 2] == ("take", 4 * head)


def test_an_untied_heads_gradient_is_its_share_and_the_embeddings_comes_last() -> None:
    head = 152064 * 3584 * 4  # qwen2.5-7b's fp32 head gradient, whole; the head's is half of it at TP 2
    events = _schedule("qwen2.5-7b", HF_TP2)
    start = events.index(("moment", "loss"))
    end = events.index(("moment", "end of backward"), start)
    takes = [int(size) for kind, size in events[start:end] if kind == "take" and int(size) >= head // 2]  # type: ignore[call-overload]
    assert takes[0] == head // 2 and takes[-1] == head
