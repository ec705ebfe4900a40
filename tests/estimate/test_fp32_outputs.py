"""accelerate's ``convert_outputs_to_fp32`` in the Hugging Face Trainer's step (helper fp32out17, docs/benchmarks.md):
the estimate says it where the trainer's accelerate wraps the forward (the hf profile's ``fp32_outputs``, a 16-bit
precision, not on DeepSpeed's engine) and adds no bytes: the copy's moment is the loss's forward (the traced peaks
below are ``memplan trace``'s with accelerate's wrapper, benchmarks/results/fp32_outputs_witness.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.estimate.engine import estimate
from memplan.inputs import JobRequest, load_job
from memplan.profiles import get_profile
from memplan.profiles.framework import PROFILES
from tests.estimate.test_fsdp_adapter_dtype import LLAMA_TOY

FLAGS = {"seq": 512, "mbs": 2, "attention": "sdpa", "optimizer": "adamw", "optimizer_impl": "foreach",
         "framework": "hf"}
HEAVY = {**LLAMA_TOY, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 4, "vocab_size": 16384,
         "tie_word_embeddings": True}
#: The witness cells' traced peaks (bytes, the trace running accelerate's wrapper): W1, W2, W6, C3.
TRACED = {("bf16-mixed", "none"): 669_499_392, ("bf16-mixed", "full"): 515_194_880,
          ("fp16-mixed", "none"): 669_499_392, ("bf16", "none"): 458_576_896}
_COPY_MIB = f"({4 * 512 * 2 * 16384 / 2**20:,.1f} MiB)"


@pytest.fixture(scope="module")
def heavy(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = Path(tmp_path_factory.mktemp("fp32out17")) / "llama_heavy.json"
    path.write_text(json.dumps(HEAVY), encoding="utf-8")
    return str(path)


def _estimate(model: str, **flags: object):  # type: ignore[no-untyped-def]
    loaded = load_job(JobRequest(model=model, flags={**FLAGS, **flags}))
    return estimate(loaded.model, loaded.job)


def _sentences(model: str, **flags: object) -> list[str]:
    return [note for note in _estimate(model, **flags).assumptions if "convert_outputs_to_fp32" in note]


def test_only_the_hf_profile_wraps_the_forward() -> None:
    assert get_profile("hf").fp32_outputs
    assert [name for name, profile in PROFILES.items() if profile.fp32_outputs] == ["hf"]


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed", "bf16"])
def test_said_where_the_trainer_wraps_the_forward(heavy: str, precision: str) -> None:
    """memplan's hf ``bf16`` is the Trainer's ``--bf16`` with bf16 weights (frameworks/hf_args.py): accelerate's
    ``native_amp`` is on there too."""
    (sentence,) = _sentences(heavy, precision=precision)
    assert _COPY_MIB in sentence and f"the trainer's {precision}" in sentence
    assert "adds nothing above the loss's forward" in sentence


@pytest.mark.parametrize("flags", [{"precision": "fp32"}, {"framework": "torchtitan"}, {"zero": 2, "gpus": 2},
                                   {"loss": "fused-linear"}],
                         ids=["fp32", "torchtitan", "zero2-deepspeed-engine", "fused-linear"])
def test_not_said_where_nothing_is_converted(heavy: str, flags: dict[str, object]) -> None:
    assert _sentences(heavy, **{"precision": "bf16-mixed", **flags}) == []


def test_compiled_loss_says_it_is_not_modelled(heavy: str) -> None:
    (sentence,) = _sentences(heavy, precision="bf16-mixed", compile=True)
    assert sentence.startswith("not modelled: ") and _COPY_MIB in sentence


@pytest.mark.parametrize(("precision", "recompute"), list(TRACED))
def test_peak_within_the_wrapped_trace(heavy: str, precision: str, recompute: str) -> None:
    stage = _estimate(heavy, precision=precision, recompute=recompute).stages[0]
    traced = TRACED[(precision, recompute)]
    assert abs(stage.peak_allocated_bytes - stage.workspace_bytes - traced) / traced < 0.001
