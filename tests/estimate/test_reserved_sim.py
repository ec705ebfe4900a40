"""Reserved memory from the allocator simulator on the estimate's own schedule (issue 25, item 8)."""

from __future__ import annotations

import json

import pytest

from memplan import Job, Parallelism, estimate, load_model
from memplan.alloc.allocator import CachingAllocator
from memplan.alloc.schedule import STREAM_BITS
from memplan.alloc.settings import AllocatorSettings
from memplan.errors import JobConfigError
from memplan.estimate import reserved_fsdp, reserved_replay, reserved_sim
from memplan.estimate.engine import _stages, reserved_mode
from memplan.estimate.ledger import ACTIVATIONS, ABSENT, PARAMETERS, TEMPORARY, Contribution, Ledger
from memplan.jobflags import build_job
from memplan.profiles import get_profile

JOBS = {
    "sdpa": dict(seq=2048, attention="sdpa"),
    "sdpa core_attn walked": dict(seq=2048, attention="sdpa", recompute="megatron-selective",
                                  recompute_modules="core_attn"),
    "eager fp32": dict(seq=2048, attention="eager", precision="fp32"),
    "full recompute": dict(seq=2048, recompute="full"),
    "fsdp 4, tp 2": dict(seq=2048, fsdp=4, tp=2, recompute="full"),
    "pipeline 2": dict(seq=1024, gpus=2, pp=2, gbs=8),
    "megatron distributed optimizer": dict(seq=1024, gpus=2, framework="megatron", distributed_optimizer=True),
    "hf fsdp 8": dict(seq=2048, gpus=8, framework="hf", fsdp=8, attention="sdpa"),
    "torchtitan fsdp 8 selective": dict(seq=4096, gpus=8, framework="torchtitan", fsdp=8, recompute="selective"),
    "hf lora": dict(seq=1024, framework="hf", peft="lora", lora_targets="all-linear", recompute="full"),
}


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    seen: list[object] = []
    real = reserved_sim.simulated_reserved

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(result := real(*args, **kwargs))  # type: ignore[arg-type]
        return result

    monkeypatch.setattr(reserved_sim, "simulated_reserved", spy)  # stage.py imports it on use
    _stages.cache_clear()
    return seen


@pytest.mark.parametrize("name", sorted(JOBS))
def test_the_schedule_peaks_at_the_estimates_peak_allocated(name: str, captured: list[object]) -> None:
    """The schedule is built from the estimate's contributions: its requested peak is the stage's peak allocated
    (a schedule that holds more or less than the ledger at some moment is wrong)."""
    model = load_model("llama-3.2-1b")
    est = estimate(model, build_job(JOBS[name]), reserved="simulated")
    assert len(captured) == len(est.stages)
    for stage, sim in zip(est.stages, captured):
        assert sim.requested == stage.peak_allocated_bytes  # type: ignore[attr-defined]
        assert stage.peak_reserved_bytes == sim.reserved >= stage.peak_allocated_bytes  # type: ignore[attr-defined]
        assert stage.peak_reserved_bytes % (2 * 1024 * 1024) == 0


def test_the_sentence_comes_with_the_simulated_number() -> None:
    model, job = load_model("llama-3.2-1b"), build_job({"seq": 2048})
    fixed, simulated = estimate(model, job), estimate(model, job, reserved="simulated")
    assert any("allocated / (1 - 0.10)" in a for a in fixed.assumptions)
    assert not any("allocated / (1 -" in a for a in simulated.assumptions)
    assert any("caching-allocator simulator" in a for a in simulated.assumptions)
    assert not any("caching-allocator simulator" in a for a in fixed.assumptions)
    assert simulated.peak_allocated_bytes == fixed.peak_allocated_bytes
    assert simulated.peak_reserved_bytes != fixed.peak_reserved_bytes
    # the result's fragmentation is the simulated share, not the stated 0.10 it did not use
    assert fixed.fragmentation == 0.10
    assert simulated.fragmentation == round(1 - simulated.peak_allocated_bytes / simulated.peak_reserved_bytes, 4)


