"""Framework profiles: what Megatron-LM, torchtitan/FSDP2, DeepSpeed and HF Trainer allocate and run.

The layer below :mod:`memplan.job` (see docs/architecture.md): it imports nothing from the job, the
policies, the framework readers or the estimator, so each of them may read a profile.
"""

from memplan.profiles.checks import activation_policy_name, check_features
from memplan.profiles.framework import (
    DEEPSPEED,
    FINE_TUNING_FRAMEWORK,
    HF,
    MEGATRON,
    PROFILES,
    TORCHTITAN,
    FrameworkProfile,
    get_profile,
    head_rows_split,
    vocab_split,
)
from memplan.profiles.zero3 import DEEPSPEED_ZERO3, Zero3Defaults

__all__ = ["DEEPSPEED", "DEEPSPEED_ZERO3", "FINE_TUNING_FRAMEWORK", "HF", "MEGATRON", "PROFILES", "TORCHTITAN", "FrameworkProfile", "activation_policy_name",
           "check_features", "get_profile", "head_rows_split", "vocab_split", "Zero3Defaults"]
