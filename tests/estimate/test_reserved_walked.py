"""A fused-core layer walked under Megatron's sub-module checkpoints is laid out op by op in the reserved
schedule (estimate/reserved_walked.py), its events the walk's own."""

from __future__ import annotations

import json
from pathlib import Path

from memplan import estimate, load_model
from memplan.alloc.schedule import STREAM_BITS
from memplan.estimate import layer_walk, reserved_replay
from memplan.estimate.engine import _stage_parts, _stages
from memplan.trace.setup import trace_setup

_WITNESS = Path(__file__).parents[2] / "benchmarks" / "results" / "agreement_reserved.json"
_KEY = "llama-3.2-1b s2048 b1 bf16-mixed sdpa rc=megatron-selective recompute_modules=core_attn"
_CONFIG = Path(__file__).parents[2] / "benchmarks" / "configs" / "llama-3.2-1b.json"


def _job():
    return trace_setup(None, seq=2048, mbs=1, precision="bf16-mixed", attention="sdpa",
                       recompute="megatron-selective", recompute_modules="core_attn", optimizer="adamw",
                       optimizer_impl="foreach", fsdp=1, tp=1, framework="hf", device="cuda", iterations=2).job


def _model():
    return load_model(str(_CONFIG) if _CONFIG.exists() else "llama-3.2-1b")


def test_the_sdpa_core_attn_cell_is_within_three_percent_of_the_trace() -> None:
    """The trace's simulated reserved (recorded before this change): one 50 MB block per layer was +4.72%."""
    cell = next(c for c in json.loads(_WITNESS.read_text())["cells"] if c["key"] == _KEY)
    traced = cell["reserved"]["traced_simulated_bytes"]
    _stages.cache_clear()
    _stage_parts.cache_clear()
    simulated = estimate(_model(), _job(), reserved="simulated").peak_reserved_bytes
    assert abs(simulated - traced) / traced <= 0.03


def test_the_walked_backward_is_laid_out_op_by_op(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """No allocation of the walk's worst bytes as one block (the old layout) in the schedule; its peak requested
    is still the estimate's peak allocated."""
    replays: list[reserved_replay.Replay] = []
    transients: set[int] = set()
    real, real_walk = reserved_replay.Replay.finish, layer_walk.recomputed_backward

    def finish(self: reserved_replay.Replay, *args: object, **kwargs: object) -> int:
        replays.append(self)
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    def walked(ctx, index, copies):  # type: ignore[no-untyped-def]
        # the walk's worst bytes, as the allocated peak's ledger prices them (one block in the old layout)
        figures = real_walk(ctx, index, copies)
        transients.add(figures.transient)
        return figures

    monkeypatch.setattr(reserved_replay.Replay, "finish", finish)
    monkeypatch.setattr(layer_walk, "recomputed_backward", walked)
    _stages.cache_clear()
    _stage_parts.cache_clear()
    result = estimate(_model(), _job(), reserved="simulated")
    assert replays and len(transients) == 1 and min(transients) > 0
    sizes = {op >> STREAM_BITS for replay in replays for op in replay.ops if op >= 0}
    assert not sizes & transients
    assert replays[0].peak_requested <= result.peak_allocated_bytes
