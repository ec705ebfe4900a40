"""The sizes an input may have, checked before any work, so every answer comes in bounded time and memory.

Each limit is a named constant listed in docs/inputs.md ("Limits"); an input past one is refused
with one :class:`~memplan.errors.ConfigError` naming the field, the limit and the value (exit 2).
They are far above any real job (the largest models have ~130 layers and 384 experts; the largest
clusters ~10^5 GPUs) and far below what would take minutes or gigabytes to estimate.

The readers here are the bounded forms of what the dialects use:

- :func:`parse_json` — ``json.loads`` that refuses nesting deeper than :data:`MAX_NESTING` (checked by
  a scan before parsing, so Python's recursion limit is never reached) and integers longer than
  :data:`MAX_INT_DIGITS` digits (Python's own limit, 4300, raises a bare ``ValueError``);
- :func:`parse_yaml` — a ``yaml.SafeLoader`` that also refuses those, and more than
  :data:`MAX_YAML_NODES` nodes once aliases are expanded (a "billion laughs" document is a few lines
  that expand to 10^9 nodes).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from memplan.errors import ConfigError

__all__ = ["MAX_EVENTS", "MAX_EXPERTS", "MAX_GPUS", "MAX_HEADS", "MAX_INPUT_BYTES", "MAX_INT_DIGITS",
           "MAX_LAYERS", "MAX_MODEL_INT", "MAX_NAME_CHARS", "MAX_NESTING", "MAX_SNAPSHOT_BYTES", "MAX_TRACE_BYTES", "MAX_YAML_NODES", "check_at_most",
           "nesting_depth", "parse_json", "parse_yaml"]

#: Largest text input file (config.json, job file, DeepSpeed/PEFT/TOML config, launch script), bytes.
#: Read with a cap, so ``/dev/zero`` or a FIFO stops at the cap.
MAX_INPUT_BYTES = 16 << 20
#: Deepest nesting of arrays/objects in a JSON or YAML input (real configs nest under 10 deep).
MAX_NESTING = 100
#: Most digits of an integer in a JSON or YAML input (2^64 has 20).
MAX_INT_DIGITS = 30
#: Most nodes of a YAML document once its aliases are expanded.
MAX_YAML_NODES = 100_000
#: Most decoder layers a model may have (the largest published models have under 200).
MAX_LAYERS = 2_048
#: Most routed experts per MoE layer (published models: at most 384).
MAX_EXPERTS = 16_384
#: Most attention heads (query or key/value) per layer.
MAX_HEADS = 16_384
#: Largest any other integer of a model config may be (hidden size, vocabulary, positions): 2^40.
MAX_MODEL_INT = 1 << 40
#: Most GPUs a job may span (--gpus; also the product of its parallel sizes).
MAX_GPUS = 1 << 20
#: Most events a trace file may declare or hold (about 2 GiB of memory once read).
MAX_EVENTS = 10_000_000
#: Largest trace file, and the most bytes a gzip trace may inflate to.
MAX_TRACE_BYTES = 1 << 30
#: Largest snapshot pickle (torch.cuda.memory._dump_snapshot of a long run is hundreds of MB).
MAX_SNAPSHOT_BYTES = 4 << 30
#: Longest model name or path (Linux refuses a path component over 255 bytes).
MAX_NAME_CHARS = 1024


class _OnlyBrackets(dict):  # type: ignore[type-arg]
    """str.translate table keeping ``[]{}`` and deleting every other character."""

    def __missing__(self, code: int) -> int | None:
        return code if chr(code) in "[]{}" else None


_BRACKETS_ONLY = _OnlyBrackets()
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')


def check_at_most(field: str, value: Any, number: int, limit: int, limit_name: str,
                  error: type[ConfigError] = ConfigError) -> int:
    """``number`` (``value`` as read), or ``error`` when it exceeds ``limit`` (named ``limit_name`` in
    docs/inputs.md)."""
    if number > limit:
        raise error(field, f"must be at most {limit:,} (memplan's limit {limit_name})", value)
    return number


def nesting_depth(text: str) -> int:
    """The deepest ``[``/``{`` nesting of JSON ``text`` (inside strings skipped); C loops only."""
    from itertools import accumulate

    brackets = _STRING.sub("", text).translate(_BRACKETS_ONLY)
    return max(accumulate(1 if c in "[{" else -1 for c in brackets), default=0)


def _int_of(field: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if len(text.lstrip("-")) > MAX_INT_DIGITS:
            raise ConfigError(field, f"holds an integer of {len(text.lstrip('-')):,} digits; at most "
                              f"{MAX_INT_DIGITS} (memplan's limit MAX_INT_DIGITS)", text[:20] + "...")
        return int(text)

    return parse


def parse_json(text: str, *, field: str, **kwargs: Any) -> Any:
    """``json.loads(text, **kwargs)`` within :data:`MAX_NESTING` and :data:`MAX_INT_DIGITS`; a violation
    raises ConfigError naming ``field``. ``json.JSONDecodeError`` passes through for the caller's message."""
    if text.count("[") + text.count("{") > MAX_NESTING and nesting_depth(text) > MAX_NESTING:
        raise ConfigError(field, f"nests arrays/objects more than {MAX_NESTING} deep (memplan's limit MAX_NESTING)")
    try:
        return json.loads(text, parse_int=_int_of(field), **kwargs)
    except RecursionError:  # the scan above makes this unreachable; kept as the backstop
        raise ConfigError(field, f"nests arrays/objects more than {MAX_NESTING} deep (memplan's limit "
                          "MAX_NESTING)") from None


def parse_yaml(text: str, *, field: str, loader: Any = None) -> Any:
    """``yaml.load(text)`` with a SafeLoader (``loader``, a SafeLoader subclass, or SafeLoader) within
    :data:`MAX_NESTING`, :data:`MAX_INT_DIGITS` and :data:`MAX_YAML_NODES`; ``yaml.YAMLError`` passes through."""
    import yaml

    base = loader or yaml.SafeLoader
    if text.count("[") + text.count("{") > MAX_NESTING and nesting_depth(text) > MAX_NESTING:  # flow style
        raise ConfigError(field, f"nests more than {MAX_NESTING} deep (memplan's limit MAX_NESTING)")
    reader = base(text)
    try:
        node = reader.get_single_node()
        if node is None:
            return None
        _check_yaml_node(node, field)
        return reader.construct_document(node)
    except RecursionError:
        raise ConfigError(field, f"nests more than {MAX_NESTING} deep (memplan's limit MAX_NESTING)") from None
    finally:
        reader.dispose()


def _check_yaml_node(root: Any, field: str) -> None:
    """Count ``root``'s nodes as the constructor would build them (aliases expanded), its depth and its
    integers' digits, without recursion; raise at the first limit passed."""
    import yaml

    sizes: dict[int, int] = {}  # id(node) -> expanded size, for aliases seen again
    started: dict[int, int] = {}  # id(node) -> the count when its expansion began (a node still open)
    stack: list[tuple[Any, int, bool]] = [(root, 1, False)]
    total = 0
    while stack:
        node, depth, closing = stack.pop()
        if depth > MAX_NESTING:
            raise ConfigError(field, f"nests more than {MAX_NESTING} deep (memplan's limit MAX_NESTING)")
        key = id(node)
        if closing:
            sizes[key] = total - started.pop(key) + 1
            total += 1
        elif key in sizes:
            total += sizes[key]
        elif key in started:
            raise ConfigError(field, "holds an alias that contains itself (a recursive YAML structure)")
        elif isinstance(node, yaml.ScalarNode):
            total += 1
            if node.tag == "tag:yaml.org,2002:int" and sum(c.isdigit() for c in node.value) > MAX_INT_DIGITS:
                raise ConfigError(field, f"holds an integer of more than {MAX_INT_DIGITS} digits (memplan's limit "
                                  "MAX_INT_DIGITS)", node.value[:20] + "...")
        else:
            started[key] = total
            stack.append((node, depth, True))
            children = node.value if isinstance(node, yaml.SequenceNode) else [n for pair in node.value for n in pair]
            stack.extend((child, depth + 1, False) for child in reversed(children))
        if total > MAX_YAML_NODES:
            raise ConfigError(field, f"expands to more than {MAX_YAML_NODES:,} YAML nodes (aliases included; "
                              "memplan's limit MAX_YAML_NODES)")
