"""auto_checkpoint in the loops users write: a plain loop, gradient accumulation, an unchanged
``transformers.Trainer``, FSDP2 — judged by the benchmark's independent meter over the whole step."""

from __future__ import annotations

import copy

import pytest
import torch
from ckpt_helpers import N_LAYER, tiny_gpt2, tokens

from memplan.ckpt import auto_checkpoint, controller_of, remove_checkpointing
from memplan.ckpt.bench_meter import StepMeter
from memplan.errors import ConfigError, UnsupportedError

SLACK = 1.02  # the 2 % slack over the budget
LENGTHS = (12, 20, 28, 16, 24, 64, 18, 40, 22, 60)


def _step_peak(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> tuple[int, float]:
    """One optimizer step over ``batches`` (micro-batches) under the independent meter: (peak, last loss)."""
    judge = StepMeter()
    with judge:
        judge.start(model, opt, *batches)
        for b in batches:
            loss = model(input_ids=b, labels=b).loss
            (loss / len(batches)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return judge.stop(), float(loss)


def _budget(longest: torch.Tensor) -> int:
    """Halfway between checkpointing every block and none, on the longest batch, AdamW states included."""
    peaks = []
    for flags in ((True,) * N_LAYER, (False,) * N_LAYER):
        model = auto_checkpoint(tiny_gpt2(), 2**40)
        controller_of(model).fix_plan(flags)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _step_peak(model, opt, [tokens(8)])  # the moments exist from the second step on
        peaks.append(_step_peak(model, opt, [longest])[0])
        remove_checkpointing(model)
    return (peaks[0] + peaks[1]) // 2


def test_the_plain_loop_plans_per_batch_within_budget_with_the_unwrapped_losses() -> None:
    budget = _budget(tokens(max(LENGTHS)))
    reference = tiny_gpt2()
    model = auto_checkpoint(tiny_gpt2(), budget)  # no optimizer=: found through its step hooks
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for n in LENGTHS:
        _, loss_ref = _step_peak(reference, opt_ref, [tokens(n)])
        peak, loss = _step_peak(model, opt, [tokens(n)])
        assert loss == loss_ref
        assert peak <= budget * SLACK, f"length {n}: {peak} > {budget}"
    ctl = controller_of(model)
    stats = ctl.stats()
    assert stats.optimizer_states == "measured" and ctl.optimizer is opt
    assert stats.steps == stats.optimizer_steps == len(LENGTHS)
    assert ctl.ready and stats.sheltered_steps < len(LENGTHS)
    assert stats.max_optimizer_peak_bytes > 0 and stats.optimizer_over_budget_steps == 0
    assert stats.recomputed_forwards < N_LAYER * len(LENGTHS)  # planned steps kept some blocks
    assert ctl.last is not None and ctl.last[1].n_checkpointed > 0  # the last, long batch needed some


def test_gradient_accumulation_plans_each_micro_step_and_the_step_fits() -> None:
    lengths = [(12, 20), (28, 16), (24, 64), (40, 22), (60, 18), (64, 64)]
    budget = _budget(tokens(64))
    reference, model = tiny_gpt2(), auto_checkpoint(tiny_gpt2(), budget)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for pair in lengths:
        _, loss_ref = _step_peak(reference, opt_ref, [tokens(n) for n in pair])
        peak, loss = _step_peak(model, opt, [tokens(n) for n in pair])
        assert loss == loss_ref
        assert peak <= budget * SLACK
    stats = controller_of(model).stats()
    assert stats.steps == 2 * len(lengths) and stats.optimizer_steps == len(lengths)
    for p, q in zip(reference.parameters(), model.parameters()):
        assert torch.equal(p, q)


def _trainer_run(tmp_path, wrap: bool) -> tuple[torch.nn.Module, list[float]]:  # type: ignore[no-untyped-def]
    from transformers import Trainer, TrainingArguments

    class Batches(torch.utils.data.Dataset):  # one sequence per item, lengths vary
        def __len__(self) -> int:
            return len(LENGTHS)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = tokens(LENGTHS[i], batch=1)[0]
            return {"input_ids": ids, "labels": ids}

    model = tiny_gpt2()
    if wrap:
        model = auto_checkpoint(model, "64MiB")
    args = TrainingArguments(
        output_dir=str(tmp_path / ("wrapped" if wrap else "plain")), per_device_train_batch_size=1, max_steps=6,
        learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
        disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Batches())
    trainer.train()
    return model, [float(p.detach().sum()) for p in model.parameters()]


def test_an_unchanged_trainer_plans_every_step_with_the_unwrapped_weights(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("accelerate")
    _, plain = _trainer_run(tmp_path, wrap=False)
    model, wrapped = _trainer_run(tmp_path, wrap=True)
    assert wrapped == plain
    stats = controller_of(model).stats()
    assert stats.steps == 6 and stats.optimizer_steps == 6
    assert stats.optimizer_states == "measured"
    assert stats.max_peak_bytes > 0


def test_fsdp2_fully_shard_on_gloo_plans_and_keeps_the_math(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        reference, model = tiny_gpt2(), tiny_gpt2()
        model = auto_checkpoint(model, "64MiB")
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for n in LENGTHS[:5]:
            for m, o in ((reference, opt_ref), (model, opt)):
                m(input_ids=tokens(n), labels=tokens(n)).loss.backward()
                o.step()
                o.zero_grad(set_to_none=True)
        for p, q in zip(reference.parameters(), model.parameters()):
            assert torch.equal(p, q.full_tensor())
        stats = controller_of(model).stats()
        assert stats.steps == stats.optimizer_steps == 5 and stats.optimizer_states == "measured"
        remove_checkpointing(model)
    finally:
        dist.destroy_process_group()


def test_an_optimizer_holding_replaced_parameters_is_refused() -> None:
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    replaced = copy.deepcopy(model)  # what a sharding or adapter wrapper hands back: new parameters
    with pytest.raises(ConfigError, match="optimizer: holds .* not the model's .*create the optimizer"):
        auto_checkpoint(replaced, "64MiB", optimizer=opt)


def test_torch_compile_is_refused_with_a_message() -> None:
    model = tiny_gpt2()
    with pytest.raises(UnsupportedError, match="torch.compile is not supported"):
        auto_checkpoint(torch.compile(model), "64MiB")


def test_compiling_a_wrapped_model_still_plans_and_keeps_the_math() -> None:
    """The forward pre-hook refuses to be traced; dynamo (torch 2.13) then runs that frame eagerly."""
    reference, model = tiny_gpt2(), auto_checkpoint(tiny_gpt2(), "64MiB")
    compiled = torch.compile(model)
    x = tokens(8)
    assert torch.equal(compiled(input_ids=x, labels=x).loss, reference(input_ids=x, labels=x).loss)
    assert controller_of(model).stats().steps == 1
    remove_checkpointing(model)  # no optimizer step ended this loop: leave the CPU meter


def test_the_cpu_meter_is_left_after_the_optimizer_step_and_on_removal() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    model = auto_checkpoint(tiny_gpt2(), "64MiB")
    opt = torch.optim.AdamW(model.parameters())
    x = tokens(8)
    model(input_ids=x, labels=x).loss.backward()
    assert _get_current_dispatch_mode() is controller_of(model).meter  # metering the step until the update
    opt.step()
    assert _get_current_dispatch_mode() is None
    model(input_ids=x, labels=x).loss.backward()  # a loop that stops without an optimizer step
    remove_checkpointing(model)
    assert _get_current_dispatch_mode() is None


def test_the_optimizer_phase_is_metered_only_until_known_when_steps_run_unmetered() -> None:
    """A plain loop far below its budget: after two metered optimizer steps the CPU meter (a dispatch mode,
    costly per AdamW operator) stays off for the optimizer too; every step is still counted."""
    from memplan.ckpt.loop_hooks import OPTIMIZER_STEPS_METERED

    model = auto_checkpoint(tiny_gpt2(), 2**34)
    ctl = controller_of(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctl.seed([lambda n=n: model(input_ids=tokens(n), labels=tokens(n)).loss.backward() for n in (8, 16, 32)])
    for n in (12, 20, 16, 24, 14, 18):
        model(input_ids=tokens(n), labels=tokens(n)).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    stats = ctl.stats()
    assert stats.optimizer_steps == 6 and stats.metered_steps == 0
    assert ctl._count["opt_metered"] == OPTIMIZER_STEPS_METERED
    assert stats.max_optimizer_peak_bytes > 0 and stats.optimizer_over_budget_steps == 0
