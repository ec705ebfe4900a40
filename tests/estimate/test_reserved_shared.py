"""The reserved-memory schedule's recorded layer stretches shared across stages and jobs
(:func:`memplan.estimate.reserved_replay.shared_templates`): a schedule built with stretches other jobs
recorded is event for event the schedule built layer by layer."""

from __future__ import annotations

import pytest

from memplan import estimate, load_model
from memplan.estimate import reserved_layers, reserved_replay
from memplan.estimate.engine import _stage_parts, _stages
from memplan.jobflags import build_job

#: Run in this order in one process: later jobs share layer stretches with earlier ones (same layer kind and
#: sizes) while differing elsewhere (pipeline stages, data parallelism, optimizer, recompute of other layers,
#: FSDP), and the last ones share nothing with the first.
SEQUENCE = [
    ("llama-3.2-1b", {"seq": 1024, "gpus": 8}),
    ("llama-3.2-1b", {"seq": 1024, "gpus": 8, "pp": 2, "gbs": 16}),
    ("llama-3.2-1b", {"seq": 1024, "gpus": 4, "optimizer": "sgd"}),
    ("llama-3.2-1b", {"seq": 1024, "gpus": 8, "pp": 2, "gbs": 16, "recompute": "full", "recompute_num_layers": 2,
                          "recompute_method": "block"}),
    ("llama-3.2-1b", {"seq": 1024, "gpus": 8, "fsdp": 8}),
    ("llama-3.2-1b", {"seq": 1024, "gpus": 8, "fsdp": 4, "tp": 2, "recompute": "full"}),
    ("llama-3.2-1b", {"seq": 1024, "framework": "hf", "attention": "eager", "precision": "fp32"}),
    ("llama-3.2-1b", {"seq": 1024, "framework": "hf", "peft": "lora", "lora_targets": "all-linear", "recompute": "full"}),
    ("deepseek-v3", {"seq": 1024, "gpus": 64, "pp": 4, "ep": 16, "gbs": 64}),
    ("deepseek-v3", {"seq": 1024, "gpus": 64, "pp": 8, "ep": 8, "gbs": 64}),
]


def _schedules(monkeypatch: pytest.MonkeyPatch, *, repeat: bool) -> list[list[int]]:
    """The ops of every stage schedule of :data:`SEQUENCE`, built with copies (``repeat``) or layer by layer."""
    ops: list[list[int]] = []
    real_finish = reserved_replay.Replay.finish

    def finish(self: reserved_replay.Replay, *args: object, **kwargs: object) -> int:
        ops.append(list(self.ops))
        return real_finish(self, *args, **kwargs)  # type: ignore[arg-type]

    real_init = reserved_replay.Replay.__init__

    def init(self: reserved_replay.Replay, *, repeat: bool = True, _want: bool = repeat) -> None:
        real_init(self, repeat=_want)

    monkeypatch.setattr(reserved_replay.Replay, "finish", finish)
    monkeypatch.setattr(reserved_replay.Replay, "__init__", init)
    for name, flags in SEQUENCE:
        _stages.cache_clear()
        _stage_parts.cache_clear()
        estimate(load_model(name), build_job(flags), reserved="simulated")  # type: ignore[arg-type]
    monkeypatch.undo()
    return ops


def test_shared_stretches_make_the_schedule_built_layer_by_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    reserved_replay.shared_templates.cache_clear()
    shared = _schedules(monkeypatch, repeat=True)
    info = reserved_replay.shared_templates.cache_info()
    assert info.hits > info.misses, "later stages and jobs must reuse the stretches earlier ones recorded"
    reference = _schedules(monkeypatch, repeat=False)
    assert len(shared) == len(reference) > len(SEQUENCE)
    for built, expected in zip(shared, reference):
        assert built == expected


def test_a_second_job_copies_the_forward_stretches_the_first_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two jobs with the same layers at the same sizes but another pipeline split: the second records no
    forward stretch (its backward ones are its own schedule's: the backward reads the run beyond its key)."""
    reserved_replay.shared_templates.cache_clear()
    recorded: list[bool] = []
    real = reserved_replay.Replay.repeat

    def repeat(self: reserved_replay.Replay, key: object, *args: object) -> object:
        before = len(recorded)
        store = self._store(key)
        sizes_known = len(store)
        result = real(self, key, *args)  # type: ignore[arg-type]
        if len(store) > sizes_known and len(recorded) == before:
            recorded.append(key in shared)
        return result

    shared: set[object] = set()
    real_shared = reserved_replay.shared_templates

    def tracked(key: object) -> reserved_replay.Templates:
        store = real_shared(key)
        shared.add(store)
        return store

    monkeypatch.setattr(reserved_replay.Replay, "repeat", repeat)
    monkeypatch.setattr(reserved_layers, "shared_templates", tracked)
    model = load_model("llama-3.2-1b")
    estimate(model, build_job({"seq": 1024, "gpus": 8, "pp": 2, "gbs": 16}), reserved="simulated")
    first = recorded.count(True)
    recorded.clear()
    estimate(model, build_job({"seq": 1024, "gpus": 8, "pp": 4, "gbs": 16}), reserved="simulated")
    assert first > 0 and recorded.count(True) == 0 and recorded.count(False) > 0


def test_the_shared_cache_is_bounded() -> None:
    assert reserved_replay.shared_templates.cache_info().maxsize == 4096
