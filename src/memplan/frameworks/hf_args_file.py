"""Reading ``--hf-args`` files: a TrainingArguments JSON object, or the command line of a script.

A text file holds the launch of a Trainer/TRL script (``torchrun --nproc_per_node 8 sft.py
--per_device_train_batch_size 4 --bf16 ...``), read with :mod:`memplan.frameworks.shell_script`
(continuations, variables). The command with the most ``--`` flags is the training command; the
launcher's flags before the ``*.py`` script come back as ``launcher.NAME``. Values are read as
HfArgumentParser reads them: a bare ``--flag`` is true, ``true``/``false``, numbers, JSON objects,
several words a list (``--lora_target_modules q_proj v_proj``). Example::

    >>> parse_hf_command_line("python train.py --per_device_train_batch_size 4 --bf16")
    {'per_device_train_batch_size': 4, 'bf16': True}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memplan.errors import ConfigError
from memplan.bounds import parse_json
from memplan.textfile import read_text_file

__all__ = ["parse_hf_command_line", "read_hf_args", "read_json_object"]

_FLAG = "--hf-args"


def read_hf_args(path: str | Path) -> dict[str, Any]:
    """A TrainingArguments JSON object, or the ``--flag value`` words of a script's command line."""
    text = read_text_file(path, field=_FLAG)
    if text.lstrip().startswith("{"):
        try:
            data = parse_json(text, field=_FLAG)
        except json.JSONDecodeError as exc:
            raise ConfigError(_FLAG, f"is not valid JSON (line {exc.lineno}: {exc.msg})", str(path)) from None
        return dict(data)
    return parse_hf_command_line(text)


def _value(words: list[str]) -> Any:
    if not words:
        return True  # a bare --flag (HfArgumentParser: nargs="?", const=True)
    values = [_scalar(w) for w in words]
    return values[0] if len(values) == 1 else values


def _scalar(word: str) -> Any:
    low = word.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(word)
        except ValueError:
            pass
    if word.strip().startswith(("{", "[")):
        try:
            return parse_json(word, field=_FLAG)
        except json.JSONDecodeError:
            return word
    return word


def _words_to_args(words: list[str], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    key: str | None = None
    pending: list[str] = []
    for word in [*words, "--"]:
        if word.startswith("--"):
            if key is not None:
                out[prefix + key] = _value(pending)
            name, sep, inline = word[2:].partition("=")
            key, pending = (name.replace("-", "_") or None), ([inline] if sep else [])
        elif key is not None:
            pending.append(word)
    return out


def parse_hf_command_line(text: str) -> dict[str, Any]:
    """``{field: value}`` of the training command in ``text`` (the command with the most flags);
    the launcher's flags before the ``*.py`` script are returned as ``launcher.NAME``."""
    from memplan.frameworks.shell_script import read_script

    commands = read_script(text, field=_FLAG)
    if not commands:
        raise ConfigError(_FLAG, "holds no command line (expected e.g. python train.py --per_device_train_batch_size 4)")
    words = max(commands, key=lambda c: sum(w.startswith("--") for w in c))
    script = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
    if script is None:
        return _words_to_args(words)
    return {**_words_to_args(words[:script], "launcher."), **_words_to_args(words[script + 1:])}


def read_json_object(path: str, base_dir: Path | None, key: str) -> dict[str, Any]:
    """The JSON object in the file ``path`` (relative: to ``base_dir`` if it is there, else the current
    folder) that field ``key`` of the arguments names; a value starting with ``{`` is the object itself, as
    TrainingArguments reads its dict fields (``_VALID_DICT_FIELDS``: ``--deepspeed '{"zero_optimization": ...}'``)."""
    if path.lstrip().startswith("{"):
        text = path
    else:
        file = Path(path).expanduser()
        if not file.is_absolute() and base_dir is not None and (base_dir / file).is_file():
            file = base_dir / file
        text = read_text_file(file, field=f"{_FLAG}: {key}")
    try:
        data = parse_json(text, field=f"{_FLAG}: {key}")
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{_FLAG}: {key}", f"is not valid JSON (line {exc.lineno}: {exc.msg})", path) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{_FLAG}: {key}", "must hold a JSON object", path)
    return data
