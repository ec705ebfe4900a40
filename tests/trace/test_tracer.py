"""The tracer on tiny real transformers models: categories, states vs the estimator, file round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.events import read_trace, validate_events, write_trace
from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate


@pytest.fixture(scope="module")
def gpt2_cuda(tiny_gpt2: str):  # type: ignore[no-untyped-def]
    # foreach: CUDA keeps Adam's step counters on the host (fused keeps them on the device).
    return trace(tiny_gpt2, seq=64, mbs=2, precision="fp32", optimizer="adamw", device="cuda", optimizer_impl="foreach")


def test_events_are_consistent_and_cover_the_phases(gpt2_cuda) -> None:  # type: ignore[no-untyped-def]
    events = gpt2_cuda.trace.events
    validate_events(events)
    assert [e.index for e in events] == list(range(len(events)))
    assert {e.phase for e in events} >= {"setup", "forward", "backward", "optimizer"}
    assert {e.iteration for e in events} == {-1, 0, 1}
    assert gpt2_cuda.summary.events == len(events)
    assert any(e.op == "aten.mm.default" for e in events)
    assert any(e.module.startswith("transformer.h.1.") for e in events)


def test_categories_hold_the_expected_bytes(gpt2_cuda, tiny_gpt2: str) -> None:  # type: ignore[no-untyped-def]
    model = gpt2_cuda.trace.meta.extra["model"]
    assert model == "tiny-gpt2" or model.startswith("tiny-gpt2")
    most = gpt2_cuda.summary.max_by_category
    params = most["parameter"]
    # Tied GPT-2 head: wte (1024x128) + wpe (256x128) + 2 blocks + final LayerNorm, fp32.
    blocks = 2 * (2 * 2 * 128 + 128 * 384 + 384 + 128 * 128 + 128 + 128 * 512 + 512 + 512 * 128 + 128)
    assert params == 4 * (1024 * 128 + 256 * 128 + blocks + 2 * 128)
    assert most["gradient"] == params
    assert most["optimizer_state"] == 2 * params  # AdamW m and v; CUDA keeps `step` on the host
    assert most["input"] == 2 * 2 * 64 * 8  # input_ids and labels, int64
    assert most["activation"] > 0 and most["logits"] >= 2 * 64 * 1024 * 4


def test_states_are_identical_to_the_estimator(tiny_llama: str) -> None:
    result = trace(tiny_llama, seq=64, mbs=2, precision="bf16-mixed", optimizer="adamw", device="cuda",
                   optimizer_impl="foreach")
    comparison = compare_with_estimate(tiny_llama, result.options, result.summary)
    for category in ("parameter", "gradient", "optimizer_state"):
        row = comparison.row(category)
        assert row.traced_bytes == row.estimated_bytes > 0, category


def test_cpu_trace_counts_adam_step_counters_and_no_rounding(tiny_gpt2: str, gpt2_cuda) -> None:  # type: ignore[no-untyped-def]
    cpu = trace(tiny_gpt2, seq=64, mbs=2, precision="fp32", optimizer="adamw", device="cpu", optimizer_impl="foreach")
    tensors = sum(1 for e in cpu.trace.events if e.kind == "alloc" and e.category == "parameter")
    assert cpu.summary.max_by_category["optimizer_state"] == gpt2_cuda.summary.max_by_category["optimizer_state"] + 4 * tensors
    assert cpu.summary.peak_allocated_bytes == cpu.summary.peak_requested_bytes


def test_cuda_rounding_applies_to_the_peak(gpt2_cuda) -> None:  # type: ignore[no-untyped-def]
    summary = gpt2_cuda.summary
    assert summary.peak_allocated_bytes >= summary.peak_requested_bytes
    assert all(value % 512 == 0 for value in summary.by_category.values())
    assert sum(summary.by_category.values()) == summary.peak_allocated_bytes


def test_recompute_full_keeps_fewer_activations(tiny_llama: str) -> None:
    plain = trace(tiny_llama, seq=64, mbs=2, precision="fp32", device="cpu", iterations=1)
    full = trace(tiny_llama, seq=64, mbs=2, precision="fp32", device="cpu", iterations=1, recompute="full")
    selective = trace(tiny_llama, seq=64, mbs=2, precision="fp32", device="cpu", iterations=1, recompute="selective")
    acts = [r.summary.max_by_category["activation"] for r in (plain, selective, full)]
    assert acts[0] > acts[1] > acts[2] > 0


def test_round_trip_through_the_trace_file(gpt2_cuda, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "step.mptrace"
    write_trace(gpt2_cuda.trace, path)
    back = read_trace(path)
    assert back.events == gpt2_cuda.trace.events
    assert back.meta == gpt2_cuda.trace.meta
    assert back.meta.extra["options"]["job"]["batch"]["seq_length"] == 64


def test_cuda_trace_applies_cuda_autocast_fp32_policy(tiny_gpt2: str) -> None:
    """CUDA autocast runs pow in fp32, so GPT-2's Python gelu_new keeps fp32 tanh outputs on a GPU."""
    def tanh_sizes(device: str) -> set[int]:
        result = trace(tiny_gpt2, seq=32, mbs=1, precision="bf16-mixed", device=device, iterations=1)
        return {e.size for e in result.trace.events if e.kind == "alloc" and e.op == "aten.tanh.default"}

    elements = 32 * 512  # tokens x 4*hidden
    assert tanh_sizes("cpu") == {2 * elements}
    assert tanh_sizes("cuda") == {4 * elements}


def test_full_recompute_under_cuda_autocast_policies(tiny_gpt2: str) -> None:
    """The checkpoint's recompute in the backward sees CUDA's fp32 autocast policies like the forward
    (GPT-2's pow runs in fp32 in both), so bf16-mixed full recompute traces."""
    result = trace(tiny_gpt2, seq=32, mbs=1, precision="bf16-mixed", recompute="full", device="cuda", iterations=1)
    assert result.summary.max_by_category["activation"] > 0
