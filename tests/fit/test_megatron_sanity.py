"""No false "does not fit": every in-scope Megatron CI run measured on 80 GB H100s passes the fit filter.

The cases, their world sizes and the records left out as inconsistent are the accuracy benchmark's
own (``benchmarks/accuracy_megatron.py``: ``in_scope`` for the dense and the MoE suites,
``evaluate`` for the world size a recipe ran on), imported, not copied.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
from pathlib import Path

import pytest

from memplan.estimate import estimate
from memplan.fit.results import FIT_MARGIN, fits_memory
from memplan.frameworks.megatron_args import from_megatron_args
from memplan.gpus import get_gpu

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO.parent / "shared" / "reference" / "megatron_ci_h100.json"


@functools.cache
def _benchmark():  # type: ignore[no-untyped-def]
    """The accuracy benchmark's own case selection (in_scope, world_size), not a copy of it."""
    spec = importlib.util.spec_from_file_location("accuracy_megatron", REPO / "benchmarks" / "accuracy_megatron.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cases() -> list[dict]:  # type: ignore[type-arg]
    if not REFERENCE.exists():
        return []
    bench = _benchmark()
    data = json.loads(REFERENCE.read_text())
    # Ran on 80 GB H100s: the reference is H100 measurements; the *_gb200 recipe ran elsewhere.
    return [c for c in data["cases"] if bench.in_scope(c, "all") and "gb200" not in c["name"]]


def _case_job(case: dict):  # type: ignore[no-untyped-def,type-arg]
    """(model, job) at the world size the accuracy benchmark assigns, or a skip with its reason."""
    row = _benchmark().evaluate(case)
    if row.get("excluded") or row.get("error"):
        pytest.skip(f"left out by the accuracy benchmark: {row.get('excluded') or row.get('error')}")
    return from_megatron_args(case["model_args"], gpus=row["gpus"], name=case["name"])


CASES = _cases()


@pytest.mark.skipif(not CASES, reason=f"reference file not found: {REFERENCE}")
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_measured_run_is_reported_as_fitting(case: dict) -> None:  # type: ignore[type-arg]
    model, job = _case_job(case)
    h100 = get_gpu("h100-80gb")
    est = estimate(model, job)
    assert fits_memory(est.peak_reserved_bytes, h100.usable_bytes, FIT_MARGIN), (
        f"{case['name']} ran on H100 80GB (measured {case['measured']['max_allocated_bytes'] / 2**30:.1f} GiB) "
        f"but is predicted at {est.peak_reserved_bytes / 2**30:.1f} GiB reserved"
    )


def _layout_key(job) -> tuple[int, int, int]:  # type: ignore[no-untyped-def]
    return job.parallel.tp, job.parallel.pp, job.parallel.cp


@pytest.mark.skipif(not CASES, reason=f"reference file not found: {REFERENCE}")
def test_search_lists_every_measured_layout_among_the_fitting() -> None:
    """End to end: ``fit`` on each case's model, GPUs, sequence and batch lists the case's TP/PP/CP.

    The CP floor (``min_tokens_per_cp_rank``, a speed heuristic) is lowered to what the CI runs
    use (CP2 at 1,024 tokens); memory decides the rest. Micro-batches are capped at 1: memory grows
    with the micro-batch, so a layout that fits at the case's micro-batch fits at 1 too.
    """
    from memplan.fit import SearchSpace, fit

    searches: dict[tuple[object, ...], set[tuple[int, int, int]]] = {}
    missing = []
    for case in CASES:
        row = _benchmark().evaluate(case)
        if row.get("excluded") or row.get("error"):
            continue
        gpus = row["gpus"]
        model, job = from_megatron_args(case["model_args"], gpus=gpus, name=case["name"])
        key = (dataclasses.replace(model, name=""), job.batch.seq_length, job.batch.global_batch_size, gpus)
        if key not in searches:
            result = fit(model, gpus=gpus, seq=job.batch.seq_length, gbs=job.batch.global_batch_size,
                         space=SearchSpace(min_tokens_per_cp_rank=256, max_micro_batch=1))
            searches[key] = {_layout_key(c.job) for c in result.candidates}
        if _layout_key(job) not in searches[key]:
            missing.append(f"{case['name']} {_layout_key(job)}")
    assert not missing, missing
