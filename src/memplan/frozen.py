"""Frozen dataclasses that cost less to define (issue 24: start-up speed).

``@frozen_dataclass`` (or ``@frozen_dataclass(kw_only=True)``) makes the same frozen dataclass as
``@dataclass(frozen=True)``: the same fields (``dataclasses.fields``, ``replace``, ``asdict`` work), the
same ``__init__`` signature, defaults, default factories and ``__post_init__``, the same ``==``,
``hash`` and ``repr`` values, and assignment raises :class:`dataclasses.FrozenInstanceError`. What
differs is the cost of defining the class: ``dataclass`` compiles source for six methods of every
frozen class when its module is imported (about 1.2 ms a class; ``import memplan.cli`` spent 110-130 ms
of ~230 ms on 89 classes). Here ``__repr__``, ``__setattr__`` and ``__delattr__`` are shared
functions over the class's field names (nothing compiled), and ``__init__``, ``__eq__`` and ``__hash__``
(the same source as dataclass's) are compiled on their first use, so a class never built costs nothing.

``__init__`` sets each field with ``object.__setattr__``, as dataclass's own does, bound to the instance
once (``object.__setattr__.__get__(self)``): calling the unbound slot wrapper makes CPython build the
arguments' tuple and then slice ``self`` off it for every field; the bound wrapper is called with the
name and value only (callgrind: 1.067 M -> 1.026 M instructions per new-job estimate). Writing into the
instance's ``__dict__`` instead builds instances faster but makes CPython 3.11 materialize the
instance dict, and every later attribute read is slower: callgrind counted 1.19 M instructions per
new-job estimate that way against 1.15 M with the unbound ``object.__setattr__`` (1.17 M with dataclass).

Not supported (refused with ``TypeError`` when the class is defined): ``slots=True`` classes and
``InitVar`` fields; use ``dataclass`` for those.
"""

from __future__ import annotations

import dataclasses
import reprlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, overload

if TYPE_CHECKING:  # tells type checkers (and mypyc) what the decorator makes: typing's own from Python 3.11
    from typing_extensions import dataclass_transform
else:
    def dataclass_transform(**_: Any) -> Callable[[Any], Any]:
        return lambda function: function

__all__ = ["frozen_dataclass"]

T = TypeVar("T", bound=type)


@overload
def frozen_dataclass(cls: T, /) -> T: ...
@overload
def frozen_dataclass(*, kw_only: bool = False) -> Callable[[T], T]: ...


@dataclass_transform(frozen_default=True)
def frozen_dataclass(cls: Any = None, /, *, kw_only: bool = False) -> Any:
    """``@dataclass(frozen=True[, kw_only=True])``, built without compiling source at definition (module doc)."""
    if cls is None:
        return lambda c: _make(c, kw_only)
    return _make(cls, kw_only)


