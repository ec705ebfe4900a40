"""The 4-D masks checkpointed layers keep are released in the backward after their last user's backward
(estimate/mask_lifetime.py): a gpt-oss-like job's walk at layer 0 no longer counts the full-attention mask,
which the trace frees after layer 1's backward (agreement grid cell gpt_oss s1024 bf16 eager full)."""

from __future__ import annotations

from pathlib import Path

from memplan import load_model
from memplan.estimate.engine import _stage_parts
from memplan.estimate.mask_lifetime import mask_releases, released_masks
from memplan.estimate.memo import Same
from memplan.estimate.stage_peak import backward_moment
from memplan.estimate.stage_states import model_states
from memplan.trace.setup import trace_setup

_CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"


def _job(precision: str, seq: int, mbs: int):  # type: ignore[no-untyped-def]
    return trace_setup(None, seq=seq, mbs=mbs, precision=precision, attention="eager", recompute="full",
                       optimizer="adamw", optimizer_impl="foreach", fsdp=1, tp=1, framework="hf", device="cuda",
                       iterations=2).job


def _moment(name: str, precision: str, seq: int, mbs: int):  # type: ignore[no-untyped-def]
    path = _CONFIGS / f"{name}.json"
    model = load_model(str(path) if path.exists() else name)
    _, parts = _stage_parts(Same(model), _job(precision, seq, mbs), 0.0)
    part = parts[0][2]
    return model, part, backward_moment(part.ctx, model_states(part.ctx), part.walk, part.acts, part.loss)


def test_each_kind_s_mask_goes_after_its_lowest_layer() -> None:
    model = load_model(str(_CONFIGS / "gpt-oss-20b.json"))
    windows = [layer.attention.sliding_window for layer in model.layers]
    assert len(set(windows)) == 2 and windows[0] != windows[1]
    releases = mask_releases(model, tuple(range(len(windows))), 2 * 1000)
    assert sorted(releases) == [(0, 1000), (1, 1000)]
    # layer 1's backward still has both; at layer 0's, layer 1's kind is gone
    assert released_masks(releases, 1) == 0 and released_masks(releases, 0) == 1000
    # a stage without layer 0 (pipeline): layer 0's kind is not released on it
    assert released_masks(mask_releases(model, (2, 3), 2000), 2) == 1000


def test_the_walk_at_layer_0_holds_one_mask_of_gpt_oss_s_two() -> None:
    """gpt-oss-20b at 8,192 tokens x 2, bf16-mixed eager, full recompute: the walk stops at layer 0, where the
    full layers' fp32 mask (b x s x s x 4 = 512 MiB) is released; the sliding layers' is still held."""
    _, part, (layers, _, position, _) = _moment("gpt-oss-20b", "bf16-mixed", 8192, 2)
    mask = 2 * 8192 * 8192 * 4
    assert part.acts.masks == 2 * mask
    assert position == 0 and part.walk.per_layer[0][0] == 0
    assert layers == part.walk.per_layer[0][1] - mask


def test_one_kind_of_layer_keeps_its_mask_to_the_end() -> None:
    _, part, (layers, _, position, _) = _moment("llama-3.2-1b", "bf16-mixed", 2048, 1)
    assert part.acts.masks > 0
    assert position == 0  # the walk stops at layer 0 under full recompute, the mask still held
    assert layers == part.walk.per_layer[0][1]
