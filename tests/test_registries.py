"""Closed variants are registry entries (issue 24): nothing outside a registry compares their names.

Greps ``src/memplan`` for comparisons (``==``, ``!=``, ``in``, ``not in``) with the name of an
attention kind, an activation policy, a PEFT method or a quantized-base format, and for dictionaries
keyed by those names, outside the module that holds the registry. The finder is run on a synthetic
source first, so it can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "memplan"


def _names_compared(source: str, names: frozenset[str], *, keys: bool = True) -> list[tuple[int, str]]:
    """``(line, name)`` of every comparison with one of ``names`` (with ``keys``: or dictionary key)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for operand in operands:
                items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                out += [(node.lineno, i.value) for i in items
                        if isinstance(i, ast.Constant) and i.value in names]
        elif keys and isinstance(node, ast.Dict):
            out += [(node.lineno, k.value) for k in node.keys
                    if isinstance(k, ast.Constant) and k.value in names]
    return out


def _hits(names: frozenset[str], registries: tuple[str, ...] = (), under: str = "", *,
          keys: bool = True) -> list[str]:
    out = []
    for path in sorted((SRC / under).rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in registries or rel.startswith("tuning/"):
            continue
        out += [f"{rel}:{line}: {name!r}" for line, name in _names_compared(path.read_text(), names, keys=keys)]
    return out


def test_the_finder_finds_comparisons_and_keys() -> None:
    source = ('if attn.kind == "mla": pass\nx = kind in ("gqa", "other")\ny = {"mla": 1}\n'
              'z = name != "other"\nw = "mla" if a else "b"\n')
    assert _names_compared(source, frozenset({"mla", "gqa"})) == [(1, "mla"), (2, "gqa"), (3, "mla")]
    assert _names_compared(source, frozenset({"mla", "gqa"}), keys=False) == [(1, "mla"), (2, "gqa")]


ATTENTION = frozenset({"mha", "gqa", "mla"})


def test_attention_kinds_are_compared_only_in_their_registry() -> None:
    assert _hits(ATTENTION, ("model/attention_kinds.py",)) == []


POLICIES = frozenset({"full", "megatron-selective", "attention-core", "attention-module", "torchtitan-sac",
                      "memory-budget"})


@pytest.mark.parametrize("under", ["estimate", "fit"])
def test_activation_policies_are_compared_only_in_their_registry(under: str) -> None:
    """The estimator and the step-time model ask ``policy.kind``. ``none`` is every other option's off
    value, so it is left out; :data:`memplan.estimate.activations.KEPT_BY` is keyed by recompute-class
    sets that entries name (``PolicyKind.kept_classes``), so dictionary keys are not counted; fit's
    training methods (``full`` fine-tuning, ``lora``, ``qlora``) are not policies."""
    assert _hits(POLICIES, ("fit/methods.py",), under=under, keys=False) == []


PEFT = frozenset({"lora", "dora"})


def test_peft_methods_are_compared_only_in_their_registry() -> None:
    """``fit/methods.py`` keys fit's training methods (full, lora, qlora), which are not --peft values."""
    assert _hits(PEFT, ("fit/methods.py",), under="") == []


def test_quantized_base_formats_are_compared_only_in_their_registry() -> None:
    """``int8`` is also a dtype (``units.py``; ``job.py`` refuses it as a precision dtype)."""
    assert _hits(frozenset({"nf4", "fp4"}), ()) == []
    assert _hits(frozenset({"int8"}), ("units.py", "job.py")) == []


def test_each_registry_holds_every_choice_of_its_flag() -> None:
    """The job's declared choices (its Literals, which the flags show) are the registries' entries."""
    from typing import get_args

    from memplan.job import PeftMethod, QuantizeBase
    from memplan.model.attention_kinds import ATTENTION_KINDS, SPEC_KINDS
    from memplan.policies import POLICY_KINDS, POLICY_NAMES
    from memplan.tuning import PEFT_METHODS, QUANT_FORMATS

    assert tuple(PEFT_METHODS) == get_args(PeftMethod)
    assert tuple(QUANT_FORMATS) == get_args(QuantizeBase)
    assert tuple(POLICY_KINDS) == POLICY_NAMES
    assert set(SPEC_KINDS) <= set(ATTENTION_KINDS)
