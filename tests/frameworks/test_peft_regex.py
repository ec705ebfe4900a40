"""PEFT target_modules regexes: peft's semantics (re.fullmatch per module name), in bounded time."""

from __future__ import annotations

import re
import time

import pytest

from memplan.errors import ConfigError
from memplan.frameworks import peft_regex
from memplan.frameworks.peft_regex import full_matches

NAMES = [f"model.layers.{i}.{part}" for i in range(4) for part in
         ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj")]
PATTERNS = [r".*\.(q_proj|v_proj)", r"model\.layers\.[02]\..*", r".*(?<!k)_proj", r"(\w)\w*\.layers\.1\..*",
            r".*self_attn.*", r"q_proj"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_same_names_as_python_re(pattern: str) -> None:
    assert full_matches(pattern, NAMES, field="f") == [n for n in NAMES if re.fullmatch(pattern, n)]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_same_names_without_re2(pattern: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peft_regex, "_re2", lambda _pattern: None)
    assert full_matches(pattern, NAMES, field="f") == [n for n in NAMES if re.fullmatch(pattern, n)]


def test_backtracking_pattern_is_bounded() -> None:
    evil = r"([\w.]|[\w.][\w.]|[\w.][\w.][\w.])*Z"
    start = time.perf_counter()
    assert full_matches(evil, NAMES, field="f") == []  # RE2: linear time
    assert time.perf_counter() - start < 1.0


def test_backtracking_pattern_without_re2_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peft_regex, "_re2", lambda _pattern: None)
    monkeypatch.setattr(peft_regex, "REGEX_SECONDS", 0.5)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="took more than 0.5 s"):
        full_matches(r"([\w.]|[\w.][\w.]|[\w.][\w.][\w.])*Z", [n * 3 for n in NAMES], field="f")
    assert time.perf_counter() - start < 3.0


def test_invalid_pattern_is_named() -> None:
    with pytest.raises(ConfigError, match="is not a valid regex"):
        full_matches("(unclosed", NAMES, field="--peft-config: target_modules")
