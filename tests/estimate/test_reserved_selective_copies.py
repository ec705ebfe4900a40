"""autocast's saved weight copies under Hugging Face's selective recompute (the attention module checkpointed), in the
reserved schedule (session 14, c5moe14): autograd saves the MLP's copies only (the checkpointed attention casts its
projections again in the backward), so the schedule's saved copies are the MLP's weights', not the same bytes spread
over every linear. A trace of qwen3-8b s1024 bf16-mixed saves three 96 MiB ``_to_copy`` per layer (the schedule made
seven pieces, 75 MiB for each MLP weight); against the trace's simulated reserved +1.71% before, +1.48% after."""

from __future__ import annotations

from memplan.estimate.reserved_autocast import layer_weight_copies
from tests.estimate.test_reserved_mechanics import _ctx

SELECTIVE = {"framework": "hf", "seq": 1024, "precision": "bf16-mixed", "attention": "sdpa", "recompute": "selective"}


def test_a_selective_layers_saved_copies_are_its_mlps() -> None:
    ctx = _ctx("qwen3-8b", SELECTIVE)
    copies = layer_weight_copies(ctx, list(ctx.layout.layer_indices))
    mlp = 12288 * 4096 * 2  # each of gate_proj, up_proj, down_proj in bf16
    assert copies and all(layer == [mlp, mlp, mlp] for layer in copies)


def test_without_a_policy_every_linear_is_saved() -> None:
    ctx = _ctx("qwen3-8b", {**SELECTIVE, "recompute": "none"})
    copies = layer_weight_copies(ctx, list(ctx.layout.layer_indices))
    assert len(copies[0]) == 7  # q, k, v, o and the MLP's three
