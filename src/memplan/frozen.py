"""A faster ``__init__`` for the frozen dataclasses an estimate builds on every call.

A frozen dataclass's generated ``__init__`` sets each field through ``object.__setattr__`` (a call
per field, since its own ``__setattr__`` refuses); :func:`direct_init` replaces it by one that writes
the fields into the instance's ``__dict__`` directly: the same signature, defaults and
``__post_init__``, the same value, still frozen afterwards (assignment still raises). Measured on
``StageEstimate`` (38 fields): 12.8 us -> 4.3 us a construction (benchmarks/speed.py, issue 24).

Only plain classes qualify: no ``__slots__`` (no ``__dict__`` to write), no ``default_factory`` and no
``InitVar`` (their generated code does more than store); others keep dataclasses' own ``__init__``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TypeVar

__all__ = ["direct_init"]

T = TypeVar("T", bound=type)


def direct_init(cls: T) -> T:
    """Give the frozen dataclass ``cls`` an ``__init__`` that stores its fields directly (see module)."""
    fields = [f for f in dataclasses.fields(cls) if f.init]
    init_vars = [name for name, hint in cls.__dict__.get("__annotations__", {}).items()
                 if "InitVar" in str(hint)]
    if ("__slots__" in cls.__dict__ or init_vars
            or any(f.default_factory is not dataclasses.MISSING for f in dataclasses.fields(cls))):
        return cls
    params, defaults, keyword = [], {}, False
    for param in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if param.kind is param.KEYWORD_ONLY and not keyword:
            params.append("*")
            keyword = True
        if param.default is param.empty:
            params.append(param.name)
        else:
            defaults[f"_default_{param.name}"] = param.default
            params.append(f"{param.name}=_default_{param.name}")
    lines = [f"def __init__(self, {', '.join(params)}):", "    _fields = self.__dict__"]
    lines += [f"    _fields[{f.name!r}] = {f.name}" for f in fields]
    if hasattr(cls, "__post_init__"):
        lines.append("    self.__post_init__()")
    namespace: dict[str, object] = {}
    exec("\n".join(lines), defaults, namespace)  # noqa: S102 - source built from the class's own field names
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"  # type: ignore[attr-defined]
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[misc]
    return cls
