"""Read a Megatron-LM launch into ``{"--flag": value}``, whatever form it is written in.

Forms: a command line or bash launch script (``pretrain_gpt.py --num-layers 32 ...``; the script's
own variables are expanded by :mod:`memplan.frameworks.shell_script`), a YAML/JSON mapping of flags
(``--num-layers: 32`` or ``num_layers: 32``, optionally under ``MODEL_ARGS`` as in Megatron's
functional tests), a YAML/JSON list of tokens, or, in Python, a token list or a mapping.
:mod:`memplan.frameworks.megatron_args` maps the flags to a ModelSpec and a Job.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from memplan.errors import ConfigError
from memplan.frameworks.shell_script import Unresolved, read_script
from memplan.textfile import read_text_file

__all__ = ["parse_megatron_args", "read_megatron_args_file"]


def parse_megatron_args(source: str | Sequence[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Normalise a command line or launch script, a token list or a mapping into ``{"--flag": value}``.

    A flag followed by another flag (or nothing) is a switch and maps to ``True``; a flag given
    several values maps to the list of them; flags before a ``*.py`` script are the launcher's
    (torchrun, python -m ...) and are left out. A string is read as a bash script
    (:mod:`memplan.frameworks.shell_script`): its variables are expanded, and the flags of every
    command are collected (a later command's value wins). A variable the script never assigns
    standing where flags are expected is a ConfigError: its flags cannot be known.
    """
    if isinstance(source, Mapping):
        out: dict[str, Any] = {}
        for key, value in source.items():
            flag = key if str(key).startswith("--") else "--" + str(key).replace("_", "-")
            out[flag] = _bracketed(value)
        return out
    if not isinstance(source, str):
        return _flags([str(token) for token in source])
    args: dict[str, Any] = {}
    for words in read_script(source, field="--megatron-args"):
        if any(word.startswith("--") for word in words):
            args.update(_flags(words))
    return args


def _bracketed(value: Any) -> Any:
    """A mapping's ``"[a b c]"``: Megatron's functional tests (``_run_training.sh``) strip the brackets and
    pass the words as the flag's values (``--recompute-modules a b c``); one word is one value."""
    if isinstance(value, str) and len(value) > 2 and value.startswith("[") and value.endswith("]") \
            and "]" not in value[1:-1]:
        words = value[1:-1].split()
        return words[0] if len(words) == 1 else words
    return value


def _flags(tokens: Sequence[str]) -> dict[str, Any]:
    """The flags of one command; flags before the training script (``torchrun --nproc_per_node 8
    pretrain_gpt.py ...``) are the launcher's and are left out."""
    args: dict[str, Any] = {}
    current: str | None = None
    for index, token in enumerate(tokens):
        if token.endswith(".py") and not token.startswith("-"):
            args, current = {}, None  # the script: what came before it was the launcher's
        elif token.startswith("--"):
            flag, eq, value = token.partition("=")
            current = flag
            args[flag] = value if eq else True
        elif isinstance(token, Unresolved) and _where_flags_go(tokens, index, current, args):
            raise ConfigError("--megatron-args", f"uses {token} where flags are expected, but the script "
                              "never assigns it, so its flags are unknown",
                              hint="assign it in the file (memplan does not read the environment)")
        elif current is not None:
            existing = args[current]
            if existing is True:
                args[current] = token
            elif isinstance(existing, list):
                existing.append(token)
            else:
                args[current] = [existing, token]
    return args


def _where_flags_go(tokens: Sequence[str], index: int, current: str | None, args: Mapping[str, Any]) -> bool:
    """Whether ``tokens[index]`` stands where flags, not a flag's value or the command, are expected.

    The first word is the command (``$LAUNCHER pretrain_gpt.py``) unless a flag follows it directly
    (an argument file starting with ``$GPT_ARGS --num-layers 2``); later, a word after the command or
    after a flag that already has its value.
    """
    if index == 0:
        return len(tokens) == 1 or tokens[1].startswith("--")
    return current is None or args[current] is not True


def read_megatron_args_file(path: str | Path) -> dict[str, Any]:
    """Read a file holding a command line or launch script, or a YAML/JSON mapping of flags
    (optionally under ``MODEL_ARGS``), or a YAML/JSON list of tokens.

    The form is decided by the first line that is not blank, a comment or ``---``: a YAML mapping
    key (``--num-layers: 32``, ``MODEL_ARGS:``, ``"num_layers": 32``) or ``{`` means a mapping, ``- ``
    or ``[`` a list; anything else is a shell command line or script.
    """
    text = read_text_file(path, field="--megatron-args")
    form = _file_form(text)
    if form == "script":
        try:
            return parse_megatron_args(text)
        except ConfigError as exc:
            raise ConfigError(exc.field, exc.rule, str(path), hint=_hint(exc)) from None
    data = _load_yaml(text, str(path))
    if form == "list":
        if not isinstance(data, list) or not all(isinstance(t, (str, int, float)) for t in data):
            raise ConfigError("--megatron-args", "a list must hold the command-line tokens as strings", str(path))
        return parse_megatron_args([str(t) for t in data])
    if not isinstance(data, Mapping):
        raise ConfigError("--megatron-args", "must hold a command line or a mapping of flags", str(path))
    if "MODEL_ARGS" in data and isinstance(data["MODEL_ARGS"], Mapping):
        data = data["MODEL_ARGS"]
    return parse_megatron_args(data)


#: A YAML mapping key at the start of a line: a plain word, or a quoted string, then ":" and a space.
_YAML_KEY = re.compile(r"""(?:"[^"]*"|'[^']*'|[^\s"'=$#{}\[\]]+)\s*:(?:\s|$)""")


def _file_form(text: str) -> str:
    """``mapping``, ``list`` or ``script``, from the first significant line (see read_megatron_args_file)."""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "%")) or stripped == "---":
            continue
        if stripped.startswith("{") or _YAML_KEY.match(stripped):
            return "mapping"
        if stripped == "-" or stripped.startswith("- ") or stripped.startswith("[") and text.rstrip().endswith("]"):
            return "list"  # (bash's "[ -f x ] && ..." does not end with "]")
        return "script"
    return "script"


def _hint(exc: ConfigError) -> str:
    text = str(exc)
    return text.split("; ", 1)[1] if "; " in text else ""


def _load_yaml(text: str, where: str) -> Any:
    import yaml

    from memplan.bounds import parse_yaml

    try:
        return parse_yaml(text, field="--megatron-args")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError("--megatron-args", f"is not valid YAML/JSON{at}", where) from None
