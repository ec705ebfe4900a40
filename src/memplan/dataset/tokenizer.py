"""Find a tokenizer (``--tokenizer``, or the model's) and describe it without loading transformers.

A tokenizer is a ``tokenizer.json`` (the Rust ``tokenizers`` format every fast Hugging Face tokenizer
ships) plus, when present, ``tokenizer_config.json`` (special tokens, the chat template) and
``chat_template.jinja``. ``--tokenizer`` names the file, its folder, or a Hub id that must already be
in the local Hub cache (memplan never downloads one). With no ``--tokenizer`` the model's own folder
or Hub id is used; a shipped preset has no tokenizer files, so one must be named.

Its :attr:`TokenizerFiles.digest` (sha256 of the files' bytes) keys the length cache.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan.errors import ConfigError

__all__ = ["TokenizerFiles", "find_tokenizer"]

_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@dataclass(frozen=True, kw_only=True)
class TokenizerFiles:
    """The files of one tokenizer and what memplan reads from them."""

    #: ``tokenizer.json``.
    path: Path
    #: sha256 over the tokenizer's files (the cache key's tokenizer half).
    digest: str
    #: The chat template (Jinja text), or None when the tokenizer has none.
    chat_template: str | None = None
    #: Special tokens by name (``bos_token``, ``eos_token``, ...), as the chat template sees them.
    special_tokens: tuple[tuple[str, str], ...] = ()

    @property
    def eos_token(self) -> str | None:
        return dict(self.special_tokens).get("eos_token")


def find_tokenizer(tokenizer: str | None, model_ref: str | None) -> TokenizerFiles:
    """The tokenizer ``--tokenizer`` names, else the model's (a folder, config path or cached Hub id)."""
    flag = "--tokenizer"
    ref = tokenizer if tokenizer is not None else model_ref
    if ref is None:
        raise ConfigError(flag, "a tokenizer is needed to read --dataset: name a tokenizer.json, its folder or a "
                          "cached Hub id")
    path = _resolve(ref)
    if path is None:
        if tokenizer is None:
            raise ConfigError(flag, f"a tokenizer is needed to read --dataset: the model {ref!r} has no tokenizer "
                              "files here (a preset ships none, and none is in the Hub cache); name a "
                              "tokenizer.json, its folder or a cached Hub id", ref)
        raise ConfigError(flag, "must be a tokenizer.json, a folder holding one, or a Hub id in the local cache", ref)
    return _describe(path)


def _resolve(ref: str) -> Path | None:
    """``tokenizer.json`` for a file, a folder (or a config.json inside one) or a cached Hub id."""
    given = Path(ref).expanduser()
    if given.is_file() and given.name != "config.json":
        return given
    folder = given.parent if given.is_file() else given
    if (folder / "tokenizer.json").is_file():
        return folder / "tokenizer.json"
    if given.exists():
        return None
    return _cached_hub_file(ref)


def _cached_hub_file(ref: str) -> Path | None:
    from memplan.model.hub import looks_like_hub_id, split_hub_id

    if not looks_like_hub_id(ref):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub comes with datasets
        return None
    repo_id, revision = split_hub_id(ref)
    found = try_to_load_from_cache(repo_id, "tokenizer.json", revision=revision)
    return Path(found) if isinstance(found, str) else None


def _describe(path: Path) -> TokenizerFiles:
    digest = hashlib.sha256()
    for name in _FILES:
        file = path if name == "tokenizer.json" else path.parent / name
        if file.is_file():
            digest.update(name.encode() + b"\0" + file.read_bytes() + b"\0")
    config = _read_json(path.parent / "tokenizer_config.json")
    template_file = path.parent / "chat_template.jinja"
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else _template(config)
    return TokenizerFiles(path=path, digest=digest.hexdigest(), chat_template=template,
                          special_tokens=_special_tokens(config))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError("--tokenizer", f"{path} is not readable JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def _template(config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the tokenizer's default is "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _special_tokens(config: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    tokens = []
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens.append((name, value))
    return tuple(tokens)
