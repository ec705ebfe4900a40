"""memplan's numpy reproduction of torch.randperm equals torch's, draw for draw."""

from __future__ import annotations

import numpy as np
import pytest

from memplan.dataset.rng import torch_randperm

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("n, seed", [(0, 1), (1, 3), (2, 0), (17, 42), (1000, 12345), (54_321, 2**32 - 1)])
def test_randperm_equals_torch(n, seed):
    expected = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    assert np.array_equal(torch_randperm(n, seed), expected)


def test_skip_follows_the_global_generator():
    torch.manual_seed(9)
    torch.empty((), dtype=torch.int64).random_()
    assert np.array_equal(torch_randperm(500, 9, skip=2), torch.randperm(500).numpy())