def _make(cls: T, kw_only: bool) -> T:
    if "__slots__" in cls.__dict__:
        raise TypeError(f"frozen_dataclass: {cls.__qualname__} declares __slots__; use dataclass(frozen=True)")
    if any("InitVar" in str(hint) for hint in cls.__dict__.get("__annotations__", {}).values()):
        raise TypeError(f"frozen_dataclass: {cls.__qualname__} has an InitVar; use dataclass(frozen=True)")
    body = cls.__dict__
    own = {"__eq__": "__eq__" in body, "__repr__": "__repr__" in body,
           # as dataclass: a __hash__ Python set to None for a body's own __eq__ is no explicit one
           "__hash__": "__hash__" in body and not (body["__hash__"] is None and "__eq__" in body)}
    # frozen=False skips compiling __setattr__/__delattr__ (ours below); dataclass insists on True under a frozen base
    frozen_base = any(getattr(getattr(base, "__dataclass_params__", None), "frozen", False) for base in cls.__mro__[1:])
    cls = dataclasses.dataclass(cls, init=False, repr=False, eq=False, frozen=frozen_base, kw_only=kw_only)
    params = cls.__dataclass_params__  # type: ignore[attr-defined]
    params.init = params.repr = params.eq = params.frozen = True  # what the class is, for subclasses' checks
    fields = dataclasses.fields(cls)
    names = frozenset(f.name for f in fields)
    compared = tuple(f.name for f in fields if f.compare)
    hashed = tuple(f.name for f in fields if (f.compare if f.hash is None else f.hash))
    shown = tuple(f.name for f in fields if f.repr)

    def __eq__(self: Any, other: Any) -> Any:
        return _compiled(cls, "__eq__", _EQ.format(mine=_tuple_source("self", compared),
                                                    theirs=_tuple_source("other", compared)))(self, other)

    def __hash__(self: Any) -> int:
        return _compiled(cls, "__hash__", _HASH.format(mine=_tuple_source("self", hashed)))(self)

    @reprlib.recursive_repr()
    def __repr__(self: Any) -> str:
        return f"{self.__class__.__qualname__}({', '.join(f'{n}={getattr(self, n)!r}' for n in shown)})"

    def __setattr__(self: Any, name: str, value: Any) -> None:
        if type(self) is cls or name in names:
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
        super(cls, self).__setattr__(name, value)

    def __delattr__(self: Any, name: str) -> None:
        if type(self) is cls or name in names:
            raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")
        super(cls, self).__delattr__(name)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _compiled_init(cls)(self, *args, **kwargs)

    methods: dict[str, Any] = {"__setattr__": __setattr__, "__delattr__": __delattr__, "__init__": __init__}
    if not own["__eq__"]:
        methods["__eq__"] = __eq__
    if not own["__hash__"]:
        methods["__hash__"] = __hash__
    if not own["__repr__"]:
        methods["__repr__"] = __repr__
    for name, method in methods.items():
        method.__qualname__ = f"{cls.__qualname__}.{name}"
        setattr(cls, name, method)
    return cls


#: dataclass's own ``__eq__`` and ``__hash__`` (compiled on first use, as fast as dataclass's).
_EQ = """def __eq__(self, other):
    if other.__class__ is self.__class__:
        return {mine} == {theirs}
    return NotImplemented"""
_HASH = """def __hash__(self):
    return hash({mine})"""


def _tuple_source(name: str, fields: tuple[str, ...]) -> str:
    return "(" + "".join(f"{name}.{field}," for field in fields) + ")"


def _compiled(cls: type, method: str, source: str) -> Callable[..., Any]:
    """Compile ``source`` (one method of ``cls``) and install it on ``cls``."""
    namespace: dict[str, Any] = {}
    exec(source, {}, namespace)  # noqa: S102 - source built from the class's own field names
    function = namespace[method]
    function.__qualname__ = f"{cls.__qualname__}.{method}"
    setattr(cls, method, function)
    return function


def _compiled_init(cls: type) -> Callable[..., None]:
    """Compile ``cls``'s ``__init__`` (its fields' names, order, defaults and factories) and install it."""
    fields = [f for f in dataclasses.fields(cls) if f.init]
    env: dict[str, Any] = {"_MISSING": dataclasses.MISSING, "_object_setattr": object.__setattr__}
    params, body, keyword = [], [], False
    for f in sorted(fields, key=lambda f: bool(f.kw_only)):  # keyword-only fields after the positional ones
        if f.kw_only and not keyword:
            params.append("*")
            keyword = True
        if f.default_factory is not dataclasses.MISSING:
            env[f"_factory_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_MISSING")
            body.append(f"    _set({f.name!r}, _factory_{f.name}() if {f.name} is _MISSING else {f.name})")
            continue
        if f.default is not dataclasses.MISSING:
            env[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        else:
            params.append(f.name)
        body.append(f"    _set({f.name!r}, {f.name})")
    for f in dataclasses.fields(cls):  # non-init fields with a factory are made too, as dataclass does
        if not f.init and f.default_factory is not dataclasses.MISSING:
            env[f"_factory_{f.name}"] = f.default_factory
            body.append(f"    _set({f.name!r}, _factory_{f.name}())")
    if hasattr(cls, "__post_init__"):
        body.append("    self.__post_init__()")
    source = "\n".join([f"def __init__(self, {', '.join(params)}):", "    _set = _object_setattr.__get__(self)", *body])
    namespace: dict[str, Any] = {}
    exec(source, env, namespace)  # noqa: S102 - source built from the class's own field names
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init  # type: ignore[misc]
    return init
