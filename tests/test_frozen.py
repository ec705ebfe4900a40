"""memplan.frozen.direct_init: the same construction as dataclasses' own __init__, still frozen."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from memplan.frozen import direct_init


@dataclass(frozen=True, kw_only=True)
class _Plain:
    a: int
    b: str = "x"
    c: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Post:
    a: int
    b: int = 2
    total: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", self.a + self.b)


def test_direct_init_replaces_init_and_keeps_the_value_and_frozenness() -> None:
    generated = _Plain.__init__
    cls = direct_init(dataclass(frozen=True, kw_only=True)(type("_P", (_Plain,), {})))
    assert cls.__init__ is not generated
    made = cls(a=1, c=(3,))
    assert (made.a, made.b, made.c) == (1, "x", (3,))
    assert made == cls(a=1, c=(3,)) and hash(made) == hash(cls(a=1, c=(3,)))
    assert dataclasses.replace(made, b="y").b == "y"
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.a = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        cls(1)  # keyword-only stays keyword-only
    with pytest.raises(TypeError):
        cls(b="y")  # a required field stays required


def test_direct_init_runs_post_init_and_positional_defaults() -> None:
    cls = direct_init(dataclass(frozen=True)(type("_Q", (_Post,), {})))
    assert cls(1).total == 3 and cls(1, 5).total == 6 and cls(a=1, b=1) == cls(1, 1)


def test_classes_it_cannot_serve_keep_their_own_init() -> None:
    @dataclass(frozen=True, slots=True)
    class Slotted:
        a: int

    @dataclass(frozen=True)
    class Factory:
        a: list[int] = field(default_factory=list)

    for cls in (Slotted, Factory):
        before = cls.__init__
        assert direct_init(cls).__init__ is before
    assert Factory().a == [] and Slotted(1).a == 1
