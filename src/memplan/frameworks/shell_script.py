"""The words of each command of a shell launch script, with the script's own variables expanded.

Megatron-LM is launched from bash scripts that set variables first and use them in the command::

    TP=2
    export SEQ=4096
    GPT_ARGS="--num-layers 24 --hidden-size 1024"
    MODEL_ARGS=(--num-attention-heads 16 --seq-length ${SEQ:-2048})
    torchrun pretrain_gpt.py $GPT_ARGS "${MODEL_ARGS[@]}" --tensor-model-parallel-size ${TP} 2>&1 | tee log

:func:`read_script` returns ``[["torchrun", "pretrain_gpt.py", "--num-layers", "24", ...], ["tee", "log"]]``.

Understood, as bash does them: backslash-continued lines; ``#`` comments; single quotes (nothing
expands), double quotes (expands, never splits), backslash escapes; assignments ``NAME=value``,
``NAME+=value``, arrays ``NAME=(...)`` / ``NAME+=(...)``, with ``export`` / ``declare`` / ``local``
/ ``readonly``; expansions ``$NAME``, ``${NAME}``, ``${NAME:-word}`` / ``${NAME-word}`` /
``${NAME:=word}`` / ``${NAME:+word}``, ``${NAME[@]}`` / ``${NAME[*]}`` / ``${NAME[i]}``,
``$((integer arithmetic))``; unquoted expansions split into words; a command ends at a newline,
``;``, ``&&``, ``||``, ``|`` or ``&``; redirections (``> log``, ``2>&1``) are dropped.

Known limitations: nothing is run, so ``$(command)`` and backquoted commands stay as written, and
variables set by control flow (``if``, ``for``, functions) are read in file order only; the environment is never read, so the result depends
on the file alone. ``"$@"`` and ``$*`` (the script's own arguments) expand to nothing, as when the
script runs without arguments. Any other variable the script never assigns stays as written
(``$TP``) and the word is an :class:`Unresolved` string, so callers can report it.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable

from memplan.errors import ConfigError

__all__ = ["Unresolved", "read_script", "unresolved_hint"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BRACED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:\[([^\]]*)\])?(?:(:?[-=+])(.*))?", re.DOTALL)
#: A word that is one variable reference, maybe in double quotes (``$X``, ``"${X}"``, ``${X[@]}``).
_REFERENCE = re.compile(r'"?\$(?:[A-Za-z_][A-Za-z0-9_]*|\{[A-Za-z_][A-Za-z0-9_]*(?:\[[@*]\])?\})"?')
_DECLARE = frozenset({"export", "declare", "local", "readonly", "typeset"})
_ENDS_WORD = frozenset(" \t\n;&|<>()")
_ARITH: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}


class Unresolved(str):
    """Text kept as written: a variable the script never assigns (``$TP``) or a command substitution.

    :func:`read_script` returns a word as ``Unresolved`` when the whole word is one such variable.
    """


def unresolved_hint(value: object) -> str:
    """A hint for a flag value still holding ``$NAME`` (the variable is not assigned in the file)."""
    text = str(value)
    if "$" not in text:
        return ""
    return "a shell variable the file never assigns (memplan does not read the environment); " \
           "assign it in the file, or give the flag's value there"


def read_script(text: str, *, field: str = "script") -> list[list[str]]:
    """The words of each command of ``text`` (assignment-only commands are consumed, not returned).

    An unterminated quote, ``${`` or ``$(`` is a :class:`ConfigError` naming ``field``.
    """
    return _Lexer(text.replace("\r\n", "\n"), field).commands()


class _Lexer:
    def __init__(self, text: str, field: str) -> None:
        self.text, self.pos, self.field = text, 0, field
        self.variables: dict[str, list[str]] = {}

    # ---------------------------------------------------------------- commands and words

    def commands(self) -> list[list[str]]:
        out: list[list[str]] = []
        words: list[str] = []
        leading = True  # only assignments (and export/declare) seen so far in this command
        declaring = False  # after export/declare: its options (-a, -x) are not the command
        while True:
            self._skip_blanks()
            char = self._peek()
            if char == "#":
                self._skip_comment()
            elif char in ("", "\n", ";", "&", "|"):
                if words and not leading:
                    out.append(words)
                words, leading, declaring = [], True, False
                if char == "":
                    return out
                self.pos += 1
            elif char in "<>" or (char.isdigit() and self._redirect_after_digits()):
                self._skip_redirect()
            elif char in "()":
                self.pos += 1  # subshell / grouping: its words still count
            else:
                produced = self._word(assignment_ok=leading)
                if produced is None:
                    continue
                if leading and (produced[:1] and produced[0] in _DECLARE or declaring and produced[0][:1] == "-"):
                    declaring = True
                    continue
                leading = False
                words.extend(word for word in produced if word)

    def _word(self, *, assignment_ok: bool) -> list[str] | None:
        """The words one shell word expands to, or None for an assignment (recorded)."""
        start = self.pos
        fields: list[str] = []
        cur: list[str] = []
        have, literal_only = False, True
        while (char := self._peek()) and char not in _ENDS_WORD:
            if char == "=" and assignment_ok and literal_only and _NAME.fullmatch("".join(cur).removesuffix("+")):
                self.pos += 1
                self._assign("".join(cur))
                return None
            if char == "\\":
                nxt = self.text[self.pos + 1:self.pos + 2]
                self.pos += 2
                if nxt != "\n":
                    cur.append(nxt)
                    have, literal_only = True, False
            elif char in "'`":  # `command` is kept as written, like $(command)
                text = self._until(char)
                cur.append(text if char == "'" else f"`{text}`")
                have, literal_only = True, False
            elif char == '"':
                self._double_quoted(cur, fields)
                have, literal_only = True, False
            elif char == "$":
                values, whole = self._expansion()
                literal_only = False
                if len(values) == 1 and isinstance(values[0], Unresolved):
                    cur.append(values[0])  # kept as written, never split
                    have = True
                else:
                    have = self._split_into(values if whole else " ".join(values), cur, fields, have)
            else:
                cur.append(char)
                self.pos += 1
                have = True
        if have:
            fields.append("".join(cur))
        written = self.text[start:self.pos]
        if len(fields) == 1 and _REFERENCE.fullmatch(written) and fields[0] == written.strip('"'):
            return [Unresolved(fields[0])]  # a whole word that is one unassigned variable
        return fields

    def _assign(self, target: str) -> None:
        name, append = target.removesuffix("+"), target.endswith("+")
        if self._peek() == "(":
            self.pos += 1
            values = self._array_words()
        else:
            words = self._value_word()
            values = ["".join(words)]
            if append and self.variables.get(name):
                values = [self.variables[name][0] + values[0], *self.variables[name][1:]]
                append = False
        self.variables[name] = [*self.variables.get(name, []), *values] if append else values

    def _value_word(self) -> list[str]:
        """The right-hand side of a scalar assignment: expanded, never split."""
        parts: list[str] = []
        while (char := self._peek()) and char not in _ENDS_WORD:
            if char == "\\":
                parts.append(self.text[self.pos + 1:self.pos + 2].replace("\n", ""))
                self.pos += 2
            elif char in "'`":
                text = self._until(char)
                parts.append(text if char == "'" else f"`{text}`")
            elif char == '"':
                fields: list[str] = []
                self._double_quoted(parts, fields)
                parts = [" ".join([*fields, "".join(parts)])] if fields else parts
            elif char == "$":
                values, _ = self._expansion()
                parts.append(" ".join(values))
            else:
                parts.append(char)
                self.pos += 1
        return parts

    def _array_words(self) -> list[str]:
        words: list[str] = []
        while True:
            while self._peek() in (" ", "\t", "\n"):
                self.pos += 1
            char = self._peek()
            if char == "":
                raise ConfigError(self.field, "has an array assignment without its closing ')'")
            if char == ")":
                self.pos += 1
                return words
            if char == "#":
                self._skip_comment()
                continue
            if char == "\\" and self.text[self.pos + 1:self.pos + 2] == "\n":
                self.pos += 2
                continue
            produced = self._word(assignment_ok=False)
            words.extend(produced or [])
            if self._peek() in ";&|<>(":
                self.pos += 1

    @staticmethod
    def _split_into(values: list[str] | str, cur: list[str], fields: list[str], have: bool) -> bool:
        """Append an unquoted expansion to the word in progress, splitting it at whitespace."""
        items = [values] if isinstance(values, str) else values
        for index, value in enumerate(items):
            if index:
                if have:
                    fields.append("".join(cur))
                cur.clear()
                have = False
            parts = value.split()
            if not parts:
                continue
            if value[:1].isspace() and have:
                fields.append("".join(cur))
                cur.clear()
            cur.append(parts[0])
            for part in parts[1:]:
                fields.append("".join(cur))
                cur[:] = [part]
            have = True
            if value[-1:].isspace():
                fields.append("".join(cur))
                cur.clear()
                have = False
        return have

    def _double_quoted(self, cur: list[str], fields: list[str]) -> None:
        """A "..." string: expansions never split, except "${ARRAY[@]}" (one word per element)."""
        self.pos += 1
        while (char := self._peek()) != '"':
            if char == "":
                raise ConfigError(self.field, 'has a " without its closing quote')
            if char == "\\" and self.text[self.pos + 1:self.pos + 2] in ('"', "\\", "$", "`", "\n"):
                cur.append(self.text[self.pos + 1].replace("\n", ""))
                self.pos += 2
            elif char == "$":
                values, whole = self._expansion()
                if whole and len(values) > 1:
                    cur.append(values[0])
                    for value in values[1:]:
                        fields.append("".join(cur))
                        cur[:] = [value]
                else:
                    cur.append(" ".join(values))
            else:
                cur.append(char)
                self.pos += 1
        self.pos += 1

    # ---------------------------------------------------------------- expansions

    def _expansion(self) -> tuple[list[str], bool]:
        """Expand the ``$...`` at the cursor: (values, True when it is ``${NAME[@]}``-like)."""
        start = self.pos
        self.pos += 1
        char = self._peek()
        if self.text.startswith("((", self.pos):
            self.pos += 2
            body = self._balanced("((", "))")
            result = self._arithmetic(body)
            return ([str(result)] if result is not None else [Unresolved(self.text[start:self.pos])]), False
        if char == "(":
            self.pos += 1
            self._balanced("(", ")")
            return [Unresolved(self.text[start:self.pos])], False
        if char == "{":
            self.pos += 1
            body = self._balanced("{", "}")
            return self._braced(body, self.text[start:self.pos])
        if char in ("@", "*"):
            self.pos += 1
            return [], True
        match = _NAME.match(self.text, self.pos)
        if match is None:
            if char.isdigit() or char in "#?$!-":
                self.pos += 1
                return [Unresolved(self.text[start:self.pos])], False
            return ["$"], False
        self.pos = match.end()
        value = self.variables.get(match.group())
        return ([value[0]] if value else [""]) if value is not None else [Unresolved(self.text[start:self.pos])], False

    def _braced(self, body: str, written: str) -> tuple[list[str], bool]:
        match = _BRACED.fullmatch(body)
        if match is None:
            return [Unresolved(written)], False
        name, index, op, word = match.groups()
        value = self.variables.get(name)
        if op is not None:
            empty = value is None or (op.startswith(":") and value in ([], [""]))
            if op.endswith("+"):
                return ([] if empty else [self._expand_text(word)]), False
            if not empty:
                return value or [""], False
            default = self._expand_text(word)
            if op.endswith("="):
                self.variables[name] = [default]
            return [default], False
        if value is None:
            return [Unresolved(written)], False
        if index in ("@", "*"):
            return value, index == "@"
        if index is not None:
            position = self._arithmetic(index)
            return ([value[position]] if position is not None and 0 <= position < len(value) else [""]), False
        return [value[0] if value else ""], False

    def _expand_text(self, text: str) -> str:
        """``text`` (a ``${NAME:-word}`` word) expanded like the inside of double quotes."""
        sub = _Lexer('"' + text.replace('"', '\\"') + '"', self.field)
        sub.variables = self.variables
        cur: list[str] = []
        fields: list[str] = []
        sub._double_quoted(cur, fields)
        return " ".join([*fields, "".join(cur)])

    def _arithmetic(self, expression: str) -> int | None:
        text = self._expand_text(expression).replace("/", "//")
        text = _NAME.sub(lambda m: (self.variables.get(m.group()) or ["0"])[0] or "0", text)
        try:
            return _evaluate(ast.parse(text.strip(), mode="eval").body)
        except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
            return None

    # ---------------------------------------------------------------- cursor helpers

    def _peek(self) -> str:
        return self.text[self.pos:self.pos + 1]

    def _skip_blanks(self) -> None:
        while True:
            if self._peek() in (" ", "\t"):
                self.pos += 1
            elif self.text.startswith("\\\n", self.pos):
                self.pos += 2
            else:
                return

    def _skip_comment(self) -> None:
        end = self.text.find("\n", self.pos)
        self.pos = len(self.text) if end < 0 else end

    def _until(self, quote: str) -> str:
        end = self.text.find(quote, self.pos + 1)
        if end < 0:
            raise ConfigError(self.field, f"has a {quote} without its closing quote")
        value = self.text[self.pos + 1:end]
        self.pos = end + 1
        return value

    def _balanced(self, opener: str, closer: str) -> str:
        """The text up to the closer matching an opener already consumed; the cursor passes it."""
        depth, start = 1, self.pos
        while self.pos < len(self.text):
            if self.text.startswith(closer, self.pos):
                depth -= 1
                if depth == 0:
                    self.pos += len(closer)
                    return self.text[start:self.pos - len(closer)]
                self.pos += len(closer)
            elif self.text.startswith(opener, self.pos):
                depth += 1
                self.pos += len(opener)
            else:
                self.pos += 1
        raise ConfigError(self.field, f"has a '${opener}' without its closing '{closer}'")

    def _redirect_after_digits(self) -> bool:
        match = re.compile(r"\d+[<>]").match(self.text, self.pos)
        return match is not None

    def _skip_redirect(self) -> None:
        match = re.compile(r"\d*(?:&>>?|>>?|<<<?|<>|>\||<)(&\d+|&-)?").match(self.text, self.pos)
        self.pos = match.end() if match else self.pos + 1
        if match is not None and match.group(1):
            return
        self._skip_blanks()
        if self._peek() not in _ENDS_WORD | {""}:
            self._word(assignment_ok=False)


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        return _ARITH[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("not integer arithmetic")
