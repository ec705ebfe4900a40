"""DeepSpeed ZeRO-3 with a frozen base and peft LoRA (helper zlora17): zero17's Z5 witness cell (tiny4 Llama built
under zero.Init, LoRA r8 on q_proj,v_proj, world size 2, DeepSpeed 0.19.8's real engine on CPU; docs/benchmarks.md,
benchmarks/deepspeed_engine_witness.py). The three figure tests of the backward and the states fail on 98719b1."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from deepspeed_engine_witness import memplan_cell  # noqa: E402

#: Z5's engine figures, rank 0 (both ranks alike): benchmarks/results/deepspeed_engine_witness.json
ENGINE = {"backward (layer entry)": 12_240_365, "after backward": 6_404_701, "step": 4_237_429,
          "after step": 6_404_701, "forward": 18_036_445}


@pytest.fixture(scope="module")
def z5() -> dict:
    return memplan_cell("Z5")


def test_recorded_engine_figures_match() -> None:
    rank0 = json.loads((ROOT / "benchmarks/results/deepspeed_engine_witness.json").read_text())["cells"]["Z5"]["engine"][0]
    assert {k: rank0[k] for k in ENGINE} == ENGINE


def test_backward_holds_no_frozen_root_nor_frozen_gradient(z5: dict) -> None:
    # a layer's backward entry: 12 MLP projections gathered, no embedding/head, no frozen module's gradient
    assert abs(z5["backward"] / ENGINE["backward (layer entry)"] - 1) < 0.02


@pytest.mark.parametrize("figure", ["after backward", "after step"])
def test_persistent_adapters_and_fp32_master(z5: dict, figure: str) -> None:
    # the LoRA tensors persistent (131,072 B), an fp32 master (65,536 B) and a bf16 gradient partition (32,768 B)
    assert abs(z5[figure] / ENGINE[figure] - 1) < 0.002


@pytest.mark.parametrize("figure", ["forward", "step"])
def test_other_figures_stay_within_two_percent(z5: dict, figure: str) -> None:
    assert abs(z5[figure] / ENGINE[figure] - 1) < 0.02
