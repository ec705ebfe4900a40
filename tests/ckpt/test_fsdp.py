"""Under real FSDP2 (``fully_shard``, gloo, 2 CPU processes) each rank plans for its own batches within
its own budget, counting its parameter shards (not the global tensors), and the math is unchanged.

Rank 0 trains on short batches and rank 1 on long ones, in a plain loop with AdamW found by its
step hooks. Each rank first runs the unwrapped sharded model (the reference losses and weights, and
the peak with no checkpointing) and the model with every block checkpointed (the peak of full
checkpointing); its budget is halfway between the two peaks of its longest batch. The wrapped
model warms up on three short batches of the rank's own, then trains. Every step is judged by the benchmark's independent meter, which counts a ``DTensor`` by this rank's shard.

FSDP2 frees and re-allocates the all-gathered weights by resizing storages in place, which no
dispatch mode sees directly: both meters re-read the buffers that collectives and FSDP2's copy
operators write into (memplan's at each phase mark, the judge's after every operator).
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))

from test_ddp import _wait_for_results

LENGTHS = {0: (12, 20, 16, 28, 14, 24, 18), 1: (40, 72, 56, 96, 48, 80, 64)}
#: memplan's warm-up batches per rank (three sizes, as the phase predictors need; at least half the longest)
WARMUP = {0: (8, 12, 16), 1: (24, 36, 48)}
SLACK = 1.02  # the 2 % over the budget


def _train(model: torch.nn.Module, rank: int, on_step: object = None) -> tuple[list[float], list[int], torch.Tensor]:
    """A plain loop over the rank's batches, each step judged: (losses, step peaks, full weights)."""
    from ckpt_helpers import tokens

    from memplan.ckpt.bench_meter import StepMeter

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, peaks = [], []
    for step, length in enumerate(LENGTHS[rank]):
        batch = tokens(length, seed=10 * rank + step)
        judge = StepMeter()
        with judge:
            judge.start(model, opt, batch)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        peaks.append(judge.stop())
        if callable(on_step):
            on_step()
    weights = torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()])  # a collective
    return losses, peaks, weights


def _worker(rank: int, store: str, out: str) -> None:
    from ckpt_helpers import N_LAYER, tiny_gpt2, tokens
    from torch.distributed.fsdp import fully_shard

    from memplan.ckpt import auto_checkpoint, controller_of, remove_checkpointing
    from memplan.ckpt.model_state import model_state_bytes

    # a collective that waits longer than this fails the test instead of hanging the suite
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)

    def sharded(model: torch.nn.Module) -> torch.nn.Module:
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        return model

    unsharded_weight_bytes = model_state_bytes(tiny_gpt2()).weight_bytes
    ref_losses, none_peaks, ref_weights = _train(sharded(tiny_gpt2()), rank)
    full = auto_checkpoint(tiny_gpt2(), 2**40)
    controller_of(full).fix_plan((True,) * N_LAYER)
    _, full_peaks, _ = _train(sharded(full), rank)
    remove_checkpointing(full)
    longest = LENGTHS[rank].index(max(LENGTHS[rank]))
    budget = (full_peaks[longest] + none_peaks[longest]) // 2

    model = sharded(auto_checkpoint(tiny_gpt2(), budget))
    ctl = controller_of(model)
    warmup = [tokens(n, seed=99) for n in WARMUP[rank]]
    with torch.no_grad():  # FSDP2's lazy initialisation, outside any measured step
        model(input_ids=warmup[0])
    ctl.warm_up([lambda b=b: model(input_ids=b, labels=b).loss.backward() for b in warmup])  # same count on each rank
    plans: list[tuple[bool, ...]] = []
    losses, peaks, weights = _train(model, rank, lambda: plans.append(ctl.last[1].checkpoint))
    stats = ctl.stats()
    torch.save({
        "rank": rank, "budget": budget, "none_peak": none_peaks[longest], "full_peak": full_peaks[longest],
        "losses": (ref_losses, losses), "same_weights": bool(torch.equal(ref_weights, weights)),
        "peaks": peaks, "plans": plans, "steps": stats.steps, "optimizer_steps": stats.optimizer_steps,
        "over_budget": stats.over_budget_steps, "max_peak": stats.max_peak_bytes, "optimizer_states": stats.optimizer_states,
        "found_optimizer": ctl.optimizer is not None,
        "weight_bytes": (model_state_bytes(model).weight_bytes, unsharded_weight_bytes),
    }, f"{out}.{rank}.tmp")
    os.replace(f"{out}.{rank}.tmp", f"{out}.{rank}")  # whole or absent, for the parent's wait
    remove_checkpointing(model)
    dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_fsdp2_on_two_ranks_plans_each_rank_within_its_budget_and_keeps_the_math(tmp_path) -> None:
    out = str(tmp_path / "rank")
    context = mp.start_processes(_worker, args=(str(tmp_path / "store"), out), nprocs=2, join=False,
                                 start_method="spawn")
    # 22 s alone on 2 idle cores; 87 s beside the other xdist worker at load average 4.5 (2026-12-07): 300 s, as
    # the DDP test, still ends a hung run
    _wait_for_results(context, [f"{out}.{r}" for r in range(2)], seconds=300.0)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    for r in ranks:
        reference, wrapped = r["losses"]
        assert wrapped == reference and r["same_weights"]  # checkpointing changes no gradient
        assert r["full_peak"] < r["budget"] < r["none_peak"]  # the longest batch cannot keep every block
        # every step within the budget by the independent judge (2 % slack) and by memplan's own meter
        assert max(r["peaks"]) <= r["budget"] * SLACK, (r["rank"], r["peaks"], r["budget"])
        assert r["max_peak"] <= r["budget"] and r["over_budget"] == 0
        longest = LENGTHS[r["rank"]].index(max(LENGTHS[r["rank"]]))
        assert r["peaks"][longest] < r["none_peak"]
        n = len(LENGTHS[r["rank"]])
        assert r["steps"] == r["optimizer_steps"] == len(r["plans"]) == n and r["over_budget"] == 0
        assert r["found_optimizer"] and r["optimizer_states"] == "measured"
        # the rank's own shard is counted: about half the weights (the position table is not split evenly)
        sharded, whole = r["weight_bytes"]
        assert sharded < 0.6 * whole
    # planned per batch: the ranks' plans differ, and the long batches keep some blocks but not all
    assert ranks[0]["plans"] != ranks[1]["plans"]
    assert any(0 < sum(plan) < len(plan) for plan in ranks[1]["plans"])
