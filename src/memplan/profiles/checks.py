"""What a framework cannot run, refused from its profile's data: its activation policies and the
framework-specific options (:data:`memplan.profiles.rules.FEATURES`) it has.

:class:`memplan.job.Job` runs these checks on every job; each refusal is one
:class:`~memplan.errors.JobConfigError` naming the flag, the framework and the rule.
"""

from __future__ import annotations

from typing import Any

from memplan.errors import JobConfigError
from memplan.profiles.framework import PROFILES, FrameworkProfile
from memplan.profiles.rules import FEATURES

__all__ = ["activation_policy_name", "check_features"]

#: The policy that takes ``--recompute-modules`` (Megatron's selective recompute).
_MODULES_POLICY = "megatron-selective"
_BUDGET_POLICY = "memory-budget"


def _having(test: Any) -> str:
    """``--framework a`` (or ``a or b``): the frameworks whose profile passes ``test``."""
    return " or ".join(p.name for p in PROFILES.values() if test(p))


def check_features(job: Any, profile: FrameworkProfile) -> None:
    """Refuse the first framework-specific option ``job`` turns on that ``profile`` does not run (and
    check the rule of each it runs)."""
    for feature in FEATURES:
        if not feature.on(job):
            continue
        if feature.name not in profile.features:
            use = _having(lambda p, name=feature.name: name in p.features)
            raise JobConfigError(feature.flag, f"{feature.what}; use --framework {use}", feature.value(job))
        if feature.rule is not None:
            feature.rule(job)


def activation_policy_name(profile: FrameworkProfile, *, mode: str, modules: str | None,
                           memory_budget: float | None, fine_tuning: bool) -> str:
    """The activation policy ``--recompute mode`` means under ``profile`` (``selective``: its own
    selective policy); a policy, ``--recompute-modules`` or ``--memory-budget`` the framework does
    not run with this job is refused."""
    name = profile.selective_policy if mode == "selective" else mode
    framework = profile.name
    if name not in profile.activation_policies:
        raise JobConfigError("--recompute", f"{name} is not an activation policy of --framework {framework} "
                             f"(it has {', '.join(profile.activation_policies)}; selective means "
                             f"{profile.selective_policy})", mode)
    if modules is not None and name != _MODULES_POLICY:
        use = _having(lambda p: p.selective_policy == _MODULES_POLICY)
        raise JobConfigError("--recompute-modules", f"is a Megatron-LM policy the chosen framework does not have "
                             f"(--framework {framework}, --recompute {mode}); use --framework {use} "
                             "with --recompute selective or drop it", modules)
    if fine_tuning and name in profile.full_training_only_policies:
        # the others that recompute, the most selective first
        others = [p for p in reversed(profile.activation_policies)
                  if p != "none" and p not in profile.full_training_only_policies]
        raise JobConfigError("--recompute", f"{name} on --framework {framework} is priced for full training "
                             "only (frozen layers and adapters under sub-module checkpoints are not modelled); "
                             f"use {' or '.join(others)} with fine-tuning", mode)
    if memory_budget is not None and name != _BUDGET_POLICY:
        use = _having(lambda p: _BUDGET_POLICY in p.activation_policies)
        raise JobConfigError("--memory-budget", f"only applies with --recompute memory-budget ({use}); the "
                             f"job has --recompute {mode}", memory_budget)
    return name
