"""Framework defaults memplan does not model, reported for every job of the framework.

A TOML or an arguments file spells such a setting out and its reader reports it; a job given by flags
never names it, yet the framework still applies its default. A profile lists the rules here
(:attr:`memplan.profiles.framework.FrameworkProfile.unmodelled_defaults`); the estimator adds what
they return to ``Estimate.settings`` unless an input already reported the same key, so
``unmodelled_settings`` says it either way (never silent).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memplan.settings import InputSetting

__all__ = ["DefaultRule", "default_settings"]

#: A rule on a job (a :class:`memplan.job.Job`): the default it leaves in force, or None.
DefaultRule = Callable[[Any], "InputSetting | None"]


def default_settings(rules: tuple[DefaultRule, ...], job: Any,
                     given: tuple[InputSetting, ...]) -> tuple[InputSetting, ...]:
    """``given`` and what ``rules`` report for ``job`` on keys no input reported."""
    keys = {s.key for s in given}
    found = (rule(job) for rule in rules)
    return given + tuple(s for s in found if s is not None and s.key not in keys)
