"""The names of the trainers' batching rules (``--batching``); the rules themselves are in batching.py."""

from __future__ import annotations

from typing import Literal

__all__ = ["RULES", "Rule"]

Rule = Literal["hf", "trl", "trl-padding-free", "trl-packing", "torchtune", "torchtune-packing"]
RULES: tuple[str, ...] = ("hf", "trl", "trl-padding-free", "trl-packing", "torchtune", "torchtune-packing")
