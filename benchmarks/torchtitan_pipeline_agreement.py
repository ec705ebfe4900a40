"""memplan estimate against ``memplan trace --torchtitan`` on pipeline stages (issue 25, item 1).

The witness: torchtitan 0.2.2's own llama3 8B code under its ``pipelining_fn`` (the split, FSDP2 with
the pipeline reshard default, the schedule of the TOML) and torch's schedule running every
micro-batch of pipeline rank 0 on simulated ranks (memplan.trace.runners.torchtitan_pipeline).
Compared: the trace's peak allocated (CUDA rounding) with memplan estimate's stage 0 of the same TOML,
less its cuBLAS workspaces (which a CPU trace does not allocate). The "before" column is the same
estimate with the plain-FSDP pricing (two unsharded blocks; the profile's ``pipeline_fsdp_unsharded``
off). The grid was fixed before any result was seen: pp 2/4, one or two stages per rank, FSDP 2/4,
micro-batches equal to or more than the stages, micro-batch size 1/2; seq 2048, full AC.

Usage: PYTHONPATH=src python benchmarks/torchtitan_pipeline_agreement.py [--json OUT] [--cells N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "torchtitan_pipeline_agreement.json"
MiB = 2**20

#: (pp, fsdp, schedule, local batch, micro-batch size)
CELLS = (
    (2, 2, "1F1B", 4, 1),
    (2, 4, "1F1B", 8, 1),
    (4, 2, "1F1B", 4, 1),
    (4, 2, "1F1B", 8, 1),
    (2, 2, "Interleaved1F1B", 4, 1),
    (4, 2, "Interleaved1F1B", 8, 1),
    (2, 2, "1F1B", 8, 2),
)

TOML = """[model]
name = "llama3"
flavor = "8B"

[training]
local_batch_size = {lbs}
seq_len = 2048

[parallelism]
data_parallel_shard_degree = {fsdp}
pipeline_parallel_degree = {pp}
pipeline_parallel_schedule = "{schedule}"
pipeline_parallel_microbatch_size = {mbs}

[activation_checkpoint]
mode = "full"
"""


def _estimates(target: object, setup: object, settings: object) -> tuple[int, int, int]:
    """(stage 0 peak less workspaces, the same with plain-FSDP pricing, its in-flight micro-batches)."""
    import importlib

    from memplan.estimate.engine import estimate

    engine = importlib.import_module("memplan.estimate.engine")
    frameworks = importlib.import_module("memplan.profiles.framework")

    stage = estimate(target.model_spec, setup.job, settings=settings).stages[0]  # type: ignore[attr-defined]
    profile = frameworks.get_profile("torchtitan")
    plain = replace(profile, pipeline_fsdp_unsharded=False)
    original = frameworks.PROFILES["torchtitan"]
    frameworks.PROFILES["torchtitan"] = plain
    engine._stages.cache_clear()  # the estimator memoises per job
    try:
        before = estimate(target.model_spec, setup.job, settings=settings).stages[0]  # type: ignore[attr-defined]
    finally:
        frameworks.PROFILES["torchtitan"] = original
        engine._stages.cache_clear()
    return (stage.peak_allocated_bytes - stage.workspace_bytes, before.peak_allocated_bytes - before.workspace_bytes,
            stage.inflight_microbatches)


def run_cell(cell: tuple[int, int, str, int, int], folder: Path) -> dict:
    from memplan.trace.api import trace_job
    from memplan.trace.runners.torchtitan_setup import torchtitan_setup

    pp, fsdp, schedule, lbs, mbs = cell
    path = folder / f"pp{pp}_fsdp{fsdp}_{schedule}_lbs{lbs}_mb{mbs}.toml"
    path.write_text(TOML.format(pp=pp, fsdp=fsdp, schedule=schedule, lbs=lbs, mbs=mbs), encoding="utf-8")
    target, setup, settings = torchtitan_setup(str(path), {"gpus": pp * fsdp})
    estimated, before, inflight = _estimates(target, setup, settings)
    start = time.perf_counter()
    traced = trace_job(target, setup).summary.peak_allocated_bytes
    return {"pp": pp, "fsdp": fsdp, "schedule": schedule, "vpp": setup.job.parallel.vpp, "local_batch": lbs,
            "microbatch_size": mbs, "microbatches": setup.job.num_microbatches, "inflight": inflight,
            "trace_mib": traced / MiB, "estimate_mib": estimated / MiB, "before_mib": before / MiB,
            "estimate_vs_trace": estimated / traced - 1, "before_vs_trace": before / traced - 1,
            "trace_seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(DEFAULT_OUT))
    parser.add_argument("--cells", type=int, default=len(CELLS))
    ns = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cell in CELLS[:ns.cells]:
            row = run_cell(cell, Path(tmp))
            rows.append(row)
            print(f"pp {row['pp']} fsdp {row['fsdp']} {row['schedule']} (vpp {row['vpp']}) {row['microbatches']} x "
                  f"{row['microbatch_size']}: trace {row['trace_mib']:.0f} MiB, estimate {row['estimate_mib']:.0f} "
                  f"({100 * row['estimate_vs_trace']:+.1f}%), before {row['before_mib']:.0f} "
                  f"({100 * row['before_vs_trace']:+.1f}%); {row['trace_seconds']} s", flush=True)
            Path(ns.json).write_text(json.dumps({"updated": datetime.datetime.now(datetime.UTC).isoformat(
                timespec="minutes"), "rows": rows}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
