"""Framework profiles: what Megatron-LM, torchtitan/FSDP2, DeepSpeed and HF Trainer really allocate."""

from memplan.frameworks.profiles import PROFILES, FrameworkProfile, get_profile

__all__ = ["PROFILES", "FrameworkProfile", "get_profile"]
