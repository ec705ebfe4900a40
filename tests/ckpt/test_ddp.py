"""Under real DDP (gloo, 2 CPU processes) each rank runs its own controller on its own batches and
the math is unchanged.

Rank 0 gets short batches and rank 1 long ones; after each step the replicas' weights must be
identical (DDP averaged the same gradients) and equal to an unwrapped DDP run of the same batches.
The budget leaves room for every batch, so no step can miss: a miss redone in the middle of a
backward would leave the peer waiting in the all-reduce (see docs/ckpt.md, DDP and FSDP2).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))

LENGTHS = {0: (16, 24, 12), 1: (120, 200, 160)}


def _worker(rank: int, store: str, out: str) -> None:
    from ckpt_helpers import tiny_gpt2, tokens, train_step
    from torch.nn.parallel import DistributedDataParallel as DDP

    from memplan.ckpt import auto_checkpoint, controller_of

    # rendezvous through a file in the test's tmp_path, not a TCP port: parallel test workers (pytest -n) cannot
    # collide; a collective that waits longer than the timeout fails the test instead of hanging the suite
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    results = {}
    for wrapped in (False, True):
        model = tiny_gpt2(seed=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if wrapped:
            model = auto_checkpoint(model, "40MiB", optimizer=opt)
        ddp = DDP(model)
        losses = []
        for step, length in enumerate(LENGTHS[rank]):
            batch = tokens(length, seed=10 * rank + step)
            opt.zero_grad(set_to_none=True)
            if wrapped:
                losses.append(float(controller_of(model).step(train_step(ddp, batch))))
            else:
                losses.append(float(train_step(ddp, batch)()))
            opt.step()
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        gathered = [torch.empty_like(weights) for _ in range(2)]
        dist.all_gather(gathered, weights)
        stats = controller_of(model).stats() if wrapped else None
        results[wrapped] = {
            "losses": losses,
            "replicas_equal": bool(torch.equal(gathered[0], gathered[1])),
            "weights": weights,
            "steps": 0 if stats is None else stats.steps,
            "misses": 0 if stats is None else stats.misses,
        }
    torch.save({"rank": rank, "same_weights_as_plain": bool(torch.equal(results[True]["weights"], results[False]["weights"])),
                "losses": (results[False]["losses"], results[True]["losses"]),
                "replicas_equal": results[True]["replicas_equal"], "steps": results[True]["steps"],
                "misses": results[True]["misses"]},
               f"{out}.{rank}.tmp")
    os.replace(f"{out}.{rank}.tmp", f"{out}.{rank}")  # whole or absent, for the parent's wait below
    dist.destroy_process_group()


def _wait_for_results(context: mp.ProcessContext, paths: list[str], seconds: float = 300.0) -> None:
    """Wait until both ranks wrote their results (a rank's error is raised here). A rank that has
    written them but does not exit (seen on this machine: a worker idle after its last line, its
    process never ending) is then killed, so that a stuck process exit cannot hang the suite."""
    deadline = time.monotonic() + seconds
    while not all(Path(p).exists() for p in paths):
        if context.join(timeout=1.0):  # every rank exited (an error would have been raised)
            break
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the DDP ranks wrote no results within {seconds:.0f} s")
    for process in context.processes:
        process.join(timeout=60.0)
        if process.is_alive():
            process.kill()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_under_ddp_each_rank_runs_its_own_controller_and_the_math_is_unchanged(tmp_path) -> None:
    out = str(tmp_path / "rank")
    context = mp.start_processes(_worker, args=(str(tmp_path / "store"), out), nprocs=2, join=False, start_method="spawn")
    _wait_for_results(context, [f"{out}.{r}" for r in range(2)])
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    for r in ranks:
        plain, wrapped = r["losses"]
        assert plain == wrapped  # checkpointing does not change the math
        assert r["replicas_equal"] and r["same_weights_as_plain"]
        assert r["steps"] == len(LENGTHS[r["rank"]]) and r["misses"] == 0
