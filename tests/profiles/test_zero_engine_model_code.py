"""``--framework hf --zero 1|2`` keeps the HF model's code and the Trainer's loop (helper ds16, session 16): DeepSpeed's
engine owns the model states and its buffers only (:data:`memplan.profiles.zero_engine.MODEL_CODE_FACTS`), so ZeRO-1/2
change no activation term. Over every hf cell of the agreement grid without FSDP and tests/trace's gpt-oss tiny jobs:
the activations, logits and inputs at the forward, loss and backward moments and the forward moment's temporaries (the
last layer's forward transients; no engine buffer is alive then) equal ``--framework hf``'s at the engine's precision.
The engine runs a ``*-mixed`` job's 16-bit weights without autocast (accelerate turns ``native_amp`` off under
DeepSpeed and the engine casts every parameter), so its activations are those of the 16-bit job. On 23de8e3, 23 jobs
differed: the bound ``inputs_embeds`` (gpt-oss), the logits under HF's TP plan, ``save_on_cpu`` per tensor, the loss
compiled inside the forward. Jobs the engine refuses (hf's selective policies) stay refused."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from memplan.estimate.engine import _on_engine, _stage_parts, layer_activation_costs
from memplan.estimate.memo import Same
from memplan.inputs import JobRequest, load_job
from tests.trace.test_agreement_grid import _COMMON, CELLS, CONFIGS

REPO = Path(__file__).resolve().parents[2]
_MOMENTS = ("forward", "loss", "backward")
_TERMS = ("activations", "logits", "input")


def _grid() -> list[Any]:
    spec = importlib.util.spec_from_file_location("agreement_grid", REPO / "benchmarks" / "agreement_grid.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules.setdefault("agreement_grid", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return [pytest.param(c.model_ref, dict(gpus=c.tp, seq=c.seq, micro_batch=c.mbs, precision=c.precision,
                                           attention=c.attention, recompute=c.recompute, tp=c.tp, **dict(c.flags)),
                         id=c.key)
            for c in module.GRID if c.framework == "hf" and c.fsdp == 1]


def _tiny_gpt_oss() -> list[Any]:
    out = []
    for cell in CELLS:
        values = cell.values if hasattr(cell, "values") else cell
        extra = dict(values[5]) if len(values) > 5 else {}
        if values[0] == "gpt_oss" and not extra.get("fsdp"):
            out.append(pytest.param("gpt_oss", dict(gpus=1, seq=values[1], micro_batch=2, precision=values[2],
                                                    attention=values[3], recompute=values[4], **extra),
                                    id=f"tiny gpt_oss {values[1:5]} {extra}"))
    return out


def _terms(model: str, flags: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    loaded = load_job(JobRequest(model=model, flags={"framework": "hf", **flags}))
    job, runs_on, _ = _on_engine(loaded.job)
    ledger = _stage_parts(Same(loaded.model), job, 0.1, runs_on)[1][0][2].ledger
    return {moment: tuple(ledger.total(term, moment) for term in _TERMS)
            + ((ledger.total("temporary", moment),) if moment == "forward" else ())
            for moment in ledger.phases if moment in _MOMENTS}


@pytest.mark.parametrize("model, flags", _grid() + _tiny_gpt_oss())
def test_zero_1_2_change_no_activation_term(tmp_path: Path, model: str, flags: dict[str, Any]) -> None:
    if model == "gpt_oss":
        path = tmp_path / "gpt_oss.json"
        path.write_text(json.dumps({**_COMMON, **CONFIGS["gpt_oss"]}), encoding="utf-8")
        model = str(path)
    engine_precision = {**flags, "precision": flags["precision"].replace("-mixed", "")}
    try:
        zero = {stage: _terms(model, {**flags, "zero": stage}) for stage in (1, 2)}
    except Exception as exc:  # hf's selective policies: DeepSpeed's profile does not run them (refused, as before)
        assert "--zero" in str(exc) and flags["recompute"] in ("selective", "megatron-selective"), exc
        return
    plain = _terms(model, engine_precision)
    assert zero[1] == plain
    # ZeRO-2 holds its whole gradient partition from the backward's first reduction (helper zero17): its walked
    # backward moment may stop at another layer, holding other layers' activations; its forward and loss are hf's
    assert {k: v for k, v in zero[2].items() if k != "backward"} == {k: v for k, v in plain.items() if k != "backward"}


def test_layer_activation_costs_price_a_zero_job_on_its_engine() -> None:
    """The per-layer figures the library offers price an hf ``--zero`` job as :func:`estimate` does: on DeepSpeed's
    engine (no autocast over a ``*-mixed`` job's 16-bit weights), not the Trainer's own AMP (the hf profile, before)."""
    def costs(**flags: Any) -> tuple[int, int, int]:
        loaded = load_job(JobRequest(model="llama-3.2-1b", flags={"framework": "hf", "gpus": 8, "seq": 2048, **flags}))
        return layer_activation_costs(loaded.model, loaded.job, 3)

    on_engine = costs(precision="bf16-mixed", zero=2)
    assert on_engine == costs(precision="bf16")
    assert on_engine != costs(precision="bf16-mixed")
