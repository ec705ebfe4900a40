"""The shapes the parallel layers divide: parameter counts grouped by sharding, and 2-D weights.

:class:`ParamGroups` is what :mod:`memplan.model.params` sums over a model; :class:`TpMatrix` is one
2-D weight as a tensor-parallel framework (Megatron-LM) holds it. Both are plain values the attention
kinds (:mod:`memplan.model.attention_kinds`) and the parameter counts share without importing each other.
"""

from __future__ import annotations

from memplan.frozen import frozen_dataclass


@frozen_dataclass
class ParamGroups:
    """Numbers of parameters, grouped by how tensor/expert parallelism divides them."""

    tp_sharded: int = 0
    replicated: int = 0
    expert: int = 0
    #: Part of ``tp_sharded`` that is shared-expert weights (not an extra group).
    shared_expert: int = 0

    @property
    def total(self) -> int:
        return self.tp_sharded + self.replicated + self.expert

    def __add__(self, other: ParamGroups) -> ParamGroups:
        return ParamGroups(
            self.tp_sharded + other.tp_sharded,
            self.replicated + other.replicated,
            self.expert + other.expert,
            self.shared_expert + other.shared_expert,
        )


@frozen_dataclass
class TpMatrix:
    """One 2-D weight ``(rows, cols) = (out, in)`` and how tensor parallelism splits it."""

    rows: int
    cols: int
    #: 0: column-parallel (rows split), 1: row-parallel (columns split), None: replicated.
    partition_dim: int | None = None
    #: Row counts of the parts a fused weight is made of, largest first (a fused QKV: q, k, v);
    #: empty for a weight that is one part.
    parts: tuple[int, ...] = ()
