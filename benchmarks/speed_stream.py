"""``estimate()`` on a stream of distinct jobs: what a search or a server sees, beside ``speed.py``'s one new job.

The stream (fixed before it was run): llama-3.1-8b on 8 GPUs, every combination of sequence 1,024…8,192 (6),
micro-batch 1/2/4, tp 1/2/4/8 (sequence parallel with tp > 1), recompute none/selective/full and the distributed
optimizer off/on: 432 distinct jobs, each estimated once after three warm-up estimates. Caches keyed on the model,
a layer at an activation shape or a pipeline layout are shared across the stream, as in a search.

    python benchmarks/speed_stream.py [SRC]   # SRC: another tree's src folder (the base), default: the installed memplan

Prints the estimates per second of CPU time.
"""

from __future__ import annotations

import itertools
import sys
import time

if len(sys.argv) > 1:
    sys.path.insert(0, sys.argv[1])

from memplan import Batch, Job, Parallelism, estimate, load_model  # noqa: E402
from memplan.job import Recompute, Sharding  # noqa: E402


def stream() -> list[Job]:
    jobs = [Job(parallel=Parallelism(world_size=8, tp=tp, sequence_parallel=tp > 1),
                batch=Batch(micro_batch_size=mbs, seq_length=seq), recompute=Recompute(mode=mode),
                sharding=Sharding(distributed_optimizer=dist))
            for seq, mbs, tp, mode, dist in itertools.product((1024, 2048, 3072, 4096, 6144, 8192), (1, 2, 4),
                                                              (1, 2, 4, 8), ("none", "selective", "full"), (False, True))]
    assert len(set(jobs)) == len(jobs)
    return jobs


def main() -> None:
    model, jobs = load_model("llama-3.1-8b"), stream()
    for job in jobs[:3]:
        estimate(model, job)
    start = time.process_time()
    for job in jobs:
        estimate(model, job)
    print(f"{len(jobs)} distinct jobs: {len(jobs) / (time.process_time() - start):,.0f} estimates/s (CPU)")


if __name__ == "__main__":
    main()
