"""The examples in the docstrings of memplan.fit, jobfile and the HTML report run as written."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["memplan.fit.search", "memplan.fit.steptime", "memplan.fit.limits", "memplan.fit.colocate"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_public_names_resolve() -> None:
    fit_api = importlib.import_module("memplan.fit")

    assert sorted(fit_api.__all__) == sorted(set(fit_api.__all__))
    for name in fit_api.__all__:
        assert getattr(fit_api, name) is not None
