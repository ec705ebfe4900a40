"""memplan.fit.colocate: processes add their context and reserved memory; MIG slices."""

from __future__ import annotations

import pytest

from memplan import Job, Parallelism, Sharding, estimate, load_model
from memplan.errors import ConfigError
from memplan.fit.colocate import SharedJob, colocate, resolve_device
from memplan.gpus import get_gpu

GPT2 = SharedJob(name="gpt2", model=load_model("gpt2"), job=Job())


def test_demand_is_contexts_plus_reserved() -> None:
    result = colocate([GPT2, GPT2, GPT2], gpu="h100-80gb")
    one = estimate(GPT2.model, GPT2.job).peak_reserved_bytes
    h100 = get_gpu("h100-80gb")
    assert result.demand_bytes == 3 * (one + h100.outside_allocator_bytes)
    assert result.capacity_bytes == h100.total_bytes
    assert result.fits and result.headroom_bytes == result.limit_bytes - result.demand_bytes


def test_overflow_is_negative_headroom() -> None:
    big = SharedJob(name="8b", model=load_model("llama-3.1-8b"),
                    job=Job(parallel=Parallelism(world_size=8), sharding=Sharding(distributed_optimizer=True)))
    result = colocate([big, GPT2], gpu="h100-80gb:3g.40gb")
    assert not result.fits and result.headroom_bytes < 0
    assert result.device == "h100-80gb:3g.40gb"


def test_mig_slices() -> None:
    h100 = get_gpu("h100-80gb")
    assert resolve_device("h100-80gb:3g.40gb").total_bytes == h100.total_bytes // 2
    assert resolve_device("h100-80gb:1g.10gb").total_bytes == h100.total_bytes // 8
    assert resolve_device("a100:7g.80gb").total_bytes == get_gpu("a100-80gb").total_bytes
    assert resolve_device("h200:1g.18gb").mig_profile == "1g.18gb"


@pytest.mark.parametrize("name, field", [("h100-80gb:5g.50gb", "--gpu"), ("l40s:1g.10gb", "--gpu"), ("h100-81gb", "--gpu")])
def test_unknown_gpu_or_mig_profile(name: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_device(name)
    assert info.value.field == field
