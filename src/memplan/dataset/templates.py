"""Chat templates rendered as ``apply_chat_template`` renders them (transformers' own Jinja renderer).

The tokenizer's special tokens (``bos_token``, ``eos_token``, ...) are passed to the template as
``apply_chat_template`` passes its ``special_tokens_map``. Conversations are rendered a block at a time;
when a block fails, its rows are rendered one by one so that the error names the row.
"""

from __future__ import annotations

from typing import Any

from memplan.dataset.tokenizer import TokenizerFiles
from memplan.errors import ConfigError

__all__ = ["render_chats"]

_BLOCK = 1024


def render_chats(chats: list[Any], path: str, field: str, tokenizer: TokenizerFiles) -> list[str]:
    """Each conversation (a list of ``{"role", "content"}`` messages) rendered by the chat template."""
    if tokenizer.chat_template is None:
        raise ConfigError("--messages-field", f"{path}: field {field!r} holds messages but the tokenizer "
                          f"{tokenizer.path} has no chat template")
    from transformers.utils.chat_template_utils import render_jinja_template

    special = dict(tokenizer.special_tokens)
    rendered: list[str] = []
    for start in range(0, len(chats), _BLOCK):
        block = chats[start:start + _BLOCK]
        _check_messages(block, start, path, field)
        try:
            texts, _ = render_jinja_template(block, chat_template=tokenizer.chat_template, **special)
        except Exception:  # the template's own error: find the row it failed on
            texts = [_render_one(chat, start + i, path, field, tokenizer, special) for i, chat in enumerate(block)]
        rendered.extend(texts)
    return rendered


def _render_one(chat: list[Any], index: int, path: str, field: str, tokenizer: TokenizerFiles,
                special: dict[str, str]) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        texts, _ = render_jinja_template([chat], chat_template=tokenizer.chat_template, **special)
    except Exception as exc:  # jinja2's TemplateError, raise_exception() in templates, TypeError
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError("--messages-field", f"{path}: row {index + 1}, field {field!r}: the chat template of "
                          f"{tokenizer.path} failed ({message})") from None
    return str(texts[0])


def _check_messages(block: list[Any], start: int, path: str, field: str) -> None:
    for offset, chat in enumerate(block):
        ok = isinstance(chat, list) and all(isinstance(m, dict) and "role" in m for m in chat)
        if not ok or not chat:
            raise ConfigError("--messages-field", f"{path}: row {start + offset + 1}, field {field!r}: must be a "
                              "non-empty list of {role, content} messages", type(chat).__name__)
