"""``--plot`` with ``--dataset``: every step's predicted peak against the GPU's usable memory (a PNG)."""

from __future__ import annotations

from pathlib import Path

from memplan.dataset.peaks import DatasetPeaks
from memplan.errors import MissingDependencyError
from memplan.textfile import write_atomic
from memplan.units import GiB

__all__ = ["plot_steps"]


def plot_steps(peaks: DatasetPeaks, path: str) -> None:
    """Write the per-step peak (GiB) with the GPU's usable memory and the worst step marked; atomically."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError("matplotlib", feature="--plot", extra="plot") from None
    figure, axes = plt.subplots(figsize=(10, 4))
    axes.plot(peaks.peak_allocated_bytes / GiB, linewidth=0.6, label="predicted peak allocated")
    if peaks.gpu_usable_bytes is not None:
        axes.axhline(peaks.gpu_usable_bytes / GiB, color="red", linestyle="--", label="GPU usable")
    worst = peaks.worst
    axes.plot([worst.index], [worst.peak_allocated_bytes / GiB], "o", color="black",
              label=f"worst step #{worst.index} ({worst.batch_size}x{worst.seq_length})")
    axes.set_xlabel("step (micro-batch)")
    axes.set_ylabel("GiB")
    axes.set_title(f"Per-step peak, --batching {peaks.rule}")
    axes.legend(loc="lower right")
    target = Path(path).expanduser()
    try:
        write_atomic(target, lambda partial: figure.savefig(partial, dpi=110, bbox_inches="tight"), suffix=".png")
    finally:
        plt.close(figure)
