"""``memplan trace --fsdp`` under accelerate's outer units (``--framework hf``) and torchtitan's: the [final norm,
head] unit, kept unsharded after its forward, has its all-gather output alive beside its unsharded parameters
through the loss's forward, until the root's post-forward frees it (torch ``FSDPParamGroup.wait_for_unshard``,
``FSDPState._post_forward``), where the model computes the loss (``--framework hf``: transformers' loss inside the
model's forward). torchtitan's trainer computes it on the model's output (``train.py``: ``pred = model(inputs)``,
then ``loss_fn(pred, labels)``), after the root's post-forward: the trace does the same
(:class:`memplan.trace.run.LossAfterForward`), so only the unit's parameters are there. The estimate of the same:
tests/estimate/test_fsdp_loss_gather.py (memplan.estimate.fsdp_loss_gather)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.trace import trace
from tests.estimate.test_fsdp_adapter_dtype import LLAMA_TOY
from tests.estimate.test_hf_fsdp_policy import FLAGS

#: The toy's [final norm, head] unit in bf16: (256 + 2,048 x 256) x 2.
HEAD_UNIT = (256 + 2048 * 256) * 2


def _communication_at_loss(events) -> int:  # type: ignore[no-untyped-def]
    """Communication bytes live when the second iteration's loss forward runs."""
    live, comm = {}, 0
    for event in events:
        if event.kind == "alloc":
            live[event.block] = event
            comm += event.size if event.category == "communication" else 0
        else:
            freed = live.pop(event.block)
            comm -= freed.size if freed.category == "communication" else 0
        if event.iteration == 1 and event.op.startswith("aten.nll_loss_forward"):
            return comm
    raise AssertionError("no loss forward traced")


@pytest.mark.parametrize(("framework", "copies"), [("hf", 2), ("torchtitan", 1)])
def test_head_unit_at_the_loss_forward(tmp_path: Path, framework: str, copies: int) -> None:
    """hf: the unit's parameters and its all-gather output; torchtitan: its parameters alone (the output freed at
    the root's post-forward, before the loss)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_TOY), encoding="utf-8")
    result = trace(str(path), device="cuda", iterations=2, framework=framework, recompute="none", **FLAGS)
    assert _communication_at_loss(result.trace.events) == copies * HEAD_UNIT

