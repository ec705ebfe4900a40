"""Pipeline layout: layers per rank and chunk, and forwards in flight at the peak.

The reference is Megatron-LM's ``pipeline_parallel/schedules.py``:

* non-interleaved 1F1B: rank ``r`` runs ``min(pp - r - 1, m)`` warm-up forwards, then one more
  forward before its first backward, so it holds ``min(pp - r, m)`` micro-batches;
* interleaved: ``(pp - r - 1) * 2 + (vpp - 1) * pp`` warm-up forward chunks, capped at ``m * vpp``
  (then there is no steady state), plus the steady state's one; forward ``k`` runs through model
  chunk ``(k // pp) % vpp`` (``get_model_chunk_id`` with a group size of ``pp``);
* virtual chunk ``v`` of rank ``r`` holds the layers after ``v * pp + r`` earlier chunks.
"""

from __future__ import annotations

import pytest

from memplan.estimate.layout import pipeline_layout, stage_layer_counts
from memplan.errors import JobConfigError
from memplan.job import Parallelism


def _par(pp: int, vpp: int = 1, *, first_stage_layers: int | None = None,
         last_stage_layers: int | None = None) -> Parallelism:
    return Parallelism(world_size=pp, pp=pp, vpp=vpp, first_stage_layers=first_stage_layers,
                       last_stage_layers=last_stage_layers)


def _megatron_1f1b_inflight(rank: int, pp: int, m: int) -> int:
    warmup = min(pp - rank - 1, m)
    return warmup + 1 if warmup < m else m


def _megatron_interleaved_inflight(rank: int, pp: int, vpp: int, m: int) -> int:
    total = m * vpp
    warmup = (pp - rank - 1) * 2 + (vpp - 1) * pp
    return total if warmup >= total else warmup + 1


# --------------------------------------------------------------------------- layer assignment


@pytest.mark.parametrize("layers, pp", [(8, 1), (8, 2), (8, 4), (32, 8), (126, 3)])
def test_even_split_assigns_contiguous_blocks(layers: int, pp: int) -> None:
    stages = pipeline_layout(layers, _par(pp), num_microbatches=pp)
    per = layers // pp
    assert [s.layer_indices for s in stages] == [tuple(range(r * per, (r + 1) * per)) for r in range(pp)]
    assert stage_layer_counts(layers, _par(pp)) == (per,) * pp


@pytest.mark.parametrize("layers, pp, vpp", [(16, 4, 2), (24, 2, 3), (96, 8, 3), (105, 35, 3)])
def test_interleaved_chunks_follow_megatron_offsets(layers: int, pp: int, vpp: int) -> None:
    stages = pipeline_layout(layers, _par(pp, vpp), num_microbatches=pp)
    size = layers // (pp * vpp)
    for s in stages:
        assert len(s.chunks) == vpp
        for v, chunk in enumerate(s.chunks):
            start = (v * pp + s.stage) * size
            assert chunk == tuple(range(start, start + size))
    every = sorted(i for s in stages for i in s.layer_indices)
    assert every == list(range(layers))


def test_interleaved_example_16_layers() -> None:
    """pp=4, vpp=2: rank 0 runs layers 0-1 and 8-9 (Megatron's docs example)."""
    stages = pipeline_layout(16, _par(4, 2), num_microbatches=4)
    assert stages[0].chunks == ((0, 1), (8, 9))
    assert stages[3].chunks == ((6, 7), (14, 15))


@pytest.mark.parametrize(
    "layers, pp, first, last, counts",
    [
        (10, 4, 1, 3, (1, 3, 3, 3)),
        (30, 4, 3, None, (3, 9, 9, 9)),
        (30, 4, None, 6, (8, 8, 8, 6)),
        (62, 8, 5, 3, (5, 9, 9, 9, 9, 9, 9, 3)),
        (7, 2, 3, 4, (3, 4)),
    ],
)
def test_uneven_first_and_last_stage(layers: int, pp: int, first: int | None, last: int | None,
                                     counts: tuple[int, ...]) -> None:
    par = _par(pp, first_stage_layers=first, last_stage_layers=last)
    assert stage_layer_counts(layers, par) == counts
    stages = pipeline_layout(layers, par, num_microbatches=pp)
    assert tuple(s.num_layers for s in stages) == counts
    assert [i for s in stages for i in s.layer_indices] == list(range(layers))


def test_uneven_with_interleaving_divides_each_rank_over_its_chunks() -> None:
    par = _par(4, 2, first_stage_layers=2)
    stages = pipeline_layout(14, par, num_microbatches=4)
    assert [tuple(len(c) for c in s.chunks) for s in stages] == [(1, 1), (2, 2), (2, 2), (2, 2)]
    assert sorted(i for s in stages for i in s.layer_indices) == list(range(14))
    assert stages[0].chunks == ((0,), (7,))


# --------------------------------------------------------------------------- embedding and head


