"""Memo keys for the estimator's pure functions of frozen inputs."""

from __future__ import annotations

__all__ = ["Same"]


class Same:
    """A memo key that compares its object by identity and keeps it alive while the memo holds it
    (model specs are large frozen values: hashing them by value per call would cost more than the memo saves)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj
