"""A Hugging Face selective layer's backward in the reserved schedule (session 15, rsv15): the attention module
checkpointed, an SDPA core, so no op-by-op plan; the ledger's transient is made as pieces of the residual stream's
gradient's size (the trace's commonest backward tensor), not one block
(:func:`~memplan.estimate.reserved_backward.transient_pieces`)."""

from __future__ import annotations

import json
from pathlib import Path

from memplan import estimate, load_model
from memplan.estimate.reserved_backward import transient_pieces
from memplan.trace.setup import trace_setup
from tests.estimate.test_reserved_mechanics import _ctx

_WITNESS = Path(__file__).parents[2] / "benchmarks" / "results" / "agreement_reserved_arch.json"
_S1 = "qwen3-8b s1024 b1 bf16-mixed sdpa rc=selective"


def test_the_selective_layers_transient_is_residual_width_pieces() -> None:
    ctx = _ctx("qwen3-8b", {"framework": "hf", "seq": 1024, "precision": "bf16-mixed", "recompute": "selective"})
    residual = 1024 * 4096 * 4  # the fp32 residual stream's gradient, s1024 x hidden 4096
    pieces = transient_pieces(ctx.run, 14 * residual + 5)
    assert sum(pieces) == 14 * residual + 5 and pieces[:-1] == [residual] * 13
    assert transient_pieces(ctx.run, residual + 5) == [residual + 5]  # under two pieces' worth: one block


def test_qwen3_8b_selective_against_the_recorded_trace() -> None:
    """reserved_sim's S1 cell against the trace's simulated reserved: +0.05% (was +1.48%: the second step's optimizer
    made a new 2,374 MiB segment the trace does not need)."""
    cell = next(c for c in json.loads(_WITNESS.read_text())["cells"] if c["key"] == _S1)
    traced = cell["reserved"]["traced_simulated_bytes"]
    job = trace_setup(None, seq=cell["seq"], mbs=cell["mbs"], precision=cell["precision"], attention=cell["attention"],
                      recompute=cell["recompute"], optimizer="adamw", optimizer_impl=cell["optimizer_impl"],
                      framework=cell["framework"], device="cuda", iterations=2, **cell["flags"]).job
    est = estimate(load_model("qwen3-8b"), job, reserved="simulated")
    assert abs(est.peak_reserved_bytes - traced) / traced < 0.005
