"""memplan.fit.search: candidates really fit, pruning loses nothing, ranking, bad input."""

from __future__ import annotations


import pytest

from memplan import load_model
from memplan.errors import ConfigError
from memplan.estimate import estimate
from memplan.fit import FitError, NoFitError, fit
from memplan.fit.results import FIT_MARGIN
from memplan.fit.context import FULL_RECOMPUTE, NO_RECOMPUTE, SELECTIVE_RECOMPUTE, make_context
from memplan.fit.space import SearchSpace, divisors, enumerate_layouts
from memplan.gpus import get_gpu


def test_every_candidate_fits_and_is_ranked_by_step_time() -> None:
    model = load_model("llama-3.1-8b")
    result = fit(model, gpus=8, gpu="h100-80gb", seq=4096)
    assert result.candidates, "llama-3.1-8b must fit 8 x H100"
    limit = int(get_gpu("h100-80gb").usable_bytes * (1 - FIT_MARGIN))
    assert result.limit_bytes == limit
    for cand in result.candidates:
        again = estimate(model, cand.job)
        assert again.peak_reserved_bytes == cand.reserved_bytes <= limit
        assert cand.headroom_bytes == limit - cand.reserved_bytes
        assert cand.job.batch.global_batch_size == result.global_batch_size
    times = [c.step.total_s for c in result.candidates]
    assert times == sorted(times)
    labels = [c.label for c in result.candidates]
    assert len(labels) == len(set(labels)), "one candidate per (layout, micro-batch)"


def test_rejected_families_really_do_not_fit() -> None:
    result = fit("llama-3.1-70b", gpus=64, gpu="h100-80gb")
    estimated = [r for r in result.rejected if r.min_reserved_bytes is not None]
    assert estimated, "some 70B layouts on 64 GPUs cannot fit"
    assert all(r.min_reserved_bytes > result.limit_bytes for r in estimated)
    assert all(r.reason for r in result.rejected)


