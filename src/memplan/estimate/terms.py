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
    #: How many tensors of equal size the term lumps together (a gated MLP's gate, up and ``act(gate)``
    #: outputs; GPT-2's ``gelu_new`` intermediates): one of them is ``bytes // tensors``.
    tensors: int = 1
    #: Under ``save_on_cpu`` (:mod:`memplan.estimate.offloaded_backward`): how many of those tensors the one
    #: backward node that saved the most of them brings back (a product of two of them saves both factors).
    node_saves: int = 1
    #: ... and how many tensors of that size its worst node holds beside them: the gradient coming in and
    #: those it makes (one per saved factor of a product; an op's own temporaries).
    node_made: int = 2
