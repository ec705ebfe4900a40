"""The benchmark's measurement design: a metered pass for memory, unmetered timed passes that replay memplan's plans."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("transformers")

from memplan.ckpt.bench import METHODS, BenchConfig, run_bench


@pytest.fixture(scope="module")
def result():  # type: ignore[no-untyped-def]
    return run_bench(replace(BenchConfig.quick(), steps=4, repeats=2))


def test_one_metered_and_repeats_timed_runs_per_method(result) -> None:  # type: ignore[no-untyped-def]
    for method in METHODS:
        metered, timed = result.by_method(method, "metered"), result.by_method(method)
        assert len(metered) == 1 and len(timed) == 2
        assert len(metered[0].peaks) == 4 and all(not r.peaks for r in timed)  # memory only from the meter
        assert all(len(r.step_s) == 4 for r in metered + timed)


def test_timed_memplan_replays_the_metered_plans_with_the_same_math(result) -> None:  # type: ignore[no-untyped-def]
    summary = result.summary()
    assert summary["methods"]["memplan"]["timed_plans_matching_pct"] == 100.0
    assert summary["max_loss_difference_timed_vs_metered"] == 0.0
    assert summary["max_loss_difference_memplan_vs_none"] == 0.0
    ref = result.by_method("memplan", "metered")[0]
    assert {r.recomputed_forwards for r in result.by_method("memplan")} == {ref.recomputed_forwards}


def test_per_step_median_throughput_is_tokens_over_summed_medians(result) -> None:  # type: ignore[no-untyped-def]
    runs = result.by_method("full")
    medians = [sorted(s)[len(s) // 2 - 1:len(s) // 2 + 1] for s in zip(*(r.step_s for r in runs))]
    expected = runs[0].tokens / sum(sum(m) / 2 for m in medians)  # two runs: median = mean of both
    assert result.median_throughput("full") == pytest.approx(expected)


def test_a_metered_miss_is_paid_in_the_timed_step_without_changing_the_math() -> None:
    import copy

    from memplan.ckpt import bench

    cfg = replace(BenchConfig.quick(), steps=3, warmup_lengths=())
    init = copy.deepcopy(bench._build_model(cfg).state_dict())
    batches = bench._batches(cfg, bench.sample_lengths(cfg), 1)
    ref = bench._prepare("memplan", cfg, init, 2**40, (False,) * cfg.n_layer, metered=True)
    for batch in batches:
        bench._train_metered(ref, batch)
    state, choice, _missed, observe_s = ref.trace[1]
    ref.trace[1] = (state, choice, True, observe_s)  # pretend step 1 missed and was redone
    timed = bench._prepare("memplan", cfg, init, 2**40, (False,) * cfg.n_layer, metered=False)
    for i, batch in enumerate(batches):
        bench._train_timed(timed, batch, ref, i)
    assert timed.losses == ref.losses
    assert timed.plans_matching == len(batches)
    # the redo checkpointed every block on top of what the metered run recomputed
    assert timed.counter.backward == ref.counter.backward + cfg.n_layer