def test_the_default_stays_the_stated_fragmentation() -> None:
    model, job = load_model("llama-3.2-1b"), Job(parallel=Parallelism(world_size=1))
    est = estimate(model, job)
    assert est.peak_reserved_bytes == -(-int(est.peak_allocated_bytes / 0.9) // 2**21) * 2**21


def test_an_unknown_mode_is_one_clear_error() -> None:
    with pytest.raises(JobConfigError, match="--reserved"):
        estimate(load_model("llama-3.2-1b"), Job(), reserved="measured")


def test_allocated_at_a_moment_subtracts_what_is_absent() -> None:
    ledger = Ledger(("backward", "optimizer step"))
    ledger.add(Contribution(PARAMETERS, 1000), Contribution(ACTIVATIONS, 300, ("backward",)),
               Contribution(ABSENT, 200, ("backward",)), Contribution(TEMPORARY, 340, ("optimizer step",)))
    assert ledger.allocated_at("backward") == 1100
    assert ledger.allocated_at("optimizer step") == 1340
    assert ledger.allocated_at(ledger.peak().phase) == ledger.peak().allocated


def test_the_job_flag_chooses_the_mode_and_the_argument_overrides_it() -> None:
    """``--reserved`` is a job field (every command, job file and server request carries it); ``auto`` is
    the framework profile's ``default_reserved``; ``estimate(reserved=...)`` overrides the job."""
    model = load_model("llama-3.2-1b")
    flags = {"seq": 2048, "framework": "hf"}
    auto, fixed = estimate(model, build_job(flags)), estimate(model, build_job({**flags, "reserved": "fixed"}))
    simulated = estimate(model, build_job({**flags, "reserved": "simulated"}))
    # hf's and torchtitan's loops are the ones the trace witnesses (the reserved grid): simulated; Megatron's
    # and DeepSpeed's buffers are not, nor any pipeline stage (fixed under PP whatever the framework)
    assert auto.peak_reserved_bytes == simulated.peak_reserved_bytes != fixed.peak_reserved_bytes
    assert get_profile("hf").default_reserved == get_profile("torchtitan").default_reserved == "simulated"
    assert get_profile("megatron").default_reserved == get_profile("deepspeed").default_reserved == "fixed"
    assert reserved_mode(build_job({**flags, "framework": "torchtitan"})) == "simulated"
    assert reserved_mode(build_job({**flags, "framework": "torchtitan", "gpus": 2, "pp": 2})) == "fixed"
    assert reserved_mode(build_job({**flags, "framework": "torchtitan", "gpus": 2, "pp": 2, "reserved": "simulated"})) == (
        "simulated")
    megatron = {"seq": 2048, "framework": "megatron"}
    assert estimate(model, build_job(megatron)).peak_reserved_bytes == estimate(
        model, build_job({**megatron, "reserved": "fixed"})).peak_reserved_bytes
    assert simulated.peak_reserved_bytes == estimate(model, build_job(flags), reserved="simulated").peak_reserved_bytes
    assert estimate(model, build_job({**flags, "reserved": "simulated"}), reserved="fixed").peak_reserved_bytes == (
        fixed.peak_reserved_bytes)


def test_a_bad_job_flag_value_is_one_clear_error() -> None:
    with pytest.raises(JobConfigError, match="--reserved.*auto, fixed, simulated"):
        Job(reserved="measured")  # type: ignore[arg-type]


def test_the_cli_flag_reaches_the_estimate() -> None:
    from typer.testing import CliRunner

    from memplan.cli import app

    runner = CliRunner()
    base = ["estimate", "llama-3.2-1b", "--seq", "2048", "--framework", "hf", "--json"]
    fixed = json.loads(runner.invoke(app, [*base, "--reserved", "fixed"]).stdout)
    simulated = json.loads(runner.invoke(app, [*base, "--reserved", "simulated"]).stdout)
    assert simulated["peak_allocated_bytes"] == fixed["peak_allocated_bytes"]
    assert simulated["peak_reserved_bytes"] != fixed["peak_reserved_bytes"]
    assert simulated["job"]["reserved"] == "simulated"
    bad = runner.invoke(app, [*base, "--reserved", "measured"])
    assert bad.exit_code == 2 and "--reserved" in bad.output and "Traceback" not in bad.output


def test_fsdp_sizes_follow_the_estimates_totals() -> None:
    """Under FSDP2 each unit's all-gather output is its unsharded parameters in the compute dtype and the
    reduce-scatter output its share of the estimate's gradients; without FSDP there are no such streams."""
    from memplan.model.linears import model_parameters

    model = load_model("llama-3.2-1b")
    seen: list[object] = []
    real = reserved_fsdp.fsdp_sizes

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(result := real(*args, **kwargs))  # type: ignore[arg-type]
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reserved_sim, "fsdp_sizes", spy)
        _stages.cache_clear()
        estimate(model, build_job({"seq": 1024, "gpus": 8, "framework": "hf", "fsdp": 8}), reserved="simulated")
        estimate(model, build_job({"seq": 1024, "framework": "hf"}), reserved="simulated")
    sizes, none = seen
    assert none is None and isinstance(sizes, reserved_fsdp.FsdpSizes)
    layer0 = sum(t.numel for t in model_parameters(model) if t.layer == 0)
    assert sum(sizes.unsharded[1]) == 2 * layer0  # bf16 compute dtype
    assert sizes.gather_input[1] == pytest.approx(2 * layer0 / 8, rel=1e-3)
    assert sum(sizes.sharded_grads[1]) == pytest.approx(4 * layer0 / 8, rel=1e-3)  # fp32 sharded gradients


