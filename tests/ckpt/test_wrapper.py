"""auto_checkpoint on real (tiny) GPT-2 models: same math, within budget, safety net, bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from ckpt_helpers import N_LAYER, step_peak_bytes, tiny_gpt2, tokens, train_step

from memplan.ckpt import BatchTooLargeError, auto_checkpoint, controller_of, remove_checkpointing
from memplan.ckpt.planner import CheckpointPlan
from memplan.errors import ConfigError

MiB = 2**20
WARM = (4, 8, 16, 24)



def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _warmed(model: torch.nn.Module, budget: int, opt: torch.optim.Optimizer | None = None) -> torch.nn.Module:
    """Wrapped and warmed up; the optimizer (default plain SGD, no states) is what the budget check counts."""
    model = auto_checkpoint(model, budget, optimizer=opt or torch.optim.SGD(model.parameters(), lr=0.1))
    model.memplan_ckpt.warm_up([train_step(model, tokens(n)) for n in WARM])
    return model


# ------------------------------------------------------------------------------------ the math
def test_losses_and_gradients_equal_the_unwrapped_model_step_by_step(model: torch.nn.Module) -> None:
    plain = copy.deepcopy(model)
    lengths = [20, 48, 33, 64, 12]
    budget = step_peak_bytes(copy.deepcopy(model), tokens(40))  # long batches must checkpoint some blocks
    opt_a = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = _warmed(model, budget, opt_d)
    ctl = wrapped.memplan_ckpt
    for n in lengths:
        batch = tokens(n)
        loss_a = train_step(plain, batch)()
        loss_d = ctl.step(train_step(wrapped, batch))
        assert torch.equal(loss_a, loss_d)
        for ga, gd in zip(_grads(plain), _grads(wrapped)):
            assert torch.equal(ga, gd)
        opt_a.step(), opt_d.step()
        opt_a.zero_grad(set_to_none=True), opt_d.zero_grad(set_to_none=True)
    assert ctl.stats().recomputed_forwards > 0  # some blocks really ran under checkpoint


def test_every_step_stays_within_the_budget_measured_by_the_meter(model: torch.nn.Module) -> None:
    budget = step_peak_bytes(copy.deepcopy(model), tokens(40))
    wrapped = _warmed(model, budget)
    ctl = wrapped.memplan_ckpt
    for n in [10, 64, 30, 56, 44, 64, 20]:
        ctl.step(train_step(wrapped, tokens(n)))
        wrapped.zero_grad(set_to_none=True)
        assert ctl.last is not None and ctl.last[2] <= budget
    assert ctl.stats().max_peak_bytes <= budget
    assert ctl.stats().over_budget_steps == 0


def test_short_batches_checkpoint_nothing_and_long_ones_checkpoint_some(model: torch.nn.Module) -> None:
    budget = step_peak_bytes(copy.deepcopy(model), tokens(40))
    wrapped = _warmed(model, budget)
    ctl = wrapped.memplan_ckpt
    ctl.step(train_step(wrapped, tokens(8)))
    assert ctl.last is not None and ctl.last[1].n_checkpointed == 0
    wrapped.zero_grad(set_to_none=True)
    ctl.step(train_step(wrapped, tokens(64)))
    assert 0 < ctl.last[1].n_checkpointed


def test_recomputed_forwards_are_counted_as_the_block_forwards_run_in_backward(model: torch.nn.Module) -> None:
    wrapped = auto_checkpoint(model, 64 * MiB)
    ctl = wrapped.memplan_ckpt
    in_backward = []
    for block in wrapped.transformer.h:
        block.ln_1.register_forward_pre_hook(lambda *_: in_backward.append(torch._C._current_graph_task_id() >= 0))
    ctl.step(train_step(wrapped, tokens(16)))  # not warmed up: a sheltered step, every block checkpointed + probed
    stats = ctl.stats()
    assert stats.sheltered_steps == 1
    assert stats.recomputed_forwards == N_LAYER == sum(in_backward)
    assert stats.probe_forwards == N_LAYER
    assert ctl.last is not None and ctl.last[1].checkpoint == (True,) * N_LAYER


def test_learning_steps_seed_the_predictors_without_warm_up(model: torch.nn.Module) -> None:
    reference = copy.deepcopy(model)
    wrapped = auto_checkpoint(model, 64 * MiB)
    ctl = wrapped.memplan_ckpt
    for n in (12, 20, 28, 36):
        assert torch.equal(ctl.step(train_step(wrapped, tokens(n))), train_step(reference, tokens(n))())
        wrapped.zero_grad(set_to_none=True), reference.zero_grad(set_to_none=True)
    assert ctl.ready
    ctl.step(train_step(wrapped, tokens(40)))
    assert ctl.last is not None and ctl.last[1].method == "none"  # planned: 64 MiB fits everything
    assert ctl.stats().sheltered_steps == 3  # three sizes: a line with an intercept, checked on a spare point


def test_plain_steps_extend_the_measured_range_without_checkpointing_anything(model: torch.nn.Module) -> None:
    wrapped = auto_checkpoint(model, 64 * MiB)  # 64 MiB: every batch here fits without checkpointing
    ctl = wrapped.memplan_ckpt
    for n in (12, 20, 28):  # sheltered: sizes 24, 40, 56 tokens, every block checkpointed (recompute phase)
        ctl.step(train_step(wrapped, tokens(n)))
        wrapped.zero_grad(set_to_none=True)
    assert ctl.ready and ctl.measured_size() == 56
    ctl.step(train_step(wrapped, tokens(50)))  # 100 tokens: within 2x, planned; it checkpoints nothing
    wrapped.zero_grad(set_to_none=True)
    assert ctl.last is not None and ctl.last[1].method == "none"
    assert ctl.measured_size() == 100  # its backward measured the blocks kept, not recomputed
    ctl.step(train_step(wrapped, tokens(90)))  # 180 tokens: beyond 2x the sheltered sizes, within 2x of 100
    assert ctl.last is not None and ctl.last[1].method == "none"
    assert ctl.stats().sheltered_steps == 3


# ------------------------------------------------------------------------------------ safety net
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_forced_miss_is_redone_and_gives_the_unforced_result(dropout: float) -> None:
    reference = tiny_gpt2(dropout=dropout)
    forced = copy.deepcopy(reference)
    batch = tokens(48)
    p_none = step_peak_bytes(copy.deepcopy(reference), batch)
    torch.manual_seed(5)
    loss_ref = train_step(reference, batch)()
    grads_ref = _grads(reference)

    wrapped = _warmed(forced, p_none - 64 * 1024)  # checkpointing nothing cannot fit
    ctl = wrapped.memplan_ckpt
    n = ctl.n_blocks
    ctl.planner = None  # not used: force the wrong plan through plan_for
    ctl.plan_for = lambda *a, **k: CheckpointPlan(
        checkpoint=(False,) * n, predicted_peak_bytes=0, recompute_s=0.0, fits=True)
    torch.manual_seed(5)
    loss = ctl.step(train_step(wrapped, batch))
    assert ctl.stats().misses == 1
    assert torch.equal(loss, loss_ref)
    for g_ref, g in zip(grads_ref, _grads(wrapped)):
        assert torch.equal(g_ref, g)
    assert ctl.last is not None and all(ctl.last[1].checkpoint)  # the redo checkpointed every block


def test_gradients_accumulated_before_a_step_survive_a_miss(model: torch.nn.Module) -> None:
    reference = copy.deepcopy(model)
    a, b = tokens(16, seed=3), tokens(48)
    train_step(reference, a)()
    train_step(reference, b)()
    p_none = step_peak_bytes(copy.deepcopy(model), b)
    wrapped = _warmed(model, p_none - 64 * 1024)
    ctl = wrapped.memplan_ckpt
    ctl.step(train_step(wrapped, a))
    ctl.plan_for = lambda *x, **k: CheckpointPlan(
        checkpoint=(False,) * N_LAYER, predicted_peak_bytes=0, recompute_s=0.0, fits=True)
    ctl.step(train_step(wrapped, b))
    assert ctl.stats().misses == 1
    for g_ref, g in zip(_grads(reference), _grads(wrapped)):
        assert torch.allclose(g_ref, g, rtol=0, atol=1e-7)


def test_a_batch_that_cannot_fit_at_all_is_a_clear_error(model: torch.nn.Module) -> None:
    budget = step_peak_bytes(copy.deepcopy(model), tokens(8))
    wrapped = auto_checkpoint(model, budget, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(BatchTooLargeError, match="even with every block checkpointed"):
        wrapped.memplan_ckpt.step(train_step(wrapped, tokens(128)))


# ------------------------------------------------------------------------------------ plumbing
def test_eval_and_no_grad_forwards_pass_straight_through(model: torch.nn.Module) -> None:
    reference = copy.deepcopy(model).eval()
    wrapped = auto_checkpoint(model, "64MiB").eval()
    x = tokens(16)
    with torch.no_grad():
        assert torch.equal(reference(input_ids=x).logits, wrapped(input_ids=x).logits)
    assert wrapped.memplan_ckpt.stats().recomputed_forwards == 0


def test_remove_checkpointing_restores_the_model(model: torch.nn.Module) -> None:
    keys = set(model.state_dict())
    wrapped = auto_checkpoint(model, "64MiB")
    assert set(wrapped.state_dict()) == keys  # the state dict is untouched
    remove_checkpointing(wrapped)
    assert not hasattr(wrapped, "memplan_ckpt")
    assert all("forward" not in vars(b) for b in wrapped.transformer.h)
    auto_checkpoint(wrapped, "64MiB")  # can be applied again


def test_controller_of_unwraps_a_data_parallel_style_wrapper(model: torch.nn.Module) -> None:
    wrapped = auto_checkpoint(model, "64MiB")

    class Wrapper(torch.nn.Module):
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    assert controller_of(Wrapper(wrapped)) is wrapped.memplan_ckpt


# ------------------------------------------------------------------------------------ bad input
def test_budget_strings_are_parsed(model: torch.nn.Module) -> None:
    assert auto_checkpoint(model, "1.5GiB").memplan_ckpt.budget_bytes == 3 * 2**29


@pytest.mark.parametrize("budget", ["lots", "12 parsecs", "-1GiB", 0, True])
def test_malformed_budgets_are_config_errors(model: torch.nn.Module, budget: object) -> None:
    with pytest.raises(ConfigError) as info:
        auto_checkpoint(model, budget)  # type: ignore[arg-type]
    assert info.value.field == "budget"


def test_a_budget_below_the_model_states_names_the_numbers_and_the_minimum(model: torch.nn.Module) -> None:
    weights = sum(p.numel() * 4 for p in model.parameters())
    with pytest.raises(ConfigError) as info:
        auto_checkpoint(model, weights * 2)
    text = str(info.value)
    assert "weights" in text and "gradients" in text and "optimizer states" in text
    assert f"{4 * weights} bytes" in text  # weights + grads + AdamW's two moments: the minimum
    assert "minimum that could work" in text


def test_the_budget_check_measures_a_given_optimizer(model: torch.nn.Module) -> None:
    weights = sum(p.numel() * 4 for p in model.parameters())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: no states
    assert auto_checkpoint(model, weights * 2 + 1, optimizer=sgd).memplan_ckpt.budget_bytes == weights * 2 + 1


def test_a_non_tensor_batch_without_size_fn_is_a_clear_error() -> None:
    class Batch:
        def __init__(self, ids: torch.Tensor) -> None:
            self.ids = ids

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 8)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

        def forward(self, batch: Batch) -> torch.Tensor:
            h = self.emb(batch.ids)
            for layer in self.layers:
                h = layer(h)
            return h.sum()

    net = auto_checkpoint(Net(), "16MiB")
    with pytest.raises(ConfigError) as info:
        net(Batch(torch.zeros(2, 3, dtype=torch.long)))
    assert info.value.field == "size_fn" and "size_fn=" in str(info.value)
    net2 = auto_checkpoint(Net(), "16MiB", size_fn=lambda b: b.ids.numel())
    net2.memplan_ckpt.step(lambda: net2(Batch(torch.zeros(2, 3, dtype=torch.long))).backward())


def test_size_fn_must_return_a_positive_integer(model: torch.nn.Module) -> None:
    wrapped = auto_checkpoint(model, "64MiB", size_fn=lambda batch: 0)
    with pytest.raises(ConfigError, match="positive integer"):
        wrapped(input_ids=tokens(8), labels=tokens(8))


def test_hugging_face_checkpointing_must_be_off(model: torch.nn.Module) -> None:
    model.gradient_checkpointing_enable()  # the name every transformers version has
    with pytest.raises(ConfigError, match="gradient_checkpointing_disable"):
        auto_checkpoint(model, "64MiB")


def test_applying_twice_is_refused(model: torch.nn.Module) -> None:
    auto_checkpoint(model, "64MiB")
    with pytest.raises(ConfigError, match="already"):
        auto_checkpoint(model, "64MiB")
