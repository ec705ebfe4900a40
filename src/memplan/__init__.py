"""memplan: how much GPU memory a training job needs, where it goes, and how to make it fit.

The public API mirrors the ``memplan`` command line::

    from memplan import estimate, load_model, Job, Parallelism, Batch

    model = load_model("llama-3.1-8b")
    job = Job(parallel=Parallelism(world_size=8, tp=2), batch=Batch(micro_batch_size=1, seq_length=8192))
    result = estimate(model, job, gpu=get_gpu("h100-80gb"))
    print(result.peak_allocated_bytes, result.fits)

Everything here is importable without torch.
"""

from memplan.categories import MemoryCategory
from memplan.errors import ConfigError, JobConfigError, MemplanError, ModelConfigError, UnsupportedError
from memplan.estimate import DEFAULT_FRAGMENTATION, Estimate, StageEstimate, estimate
from memplan.frameworks import FrameworkProfile, get_profile
from memplan.gpus import GPU, get_gpu, list_gpus
from memplan.job import Batch, Job, MoEOptions, Offload, Optimizer, Parallelism, Precision, Recompute, Sharding
from memplan.model import ModelSpec, list_presets, load_model, total_params

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_FRAGMENTATION",
    "GPU",
    "Batch",
    "ConfigError",
    "Estimate",
    "FrameworkProfile",
    "Job",
    "JobConfigError",
    "MemoryCategory",
    "MemplanError",
    "ModelConfigError",
    "ModelSpec",
    "MoEOptions",
    "Offload",
    "Optimizer",
    "Parallelism",
    "Precision",
    "Recompute",
    "Sharding",
    "StageEstimate",
    "UnsupportedError",
    "__version__",
    "estimate",
    "get_gpu",
    "get_profile",
    "list_gpus",
    "list_presets",
    "load_model",
    "total_params",
]
