"""DSA search core: the C extension and its pure-Python twin agree; MiniMalloc instances fit."""

from __future__ import annotations

import random
import time

import pytest
from alloc_reference import MINIMALLOC

from memplan.alloc import dsa
from memplan.alloc.minimalloc import read_minimalloc_csv

CAPACITY = 1_048_576
needs_native = pytest.mark.skipif(not dsa.HAS_NATIVE, reason="C extension _dsa_search not built")


def _random_instance(rng: random.Random) -> tuple[list[int], list[int], list[int]]:
    n = rng.randint(1, 12)
    starts = [rng.randint(0, 20) for _ in range(n)]
    ends = [s + rng.randint(1, 10) for s in starts]
    sizes = [rng.randint(1, 8) for _ in range(n)]
    return starts, ends, sizes


def _python_search(starts, ends, sizes, capacity):
    return dsa._Search(starts, ends, sizes, capacity, time.perf_counter() + 5).run(dsa.HEURISTICS)


@needs_native
def test_extension_and_fallback_give_the_same_answer():
    """Same algorithm in C and Python: same status, offsets and node count (also when infeasible)."""
    from memplan.alloc import _dsa_search

    rng = random.Random(0)
    for _ in range(80):
        starts, ends, sizes = _random_instance(rng)
        lower = dsa.live_peak(starts, ends, sizes)
        for capacity in (lower, lower + 3):
            native = _dsa_search.search(starts, ends, sizes, capacity, 5.0, list(dsa.HEURISTICS))
            assert native == _python_search(starts, ends, sizes, capacity)
            if native[1] is not None:
                assert dsa.validate(starts, ends, sizes, native[1], capacity)


def test_fallback_search_packs_a_small_instance_perfectly():
    """Forced through engine="python": every greedy pass needs 7 bytes, the search finds the bound 6."""
    starts, ends, sizes = [0, 1, 3, 4, 6], [5, 3, 5, 7, 8], [1, 4, 2, 2, 4]
    result = dsa.solve(starts, ends, sizes, time_limit=2, engine="python")
    assert result.method == "search"
    assert result.peak == result.lower_bound == dsa.live_peak(starts, ends, sizes) == 6
    assert result.optimal
    assert dsa.validate(starts, ends, sizes, result.offsets)


def test_environment_variable_forces_the_fallback(monkeypatch):
    calls = []
    original = dsa._Search.run

    def spy(self, heuristics):
        calls.append(self.n)
        return original(self, heuristics)

    monkeypatch.setattr(dsa._Search, "run", spy)
    monkeypatch.setenv(dsa.PURE_PYTHON_ENV, "1")
    starts, ends, sizes = [5, 3, 6, 0, 5], [10, 8, 11, 4, 6], [3, 2, 1, 4, 2]  # greedy 8, search 7
    result = dsa.solve(starts, ends, sizes, time_limit=2)
    assert calls == [5]
    assert result.peak == result.lower_bound == 7
    assert dsa.validate(starts, ends, sizes, result.offsets)


def test_search_reports_an_infeasible_capacity():
    # three buffers live together need 3 bytes; capacity 2 is impossible
    status, offsets, _ = _python_search([0, 0, 0], [1, 1, 1], [1, 1, 1], 2)
    assert (status, offsets) == ("infeasible", None)


@needs_native
@pytest.mark.parametrize("name", ["D.1048576.csv", "J.1048576.csv", "K.1048576.csv"])
def test_minimalloc_instances_fit_the_capacity(name):
    """Zero-slack (K) and slack (D, J: 1 s at the lower bound first) instances fit 1,048,576 bytes."""
    path = next((p for p in MINIMALLOC if p.name == name), None)
    if path is None:
        pytest.skip("instance not present")
    rows = read_minimalloc_csv(path)
    starts, ends, sizes = [b.start for b in rows], [b.end for b in rows], [b.size for b in rows]
    result = dsa.solve(starts, ends, sizes, capacity=CAPACITY, time_limit=30, engine="c")  # a cap: it stops on a fit
    assert result.peak <= CAPACITY
    assert dsa.validate(starts, ends, sizes, result.offsets, CAPACITY)


def test_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="engine"):
        dsa.solve([0], [1], [1], engine="gpu")  # type: ignore[arg-type]