def test_pruned_search_finds_everything_brute_force_finds() -> None:
    """Brute force over layout x micro-batch x {none, selective, full}: the search misses nothing."""
    model = load_model("llama-3.2-1b")
    gpu = get_gpu("rtx-4090")
    result = fit(model, gpus=4, gpu=gpu, seq=4096, gbs=32)
    found = {(c.layout, c.job.batch.micro_batch_size) for c in result.candidates}
    ctx = make_context(model, 4, gpu, 4096, 32, "megatron", "bf16-mixed", FIT_MARGIN, 0.10, None)
    layouts, _ = enumerate_layouts(model, 4, seq=4096, framework="megatron", space=SearchSpace())
    brute = set()
    for layout in layouts:
        for mbs in divisors(32 // layout.dp):
            if any(ctx.fits(ctx.job(layout, mbs, rc)) for rc in (NO_RECOMPUTE, SELECTIVE_RECOMPUTE, FULL_RECOMPUTE)):
                brute.add((layout, mbs))
    assert brute, "the case must have fitting configurations"
    assert brute == found


def test_more_margin_never_adds_candidates() -> None:
    loose = fit("llama-3.1-8b", gpus=8, margin=0.0)
    tight = fit("llama-3.1-8b", gpus=8, margin=0.2)
    def pairs(result):  # type: ignore[no-untyped-def]
        return {(c.layout, c.job.batch.micro_batch_size) for c in result.candidates}

    assert pairs(tight) <= pairs(loose)
    assert len(tight.candidates) < len(loose.candidates)


def test_deepseek_v3_reference_layout_is_found() -> None:
    """published.md §1: DeepSeek-V3 on 1,024 GPUs with TP2 PP16 EP8 (ETP1), DP32."""
    result = fit("deepseek-v3", gpus=1024, gpu="h100-80gb", seq=4096)
    hits = [c for c in result.candidates
            if (c.job.parallel.tp, c.job.parallel.pp, c.job.parallel.ep, c.job.parallel.expert_tp,
                c.job.parallel.data_parallel) == (2, 16, 8, 1, 32)]
    assert hits, "the published DeepSeek-V3 layout must be among the fitting ones"
    # ...with the published stage split: embedding + 4 layers, 14 x 4 MoE layers, 1 layer + head.
    assert any((c.job.parallel.first_stage_layers, c.job.parallel.last_stage_layers) == (4, 1) for c in hits)


def test_llama_70b_on_64_gpus_finds_layouts() -> None:
    # Its speed target (2 s) is measured by benchmarks/fit_speed.py, not here.
    result = fit("llama-3.1-70b", gpus=64)
    assert result.candidates and all(c.job.parallel.world_size == 64 for c in result.candidates)


def test_a_model_that_fits_nowhere_says_how_much_and_where() -> None:
    with pytest.raises(NoFitError) as info:
        fit("deepseek-v3", gpus=8, gpu="h100-80gb")
    assert not isinstance(info.value, ConfigError), "nothing fitting is a result, not bad input"
    text = str(info.value)
    assert "fits no layout on 8 x h100-80gb" in text
    assert "GiB over all GPUs" in text
    assert "try --gpus 256" in text and info.value.hint.endswith("try --gpus 256")
    result = info.value.result
    assert result.candidates == () and result.best is None and result.gpus == 8
    assert result.rejected and all(r.reason for r in result.rejected)


def test_gpus_no_layout_can_use() -> None:
    with pytest.raises(FitError) as info:
        fit("llama-3.1-70b", gpus=12, space=SearchSpace(gpus_per_node=8))
    assert info.value.field == "--gpus"
    assert "whole number of nodes" in str(info.value)


def test_unknown_gpu_and_bad_margin() -> None:
    with pytest.raises(ConfigError) as info:
        fit("llama-3.1-8b", gpus=8, gpu="h100-81gb")
    assert info.value.field == "--gpu"
    with pytest.raises(ConfigError):
        fit("llama-3.1-8b", gpus=8, margin=1.5)


def test_frameworks_without_model_parallelism_search_only_sharding() -> None:
    result = fit("llama-3.2-1b", gpus=8, framework="deepspeed", gbs=64)
    assert result.candidates
    assert all(c.job.parallel.tp == 1 and c.job.parallel.pp == 1 for c in result.candidates)
    assert {c.layout.sharding.zero for c in result.candidates} <= {1, 2, 3}


@pytest.mark.parametrize("name, gpus", [("llama-3.1-70b", 64), ("mixtral-8x7b", 16)])
def test_top_k_search_proves_the_same_fastest_as_the_exhaustive_one(name: str, gpus: int) -> None:
    full = fit(name, gpus=gpus)
    top = fit(name, gpus=gpus, top=5)
    assert full.exhaustive and not top.exhaustive
    assert [c.step.total_s for c in top.candidates[:5]] == [c.step.total_s for c in full.candidates[:5]]
    assert top.estimates < full.estimates and top.layouts_pruned > 0
    with pytest.raises(FitError):
        fit(name, gpus=gpus, top=0)


@pytest.mark.parametrize("name", ["qwen2.5-7b", "llama-3.1-8b", "llama-3.1-405b"])
def test_torchtitan_pipelines_use_the_profile_split_that_estimate_applies(name: str) -> None:
    """fit leaves a torchtitan pipeline's split to the profile's rule (uneven, generate_llm_fqn_per_model_part:
    28 layers on 8 stages are 3, 4 x 5, 3, 2), so every proposed layout is one the estimator accepts, with the
    stages the framework would build."""
    from memplan.estimate.layout import pipeline_layout
    from memplan.job import Job
    from memplan.profiles import get_profile
    from memplan.profiles.pipeline_split import weighted_split

    model = load_model(name)
    layouts, excluded = enumerate_layouts(model, 8, seq=4096, framework="torchtitan", space=SearchSpace())
    piped = [lay for lay in layouts if lay.pp > 1]
    assert {lay.pp for lay in piped} == {2, 4, 8}
    assert not [e for e in excluded if "split" in e.reason]
    rule = get_profile("torchtitan").pipeline_split
    for lay in piped:
        assert (lay.first_stage_layers, lay.last_stage_layers) == (None, None)
        par = lay.parallelism(8)
        stages = pipeline_layout(model.num_layers, par, 1, rule)
        assert tuple(len(s.layer_indices) for s in stages) == weighted_split(lay.pp, model.num_layers, 1, 1)
    lay = next(lay for lay in piped if lay.pp == 8)
    estimate(model, Job(framework="torchtitan", parallel=lay.parallelism(8), sharding=lay.sharding))
