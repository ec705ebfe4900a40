"""Eager attention cores in the reserved schedule (session 12, rswing12b). A layer recomputed whole under autocast: its
checkpointed forward makes the attention scores' temporaries as a trace does (``bmm``, ``mul``, the fp32 masked
scores beside the fp32 softmax output), and its backward runs the allocated peak's op-by-op walk
(:func:`memplan.estimate.recomputed_backward.walk_events`) after the forward made again, rather than one block
of the walk's worst bytes (5.3 GiB for llama-3.2-1b s4096 b2, where autograd makes two 4 GiB fp32 tensors).
The masked scores are fp32 where the mask is (autocast over fp32 weights), without the softmax's upcast."""

from __future__ import annotations

from test_reserved_swing import _schedule

#: llama-3.2-1b at s4096 b2: one fp32 tensor of the attention scores (32 heads).
FP32_SCORES = 32 * 2 * 4096 * 4096 * 4
LAYERS = 16
JOB = {"framework": "hf", "recompute": "full", "attention": "eager", "seq": 4096, "mbs": 2,
       "precision": "bf16-mixed"}


def _stretch(log: list[tuple[str, object]], start: str, stop: str) -> list[tuple[str, object]]:
    """The entries of the first step between the moments ``start`` ("" the beginning) and ``stop``."""
    first = 0 if not start else log.index(("moment", start))
    return log[first:log.index(("moment", stop), first)]


def _peak_requested(log: list[tuple[str, object]]) -> int:
    """The most bytes the schedule holds at once."""
    held = peak = 0
    for kind, size in log:
        held += size if kind == "take" else -size if kind == "give" else 0  # type: ignore[operator]
        peak = max(peak, held)
    return peak


def test_the_recomputed_layers_backward_makes_no_block_above_autograds_largest_tensor() -> None:
    log, allocated = _schedule("llama-3.2-1b", JOB)
    # the recompute reads the layer's input from the checkpoint (no copy), as the ledger's walk counts it: the
    # schedule's most held is the ledger's peak, no input made twice above it
    assert _peak_requested(log) == allocated
    backward = _stretch(log, "loss", "end of backward")
    assert max(size for kind, size in backward if kind == "take") == FP32_SCORES  # type: ignore[type-var]
    # each layer: the recomputed forward's masked scores and softmax output, the core backward's upcast and gradient
    assert sum(entry == ("take", FP32_SCORES) for entry in backward) == 4 * LAYERS


def test_the_checkpointed_forward_makes_the_fp32_masked_scores_beside_the_softmax_output() -> None:
    log, _ = _schedule("llama-3.2-1b", JOB)
    forward = _stretch(log, "", "forward")
    assert sum(entry == ("take", FP32_SCORES) for entry in forward) == 2 * LAYERS


def test_an_fp32_mask_makes_the_masked_scores_fp32_and_the_softmax_casts_nothing() -> None:
    # Hugging Face builds the additive mask in the embeddings' dtype: under autocast over fp32 weights the 16-bit
    # scores plus the fp32 mask are fp32 (a trace: bmm, mul 2 bytes per score, add, _softmax 4 bytes, _to_copy 2);
    # in pure bf16 the sum is bf16 and the softmax upcasts it (_to_copy 4 bytes) first
    scores = 32 * 2048 * 2048 * 2  # llama-3.2-1b s2048 b1, 16-bit
    for precision, sixteen in (("bf16-mixed", 3), ("bf16", 4)):
        log, _ = _schedule("llama-3.2-1b", {"framework": "hf", "attention": "eager", "seq": 2048, "mbs": 1,
                                            "precision": precision})
        forward = _stretch(log, "", "forward")
        assert sum(entry == ("take", 2 * scores) for entry in forward) == 2 * LAYERS
        assert sum(entry == ("take", scores) for entry in forward) == sixteen * LAYERS
