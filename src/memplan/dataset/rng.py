"""``torch.randperm`` on the CPU generator, reproduced with numpy (so that batching never imports torch).

PyTorch's CPU generator is an MT19937 seeded by ``manual_seed(seed)`` with the reference
``init_genrand`` (the seeding numpy's legacy ``RandomState(seed)`` uses), and ``randperm_cpu``
(aten/src/ATen/native/TensorFactories.cpp) is a Fisher-Yates shuffle drawing ``random() % (n - i)``
from 32-bit outputs for ``n`` below ``2**32 / 20``. ``RandomState.randint(0, 2**32, dtype=uint32)``
returns those raw outputs. The tests compare with ``torch.randperm`` itself.
"""

from __future__ import annotations

import numpy as np

from memplan.errors import UnsupportedError

__all__ = ["torch_randperm"]

#: randperm_cpu takes 64-bit draws from here on (never reached by a dataset's example count).
_LIMIT_32 = (1 << 32) // 20


def torch_randperm(n: int, seed: int, *, skip: int = 0) -> np.ndarray:
    """``torch.randperm(n, generator=torch.Generator().manual_seed(seed))``; ``skip`` 32-bit outputs
    drawn first (``torch.empty((), dtype=torch.int64).random_()`` draws two)."""
    if n >= _LIMIT_32 or not 0 <= seed < 1 << 32:
        raise UnsupportedError(f"the sampler's permutation of {n} examples with seed {seed} is not reproduced")
    if n <= 1:
        return np.arange(n)
    state = np.random.RandomState(seed)
    draws = state.randint(0, 1 << 32, size=skip + n - 1, dtype=np.uint32)[skip:].astype(np.int64)
    steps = np.arange(n - 1)
    targets = (draws % (n - steps) + steps).tolist()
    order = list(range(n))
    for i, j in enumerate(targets):
        order[i], order[j] = order[j], order[i]
    return np.asarray(order, dtype=np.int64)
