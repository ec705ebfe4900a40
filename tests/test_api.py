"""The public Python API: a curated ``memplan.__all__``, no torch import, typed frozen results."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

import memplan
from memplan import Batch, Estimate, Job, Parallelism, StageEstimate, estimate, get_gpu, load_model

#: The public surface. Changing it is an API change: update this set on purpose.
PUBLIC_API = {
    "build_job",
    "load_job",
    "DEFAULT_FRAGMENTATION",
    "GPU",
    "Batch",
    "ConfigError",
    "Estimate",
    "FitResult",
    "FrameworkProfile",
    "InputSetting",
    "Job",
    "JobConfigError",
    "JobRequest",
    "LoadedJob",
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
    "Trace",
    "UnsupportedError",
    "__version__",
    "estimate",
    "fit",
    "get_gpu",
    "get_profile",
    "list_gpus",
    "list_presets",
    "load_model",
    "read_trace",
    "total_params",
    "trace",
    "watch",
    "write_trace",
}


def test_all_is_the_curated_set() -> None:
    assert set(memplan.__all__) == PUBLIC_API
    assert len(memplan.__all__) == len(set(memplan.__all__))


def test_every_public_name_exists() -> None:
    for name in memplan.__all__:
        assert hasattr(memplan, name), name


def test_estimate_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import memplan\n"
        "job = memplan.Job(parallel=memplan.Parallelism(world_size=8, tp=2))\n"
        "est = memplan.estimate(memplan.load_model('llama-3.1-8b'), job, gpu=memplan.get_gpu('h100-80gb'))\n"
        "assert est.peak_allocated_bytes > 0\n"
        "print(sorted(m for m in ('torch', 'transformers', 'numpy', 'matplotlib') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_trace_fit_and_ckpt_are_lazy_callable_packages() -> None:
    code = (
        "import sys\n"
        "import memplan\n"
        "assert not any(m in sys.modules for m in ('memplan.fit', 'memplan.trace', 'memplan.ckpt'))\n"
        "result = memplan.fit('llama-3.1-8b', gpus=8, gpu='h100-80gb', top=1)\n"
        "assert isinstance(result, memplan.FitResult) and result.best is not None\n"
        "import memplan.fit.search\n"
        "assert callable(memplan.fit) and memplan.fit.fit is memplan.fit.search.fit\n"
        "assert callable(memplan.trace) and 'torch' not in sys.modules\n"
        "assert memplan.ckpt.auto_checkpoint and 'torch' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def result() -> Estimate:
    job = Job(parallel=Parallelism(world_size=8, pp=2), batch=Batch(global_batch_size=16))
    return estimate(load_model("llama-3.1-8b"), job, gpu=get_gpu("h100-80gb"))


def test_results_are_frozen_dataclasses(result: Estimate) -> None:
    for obj in (result, result.stages[0]):
        assert dataclasses.is_dataclass(obj)
        with pytest.raises(dataclasses.FrozenInstanceError):
            obj.peak_allocated_bytes = 0  # type: ignore[misc]
    assert isinstance(result.stages, tuple)
    assert all(isinstance(s, StageEstimate) for s in result.stages)


def test_bytes_are_ints(result: Estimate) -> None:
    def byte_fields(obj: object) -> dict[str, object]:
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name.endswith("_bytes")}  # type: ignore[arg-type]

    values = byte_fields(result)
    for stage in result.stages:
        values.update({f"stage{stage.stage}.{k}": v for k, v in byte_fields(stage).items()})
    assert len(values) > 10
    for name, value in values.items():
        assert isinstance(value, int) and not isinstance(value, bool), name
    assert isinstance(result.headroom_bytes, int)


def test_to_dict_matches_fields(result: Estimate) -> None:
    data = result.to_dict()
    assert data["peak_allocated_bytes"] == result.peak_allocated_bytes
    assert data["peak_stage"] == result.peak_stage
    assert len(data["stages"]) == len(result.stages) == 2
    assert data["gpu"]["fits"] is result.fits


def test_job_is_frozen() -> None:
    job = Job()
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.framework = "hf"  # type: ignore[misc]
