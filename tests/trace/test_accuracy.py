"""The traced peak against an independent measurement: torch.profiler's memory timeline of the
same step on real CPU tensors (target: within 2%)."""

from __future__ import annotations

import pytest

from memplan.trace import trace
from memplan.trace.setup import trace_setup
from profiler_reference import measure_hf_reference

TOLERANCE = 0.02


@pytest.mark.parametrize("fixture", ["tiny_gpt2", "tiny_llama"])
def test_cpu_trace_peak_matches_profiler_memory_timeline(fixture: str, request: pytest.FixtureRequest) -> None:
    config = request.getfixturevalue(fixture)
    options = trace_setup(seq=64, mbs=2, precision="fp32", optimizer="adamw", device="cpu")
    measured = measure_hf_reference(config, options)
    traced = trace(config, seq=64, mbs=2, precision="fp32", optimizer="adamw", device="cpu")
    assert measured > 0
    assert abs(traced.summary.peak_allocated_bytes - measured) / measured < TOLERANCE


def test_cpu_trace_peak_matches_profiler_with_mixed_precision_and_recompute(tiny_llama: str) -> None:
    options = trace_setup(seq=32, mbs=2, precision="bf16-mixed", recompute="full", device="cpu", iterations=1)
    measured = measure_hf_reference(tiny_llama, options)
    traced = trace(tiny_llama, seq=32, mbs=2, precision="bf16-mixed", recompute="full", device="cpu", iterations=1)
    assert abs(traced.summary.peak_allocated_bytes - measured) / measured < TOLERANCE
