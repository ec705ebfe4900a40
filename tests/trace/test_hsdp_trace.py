"""``memplan trace --fsdp hybrid`` runs FSDP2 HSDP: ``fully_shard`` on a 2-D (``dp_replicate``, ``dp_shard``) mesh of
the fake process group, each unit's reduce-scattered gradients all-reduced across the replicas. The estimate of the
same jobs: tests/estimate/test_hsdp.py (``CELLS``, the traced peaks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from memplan.errors import ConfigError
from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate
from tests.estimate.test_fsdp_adapter_dtype import LLAMA_TOY
from tests.estimate.test_hsdp import BASE, CELLS


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = Path(tmp_path_factory.mktemp("hsdp17")) / "llama.json"
    path.write_text(json.dumps(LLAMA_TOY), encoding="utf-8")
    return str(path)


def _trace(config: str, flags: dict[str, Any]) -> Any:
    flags = {**BASE, **flags}
    return trace(config, device="cuda", iterations=2, **flags)


@pytest.mark.parametrize("name", list(CELLS))
def test_hybrid_traced(config: str, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Before: refused ("hybrid sharding is not simulated by memplan trace")."""
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    meshes, reduced = [], []
    real_shard, real_all_reduce = fsdp.fully_shard, dist.all_reduce

    def shard(module, **kwargs):  # type: ignore[no-untyped-def]
        meshes.append((kwargs["mesh"].mesh_dim_names, tuple(kwargs["mesh"].shape)))
        return real_shard(module, **kwargs)

    def all_reduce(tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        reduced.append((tensor.dtype, kwargs["group"].size()))
        return real_all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(fsdp, "fully_shard", shard)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    flags, traced = CELLS[name]
    result = _trace(config, flags)
    assert set(meshes) == {(("dp_replicate", "dp_shard"), (2, 2))}
    reduce_dtype = torch.bfloat16 if flags["framework"] == "hf" else torch.float32
    assert reduced and set(reduced) == {(reduce_dtype, 2)}
    assert result.summary.peak_allocated_bytes == traced
    rows = {r.category: r for r in compare_with_estimate(config, result.options, result.summary).rows}
    for category in ("parameter", "gradient", "optimizer_state"):
        assert rows[category].estimated_bytes == rows[category].traced_bytes, category
    assert result.to_dict()["options"]["resolved"]["fsdp_replicas"] == 2


def test_hybrid_with_tensor_parallelism(config: str) -> None:
    """A 3-D mesh (replicas, shards, tp): the same states per GPU as full sharding over the shard group."""
    flags = {**CELLS["Y3"][0], "precision": "bf16", "recompute": "full", "tp": 2}
    hybrid = _trace(config, {**flags, "gpus": 8})
    full = _trace(config, {**flags, "gpus": 4})
    assert hybrid.options.job.sharding.fsdp == "hybrid" and full.options.job.sharding.fsdp == "full"
    for category in ("parameter", "gradient", "optimizer_state"):
        assert hybrid.summary.max_requested_by_category[category] == full.summary.max_requested_by_category[category]


def test_shard_group_must_divide_the_ranks(config: str) -> None:
    with pytest.raises(ConfigError, match="--fsdp-shard-size"):
        _trace(config, {**CELLS["Y1"][0], "gpus": 6, "fsdp": "hybrid", "fsdp_shard_size": 4})


def _live_at_last_gather(result: Any) -> int:
    """Allocated bytes when the backward of the last iteration makes its last all-gather output (the embedding's
    unit, gathered after every decoder layer's post-backward)."""
    live, at = 0, 0
    last = result.options.iterations - 1
    for event in result.trace.events:
        live += event.size if event.kind == "alloc" else -event.size if event.kind == "free" else 0
        if (event.kind, event.phase, event.iteration, event.category, event.op) == (
                "alloc", "backward", last, "communication", "resize_"):
            at = live
    return at


def test_lora_traced_under_hybrid(config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The witness's V1 and V2 (hf, LoRA r 8 on q and v, 2 replicas x 2 shards). Before: refused ("memplan trace
    runs fine-tuning ... under --fsdp full"). Each layer's unit all-reduces its adapters' sharded gradients only
    (3,328 bf16 elements: FSDP2 reduces the parameters with a gradient), the frozen embedding's and head's units
    nothing; the buffers stay held to the end of the backward: with full recompute, where the embedding's unit is
    gathered last, 2 x 3,328 x 2 B more than full sharding over the group (tests/estimate/test_hsdp.py)."""
    import torch.distributed as dist

    from tests.estimate.test_hsdp import LORA

    reduced = []
    real_all_reduce = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        reduced.append((tensor.dtype, tensor.numel(), kwargs["group"].size()))
        return real_all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    result = _trace(config, LORA)
    assert reduced == [(torch.bfloat16, 3_328, 2)] * 4  # two layers, two iterations
    rows = {r.category: r for r in compare_with_estimate(config, result.options, result.summary).rows}
    for category in ("parameter", "gradient", "optimizer_state"):
        assert rows[category].estimated_bytes == rows[category].traced_bytes, category
    assert abs(rows["peak allocated"].relative or 0.0) < 0.001, rows["peak allocated"]
    hybrid = _trace(config, {**LORA, "recompute": "full"})
    full = _trace(config, {**LORA, "recompute": "full", "gpus": 2})
    assert _live_at_last_gather(hybrid) - _live_at_last_gather(full) == 2 * 3_328 * 2
