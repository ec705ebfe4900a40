"""The forward moment of DoRA's weight-norm step at the last layer's MLP output projection: the tensors transformers'
modeling code binds there, less the projection's saved tensors not made yet
(memplan.estimate.dora_forward_moment; helper bw15, session 15), and the one input-sized tensor beside the step
(memplan.estimate.adapter_acts.dora_forward_transient)."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.estimate import estimate
from memplan.jobflags import build_job
from tests.estimate.test_bound_embedding import JOB, _model

_DORA = {"peft": "dora", "lora_targets": "all-linear"}


@pytest.mark.parametrize("family, flags, traced, before", [
    # bf16-mixed, peak at layer 1's down_proj lora_B(lora_A(eye)): the layer's input (the model's loop), the
    # residual and the MLP's input (the decoder layer's locals), the eager 4-D mask; lora_A's output, lora_B's result
    # and the weight norm and scales of down_proj not made yet
    ("llama", {}, 308_061_184, -0.0075),
    ("qwen2", {}, 308_067_328, -0.0075),
    ("llama", {"attention": "sdpa"}, 294_202_368, -0.0070),  # no 4-D mask
    # pure bf16 with fp32 adapters (no autocast): lora_A saves peft's fp32 cast of the input, made before the step;
    # the 16-bit input is the tensor beside; lora_A's output of the identity is kept while the weight is rebuilt
    ("llama", {"precision": "bf16"}, 372_540_416, 0.0075),
    ("llama", {"precision": "fp32"}, 450_538_496, 0.0033),  # one dtype: no cast, the input is lora_A's
])
def test_the_dora_forward_moment_is_the_traced_one(tmp_path: Path, family: str, flags: dict[str, object],
                                                   traced: int, before: float) -> None:
    """memplan trace of the llama_1k_v256 toy (256 tokens x 2, AdamW foreach, eager unless said); ``before``: the
    error at 83e1fcf."""
    stage = estimate(_model(tmp_path, family), build_job({**JOB, **_DORA, **flags})).stages[0]
    assert abs((stage.peak_allocated_bytes - stage.workspace_bytes) / traced - 1) <= 0.0005


_DORA_QV = {"peft": "dora", "lora_targets": "q_proj,v_proj"}


@pytest.mark.parametrize("flags, traced, before", [
    # peak in layer 1's MLP backward; the forward moment at q_proj's weight-norm step no longer carries the layer's
    # saved tensors made after it (the trace: 118,133,248 B there)
    ({}, 135_177_216, 0.06216),
    ({"attention": "sdpa"}, 122_629_120, 0.06851),
    ({"precision": "bf16"}, 141_952_000, 0.06670),
])
def test_dora_on_the_attention_inputs_moment_holds_what_is_made_by_then(tmp_path: Path, flags: dict[str, object],
                                                                       traced: int, before: float) -> None:
    """memplan trace of the llama_1k_v256 toy with DoRA on q_proj and v_proj (helper bw16); ``before``: the error at
    23de8e3."""
    stage = estimate(_model(tmp_path, "llama"), build_job({**JOB, **_DORA_QV, **flags})).stages[0]
    assert abs((stage.peak_allocated_bytes - stage.workspace_bytes) / traced - 1) <= 0.0005


def test_dora_on_the_attention_inputs_forward_moment_is_the_traced_one(tmp_path: Path) -> None:
    """The forward moment itself (the ledger's forward phase, less the workspace) against the trace's total at layer
    1's q_proj weight-norm sum (``weight + scaling * lora_weight``): 118,133,248 B."""
    from memplan.estimate.engine import _stage_parts
    from memplan.estimate.ledger import WORKSPACE
    from memplan.estimate.memo import Same

    _, parts = _stage_parts(Same(_model(tmp_path, "llama")), build_job({**JOB, **_DORA_QV}), 0.0)
    ledger = parts[0][2].ledger
    assert abs((ledger.allocated_at("forward") - ledger.total(WORKSPACE)) / 118_133_248 - 1) <= 0.001


@pytest.mark.parametrize("targets", ["q_proj,o_proj", "q_proj,k_proj,v_proj,o_proj"])
def test_a_tie_with_the_output_projection_is_not_priced_at_q_proj(tmp_path: Path, targets: str) -> None:
    """q_proj's and o_proj's weight-norm steps are the same size on the toy (hidden x hidden); o_proj's runs after the
    attention core's tensors exist, so pricing the moment at q_proj's step (what the layer holds by then) put it below
    the o_proj-only job's (the review of session 16: 187.8 against 199.3 MB). An adapter more never lowers it."""
    from memplan.estimate.engine import _stage_parts
    from memplan.estimate.memo import Same

    def forward_moment(lora_targets: str) -> int:
        job = build_job({**JOB, "peft": "dora", "lora_targets": lora_targets})
        return _stage_parts(Same(_model(tmp_path, "llama")), job, 0.0)[1][0][2].ledger.allocated_at("forward")

    assert forward_moment(targets) >= forward_moment("o_proj")


@pytest.mark.parametrize("targets", ["q_proj,o_proj", "o_proj"])
def test_the_output_projection_step_holds_the_attention_block_not_the_mlp(tmp_path: Path, targets: str) -> None:
    """DoRA on q_proj,o_proj (a tie) or o_proj alone on the llama_1k_v256 toy: the moment is o_proj's step, where
    the attention block's saved tensors exist and the MLP block's (fc1 output, its norm's fp32 copy: about 14 MiB)
    do not (helper qknorm18). The trace of q_proj,o_proj: forward maximum 133,075,968 B at layer 1's o_proj DoRA step,
    peak 136,452,096 B in layer 1's MLP backward; the estimate had peaked at that forward moment (144,855,040 B,
    +6.158% at ca4aa10, every tensor of the layer counted)."""
    from memplan.estimate.engine import _stage_parts
    from memplan.estimate.ledger import WORKSPACE
    from memplan.estimate.memo import Same

    job = build_job({**JOB, "peft": "dora", "lora_targets": targets})
    ledger = _stage_parts(Same(_model(tmp_path, "llama")), job, 0.0)[1][0][2].ledger
    assert ledger.allocated_at("forward") - ledger.total(WORKSPACE) <= 133_075_968
    if targets == "q_proj,o_proj":
        stage = estimate(_model(tmp_path, "llama"), job).stages[0]
        assert abs((stage.peak_allocated_bytes - stage.workspace_bytes) / 136_452_096 - 1) <= 0.0015
