"""The Llama-shaped tiny model of the optimizer tests, written once per session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from optimizer_helpers import TINY_LLAMA


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = Path(tmp_path_factory.mktemp("optimizer-llama")) / "config.json"
    path.write_text(json.dumps(TINY_LLAMA), encoding="utf-8")
    return str(path)
