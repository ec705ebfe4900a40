"""Exceptions raised by memplan.

Hierarchy::

    MemplanError                 base of everything memplan raises on purpose
    ├── ConfigError              bad user input: names the field, the rule and the value (CLI exit 2)
    │   ├── ModelConfigError     a model config / preset that cannot be understood
    │   └── JobConfigError       a training-job description that is invalid or inconsistent
    └── UnsupportedError         valid input that memplan does not model (yet); says what to try

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
]


class MemplanError(Exception):
    """Base class of every error memplan raises deliberately."""


class ConfigError(MemplanError, ValueError):
    """Invalid user input. The message names the field, the rule and the given value."""

    def __init__(self, field: str, rule: str, value: object = None, *, hint: str = "") -> None:
        self.field = field
        self.rule = rule
        self.value = value
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
