"""The names of the trainers' batching rules (``--batching``); the rules themselves are in batching.py."""

from __future__ import annotations

from typing import Literal

__all__ = ["RULES", "Rule", "family"]

Rule = Literal["hf", "trl", "trl-padding-free", "trl-packing", "torchtune", "torchtune-packing", "axolotl"]
RULES: tuple[str, ...] = ("hf", "trl", "trl-padding-free", "trl-packing", "torchtune", "torchtune-packing",
                          "axolotl")


def family(rule: str) -> str:
    """The trainer a rule belongs to: hf, trl, torchtune or axolotl (its ``--emit`` kind)."""
    return next((name for name in ("trl", "torchtune", "axolotl") if rule.startswith(name)), "hf")
