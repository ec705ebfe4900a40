"""memplan.frozen.frozen_dataclass: the same class as dataclass(frozen=True), built at lower cost."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from dataclasses import dataclass, field

import pytest

from memplan.frozen import frozen_dataclass


def _pair(kw_only: bool = False):  # type: ignore[no-untyped-def]
    """The same class body made by dataclass(frozen=True) and by frozen_dataclass."""
    def body() -> type:
        class Point:
            """A point."""

            x: int
            y: float = 2.5
            tags: tuple[str, ...] = ()
            extra: dict[str, int] = field(default_factory=dict, compare=False)
            total: float = field(init=False, repr=False)

            def __post_init__(self) -> None:
                object.__setattr__(self, "total", self.x + self.y)
        return Point
    return dataclass(frozen=True, kw_only=kw_only)(body()), frozen_dataclass(kw_only=kw_only)(body())


@pytest.mark.parametrize("kw_only", [False, True])
def test_same_values_equality_hash_repr_and_fields_as_dataclass(kw_only: bool) -> None:
    real, ours = _pair(kw_only)
    args: dict[str, object] = {"x": 1, "tags": ("a",), "extra": {"k": 1}}
    a, b = real(**args), ours(**args)
    assert repr(a) == repr(b) and repr(b).endswith("Point(x=1, y=2.5, tags=('a',), extra={'k': 1})")
    assert hash(a) == hash(b) and b.total == 3.5
    assert b == ours(**{**args, "extra": {}}) and b != ours(**{**args, "x": 2}) and b != a  # other class
    assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(real)]
    assert ours(x=1).extra == {} and ours(x=1).extra is not ours(x=1).extra  # a new default each time
    assert dataclasses.replace(b, y=1.0).total == 2.0 and dataclasses.asdict(b) == dataclasses.asdict(a)
    assert dataclasses.is_dataclass(b) and ours.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_keyword_only_and_required_fields_are_kept() -> None:
    _, ours = _pair(kw_only=True)
    with pytest.raises(TypeError):
        ours(1)
    with pytest.raises(TypeError):
        ours(y=1.0)
    _, positional = _pair()
    assert positional(1, 3.0).total == 4.0


def test_assignment_and_deletion_raise() -> None:
    _, ours = _pair()
    point = ours(x=1)
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'x'"):
        point.x = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        point.other = 2  # type: ignore[attr-defined]
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot delete field 'x'"):
        del point.x


def test_copies_pickles_and_subclasses() -> None:
    point = _Base(a=1)
    assert pickle.loads(pickle.dumps(point)) == point and copy.deepcopy(point) == point
    child = _Child(a=1, b=2)
    assert child != point and child == _Child(a=1, b=2) and repr(child) == "_Child(a=1, b=2)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        child.b = 3  # type: ignore[misc]

    @dataclass(frozen=True, kw_only=True)
    class Grandchild(_Child):  # a real frozen dataclass may derive from one
        c: int = 0

    assert Grandchild(a=1, b=2, c=3).c == 3


def test_own_methods_are_kept_and_unsupported_classes_refused() -> None:
    @frozen_dataclass
    class Own:
        a: int

        def __repr__(self) -> str:
            return "own"

        def __eq__(self, other: object) -> bool:
            return True

    assert repr(Own(1)) == "own" and Own(1) == Own(2) and hash(Own(1)) == hash(Own(1))
    with pytest.raises(TypeError, match="__slots__"):
        @frozen_dataclass
        class Slotted:
            __slots__ = ("a",)
            a: int


@frozen_dataclass(kw_only=True)
class _Base:
    a: int


@frozen_dataclass(kw_only=True)
class _Child(_Base):
    b: int
