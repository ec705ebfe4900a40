"""Rich renderables of ``memplan ckpt``: the benchmark (also as Markdown) and a profile.

The maths never prints; the CLI and ``benchmarks/ckpt_bench.py`` render these. Imported only to
render (it imports rich); the ckpt result types are imported for annotations only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.table import Table

from memplan.units import MiB

if TYPE_CHECKING:
    from memplan.ckpt.bench import BenchResult
    from memplan.ckpt.profile import ProfileResult

__all__ = ["bench_markdown", "bench_tables", "profile_table"]

_LABELS = {
    "none": "(a) none",
    "full": "(b) full",
    "static": "(c) static",
    "memplan": "(d) memplan",
}
#: What each method is, printed under the table.
_LEGEND = ("(a) no checkpointing; (b) every block (Hugging Face checkpointing, non-reentrant); "
           "(c) a static plan sized for the longest batch; (d) memplan auto_checkpoint, warm-up included.")


def _rows(result: BenchResult) -> list[list[str]]:
    from memplan.ckpt.bench import METHODS

    summary = result.summary()
    rows = []
    for method in METHODS:
        m = summary["methods"][method]
        tp = m["throughput_tokens_per_s"]
        rows.append([
            _LABELS[method],
            f"{tp['per_step_median']:.1f}",
            f"{tp['min']:.1f}-{tp['max']:.1f}",
            f"{m['metered_throughput_tokens_per_s']:.1f}",
            f"{m['steps_within_budget_pct']:.0f} %",
            f"{m['max_peak_bytes'] / MiB:,.0f}",
            str(m["recomputed_forwards"]) + (f" + {m['probe_forwards']} probes" if m["probe_forwards"] else ""),
            str(m["warmup_forwards"]),
            str(m["misses"]),
        ])
    return rows


_HEADER = ["method", "tokens/s (per-step median)", "per-run min-max", "metered tokens/s", "steps in budget (metered)",
           "max peak MiB", "recomputed block fwds", "warm-up block fwds", "misses redone"]


def _ratio_rows(result: BenchResult) -> list[list[str]]:
    ratios = result.summary()["ratios"]
    return [[name, f"{r['per_step_median']:.3f}", f"{r['min']:.3f}-{r['max']:.3f}"] for name, r in ratios.items()]


def bench_tables(result: BenchResult) -> Group:
    """The comparison table and the targets table."""
    cfg = result.config
    table = Table(title=(
        f"GPT-2-style {result.n_params / 1e6:.1f}M params, {cfg.steps} steps, 1 metered + {cfg.repeats} timed "
        f"interleaved runs, "
        f"budget {result.budget_bytes / MiB:,.0f} MiB"), title_justify="left", caption=_LEGEND,
        caption_justify="left")
    for i, name in enumerate(_HEADER):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in _rows(result):
        table.add_row(*row)
    ratios = Table(title="throughput ratios", title_justify="left")
    for name in ("ratio", "per-step median", "per-run min-max"):
        ratios.add_column(name, justify="left" if name == "ratio" else "right")
    for row in _ratio_rows(result):
        ratios.add_row(*row)
    targets = Table(title="targets", title_justify="left")
    for name in ("target", "measured", "wanted", "met"):
        targets.add_column(name, justify="left" if name == "target" else "right")
    for name, t in result.summary()["targets"].items():
        targets.add_row(name, f"{t['value']:.3g}", t["target"], "yes" if t["met"] else "no")
    return Group(table, ratios, targets)


def bench_markdown(result: BenchResult) -> str:
    """The comparison table as Markdown (for docs)."""
    lines = ["| " + " | ".join(_HEADER) + " |", "| --- |" + " ---: |" * (len(_HEADER) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(result)]
    lines += ["", "| ratio | per-step median | per-run min-max |", "| --- | ---: | ---: |"]
    lines += ["| " + " | ".join(row) + " |" for row in _ratio_rows(result)]
    return "\n".join(lines)


def _fmt_fit(fit: Any, *, seconds: bool) -> str:
    if fit is None:
        return "-"
    c0, c1, c2 = fit.coeffs
    if seconds:
        return f"{c0:.3g} + {c1:.3g}·s + {c2:.3g}·s²"
    return f"{c0:,.0f} + {c1:,.1f}·s + {c2:.3g}·s²"


def profile_table(result: ProfileResult) -> Table:
    """One row per predictor: measured values at each size and the fitted polynomial."""
    sizes = [n * result.batch_size for n in result.seq_lengths]
    table = Table(title=(
        f"{result.model} ({result.model_type}): {result.n_layers_profiled} of {result.n_layers_model} layers "
        f"profiled, batch {result.batch_size}, size s = tokens"), title_justify="left")
    table.add_column("predictor")
    for s in sizes:
        table.add_column(f"s={s}", justify="right")
    table.add_column("fit (bytes or seconds)")
    table.add_column("max rel err", justify="right")
    table.add_column("accepted")
    for series in result.series:
        values = dict(series.points)
        is_time = series.name.endswith("_s")
        cells = [(f"{values[s] * 1e3:.1f} ms" if is_time else f"{values[s] / MiB:.2f} MiB") if s in values else "-"
                 for s in sizes]
        fit = series.fit
        table.add_row(series.name, *cells, _fmt_fit(fit, seconds=is_time), f"{fit.max_rel_error:.3f}" if fit else "-",
                      "yes" if fit and fit.accepted else "no")
    return table
