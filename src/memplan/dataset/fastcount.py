"""Exact token counts of byte-level BPE tokenizers for plain-ASCII rows, without building ``Encoding`` objects.

``Tokenizer.encode_batch_fast`` spends most of its time in its pre-tokenizer's regex and in building one
``Encoding`` (ids, offsets, masks) per row; memplan only needs each row's length. For the tokenizers of
GPT-2, Llama 3, Qwen 2, Mistral-Nemo and the like, the length of a row is, by the pipeline
``tokenizers`` runs (``TokenizerImpl::encode_single_sequence``):

1. the added tokens found in the text (leftmost-longest; one token each), splitting it into segments;
2. each segment normalized (none, or NFC: the identity on ASCII), then split by the pre-tokenizer's
   regex (``ByteLevel(use_regex=True)``: GPT-2's pattern; or ``Split(Regex, Isolated)`` followed by
   ``ByteLevel(use_regex=False)``) into pieces;
3. each piece byte-level mapped and tokenized by the BPE model on its own (the model never sees two
   pieces together);
4. plus the post-processor's special tokens when ``add_special_tokens``.

Here steps 1 and 2 run in Python's ``regex`` engine, and step 3 runs once per *distinct* piece through
the tokenizer's own model (``Tokenizer.model.tokenize``), memoized. A row is counted this way only when
it is printable ASCII (plus tab, newline, carriage return), where every regex engine agrees on ``\\s``,
``\\p{L}`` and ``\\p{N}``, and when its pieces cover it exactly; any other row, and any tokenizer whose
pipeline is not the one above (other normalizers or pre-tokenizers, BPE dropout, added tokens that strip
or match whole words, ``add_prefix_space``), is left to ``encode_batch_fast``.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

__all__ = ["count_tokens"]

#: The pattern of ``tokenizers``' ByteLevel pre-tokenizer with ``use_regex=True`` (GPT-2's).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
#: Characters outside printable ASCII, tab, newline and carriage return (the rows left to Rust).
_OUTSIDE = re.compile(r"[^\t\n\r\x20-\x7e]")
_NORMALIZERS = (None, "NFC")


#: Rows below which counting stays in one process (a fork and its pipe cost more than they save).
PARALLEL_ROWS = 20_000


def count_tokens(texts: list[str], rust: Any, spec: dict[str, Any], *, add_special_tokens: bool,
                 parallel_rows: int = PARALLEL_ROWS) -> np.ndarray | None:
    """Each row's token count, or -1 for rows left to ``encode_batch_fast``; None when the tokenizer's
    pipeline is not one this module reproduces. ``spec``: the tokenizer.json document of ``rust``.

    From ``parallel_rows`` rows on, where the machine has a second core and ``fork``, the second half
    of the rows is counted in a forked child (:mod:`memplan.dataset.forked`) while this process counts
    the first half; the counts are the same either way."""
    pattern = _piece_pattern(spec)
    if pattern is None:
        return None
    added = _added_patterns(rust)
    if added is None:
        return None
    post = rust.post_processor
    extra = post.num_special_tokens_to_add(False) if add_special_tokens and post is not None else 0

    def count(rows: list[str]) -> np.ndarray:
        return _count_rows(rows, _compiled(pattern), _PieceCounts(rust.model, _byte_table()), added, extra)

    if len(texts) >= parallel_rows:
        from memplan.dataset.forked import in_two_halves

        return in_two_halves(texts, count)
    return count(texts)


def _count_rows(texts: list[str], pieces: Any, counts: _PieceCounts, added: tuple[Any, ...], extra: int
                ) -> np.ndarray:
    out = np.full(len(texts), -1, dtype=np.int64)
    for row, text in enumerate(texts):
        if _OUTSIDE.search(text) is not None:
            continue
        segments = _split_added(text, added)
        total, covered = extra + (len(segments) - 1) // 2, True
        for segment in segments[::2]:
            found = pieces.findall(segment)
            covered = covered and sum(map(len, found)) == len(segment)
            total += sum(map(counts.__getitem__, found))
        if covered:
            out[row] = total
    return out


class _PieceCounts(dict[str, int]):
    """Distinct piece -> its token count by the tokenizer's own BPE model (filled on first sight)."""

    def __init__(self, model: Any, table: dict[int, int]) -> None:
        super().__init__()
        self._model, self._table = model, table

    def __missing__(self, piece: str) -> int:
        count = len(self._model.tokenize(piece.translate(self._table)))
        self[piece] = count
        return count


