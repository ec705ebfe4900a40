"""Never silent: every job flag, given alone on a small preset, changes the estimate's figures, adds or changes a
sentence of its assumptions, or is refused with a sentence. A flag that does none of these was dropped without a
word; the few that legitimately restate what the job already is are listed with the reason."""

from __future__ import annotations

from typing import Any

import pytest

from memplan import estimate
from memplan.errors import MemplanError
from memplan.inputs import JobRequest, load_job
from memplan.jobflags import JobFlag, job_flags

MODEL = "llama-3.2-1b"

#: Values for flags whose type alone does not give a valid one (lists, layouts, names).
VALUES: dict[str, Any] = {
    "gpus": 2, "dp": 1, "first_stage_layers": 4, "last_stage_layers": 4, "stage_layers": "8,8", "chunk_layers": "8,8",
    "fragmentation": 0.2, "lora_targets": "all-linear", "lora_rank_pattern": "q_proj=4", "trainable": "layers.1",
    "modules_to_save": "lm_head", "offload_modules": "core_attn", "cuda_graph_modules": "attn",
    "recompute_modules": "core_attn",
}

#: Flags that, alone on this job, restate it: the value given is what the job already is.
RESTATING = {
    "dp": "1 GPU: the data-parallel size is 1 already",
    "reserved": "fixed is the megatron profile's default reserved mode",
    "make_vocab_size_divisible_by": "llama-3.2-1b's 128,256 rows are a multiple of 2 already",
}


def _value(flag: JobFlag) -> Any:
    if flag.name in VALUES:
        return VALUES[flag.name]
    if flag.kind is bool:
        return not bool(flag.default)
    if flag.choices:
        return next(choice for choice in flag.choices if choice != flag.default)
    if flag.kind is int:
        return (flag.default or 1) + 1
    if flag.kind is float:
        return 0.5 if flag.default in (None, 0.0, 1.0) else flag.default / 2
    return "x"


def _said(flags: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    loaded = load_job(JobRequest(model=MODEL, flags=flags))
    data = estimate(loaded.model, loaded.job).to_dict()
    for key in ("job", "input_settings", "unmodelled_settings"):
        data.pop(key, None)
    return data, tuple(data.pop("assumptions"))


@pytest.fixture(scope="module")
def alone() -> tuple[dict[str, Any], tuple[str, ...]]:
    return _said({})


@pytest.mark.parametrize("flag", job_flags(), ids=lambda f: f.flag)
def test_every_flag_given_alone_is_heard(flag: JobFlag, alone: tuple[dict[str, Any], tuple[str, ...]]) -> None:
    try:
        said = _said({flag.name: _value(flag)})
    except MemplanError as refusal:
        assert str(refusal).strip()
        return
    heard = said != alone
    if flag.name in RESTATING:
        assert not heard, f"{flag.flag} now changes the estimate: drop it from RESTATING"
    else:
        assert heard, f"{flag.flag} {_value(flag)!r} changed nothing and said nothing"
