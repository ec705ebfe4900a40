"""The benchmark's design: an independent judge over the whole step, every variant on the same batches."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from memplan.ckpt.bench import MEMPLAN, TIMED, VARIANTS, BenchConfig, run_bench, sample_lengths
from memplan.ckpt.bench_meter import StepMeter

STEPS, REPEATS = 3, 1


@pytest.fixture(scope="module")
def result():  # type: ignore[no-untyped-def]
    return run_bench(replace(BenchConfig.quick(), steps=STEPS, repeats=REPEATS))


def test_timed_variants_run_every_repetition_and_references_once(result) -> None:  # type: ignore[no-untyped-def]
    cfg = result.config
    assert set(TIMED) <= set(cfg.timed)
    for variant in VARIANTS:
        runs = result.of(variant)
        assert len(runs) == (REPEATS if variant in cfg.timed else 1 if variant in cfg.once else 0)
        assert all(len(r.peaks) == len(r.losses) == STEPS for r in runs)


def test_memplan_variants_keep_the_losses_and_find_the_optimizer(result) -> None:  # type: ignore[no-untyped-def]
    none, trainer_full = result.of("none")[0], result.of("trainer-full")[0]
    for variant in MEMPLAN:
        for run in result.of(variant):
            assert run.losses == (trainer_full if variant == "trainer" else none).losses
            assert run.sheltered_steps == 0 and run.seed_s > 0  # seeded before the first step
            assert run.optimizer_states == "measured"
    assert result.summary()["smoke_test"] is True
    assert {r.recomputed_forwards for r in result.of("full")} == {STEPS * result.config.n_layer}


def test_the_judge_counts_whole_steps_with_adamw_moments() -> None:
    model = torch.nn.Linear(256, 256, bias=False)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    weight = 256 * 256 * 4
    judge = StepMeter()
    with judge:
        judge.start(model, opt)
        assert judge.live_bytes == weight
        model(torch.ones(1, 256)).sum().backward()
        opt.step()
    # weights, their gradient and two moments live at the end of the first step
    assert judge.live_bytes >= 4 * weight and judge.peak >= judge.live_bytes


def test_lengths_have_a_tail_to_the_longest_and_six_times_the_median() -> None:
    lengths = sample_lengths(BenchConfig())
    assert len(lengths) == 24 and max(lengths) >= 1000 >= max(lengths) - 24
    assert max(lengths) >= 6 * statistics.median(lengths)
    assert sample_lengths(BenchConfig()) == lengths  # seeded


def test_step_interleaving_judges_each_variant_and_checks_statics_first() -> None:
    cfg = replace(BenchConfig.quick(), steps=3, interleave="step", timed=("full", "plain", "half"), once=())
    res = run_bench(cfg)
    assert [r.variant for r in res.runs] == ["full", "plain", "half"] or set(res.static_peaks) == {"half"}
    assert set(res.static_peaks) == {"half"}
    plain = res.of("plain")[0]
    full = res.of("full")[0]
    assert plain.losses == full.losses and len(plain.peaks) == 3
    assert plain.seed_s > 0 and plain.sheltered_steps == 0 and plain.wall_s > plain.seed_s
    summary = res.summary()
    assert summary["targets"]["plain"]["losses equal to full"]["met"]


def test_process_per_variant_runs_pair_the_steps_and_record_faults() -> None:
    cfg = replace(BenchConfig.quick(), steps=3, interleave="process", timed=("full", "plain", "sac"), once=())
    res = run_bench(cfg)
    assert [r.variant for r in res.runs] == ["full", "plain", "sac"]
    plain, full, sac = res.of("plain")[0], res.of("full")[0], res.of("sac")[0]
    assert plain.losses == full.losses == sac.losses  # each process built the same weights from the seed
    assert len(plain.step_s) == len(plain.step_faults) == 3 and all(f >= 0 for f in plain.step_faults)
    # each memplan step's plan is recorded, one letter per block, and agrees with the witness's count
    assert len(plain.step_plans) == 3 and not full.step_plans
    assert all(set(p) <= set("KSFO") and len(p) == len(plain.step_plans[0]) for p in plain.step_plans)
    assert sum(len(p) - p.count("K") - p.count("O") for p in plain.step_plans) == plain.recomputed_forwards
    assert plain.seed_s > 0 and plain.wall_s > plain.seed_s and plain.recomputed_forwards < full.recomputed_forwards
    assert plain.host_memory.startswith(("retained", "unchanged")) and full.host_memory == ""
    assert res.summary()["targets"]["plain"]["losses equal to full"]["met"]


def test_supplementary_runs_can_give_the_static_variants_the_same_allocator_setting() -> None:
    cfg = replace(BenchConfig.quick(), steps=2, interleave="process", timed=("full", "plain"), once=(),
                  static_retain=True)
    res = run_bench(cfg)
    full, plain = res.of("full")[0], res.of("plain")[0]
    assert full.host_memory.startswith("retained") and plain.host_memory.startswith("retained")
    assert full.losses == plain.losses
