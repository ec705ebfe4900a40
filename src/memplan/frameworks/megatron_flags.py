"""What memplan does with each Megatron-LM flag: modelled, no memory effect, or not modelled.

Every flag of Megatron-LM's argument parser (the list in ``megatron_flag_list.txt``, written by
``scripts/extract_megatron_flags.py`` from ``megatron/training/arguments.py``) is classified here,
so that a launch given to ``--megatron-args`` reports each flag it holds
(:func:`megatron_settings`; JSON ``input_settings``, and the not-modelled ones in
``unmodelled_settings`` and the text output's warning block). The tables are grouped by what the
flags do; a few whole families share one rule (:data:`_FAMILIES`: logging, checkpointing, data
loading, inference serving...), each stating why. Example::

    >>> classify("--optimizer-cuda-graph", True)[0]
    'not-modelled'
    >>> classify("--num-layers", 32)[0]
    'modelled'

A flag that is neither in Megatron's list nor a flag of an older Megatron that memplan still reads
is reported as not modelled ("not a Megatron-LM flag").
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Any

from memplan.frameworks.megatron_flag_table import FAMILIES, GROUPS, MODELLED, OLDER_FLAGS
from memplan.settings import Effect, InputSetting

__all__ = ["classify", "flag_list", "flag_list_version", "megatron_settings"]

_SOURCE = "--megatron-args"
_LIST_FILE = "megatron_flag_list.txt"

#: (flag, value) pairs whose value changes the classification of a modelled flag.
_BY_VALUE: dict[tuple[str, str], tuple[Effect, str]] = {
    ("--moe-token-dispatcher-type", "flex"): (
        "modelled", ("flex: DeepEP's or HybridEP's buffer priced outside the allocator (NCCL-EP's is reported under "
        "--moe-flex-dispatcher-backend); the permuted tokens priced as the all-to-all dispatcher's")),
    ("--moe-flex-dispatcher-backend", "hybridep"): (
        "modelled", ("HybridEP's shared dispatch/combine buffer priced outside the allocator (DeepEP hybrid-ep "
                     "branch's layout, 8 ranks per NVLink domain; its RDMA staging across domains is not)")),
    ("--moe-flex-dispatcher-backend", "ncclep"): (
        "not-modelled", "NCCL-EP's buffers are not priced"),
    ("--cuda-graph-impl", "none"): ("no-memory-effect", "no CUDA graphs (Megatron's default)"),
    ("--muon-fp32-matmul-prec", "medium"): (
        "modelled", "bf16 Newton-Schulz iterates (Megatron's default), as memplan prices Muon's step"),
    ("--muon-scalar-optimizer", "lion"): (
        "not-modelled", "Lion as Muon's scalar optimizer is not modelled (memplan refuses it; adam is)"),
}


@cache
def _list_text() -> str:
    return resources.files("memplan.frameworks").joinpath(_LIST_FILE).read_text()


def flag_list() -> frozenset[str]:
    """Every flag of Megatron-LM's parser at the commit ``megatron_flag_list.txt`` was written from."""
    return frozenset(line for line in _list_text().splitlines() if line.startswith("--"))


def flag_list_version() -> str:
    """The Megatron-LM commit the flag list was written from (its first 7 hex digits)."""
    for line in _list_text().splitlines():
        if "commit " in line:
            return line.split("commit ", 1)[1].split(",")[0][:7]
    return "unknown"


@cache
def _table() -> dict[str, tuple[Effect, str]]:
    table: dict[str, tuple[Effect, str]] = {}
    for effect, note, flags in GROUPS:
        for flag in flags:
            table[flag] = (effect, note)
    for flag, note in MODELLED.items():
        table[flag] = ("modelled", note)
    return table


def classify(flag: str, value: Any = True) -> tuple[Effect, str] | None:
    """``(effect, note)`` for a Megatron flag given ``value``, or None for a flag not classified."""
    special = _BY_VALUE.get((flag, str(value)))
    if special is not None:
        return special
    found = _table().get(flag)
    if found is not None:
        return found
    for prefix, effect, note in FAMILIES:
        if flag.startswith(prefix):
            return effect, note
    return None


def _switched_off(value: Any) -> bool:
    """A switch written as ``false`` in a mapping (``--tp-comm-overlap: false``) is not set."""
    return value is False or (isinstance(value, str) and value.lower() == "false")


def megatron_settings(args: Mapping[str, Any]) -> tuple[InputSetting, ...]:
    """One InputSetting per flag of a Megatron launch (``{"--flag": value}``), values as given."""
    known = flag_list() | OLDER_FLAGS
    out: list[InputSetting] = []
    for flag, value in args.items():
        found = classify(flag, value)
        if flag not in known:
            effect: Effect = "not-modelled"
            note = f"not a Megatron-LM flag (version {flag_list_version()}); memplan cannot tell what it does"
        elif found is None:
            effect, note = "not-modelled", "a Megatron-LM flag memplan has not classified"
        elif found[0] == "not-modelled" and _switched_off(value):
            effect, note = "no-memory-effect", "not set (false)"
        else:
            effect, note = found
        out.append(InputSetting(source=_SOURCE, key=flag, value=value, effect=effect, note=note))
    return tuple(out)
