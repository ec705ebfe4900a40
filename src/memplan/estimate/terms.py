"""A saved tensor of a layer as the activation mechanics price it (:class:`Term`), and its region and
recompute class (:mod:`memplan.estimate.activations` explains both; it re-exports these names)."""

from __future__ import annotations

from typing import Literal

from memplan.frozen import frozen_dataclass

__all__ = ["Keep", "Region", "Term"]

Region = Literal["tp", "sp", "rep"]
Keep = Literal["input", "core", "attn", "attn_input", "body", "ckpt_input"]


@frozen_dataclass
class Term:
    name: str
    bytes: int
    region: Region
    keep: Keep
    #: Input of a linear layer's GEMM: saved in FP8 (1 byte per element) under FP8 training.
    gemm_input: bool = False
    #: Which checkpointable part of a Megatron layer saves it (:data:`memplan.estimate.recompute_modules.
    #: SITES_DROPPED_BY` says which ``--recompute-modules`` drop each); "" for none.
    site: str = ""