@pytest.mark.parametrize("pp, vpp", [(1, 1), (2, 1), (4, 1), (4, 2), (8, 3)])
def test_embedding_on_first_and_head_on_last_stage(pp: int, vpp: int) -> None:
    stages = pipeline_layout(pp * vpp * 2, _par(pp, vpp), num_microbatches=pp)
    assert [s.has_embedding for s in stages] == [r == 0 for r in range(pp)]
    assert [s.has_head for s in stages] == [r == pp - 1 for r in range(pp)]
    # The embedding's rank runs layer 0 (chunk 0); the head's rank runs the last layer (last chunk).
    assert stages[0].chunks[0][0] == 0
    assert stages[-1].chunks[-1][-1] == pp * vpp * 2 - 1


# --------------------------------------------------------------------------- micro-batches in flight


@pytest.mark.parametrize("pp", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_1f1b_rank_holds_min_pp_minus_rank_and_m(pp: int, m: int) -> None:
    stages = pipeline_layout(pp * 2, _par(pp), num_microbatches=m)
    for s in stages:
        expected = 1 if pp == 1 else min(pp - s.stage, m)
        assert s.inflight_microbatches == expected == (1 if pp == 1 else _megatron_1f1b_inflight(s.stage, pp, m))
        assert set(s.inflight_chunks) == {0}


def test_gradient_accumulation_without_pipeline_holds_one_microbatch() -> None:
    assert pipeline_layout(4, _par(1), num_microbatches=32)[0].inflight_microbatches == 1


@pytest.mark.parametrize("pp, vpp", [(2, 2), (4, 2), (4, 3), (8, 3), (35, 3)])
@pytest.mark.parametrize("m_per_pp", [1, 2, 4])
def test_interleaved_inflight_follows_megatron_warmup(pp: int, vpp: int, m_per_pp: int) -> None:
    m = pp * m_per_pp
    stages = pipeline_layout(pp * vpp, _par(pp, vpp), num_microbatches=m)
    for s in stages:
        assert s.inflight_microbatches == _megatron_interleaved_inflight(s.stage, pp, vpp, m)
        assert s.inflight_chunks == tuple((k // pp) % vpp for k in range(s.inflight_microbatches))


def test_interleaved_worked_example() -> None:
    """pp=4, vpp=2, 8 micro-batches: rank 0 warms up 3*2 + 1*4 = 10 chunks and holds 11."""
    stages = pipeline_layout(16, _par(4, 2), num_microbatches=8)
    assert [s.inflight_microbatches for s in stages] == [11, 9, 7, 5]
    assert stages[0].inflight_chunks == (0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0)


def test_interleaved_warmup_capped_by_all_chunks() -> None:
    """pp=4, vpp=2, m=4: 8 forward chunks in total; rank 0's warm-up (10) runs all of them."""
    stages = pipeline_layout(16, _par(4, 2), num_microbatches=4)
    assert [s.inflight_microbatches for s in stages] == [8, 8, 7, 5]


def test_korthikanti_first_stage_holds_whole_model_worth() -> None:
    """1F1B with m >= pp: the first stage keeps pp micro-batches of L/pp layers = L layers."""
    stage = pipeline_layout(128, _par(64), num_microbatches=256)[0]
    assert stage.num_layers * stage.inflight_microbatches == 128


def test_torchtitan_rule_splits_126_layers_over_pp8_vpp2_like_torchtitan() -> None:
    """torchtitan's generate_llm_fqn_per_model_part: embedding and output count as a layer each."""
    par = Parallelism(world_size=8, pp=8, vpp=2)
    stages = pipeline_layout(126, par, num_microbatches=16, split_rule="embedding-output-weighted")
    chunks = [len(s.chunks[v]) for v in range(2) for s in stages]  # model order: chunk v * pp + rank
    assert chunks == [7] + [8] * 14 + [7]
    assert [len(s.chunks[0]) for s in stages][:2] == [7, 8] and [len(c) for c in stages[-1].chunks] == [8, 7]
    assert stage_layer_counts(32, _par(4), "embedding-output-weighted") == (8, 9, 8, 7)
    # the even rule still refuses what it cannot split; the same job given the list is accepted
    assert stage_layer_counts(126, Parallelism(world_size=8, pp=8, chunk_layers="7," + "8," * 14 + "7")) == (15,) + (16,) * 6 + (15,)


def test_impossible_framework_split_is_one_line_naming_the_rule() -> None:
    with pytest.raises(JobConfigError, match="torchtitan's split .* cannot split 10 layers over pp\\*vpp = 16"):
        pipeline_layout(10, _par(8, 2), num_microbatches=8, split_rule="embedding-output-weighted")


@pytest.mark.parametrize(("value", "rule"), [("7,x", "comma list of integers"), ("7,8,8", "a multiple of pp=8"),
                                             ("7,-1," + "8," * 13 + "8", "at least 0")])
def test_stage_layers_refusals(value: str, rule: str) -> None:
    with pytest.raises(JobConfigError, match=rule):
        Parallelism(world_size=8, pp=8, chunk_layers=value)
