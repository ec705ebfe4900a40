"""Simulated ranks on PyTorch's fake process group, MoE routing, data-dependent and unsupported ops."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from memplan.errors import ConfigError, UnsupportedError
from memplan.trace import trace
from memplan.trace.setup import trace_setup
from profiler_reference import measure_hf_reference


@pytest.fixture(scope="module")
def single(tiny_llama: str):  # type: ignore[no-untyped-def]
    # foreach keeps Adam's step counters on the host (left out of a cuda trace), so every state shards.
    return trace(tiny_llama, seq=64, mbs=1, precision="bf16-mixed", device="cuda", optimizer_impl="foreach")


def test_fsdp_shards_states_over_the_ranks(tiny_llama: str, single) -> None:  # type: ignore[no-untyped-def]
    sharded = trace(tiny_llama, seq=64, mbs=1, precision="bf16-mixed", device="cuda", fsdp=4, optimizer_impl="foreach")
    assert sharded.trace.meta.world_size == 4 and sharded.trace.meta.rank == 0
    for category in ("parameter", "gradient", "optimizer_state"):
        assert sharded.summary.max_requested_by_category[category] * 4 == single.summary.max_requested_by_category[category]
    # FSDP all-gathers each block's bf16 parameters: communication buffers appear.
    assert sharded.summary.max_by_category["communication"] > 0
    assert any(e.op.startswith("fsdp.") or e.op.startswith("_c10d") or e.op == "resize_" for e in sharded.trace.events)
    assert not dist.is_initialized()  # the fake process group is torn down


def test_tensor_parallel_shards_the_blocks(tiny_llama: str, single) -> None:  # type: ignore[no-untyped-def]
    tp = trace(tiny_llama, seq=64, mbs=1, precision="bf16-mixed", device="cuda", tp=2)
    embed = 1024 * 128 * 4  # whole on every rank (Hugging Face's TP plan), fp32
    norms = (2 * 2 + 1) * 128 * 4
    full = single.summary.max_requested_by_category["parameter"]
    # The untied head is column-parallel like the projections; only the embedding and norms stay whole.
    assert tp.summary.max_requested_by_category["parameter"] == embed + norms + (full - embed - norms) // 2
    both = trace(tiny_llama, seq=64, mbs=1, precision="bf16", device="cuda", tp=2, fsdp=2)
    assert both.trace.meta.world_size == 4


def test_tensor_parallel_must_divide_the_heads(tiny_llama: str) -> None:
    with pytest.raises(ConfigError, match="--tp"):
        trace(tiny_llama, seq=32, tp=3)


def test_moe_routing_is_static_and_matches_a_real_run(tiny_mixtral: str) -> None:
    options = trace_setup(seq=32, mbs=2, precision="fp32", device="cpu", iterations=1)
    traced = trace(tiny_mixtral, seq=32, mbs=2, precision="fp32", device="cpu", iterations=1)
    measured = measure_hf_reference(tiny_mixtral, options)
    assert abs(traced.summary.peak_allocated_bytes - measured) / measured < 0.02
    assert any("experts" in e.module for e in traced.trace.events)


DATA_DEPENDENT = '''
import torch

class Gate(torch.nn.Module):
    def forward(self, x):
        return x[x > 0].sum()

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.gate = Gate()
    def forward(self, x):
        return self.gate(self.proj(x))

def make_job():
    net = Net()
    return net, torch.randn(4, 16), torch.optim.SGD(net.parameters(), lr=0.1), lambda out, batch: out
'''


def test_data_dependent_shape_names_op_and_module(tmp_path: Path) -> None:
    from memplan.trace.script import load_script_function

    path = tmp_path / "dd.py"
    path.write_text(DATA_DEPENDENT, encoding="utf-8")
    with pytest.raises(UnsupportedError) as info:
        trace(load_script_function(f"{path}:make_job"), device="cpu")
    message = str(info.value)
    assert "aten.nonzero" in message or "aten.masked_select" in message or "aten.index" in message
    assert "'gate'" in message and str(path) in message


def test_optimizer_runs_as_on_the_device(tiny_gpt2: str) -> None:
    """foreach (CUDA default) allocates its temporaries for all tensors at once; for-loop one at a time."""
    foreach = trace(tiny_gpt2, seq=32, mbs=1, precision="fp32", device="cpu", optimizer_impl="foreach")
    loop = trace(tiny_gpt2, seq=32, mbs=1, precision="fp32", device="cpu", optimizer_impl="for-loop")
    assert foreach.summary.by_phase["optimizer"] > loop.summary.by_phase["optimizer"]
    ops = {e.op for e in foreach.trace.events if e.phase == "optimizer"}
    assert any(op.startswith("aten._foreach_") for op in ops)


NO_FAKE_IMPL = '''
import torch

@torch.library.custom_op("memplan_trace_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x.clone()

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
    def forward(self, x):
        return mystery(self.proj(x))

def make_job():
    net = torch.nn.ModuleDict({"block": Block()})
    return net["block"], torch.randn(2, 8), torch.optim.SGD(net.parameters(), lr=0.1), lambda out, b: out.sum()
'''


def test_operator_without_fake_implementation_names_op_and_module(tmp_path: Path) -> None:
    from memplan.trace.script import load_script_function

    path = tmp_path / "custom.py"
    path.write_text(NO_FAKE_IMPL, encoding="utf-8")
    with pytest.raises(UnsupportedError) as info:
        trace(load_script_function(f"{path}:make_job"), device="cpu")
    message = str(info.value)
    assert "memplan_trace_test.mystery" in message and str(path) in message and "fake" in message
