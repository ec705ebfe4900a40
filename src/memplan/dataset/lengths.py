"""Token lengths of every example: the dataset's fields turned into text, tokenized in Rust, cached.

What a row becomes, as the trainers build their ``input_ids``:

* ``--text-field F``: the text, tokenized with the tokenizer's special tokens (its post-processor adds
  BOS where the model wants one). TRL's SFTTrainer appends the EOS token first when the text does not
  end with it (``add_eos=True`` here, for the ``trl-*`` rules).
* ``--messages-field F``: the tokenizer's chat template rendered over the messages (transformers'
  ``render_jinja_template``, the code ``apply_chat_template`` runs), tokenized without special
  tokens, as ``apply_chat_template(tokenize=True)`` does.
* ``--prompt-field P --completion-field C``: prompt and completion joined (strings; EOS appended as
  for text) or, when both are message lists, the template over the prompt's messages followed by the
  completion's, as TRL tokenizes prompt-completion rows.

Tokenization is ``tokenizers.Tokenizer.encode_batch_fast`` (parallel in Rust). The lengths are cached
as a ``.npy`` file under ``$MEMPLAN_CACHE`` (default ``~/.cache/memplan``)/``lengths``, keyed by the
sha256 of the dataset's bytes, the tokenizer files' sha256 and the field options; a second run reads
that file and neither opens the dataset nor imports ``datasets``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memplan.dataset.source import content_digest, open_dataset
from memplan.dataset.tokenizer import TokenizerFiles
from memplan.errors import ConfigError
from memplan.textfile import write_atomic

__all__ = ["Fields", "cache_dir", "token_lengths"]

_BATCH = 4096
_VERSION = "2"


@dataclass(frozen=True, kw_only=True)
class Fields:
    """Which columns hold an example, and how the trainer turns them into tokens."""

    text: str | None = None
    messages: str | None = None
    prompt: str | None = None
    completion: str | None = None
    #: Append the EOS token to plain text that does not end with it (TRL's SFTTrainer does).
    add_eos: bool = False

    def __post_init__(self) -> None:
        kinds = [self.text is not None, self.messages is not None, self.prompt is not None or self.completion is not None]
        if sum(kinds) > 1:
            raise ConfigError("--text-field", "give one of --text-field, --messages-field or "
                              "--prompt-field/--completion-field")
        if (self.prompt is None) != (self.completion is None):
            raise ConfigError("--prompt-field", "--prompt-field and --completion-field go together")

    def key(self) -> str:
        return repr((self.text, self.messages, self.prompt, self.completion, self.add_eos))


def cache_dir() -> Path:
    """Where memplan caches derived data: ``$MEMPLAN_CACHE`` or ``~/.cache/memplan``."""
    return Path(os.environ.get("MEMPLAN_CACHE") or Path.home() / ".cache" / "memplan").expanduser()


def token_lengths(path: str, fields: Fields, tokenizer: TokenizerFiles, *, vocab_size: int | None = None
                  ) -> tuple[np.ndarray, bool]:
    """The token length of every row of the dataset at ``path`` (int64) and whether it came from the cache.

    ``vocab_size``: the model's; a row whose token ids reach it is refused (the tokenizer is not the model's).
    """
    key = hashlib.sha256("\0".join((_VERSION, content_digest(path), tokenizer.digest, fields.key(),
                                    str(vocab_size))).encode()).hexdigest()
    cached = cache_dir() / "lengths" / f"{key}.npy"
    if cached.is_file():
        try:
            return np.load(cached, allow_pickle=False), True
        except (OSError, ValueError):
            pass  # a damaged cache file is recomputed and replaced
    lengths = _compute(path, fields, tokenizer, vocab_size)
    _save(cached, lengths)
    return lengths, False


def _compute(path: str, fields: Fields, tokenizer: TokenizerFiles, vocab_size: int | None) -> np.ndarray:
    from tokenizers import Tokenizer

    data = open_dataset(path)
    try:
        rust = Tokenizer.from_file(str(tokenizer.path))
    except Exception as exc:  # the Rust parser raises a bare Exception on any malformed file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError("--tokenizer", f"{tokenizer.path}: not a tokenizer.json the tokenizers library can read "
                          f"({first})") from None
    rust.no_truncation()  # transformers turns both off for a call that asks for neither
    rust.no_padding()
    texts, special = _texts(data, path, fields, tokenizer)
    too_big = vocab_size is not None and rust.get_vocab_size(with_added_tokens=True) > vocab_size
    lengths = None if too_big else _counted(texts, rust, tokenizer, special)
    if lengths is None:
        lengths = np.full(len(texts), -1, dtype=np.int64)
    left = np.flatnonzero(lengths < 0).tolist()
    for start in range(0, len(left), _BATCH):
        rows = left[start:start + _BATCH]
        encodings = rust.encode_batch_fast([texts[i] for i in rows], add_special_tokens=special)
        lengths[rows] = [len(e) for e in encodings]
        if too_big:
            _check_vocab(encodings, start, vocab_size, path, fields, tokenizer)
    return lengths


def _counted(texts: list[str], rust: Any, tokenizer: TokenizerFiles, special: bool) -> np.ndarray | None:
    """The fast exact counts of :mod:`~memplan.dataset.fastcount` (-1: rows it leaves to encode_batch_fast)."""
    try:
        import regex  # noqa: F401  (transformers' dependency; without it every row goes to encode_batch_fast)
    except ImportError:
        return None
    from memplan.dataset.fastcount import count_tokens

    spec = json.loads(tokenizer.path.read_text(encoding="utf-8"))
    return count_tokens(texts, rust, spec, add_special_tokens=special)


def _check_vocab(encodings: list[Any], start: int, vocab_size: int | None, path: str, fields: Fields,
                 tokenizer: TokenizerFiles) -> None:
    assert vocab_size is not None
    for offset, encoding in enumerate(encodings):
        if encoding.ids and max(encoding.ids) >= vocab_size:
            raise ConfigError("--tokenizer", f"{path}: row {start + offset + 1}, field {_field_name(fields)!r}: "
                              f"token id {max(encoding.ids)} is outside the model's vocabulary of {vocab_size} "
                              f"(the tokenizer {tokenizer.path} is not the model's)")


def _field_name(fields: Fields) -> str:
    return fields.text or fields.messages or f"{fields.prompt}+{fields.completion}"


def _texts(data: Any, path: str, fields: Fields, tokenizer: TokenizerFiles) -> tuple[list[str], bool]:
    """The strings to tokenize and whether the tokenizer adds its special tokens to them."""
    from memplan.dataset.templates import render_chats

    if fields.messages is not None:
        chats = _column(data, path, fields.messages)
        return render_chats(chats, path, fields.messages, tokenizer), False
    if fields.prompt is not None and fields.completion is not None:
        prompts, completions = _column(data, path, fields.prompt), _column(data, path, fields.completion)
        if prompts and isinstance(prompts[0], list):
            chats = [p + c if isinstance(p, list) and isinstance(c, list) else None
                     for p, c in zip(prompts, completions, strict=True)]
            return render_chats(chats, path, f"{fields.prompt}+{fields.completion}", tokenizer), False
        _check_strings(prompts, path, fields.prompt)
        _check_strings(completions, path, fields.completion)
        return [p + _with_eos(c, fields, tokenizer) for p, c in zip(prompts, completions, strict=True)], True
    name = fields.text or "text"
    texts = _column(data, path, name)
    _check_strings(texts, path, name)
    return [_with_eos(t, fields, tokenizer) for t in texts] if fields.add_eos else texts, True


def _with_eos(text: str, fields: Fields, tokenizer: TokenizerFiles) -> str:
    eos = tokenizer.eos_token
    return text + eos if fields.add_eos and eos and not text.endswith(eos) else text


def _column(data: Any, path: str, name: str) -> list[Any]:
    if name not in data.column_names:
        raise ConfigError("--dataset", f"{path}: row 1 has no field {name!r} (fields: {', '.join(data.column_names)})")
    return data[name] if isinstance(data[name], list) else list(data[name])


def _check_strings(values: list[Any], path: str, name: str) -> None:
    for row, value in enumerate(values, start=1):
        if not isinstance(value, str):
            raise ConfigError("--dataset", f"{path}: row {row}, field {name!r}: must be a string",
                              type(value).__name__)


def _save(target: Path, lengths: np.ndarray) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, lambda partial: np.save(partial, lengths, allow_pickle=False), suffix=".npy")
    except OSError:
        return  # an unwritable cache only costs the next run its speed
