"""Fixtures of the ckpt tests (torch and transformers are required; the tests skip without them)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from ckpt_helpers import tiny_gpt2


@pytest.fixture
def model():  # type: ignore[no-untyped-def]
    """A fresh tiny GPT-2 in training mode."""
    return tiny_gpt2()


@pytest.fixture(autouse=True, scope="session")
def _one_thread():  # type: ignore[no-untyped-def]
    """Tiny models run faster and steadier on one thread, above all on a shared machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_leaked_dispatch_mode():  # type: ignore[no-untyped-def]
    """A test must not leave a dispatch mode (a CPU meter) entered: it would meter every later test."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode

    yield
    leaked = []
    while _get_current_dispatch_mode() is not None:
        leaked.append(type(_pop_mode()).__name__)
    assert not leaked, f"dispatch modes left entered: {leaked}"