def _compiled(pattern: str) -> Any:
    """The pattern compiled for ASCII rows: Python's ``re`` with ``\\p{L}``/``\\p{N}`` spelled as their ASCII
    members (twice as fast as ``regex``), else the ``regex`` module for other Unicode classes."""
    ascii_form = _ascii_classes(pattern)
    if ascii_form is not None:
        try:
            return re.compile(ascii_form)
        except re.error:
            pass
    import regex

    return regex.compile(pattern)


def _ascii_classes(pattern: str) -> str | None:
    """``pattern`` with ``\\p{L}`` and ``\\p{N}`` as ``A-Za-z`` and ``0-9`` (bracketed outside a class);
    None when it uses another Unicode property (``\\p{M}``, ``\\P{L}``, ...)."""
    members = {"L": "A-Za-z", "N": "0-9"}
    out, i, depth = [], 0, 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and pattern[i + 1:i + 2] in ("p", "P"):
            match = re.match(r"\\p\{(L|N)\}", pattern[i:])
            if match is None:
                return None
            body = members[match.group(1)]
            out.append(body if depth else f"[{body}]")
            i += len(match.group(0))
            continue
        if char == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if char == "[" and not depth:
            depth = 1
            out.append(char)
            if pattern[i + 1:i + 2] == "^":
                out.append("^")
                i += 1
            if pattern[i + 1:i + 2] == "]":  # a literal ] first in a class
                out.append("]")
                i += 1
        elif char == "]" and depth:
            depth = 0
            out.append(char)
        else:
            out.append(char)
        i += 1
    return "".join(out)


def _byte_table() -> dict[int, int]:
    """GPT-2's byte -> printable character map (``bytes_to_unicode``), for the ASCII bytes."""
    printable = [*range(ord("!"), ord("~") + 1)]
    table, shifted = {}, 0
    for byte in range(128):
        if byte in printable:
            table[byte] = byte
        else:
            table[byte] = 256 + shifted
            shifted += 1
    return table


def _piece_pattern(spec: dict[str, Any]) -> str | None:
    """The pre-tokenizer's splitting regex, when the pipeline is one of the module docstring's."""
    normalizer = spec.get("normalizer")
    model = spec.get("model") or {}
    if (normalizer or {}).get("type") not in _NORMALIZERS or model.get("type") != "BPE" or model.get("dropout"):
        return None
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1 and _byte_level(steps[0], use_regex=True):
        return GPT2_PATTERN
    if len(steps) == 2 and steps[0].get("type") == "Split" and _byte_level(steps[1], use_regex=False):
        split = steps[0]
        regex_text = (split.get("pattern") or {}).get("Regex")
        if isinstance(regex_text, str) and split.get("behavior") == "Isolated" and not split.get("invert"):
            return regex_text
    return None


def _byte_level(step: dict[str, Any], *, use_regex: bool) -> bool:
    return (step.get("type") == "ByteLevel" and not step.get("add_prefix_space")
            and bool(step.get("use_regex", True)) == use_regex)


def _added_patterns(rust: Any) -> tuple[Any, ...] | None:
    """Regexes splitting on the added tokens, as ``AddedVocabulary`` does: first those matched in the raw
    text, then those matched after normalization (each leftmost-longest, captured); None when a token
    strips or matches whole words only (not reproduced here)."""
    tokens = list(rust.get_added_tokens_decoder().values())
    if any(t.lstrip or t.rstrip or t.single_word for t in tokens):
        return None
    out = []
    for normalized in (False, True):
        contents = sorted({t.content for t in tokens if t.content and t.normalized == normalized}, key=len,
                          reverse=True)
        if contents:
            out.append(re.compile("(" + "|".join(map(re.escape, contents)) + ")"))
    return tuple(out)


def _split_added(text: str, patterns: tuple[Any, ...]) -> list[str]:
    """``[text, token, text, token, ..., text]``: the row cut at its added tokens."""
    parts = [text]
    for pattern in patterns:
        parts = [piece for i, part in enumerate(parts)
                 for piece in (pattern.split(part) if i % 2 == 0 else [part])]
    return parts
