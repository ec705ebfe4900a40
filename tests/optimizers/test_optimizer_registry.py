"""The optimizer registry: one entry per ``--optimizer`` value, and nobody else compares the names."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pytest

from memplan.errors import ConfigError
from memplan.job import Job, Optimizer, OptimizerName
from memplan.jobflags import check_conflicts
from memplan.optimizers import OPTIMIZER_NAMES, OPTIMIZERS, by_dialect, optimizer_kind

SRC = Path(__file__).resolve().parents[2] / "src" / "memplan"
#: Comparisons of optimizer names that remain outside the registry: none (Muon's framework and
#: full-training rules, its Newton-Schulz step, SGD's momentum line and the dataset search's 8-bit
#: variant and torchtune emitter are fields of their entries).
_ALLOWED: dict[tuple[str, str], int] = {}


def test_the_job_literal_lists_the_registry() -> None:
    assert set(get_args(OptimizerName)) == set(OPTIMIZER_NAMES)
    assert len(OPTIMIZER_NAMES) == len(set(OPTIMIZER_NAMES))


def _name_comparisons() -> dict[tuple[str, str], int]:
    """(file, optimizer name) -> how many comparisons (``==``, ``in``) test a literal optimizer name."""
    names = set(OPTIMIZER_NAMES)
    found: dict[tuple[str, str], int] = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("optimizers/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare):
                continue
            for side in [node.left, *node.comparators]:
                items = side.elts if isinstance(side, (ast.Tuple, ast.Set, ast.List)) else [side]
                for item in items:
                    if isinstance(item, ast.Constant) and item.value in names:
                        found[(rel, item.value)] = found.get((rel, item.value), 0) + 1
    return found


def test_nothing_outside_the_registry_compares_an_optimizer_name() -> None:
    assert _name_comparisons() == _ALLOWED


def test_every_dialect_name_maps_to_one_entry() -> None:
    for dialect in ("megatron", "deepspeed", "hf", "torchtitan"):
        seen = [entry[0] if isinstance(entry, tuple) else entry
                for kind in OPTIMIZERS for entry in getattr(kind.dialects, dialect)]
        assert len(seen) == len(set(seen)) == len(by_dialect(dialect)), dialect


def test_knobs_are_fields_of_the_optimizer_section() -> None:
    fields = set(Optimizer.__dataclass_fields__)
    for kind in OPTIMIZERS:
        assert set(kind.knobs) <= fields, kind.name
        for spec in kind.dialects.megatron_flags:
            assert spec.field == "" or spec.field in fields, spec.flag


def test_a_dependent_flag_is_refused_without_its_optimizer() -> None:
    with pytest.raises(ConfigError, match="momentum: only applies with --optimizer sgd"):
        check_conflicts({"optimizer": "adamw", "momentum": 0.9})


def test_each_entry_states_and_builds_or_says_why_not() -> None:
    for kind in OPTIMIZERS:
        assert kind.summary and (kind.build is not None or kind.untraceable), kind.name
        if kind.frameworks is not None:
            assert kind.framework_rule, kind.name
            outside = next(f for f in ("megatron", "hf", "deepspeed", "torchtitan") if f not in kind.frameworks)
            with pytest.raises(ConfigError, match="--optimizer"):
                Job(framework=outside, optimizer=Optimizer(name=kind.name))  # type: ignore[arg-type]


def test_muon_keeps_its_rules() -> None:
    """Muon's framework and full-training rules are the Megatron profile's feature, checked first."""
    with pytest.raises(ConfigError, match="muon is priced as Megatron-LM's Muon"):
        Job(framework="hf", optimizer=Optimizer(name="muon"))
    assert optimizer_kind("muon").refusal(framework="megatron", full_training=True, sharded=True,
                                          implementation="fused") == ""


@pytest.mark.parametrize(("flag", "value"), [("muon_tp_mode", "distributed"), ("muon_nesterov", True)])
def test_a_muon_setting_is_refused_without_muon(flag: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"{flag.replace('_', '-')}: only applies with --optimizer muon"):
        check_conflicts({"optimizer": "adamw", flag: value})
    check_conflicts({"optimizer": "muon", flag: value})  # with Muon: accepted


def test_a_muon_setting_without_muon_exits_2_from_the_cli() -> None:
    from typer.testing import CliRunner

    from memplan.cli import app

    result = CliRunner().invoke(app, ["estimate", "llama-3.2-1b", "--framework", "megatron", "--muon-nesterov"])
    assert result.exit_code == 2
    line = result.output.strip()
    assert "\n" not in line and "muon-nesterov" in line and "only applies with --optimizer muon" in line
