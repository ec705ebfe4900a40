"""The largest micro-batch or sequence length that fits a given layout, with the memory curve.

Both searches double the value from a fitting start until it no longer fits, then bisect between
the last fitting and the first failing value. They rely on the estimator's predicted reserved
memory growing with the micro-batch and with the sequence length (checked by the tests). Every
evaluated point is kept, so the result doubles as a memory curve for a table or a plot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from memplan.errors import ConfigError
from memplan.estimate.engine import DEFAULT_FRAGMENTATION, estimate
from memplan.fit.results import FIT_MARGIN, FitError, memory_limit
from memplan.gpus import GPU, get_gpu
from memplan.job import Job
from memplan.model.spec import ModelSpec

#: Sequence lengths are searched in multiples of this (times 2·cp with context parallelism).
SEQ_GRANULARITY = 128
#: Largest value tried (the Batch limits).
_MAX_MBS = 10**7
_MAX_SEQ = 10**8


@dataclass(frozen=True, kw_only=True)
class CurvePoint:
    """Predicted memory at one value of the searched quantity."""

    value: int
    reserved_bytes: int
    allocated_bytes: int
    fits: bool


@dataclass(frozen=True, kw_only=True)
class Limit:
    """Result of :func:`max_micro_batch` / :func:`max_seq_length`."""

    #: ``"micro_batch_size"`` or ``"seq_length"``.
    quantity: Literal["micro_batch_size", "seq_length"]
    #: Largest value that fits (0: not even the smallest).
    best: int
    #: Bytes a GPU may reserve (usable x (1 - margin)).
    limit_bytes: int
    gpu: str
    #: Every value evaluated, in increasing order.
    curve: tuple[CurvePoint, ...]
    #: The job at ``best`` (None when nothing fits).
    job: Job | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "quantity": self.quantity, "best": self.best, "limit_bytes": self.limit_bytes, "gpu": self.gpu,
            "curve": [dataclasses.asdict(p) for p in self.curve],
        }


def _bisect(
    values: Callable[[int], int | None], point: Callable[[int], CurvePoint], start: int
) -> tuple[int, dict[int, CurvePoint]]:
    """Largest index i (values(i) valid) whose point fits; doubling then bisection on indices."""
    seen: dict[int, CurvePoint] = {}

    def fits(i: int) -> bool:
        v = values(i)
        assert v is not None
        if v not in seen:
            seen[v] = point(v)
        return seen[v].fits

    if not fits(start):
        return -1, seen
    lo, probe = start, start * 2
    while True:
        if values(probe) is None:  # past the last valid index: find it between lo and probe
            a, b = lo, probe
            while b - a > 1:
                m = (a + b) // 2
                a, b = (a, m) if values(m) is None else (m, b)
            if a == lo or fits(a):
                return a, seen
            hi = a
            break
        if not fits(probe):
            hi = probe
            break
        lo, probe = probe, probe * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, seen


def _limit_search(
    model: ModelSpec, job: Job, gpu: GPU | str, margin: float, fragmentation: float,
    quantity: Literal["micro_batch_size", "seq_length"], values: Callable[[int], int | None],
    with_value: Callable[[int], Job],
) -> Limit:
    gpu_spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if not 0.0 <= margin < 1.0:
        raise FitError("--margin", "must be in [0, 1)", margin)
    limit = memory_limit(gpu_spec.usable_bytes, margin)
    jobs: dict[int, Job] = {}

    def point(v: int) -> CurvePoint:
        jobs[v] = with_value(v)
        est = estimate(model, jobs[v], fragmentation=fragmentation)
        return CurvePoint(value=v, reserved_bytes=est.peak_reserved_bytes,
                          allocated_bytes=est.peak_allocated_bytes, fits=est.peak_reserved_bytes <= limit)

    index, seen = _bisect(values, point, 1)
    best = values(index) if index >= 1 else 0
    return Limit(quantity=quantity, best=best or 0, limit_bytes=limit, gpu=gpu_spec.name,
                 curve=tuple(seen[v] for v in sorted(seen)), job=jobs.get(best) if best else None)


def max_micro_batch(
    model: ModelSpec, job: Job, *, gpu: GPU | str, margin: float = FIT_MARGIN,
    fragmentation: float = DEFAULT_FRAGMENTATION,
) -> Limit:
    """Largest micro-batch size of ``job`` whose predicted reserved memory fits ``gpu``.

    With a global batch set, only micro-batches dividing ``gbs / dp`` are valid; without one,
    every size is (no gradient accumulation). Example::

        >>> from memplan import load_model, Job, Parallelism, Sharding
        >>> job = Job(parallel=Parallelism(world_size=8, tp=2), sharding=Sharding(distributed_optimizer=True))
        >>> lim = max_micro_batch(load_model("llama-3.1-8b"), job, gpu="h100-80gb")
        >>> lim.best >= 1 and lim.curve[-1].fits is False
        True
    """
    gbs = job.batch.global_batch_size
    dp = job.parallel.data_parallel
    if gbs is not None:
        if gbs % dp:
            raise FitError("--gbs", f"must be a multiple of dp={dp}", gbs)
        allowed = [d for d in range(1, gbs // dp + 1) if (gbs // dp) % d == 0]

        def values(i: int) -> int | None:
            return allowed[i - 1] if 1 <= i <= len(allowed) else None
    else:
        def values(i: int) -> int | None:
            return i if 1 <= i <= _MAX_MBS else None

    def with_value(v: int) -> Job:
        return dataclasses.replace(job, batch=dataclasses.replace(job.batch, micro_batch_size=v))

    return _limit_search(model, job, gpu, margin, fragmentation, "micro_batch_size", values, with_value)


def max_seq_length(
    model: ModelSpec, job: Job, *, gpu: GPU | str, margin: float = FIT_MARGIN,
    fragmentation: float = DEFAULT_FRAGMENTATION, granularity: int = SEQ_GRANULARITY,
) -> Limit:
    """Largest sequence length (a multiple of ``granularity`` and of 2·cp) that fits ``gpu``."""
    if granularity < 1:
        raise ConfigError("granularity", "must be at least 1", granularity)
    cp = job.parallel.cp
    step = granularity * (2 * cp if cp > 1 else 1)

    def values(i: int) -> int | None:
        return i * step if 1 <= i * step <= _MAX_SEQ else None

    def with_value(v: int) -> Job:
        return dataclasses.replace(job, batch=dataclasses.replace(job.batch, seq_length=v))

    return _limit_search(model, job, gpu, margin, fragmentation, "seq_length", values, with_value)


def plot_limit(limit: Limit, path: str) -> None:
    """Write the memory curve of ``limit`` as a PNG (imports matplotlib here, not at module load)."""
    try:
        import matplotlib
    except ImportError:
        from memplan.errors import MissingDependencyError

        raise MissingDependencyError("matplotlib", feature="--plot (the memory-curve PNG)", extra="plot") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = 2**30
    xs = [p.value for p in limit.curve]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [p.reserved_bytes / gib for p in limit.curve], marker="o", label="predicted reserved")
    ax.plot(xs, [p.allocated_bytes / gib for p in limit.curve], marker=".", linestyle="--", label="predicted allocated")
    ax.axhline(limit.limit_bytes / gib, color="red", label=f"limit on {limit.gpu} (with margin)")
    if limit.best:
        ax.axvline(limit.best, color="green", linestyle=":", label=f"largest fitting: {limit.best}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(limit.quantity.replace("_", " "))
    ax.set_ylabel("GiB (2^30 bytes)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
