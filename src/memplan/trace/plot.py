"""``--plot out.png``: live memory over the op index, stacked by category (matplotlib, Agg)."""

from __future__ import annotations

import os

from memplan.events import Trace
from memplan.trace.core.summary import timeline
from memplan.units import GiB

__all__ = ["plot_timeline"]

#: Drawing order, bottom to top: steady state first, then what comes and goes.
_ORDER = ("parameter", "buffer", "master_weight", "optimizer_state", "gradient", "input", "activation",
          "logits", "communication", "workspace", "temporary")


def plot_timeline(trace: Trace, path: str | os.PathLike[str], *, title: str = "") -> None:
    """Write a PNG of the live bytes per category after each event (GiB = 2^30 bytes)."""
    try:
        import matplotlib
    except ImportError:
        from memplan.errors import MissingDependencyError

        raise MissingDependencyError("matplotlib", feature="--plot (the timeline PNG)", extra="plot") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, series = timeline(trace)
    names = [n for n in _ORDER if any(series.get(n, ()))]
    figure, axes = plt.subplots(figsize=(11, 5), dpi=110)
    axes.stackplot(xs, *[[v / GiB for v in series[n]] for n in names], labels=names, linewidth=0)
    axes.set_xlabel("event index (allocations and frees in program order)")
    rounding = ", CUDA-rounded" if trace.meta.device == "cuda" else ""
    axes.set_ylabel(f"live memory (GiB{rounding})")
    axes.set_title(title or "memplan trace")
    axes.legend(loc="upper left", fontsize=8, ncol=2)
    axes.margins(x=0)
    figure.tight_layout()
    try:
        figure.savefig(path)
    finally:
        plt.close(figure)
