"""Pipeline layout: which layers each pipeline rank holds and how many micro-batches are in flight.

Schedules follow Megatron-LM's ``schedules.py``: non-interleaved 1F1B runs ``pp - rank - 1`` warm-up
forwards before its first backward; the interleaved schedule runs
``(pp - rank - 1) * 2 + (vpp - 1) * group`` warm-up forward chunks (``group`` = micro-batches per
chunk before switching chunks, ``pp`` by default). Activations of every forward that
has not yet had its backward stay alive, so the peak holds warm-up + 1 forwards.
"""

from __future__ import annotations

from functools import lru_cache

from memplan.frozen import frozen_dataclass
from memplan.job import Parallelism, default_uneven_split
from memplan.profiles.partial_recompute import rank_layers
from memplan.profiles.pipeline_split import rule_chunk_layers


@frozen_dataclass
class StageLayout:
    """What pipeline rank ``stage`` holds."""

    stage: int
    #: Decoder-layer indices of each virtual chunk (model chunk) on this rank, chunk 0 first.
    chunks: tuple[tuple[int, ...], ...]
    #: Holds the token (and position) embedding: first rank, first chunk.
    has_embedding: bool
    #: Holds the final norm, the output head and the loss: last rank, last chunk.
    has_head: bool
    #: For each forward in flight at the peak, the chunk index it ran through (oldest first).
    inflight_chunks: tuple[int, ...]
    #: Every decoder-layer index on this rank, chunk by chunk.
    layer_indices: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layer_indices)

    @property
    def inflight_microbatches(self) -> int:
        return len(self.inflight_chunks)


def chunk_layers(num_layers: int, par: Parallelism, split_rule: str) -> tuple[int, ...] | None:
    """Layers of every model chunk in model order: ``--stage-layers`` (or a framework layout read
    from its arguments), else the framework's split rule when no first/last stage layers are given;
    None where the even (or ceil) split applies."""
    if par.chunk_layers is not None or par.first_stage_layers is not None or par.last_stage_layers is not None:
        return par.chunk_layers
    return rule_chunk_layers(split_rule, num_layers, par.pp, par.vpp)


def stage_layer_counts(num_layers: int, par: Parallelism, split_rule: str = "even-or-ceil") -> tuple[int, ...]:
    """Decoder layers per pipeline rank (uneven first/last stage when asked for)."""
    return _rank_layer_counts(num_layers, par, chunk_layers(num_layers, par, split_rule))


def _rank_layer_counts(num_layers: int, par: Parallelism, chunks: tuple[int, ...] | None) -> tuple[int, ...]:
    """:func:`stage_layer_counts` given the chunks' layer counts (None: the even or uneven split)."""
    pp = par.pp
    if chunks is not None:
        return tuple(rank_layers(chunks, pp))
    if par.first_stage_layers is None and par.last_stage_layers is None:
        split = default_uneven_split(num_layers, pp) if num_layers % pp else None
        if split is not None:
            return (split[0],) * (pp - 1) + (split[1],)
        return (num_layers // pp,) * pp
    counts: list[int | None] = [None] * pp
    if par.first_stage_layers is not None:
        counts[0] = par.first_stage_layers
    if par.last_stage_layers is not None:
        counts[-1] = par.last_stage_layers
    fixed = sum(c for c in counts if c is not None)
    free = [i for i, c in enumerate(counts) if c is None]
    each = (num_layers - fixed) // len(free) if free else 0
    return tuple(each if c is None else c for c in counts)


def pipeline_layout(num_layers: int, par: Parallelism, num_microbatches: int,
                    split_rule: str = "even-or-ceil") -> tuple[StageLayout, ...]:
    """Layout of every pipeline rank for ``num_layers`` decoder layers; ``split_rule`` is the
    framework's (:attr:`memplan.profiles.FrameworkProfile.pipeline_split`).

    Memoised on exactly what it reads (the layer count, the pipeline fields of ``par``, the
    micro-batches and the split rule): a layout is a structure shared by every job with those."""
    return _layout(_LayoutKey(par, num_layers, num_microbatches, split_rule))


class _LayoutKey:
    """The inputs of a layout, compared on the fields it reads (the parallel layout travels along)."""

    __slots__ = ("key", "par")

    def __init__(self, par: Parallelism, num_layers: int, num_microbatches: int, split_rule: str) -> None:
        self.par = par
        self.key = (num_layers, num_microbatches, split_rule, par.pp, par.vpp, par.microbatch_group_size,
                    par.chunk_layers, par.first_stage_layers, par.last_stage_layers)

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _LayoutKey) and other.key == self.key


@lru_cache(maxsize=1024)
def _layout(inputs: _LayoutKey) -> tuple[StageLayout, ...]:
    par = inputs.par
    num_layers, num_microbatches, split_rule = inputs.key[:3]
    pp, vpp = par.pp, par.vpp
    chunks_given = chunk_layers(num_layers, par, split_rule)
    per_rank = _rank_layer_counts(num_layers, par, chunks_given)
    if chunks_given is not None:
        chunk_sizes = [[chunks_given[v * pp + rank] for v in range(vpp)] for rank in range(pp)]
    else:
        chunk_sizes = [[n // vpp + (1 if v < n % vpp else 0) for v in range(vpp)] for n in per_rank]
    chunks: list[list[tuple[int, ...]]] = [[] for _ in range(pp)]
    next_layer = 0
    for v in range(vpp):
        for rank in range(pp):
            size = chunk_sizes[rank][v]
            chunks[rank].append(tuple(range(next_layer, next_layer + size)))
            next_layer += size
    stages = []
    for rank in range(pp):
        stages.append(
            StageLayout(
                stage=rank,
                chunks=tuple(chunks[rank]),
                has_embedding=rank == 0,
                has_head=rank == pp - 1,
                layer_indices=tuple(i for chunk in chunks[rank] for i in chunk),
                inflight_chunks=_inflight_chunks(
                    rank, pp, vpp, num_microbatches, par.microbatch_group_size or pp
                ),
            )
        )
    return tuple(stages)


def _inflight_chunks(rank: int, pp: int, vpp: int, num_microbatches: int, group: int) -> tuple[int, ...]:
    """Chunk index of each forward alive at the end of warm-up (Megatron's 1F1B schedules).

    ``group`` is the number of micro-batches run through one chunk before the next chunk
    (Megatron's ``microbatch_group_size_per_vp_stage``, default ``pp``).
    """
    if pp == 1:
        return (0,)
    total = num_microbatches * vpp
    if vpp == 1:
        warmup = min(pp - rank - 1, num_microbatches)
        return (0,) * min(warmup + 1, num_microbatches)
    warmup = min((pp - rank - 1) * 2 + (vpp - 1) * group, total)
    alive = min(warmup + 1, total)
    # Forward k runs micro-batch groups of size `group` through chunk (k // group) % vpp.
    return tuple((k // group) % vpp for k in range(alive))
