"""seed(): predictors seeded from fake runs of a few blocks, per-op profiles, then training unsheltered."""

from __future__ import annotations

import copy

import torch
from ckpt_helpers import tiny_gpt2, tokens, train_step

from memplan.ckpt import auto_checkpoint
from memplan.ckpt.fastseed import seed_specs
from memplan.ckpt.phases import skip_output

MiB = 2**20
LENGTHS = (8, 32, 128)


def _samples(model: torch.nn.Module, lengths: tuple[int, ...] = LENGTHS) -> list:  # type: ignore[type-arg]
    def step(n: int) -> None:
        ids = torch.randint(0, 256, (2, n))
        model(input_ids=ids, labels=ids).loss.backward()

    return [lambda n=n: step(n) for n in lengths]


def test_seed_readies_every_predictor_without_touching_the_model(model: torch.nn.Module) -> None:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = auto_checkpoint(model, 64 * MiB)
    ctl = wrapped.memplan_ckpt
    rng = torch.get_rng_state()
    seconds = ctl.seed(_samples(wrapped))
    assert ctl.ready and ctl.measured_size() == 2 * max(LENGTHS)
    stats = ctl.stats()
    assert stats.seeded_passes == len(LENGTHS) and stats.seed_seconds == seconds > 0
    assert (stats.steps, stats.sheltered_steps, stats.recomputed_forwards) == (0, 0, 0)
    assert all(p.grad is None for p in wrapped.parameters())
    assert all(torch.equal(before[k], v) for k, v in wrapped.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert not ctl.meter.active and ctl.meter.current_bytes == 0  # fake storages are not memory
    # every block got the traced block's bytes, and an op profile with FLOP-based seconds
    acts = [dict(s.points) for name, s in ctl.series().items() if name.endswith("act_bytes")]
    assert all(a == acts[0] for a in acts) and len(acts[0]) == len(LENGTHS)
    assert all(ctl.ops.has(j) for j in range(ctl.n_blocks))
    assert ctl.ops.forward_s(0, 2 * 128) > ctl.ops.forward_s(0, 2 * 8) > 0


def test_seeded_bytes_match_what_a_real_step_keeps() -> None:
    """Never below; above by at most the causal mask Hugging Face builds under fake tensors (its
    tracing path materialises a B x T x T mask the real path leaves to the kernel: 7 % at 128 here)."""
    seeded = auto_checkpoint(tiny_gpt2(), 64 * MiB)
    seeded.memplan_ckpt.seed(_samples(seeded))
    real = auto_checkpoint(tiny_gpt2(), 64 * MiB)
    real.memplan_ckpt.warm_up([train_step(real, tokens(n)) for n in LENGTHS])
    for n in LENGTHS:
        size = 2 * n
        got = seeded.memplan_ckpt.series()["block3.act_bytes"].points[size]
        want = real.memplan_ckpt.series()["block3.act_bytes"].points[size]
        assert want <= got <= 1.10 * want, (n, got, want)


def test_training_after_seed_is_never_sheltered_and_keeps_the_losses() -> None:
    reference = tiny_gpt2()
    wrapped = auto_checkpoint(copy.deepcopy(reference), 12 * MiB)
    ctl = wrapped.memplan_ckpt
    ctl.seed(_samples(wrapped))
    opt_a = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for n in (16, 120, 40, 128):
        batch = tokens(n)
        for m, opt in ((reference, opt_a), (wrapped, opt_b)):
            loss = train_step(m, batch)()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if m is reference:
                want = loss
        assert torch.equal(loss, want)
    stats = ctl.stats()
    assert stats.sheltered_steps == 0 and stats.probe_forwards == 0 and stats.over_budget_steps == 0
    ctl.release_meter()


def test_passes_per_block_class() -> None:
    class A: ...

    class B: ...

    (modes, skip, record), = seed_specs([A, A, A, A])
    assert modes == ("keep", "full", "keep", "keep") and skip == {2, 3} and record == {0}
    specs = seed_specs([A, A, B])  # B has one block: a second pass checkpoints it
    assert len(specs) == 2 and specs[0][0] == ("keep", "full", "keep") and specs[1][0] == ("keep", "full", "full")


def test_a_skipped_block_returns_its_input_in_the_block_structure() -> None:
    hidden = torch.ones(2, 3, requires_grad=True)
    other = torch.zeros(1)
    template = (torch.ones(2, 3, requires_grad=True) * 2, other)
    out = skip_output(template, (hidden,), {})
    assert out[0] is hidden and out[1] is other
    assert skip_output(template[0], (), {"hidden_states": hidden}) is hidden


def test_selective_and_kept_blocks_run_as_planned_with_the_plain_gradients() -> None:
    from memplan.ckpt.opprofile import SacLevel
    from memplan.ckpt.planner import CheckpointPlan

    aten = torch.ops.aten
    reference = tiny_gpt2()
    # step_arms off: the plan below sheds with a whole recompute where SAC is unmeasured, which would explore
    wrapped = auto_checkpoint(copy.deepcopy(reference), 64 * MiB, step_arms=False)
    ctl = wrapped.memplan_ckpt
    ctl.seed(_samples(wrapped))
    level = SacLevel(keys=frozenset({(aten.addmm.default, 0), (aten.addmm.default, 2)}), saved_bytes=0,
                     recompute_s=0.0)
    for j in range(ctl.n_blocks):  # the tiny blocks have no level of their own (per-op overheads dominate)
        ctl.ops.blocks[j].levels = (level,)
    modes = ("sac0", "keep", "full", "sac0")
    ctl.plan_for = lambda *a, **k: CheckpointPlan(  # type: ignore[method-assign]
        checkpoint=(True, False, True, True), predicted_peak_bytes=0, recompute_s=0.0, fits=True, modes=modes)
    batch = tokens(64)
    assert torch.equal(train_step(reference, batch)(), train_step(wrapped, batch)())
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(reference.parameters(), wrapped.parameters()))
    assert ctl.last is not None and ctl.last[1].modes == modes
    stats = ctl.stats()
    assert stats.selective_forwards == 2 and stats.recomputed_forwards == 3
    ctl.release_meter()
