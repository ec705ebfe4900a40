"""What each setting of an input file did: modelled, no memory effect, or not modelled.

Every dialect that reads a file (``--hf-args``, ``--peft-config``, a Hub id) classifies each key it
reads as one :class:`InputSetting`; :class:`memplan.inputs.LoadedJob` carries them and every command
shows them (JSON ``input_settings`` and ``unmodelled_settings``; text: a warning block listing the
not-modelled ones). Nothing an input says is dropped silently. Example::

    >>> s = InputSetting(source="args.json", key="torch_compile", value=True, effect="not-modelled",
    ...                  note="compiled graphs fuse kernels; memplan prices eager kernels")
    >>> s.to_dict()["effect"]
    'not-modelled'

Importing this module imports nothing heavy.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Effect", "InputSetting", "dotted_leaves", "settings_dict", "unmodelled"]

#: ``modelled``: the value changes the Job (``note`` says how); ``no-memory-effect``: the value
#: cannot change GPU memory (logging, learning rate...); ``not-modelled``: it may change memory
#: and memplan does not price it (``note`` says what is assumed instead).
Effect = Literal["modelled", "no-memory-effect", "not-modelled"]


@dataclass(frozen=True, kw_only=True)
class InputSetting:
    """One key of an input file and what memplan did with it."""

    #: The input it came from (``--hf-args``, ``--peft-config``...).
    source: str
    #: The key as the file spells it (``gradient_checkpointing_kwargs.use_reentrant``).
    key: str
    #: The value in the file (JSON-compatible).
    value: Any
    effect: Effect
    #: How it was mapped (``--mbs 4``), or why it has no effect / is not modelled.
    note: str = ""

    def describe(self) -> str:
        """One line: ``--hf-args torch_compile = true: not modelled (...)``."""
        return f"{self.source} {self.key} = {json.dumps(_plain(self.value))}: {self.note}".rstrip(": ")

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "key": self.key, "value": _plain(self.value), "effect": self.effect,
                "note": self.note}


def _plain(value: Any) -> Any:
    """``value`` as JSON data (tuples → lists, other objects → their text)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    return str(value)


def dotted_leaves(data: Mapping[str, Any], prefix: str = "", *, empty_is_leaf: bool = False
                  ) -> Iterator[tuple[str, Any]]:
    """The leaves of a nested config as ``("section.sub.key", value)``, in file order. An empty
    section is a leaf of its own with ``empty_is_leaf`` (DeepSpeed's ``"monitor": {}``), else nothing."""
    for name, value in data.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping) and (value or not empty_is_leaf):
            yield from dotted_leaves(value, key + ".", empty_is_leaf=empty_is_leaf)
        else:
            yield key, value


def unmodelled(settings: Iterable[InputSetting]) -> tuple[InputSetting, ...]:
    """The settings memplan read and does not model."""
    return tuple(s for s in settings if s.effect == "not-modelled")


def settings_dict(settings: Iterable[InputSetting]) -> dict[str, list[Any]]:
    """The JSON fields every command adds: ``input_settings`` (every key read, as objects) and
    ``unmodelled_settings`` (what was not modelled, one string each: :meth:`InputSetting.describe`)."""
    items = tuple(settings)
    return {"input_settings": [s.to_dict() for s in items],
            "unmodelled_settings": [s.describe() for s in unmodelled(items)]}
