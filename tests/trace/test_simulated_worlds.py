"""Simulated worlds in sequence: nothing of an earlier fake process group reaches a later one.

A device mesh compares equal to any mesh of the same shape, names and ranks, and
``destroy_process_group`` restarts the group names at 0, so a sharding DTensor cached in one
world would carry that world's mesh, and its group names, into the next. torchtitan's trace builds
meshes of its own beside memplan's (group names up to 27 on 4 ranks); a Hugging Face 2 x 2 trace
after it gathered its head's logits over group "15", which its world never created.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def _gathered_head(mesh: object, rows: int) -> torch.Tensor:
    """A column-parallel linear whose output is gathered whole: a DTensor all-gather on ``mesh``."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    head = parallelize_module(torch.nn.Linear(24, 40, bias=False), mesh, ColwiseParallel(output_layouts=Replicate()))
    return head(torch.empty(rows, 24))


def test_a_later_world_gathers_over_its_own_groups_not_an_earlier_worlds() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from memplan.trace.core.distributed import simulated_ranks
    from memplan.trace.setup import trace_setup

    setup = trace_setup(fsdp=2, tp=2)
    with simulated_ranks(setup) as first:
        # a mesh of the same shape built beside memplan's, as torchtitan's runner does: its groups
        # have names this process's next world will not create
        other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        assert other["tp"] == first["tp"]
        stale = other["tp"].get_group().group_name
        _gathered_head(other["tp"], rows=3)
    with simulated_ranks(setup) as second:
        assert stale not in {second[name].get_group().group_name for name in ("dp", "tp")}
        out = _gathered_head(second["tp"], rows=3)
    assert out.shape == (3, 40)
    assert not dist.is_initialized()
