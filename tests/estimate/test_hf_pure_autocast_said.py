"""Never silent: the HF Trainer's ``--bf16``/``--fp16`` over a model loaded in that dtype still runs the forward under
accelerate's ``torch.autocast`` (``native_amp`` follows the trainer's setting, not the weights; helper tracefid18
measured GPT-2 toys 23-37% above the estimate there, docs/benchmarks.md). memplan does not price that autocast
(its pricing was reverted in session 18), so the result says so; a trainer that runs none says nothing."""

from __future__ import annotations

import pytest

from memplan import estimate, load_model
from memplan.jobflags import build_job

MODEL = load_model("gpt2")
SAID = "not modelled: the trainer's --bf16 runs the forward under torch.autocast(bf16)"


def _said(flags: dict[str, object]) -> bool:
    return any(note.startswith(SAID) for note in estimate(MODEL, build_job(flags)).assumptions)


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_hf_pure_bf16_says_its_autocast_is_not_modelled(peft: str) -> None:
    assert _said({"framework": "hf", "precision": "bf16", "peft": peft})


@pytest.mark.parametrize("flags", [{"framework": "hf", "precision": "bf16-mixed"},
                                   {"framework": "torchtitan", "precision": "bf16"},
                                   {"framework": "hf", "precision": "bf16", "zero": 2, "gpus": 2}])
def test_quiet_where_no_such_autocast_runs(flags: dict[str, object]) -> None:
    """Mixed precision is priced under autocast; torchtitan runs none over 16-bit weights; under --zero DeepSpeed's
    engine runs the step and accelerate turns native_amp off."""
    assert not _said(flags)
