"""seed_from_fake: predictors seeded on fake tensors, then training with no sheltered step."""

from __future__ import annotations

import copy

import pytest
import torch
from ckpt_helpers import step_peak_bytes, tiny_gpt2, tokens, train_step

from memplan.ckpt import auto_checkpoint
from memplan.ckpt.seed import fake_parameters
from memplan.errors import UnsupportedError

MiB = 2**20
SEED_LENGTHS = (8, 16, 32, 64)


def _fake_steps(model: torch.nn.Module, lengths: tuple[int, ...] = SEED_LENGTHS) -> list:  # type: ignore[type-arg]
    """Sample steps whose batches are created inside the step (fake under the fake mode)."""

    def step(n: int) -> None:
        ids = torch.randint(0, 256, (2, n))
        model(input_ids=ids, labels=ids).loss.backward()

    return [lambda n=n: step(n) for n in lengths]



def test_seeding_readies_the_predictors_and_leaves_the_model_as_it_was(model: torch.nn.Module) -> None:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    wrapped = auto_checkpoint(model, 64 * MiB)
    ctl = wrapped.memplan_ckpt
    rng = torch.get_rng_state()
    ctl.seed_from_fake(_fake_steps(wrapped))
    assert ctl.ready and ctl.measured_size() == 2 * max(SEED_LENGTHS)
    stats = ctl.stats()
    assert stats.seeded_passes == 2 * len(SEED_LENGTHS)
    assert (stats.steps, stats.sheltered_steps, stats.probe_forwards, stats.recomputed_forwards) == (0, 0, 0, 0)
    assert torch.equal(rng, torch.get_rng_state())
    assert list(wrapped.parameters()) == params and all(p.grad is None for p in params)
    assert all(torch.equal(before[k], v) for k, v in wrapped.state_dict().items())
    assert not any(s.points for name, s in ctl.series().items() if name.endswith("forward_s"))  # no fake times


def test_seeded_bytes_agree_with_real_learning_steps(model: torch.nn.Module) -> None:
    real = auto_checkpoint(copy.deepcopy(model), 64 * MiB)
    seeded = auto_checkpoint(model, 64 * MiB)
    seeded.memplan_ckpt.seed_from_fake(_fake_steps(seeded))
    for n in SEED_LENGTHS:  # real sheltered steps at the same sizes
        real.memplan_ckpt.step(train_step(real, tokens(n)))
        real.zero_grad(set_to_none=True)
    fake_series, real_series = seeded.memplan_ckpt.series(), real.memplan_ckpt.series()
    for j in range(seeded.memplan_ckpt.n_blocks):
        for size in (16, 64, 128):
            fake_bytes, real_bytes = fake_series[f"block{j}.act_bytes"](size), real_series[f"block{j}.act_bytes"](size)
            assert real_bytes <= fake_bytes <= 1.05 * real_bytes


def test_a_seeded_model_trains_within_budget_without_sheltered_steps(model: torch.nn.Module) -> None:
    reference = copy.deepcopy(model)
    budget = step_peak_bytes(copy.deepcopy(model), tokens(40))  # the longer batches must checkpoint some blocks
    wrapped = auto_checkpoint(model, budget, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ctl = wrapped.memplan_ckpt
    ctl.seed_from_fake(_fake_steps(wrapped, (8, 16, 32, 64)))  # 64 does not fit unplanned: fake, nothing allocated
    checkpointed = []
    for n in (10, 64, 30, 56, 20):
        assert torch.equal(ctl.step(train_step(wrapped, tokens(n))), train_step(reference, tokens(n))())
        wrapped.zero_grad(set_to_none=True), reference.zero_grad(set_to_none=True)
        assert ctl.last is not None and ctl.last[2] <= budget
        checkpointed.append(ctl.last[1].n_checkpointed)
    stats = ctl.stats()
    assert (stats.sheltered_steps, stats.probe_forwards, stats.misses) == (0, 0, 0)
    assert checkpointed[0] == 0 and checkpointed[1] > 0


def test_the_real_parameters_come_back_when_a_seed_step_fails(model: torch.nn.Module) -> None:
    wrapped = auto_checkpoint(model, 64 * MiB)
    params = list(wrapped.parameters())

    def broken() -> None:
        raise RuntimeError("a bug in the step")

    with pytest.raises(RuntimeError, match="a bug in the step"):
        wrapped.memplan_ckpt.seed_from_fake([broken])
    assert list(wrapped.parameters()) == params
    wrapped.memplan_ckpt.step(train_step(wrapped, tokens(8)))  # the controller still trains


def test_fake_parameters_keep_tied_weights_tied() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    with fake_parameters(model, FakeTensorMode()):
        assert model.lm_head.weight is model.transformer.wte.weight
        assert type(model.lm_head.weight).__name__ == "FakeTensor"
    assert type(model.lm_head.weight) is torch.nn.Parameter


def test_seeding_is_refused_without_the_cpu_meter(model: torch.nn.Module) -> None:
    wrapped = auto_checkpoint(model, 64 * MiB, device="cuda")  # a CUDA meter: fake tensors are invisible to it
    with pytest.raises(UnsupportedError, match="needs the CPU meter"):
        wrapped.memplan_ckpt.seed_from_fake(_fake_steps(wrapped))
