"""Exceptions raised by memplan.

Hierarchy::

    MemplanError                 base of everything memplan raises on purpose
    ├── ConfigError              bad user input: names the field, the rule and the value (CLI exit 2)
    │   ├── ModelConfigError     a model config / preset that cannot be understood
    │   └── JobConfigError       a training-job description that is invalid or inconsistent
    ├── UnsupportedError         valid input that memplan does not model (yet); says what to try
    └── MissingDependencyError   an optional package a feature needs is not installed; names the extra

The CLI turns a ``ConfigError`` into one coloured line and exit code 2, any other
``MemplanError`` into one line and exit code 1. Nothing here ever prints.
"""

from __future__ import annotations

__all__ = [
    "MemplanError",
    "ConfigError",
    "ModelConfigError",
    "JobConfigError",
    "UnsupportedError",
    "MissingDependencyError",
]


class MemplanError(Exception):
    """Base class of every error memplan raises deliberately."""


class ConfigError(MemplanError, ValueError):
    """Invalid user input. The message names the field, the rule and the given value."""

    def __init__(self, field: str, rule: str, value: object = None, *, hint: str = "") -> None:
        if not str(field).isprintable():  # a key holding a newline or a control character: still one line
            field = repr(str(field))[1:-1]
        self.field = field
        self.rule = rule
        self.value = value
        self.hint = hint
        text = f"{field}: {rule}"
        if value is not None:
            text += f" (got {value!r})"
        if hint:
            text += f"; {hint}"
        super().__init__(text)


class ModelConfigError(ConfigError):
    """A model config (Hugging Face config.json, preset, Megatron arguments) is malformed or unsupported."""


class JobConfigError(ConfigError):
    """A training-job setting is invalid or inconsistent with the model or the other settings."""


class UnsupportedError(MemplanError):
    """The input is well formed but describes something memplan does not model."""


class MissingDependencyError(MemplanError):
    """An optional package (numpy, matplotlib, torch) that one feature needs is not installed.

    The core (estimate, fit, alloc simulate, report) needs only typer, rich and pyyaml; the message
    names the ``memplan[extra]`` that installs the package, e.g. ``alloc plan needs numpy; install it
    with pip install 'memplan[alloc]'``.
    """

    def __init__(self, package: str, *, feature: str, extra: str) -> None:
        self.package = package
        self.feature = feature
        self.extra = extra
        super().__init__(f"{feature} needs {package}; install it with pip install 'memplan[{extra}]'")
