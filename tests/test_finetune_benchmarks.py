"""The fine-tuning benchmarks' fixed inputs: the grid, the CPU cases and the published entries are valid jobs.

Only the scripts' pure parts run here (no trace, no training): every job they will hand memplan is
accepted by :func:`memplan.load_job`, the grid is the one the issue fixed, and each published entry
states its source, number and unit.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from memplan.inputs import JobRequest, load_job

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_grid_is_the_fixed_grid() -> None:
    grid = _module("finetune_grid")
    cells = grid.grid()
    assert len(cells) == 3 * 4 * 2 * 2
    assert len({c.key for c in cells}) == len(cells)
    assert {c.model for c in cells} == {"llama-3.2-1b", "qwen2.5-7b", "qwen3-8b"}
    assert len(grid.grid(grid.MODELS[:1], grid.SEQS[:1])) == 8


@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen2.5-7b", "qwen3-8b"])
def test_grid_jobs_load(model: str) -> None:
    grid = _module("finetune_grid")
    for cell in grid.grid((model,)):
        job = load_job(JobRequest(model=cell.model, flags=cell.flags())).job
        assert job.finetune.peft == cell.method.peft
        assert job.finetune.quantize_base == cell.method.quantize
        assert job.recompute.mode == cell.recompute


def test_cpu_cases_load() -> None:
    cpu = _module("finetune_cpu")
    for case in cpu.CASES:
        job = load_job(JobRequest(model=str(cpu.CONFIG), flags=case.job_flags())).job
        assert job.batch.seq_length == cpu.SEQ
        assert job.finetune.lora_rank == case.rank


def test_published_entries() -> None:
    published = _module("finetune_published")
    entries = json.loads(published.ENTRIES.read_text(encoding="utf-8"))["entries"]
    assert len({e["id"] for e in entries}) == len(entries)
    for entry in entries:
        assert entry["url"].startswith("https://")
        assert entry["published_value"] > 0 and entry["unit"]
        assert entry["comparable"] in ("yes", "approximate", "no")
        # each entry names the counter its source logs and where that is shown
        assert entry["counter"] and entry["counter_source"]
        if entry["comparable"] != "no":
            assert entry["compare_with"] in ("peak_reserved", "peak_allocated", "nvidia_smi")
            assert entry["compare_with"] == entry["counter"]
            load_job(JobRequest(model=published._model_ref(entry["memplan_model"]), flags=entry["memplan_flags"]))


def test_matching_bytes_compares_like_with_like() -> None:
    """peak allocated against allocated, reserved against reserved, nvidia-smi against reserved plus
    what lives outside the allocator (the catalogue GPU's CUDA context + NCCL figure)."""
    from types import SimpleNamespace

    from memplan.gpus import get_gpu

    published = _module("finetune_published")
    result = SimpleNamespace(peak_allocated_bytes=10, peak_reserved_bytes=12, outside_allocator_bytes=3)
    assert published.matching_bytes({"compare_with": "peak_allocated"}, result) == 10
    assert published.matching_bytes({"compare_with": "peak_reserved"}, result) == 12
    assert published.matching_bytes({"compare_with": "peak_reserved"}, result, reserved=20) == 20
    smi = {"compare_with": "nvidia_smi", "memplan_gpu": "rtx-4090"}
    assert published.matching_bytes(smi, result) == 12 + 3 + get_gpu("rtx-4090").outside_allocator_bytes


def test_unit_bytes() -> None:
    published = _module("finetune_published")
    assert published.unit_bytes("GiB (as printed)") == 2**30
    assert published.unit_bytes("GB (as printed)") == 10**9
    assert published.unit_bytes("G as printed; GB or GiB not stated (read as GiB)") == 2**30
