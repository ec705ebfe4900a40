"""Skip the tests that need ../shared/reference when it is absent."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from alloc_reference import MINIMALLOC, SNAPSHOTS


def pytest_collection_modifyitems(items):
    for item in items:
        if ("snapshot" in item.nodeid and not SNAPSHOTS) or ("minimalloc" in item.nodeid and not MINIMALLOC):
            item.add_marker(pytest.mark.skip(reason="../shared/reference data not found"))