def test_a_job_file_carries_the_mode(tmp_path: object) -> None:
    from pathlib import Path

    from memplan.inputs import JobRequest, load_job

    path = Path(str(tmp_path)) / "job.yaml"
    path.write_text("model: llama-3.2-1b\nseq: 1024\nframework: hf\nreserved: simulated\n")
    loaded = load_job(JobRequest(job_file=str(path)))
    assert loaded.job.reserved == "simulated"
    simulated = estimate(loaded.model, loaded.job)
    assert any(a.startswith("reserved = the caching-allocator simulator") for a in simulated.assumptions)


MIXED = {"mixtral (moe layers)": ("mixtral-8x7b", dict(seq=1024, gpus=8, ep=8)),
         "deepseek-v3 (dense then moe layers, pp)": ("deepseek-v3", dict(seq=1024, gpus=64, pp=4, ep=16, gbs=64)),
         "gemma-2 (soft-capped loss)": ("gemma-2-9b", dict(seq=1024, gpus=8, fsdp=8, attention="eager"))}


@pytest.mark.parametrize("case", sorted(JOBS) + sorted(MIXED))
def test_the_fast_schedule_is_the_reference_schedule(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (repeated layers copied, the events replayed in the C core when built) gives exactly what
    ``engine="python"`` gives (every layer's events built one by one, the pure-Python allocator): peak reserved,
    peak requested, events and note; and the requested bytes the schedule tracks are the allocator model's."""
    pairs: list[tuple[object, object]] = []
    replays: list[reserved_replay.Replay] = []
    real, real_finish = reserved_sim.simulated_reserved, reserved_replay.Replay.finish

    def both(*args: object, **kwargs: object) -> object:
        pairs.append((fast := real(*args, **kwargs), real(*args, **kwargs, engine="python")))  # type: ignore[arg-type]
        return fast

    def finish(self: reserved_replay.Replay, *args: object, **kwargs: object) -> int:
        replays.append(self)
        return real_finish(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(reserved_sim, "simulated_reserved", both)
    monkeypatch.setattr(reserved_replay.Replay, "finish", finish)
    _stages.cache_clear()
    model_name, flags = MIXED.get(case, ("llama-3.2-1b", JOBS.get(case)))
    estimate(load_model(model_name), build_job(flags), reserved="simulated")  # type: ignore[arg-type]
    assert pairs and all(fast == reference for fast, reference in pairs)
    for replay in replays:
        alloc, blocks, peak = CachingAllocator(AllocatorSettings()), {}, 0
        for position, op in enumerate(replay.ops):
            if op >= 0:
                blocks[position] = alloc.malloc(op >> STREAM_BITS, op & 255)
                peak = max(peak, alloc.requested)
            else:
                alloc.free(blocks.pop(~op))
        assert (peak, alloc.requested) == (replay.peak_requested, replay.requested)


def test_a_stretch_that_frees_what_it_was_not_given_is_not_copied() -> None:
    replay = reserved_replay.Replay()
    early = replay.take(1000)

    def body() -> list[list[int | None]]:
        replay.give(early)
        return [[replay.take(2000)]]

    first = replay.repeat("k", body)
    second = replay.repeat("k", lambda: [[replay.take(3000)]])  # run again, not copied from the first
    assert first == [[2]] and second == [[3]]
    assert replay.log() == [("take", 1000), ("give", 1000), ("take", 2000), ("take", 3000)]

    copied = reserved_replay.Replay()
    made = copied.take(512)

    def layer() -> list[list[int | None]]:
        temp = copied.take(4096)
        kept = copied.take(100)
        copied.give(temp, made)
        return [[kept]]

    assert copied.repeat("layer", layer, [made]) == [[2]]
    again = copied.take(512)
    assert copied.repeat("layer", layer, [again]) == [[7]]  # a copy: the new outside block freed
    assert copied.ops[6:] == [4096 << 8, 100 << 8, ~6, ~5]  # its own blocks moved by 5, the outside one replaced
    assert (copied.requested, copied.peak_requested) == (200, 100 + 512 + 4096 + 100)


def test_a_run_of_copies_is_the_layers_made_one_by_one() -> None:
    """Replay.repeat_run: the same events, blocks and requested peaks as each layer built in turn, also when one
    layer's outside blocks differ in size (that layer is then made, not copied)."""
    def schedule(replay: reserved_replay.Replay) -> list[object]:
        saved = [[replay.take(size)] for size in (4096, 4096, 8192, 4096)]

        def layer(p: int, passed: list[int | None]) -> list[list[int | None]]:
            temp, grad = replay.take(1000), replay.take(300)
            replay.give(temp, *saved[p])
            return [[grad]]

        made = replay.repeat_run("layer", layer, [3, 2, 1, 0], lambda p: saved[p])
        return [made, replay.ops, replay.requested, replay.peak_requested]

    assert schedule(reserved_replay.Replay()) == schedule(reserved_replay.Replay(repeat=False))
    fast = reserved_replay.Replay()
    assert schedule(fast)[0] == ([[5], [9], [13], [17]], [])


@pytest.mark.parametrize("first", [2048, 512])
def test_a_run_whose_layers_free_what_the_one_before_passes_on(first: int) -> None:
    """Replay.repeat_run with a block each layer passes on to the next (FSDP2's all-gather output, freed by the
    next unit's copy-out): the copies free the copy before's block, as the layers built in turn do, also when the
    first layer is handed a block of another size (the root's output), and the last's block is returned alive."""
    def schedule(replay: reserved_replay.Replay) -> list[object]:
        root = replay.take(first, 1)

        def layer(p: int, passed: list[int | None]) -> list[list[int | None]]:
            output = replay.take(256, 1)
            params = replay.take(128)
            replay.give(*passed)
            act = replay.take(64)
            replay.give(params)
            return [[act], [output]]

        made, passed = replay.repeat_run("layer", layer, [0, 1, 2, 3, 4], lambda p: (), [root])
        replay.give(*passed)
        return [made, passed, replay.ops, replay.requested, replay.peak_requested]

    built = schedule(reserved_replay.Replay(repeat=False))
    assert schedule(reserved_replay.Replay()) == built
    made, passed, ops = built[:3]
    outputs = [at for at, op in enumerate(ops) if op == 256 << 8 | 1]
    assert len(made) == 5 and passed == outputs[-1:]
    assert [~op for op in ops if op < 0 and ops[~op] & 0xFF == 1] == [0, *outputs]  # each freed by the next layer


@pytest.mark.parametrize("framework", ["megatron", "hf", "torchtitan"])
def test_the_cached_units_are_each_tensors_size_on_one_rank(framework: str) -> None:
    """reserved_sizes.stage_units caches per model, TP degree and profile: the same sizes as rank_numel
    computed for this job's context, tensor by tensor (a job of another framework first, to fill the cache)."""
    from memplan.estimate.context import run_context, stage_context
    from memplan.estimate.layout import pipeline_layout
    from memplan.estimate.reserved_sizes import stage_units
    from memplan.estimate.reserved_tp import rank_numel
    from memplan.model.linears import ParamTensor, model_parameters

    model = load_model("llama-3.2-1b")
    for name in ("megatron", framework):
        job = build_job({"seq": 1024, "gpus": 4, "tp": 4, "framework": name})
        run = run_context(model, job, 0.1)
        layout = pipeline_layout(model.num_layers, job.parallel, job.num_microbatches, run.profile.pipeline_split)[0]
        ctx = stage_context(run, layout)
        layers = list(layout.layer_indices)
        units = stage_units(ctx, layers)
    tensors = model_parameters(model)

    def rank(t: ParamTensor) -> int:
        return rank_numel(model, run.profile, job.parallel.tp, t)

    expected = [[rank(t) for t in tensors if t.layer is None]]
    expected += [[rank(t) for t in tensors if t.layer == i] or [1] for i in layers]
    assert [list(u) for u in units] == expected
