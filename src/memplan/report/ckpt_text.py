"""Rich renderables of ``memplan ckpt``: the benchmark (also as Markdown) and a profile.

The maths never prints; the CLI and ``benchmarks/ckpt_bench.py`` render these. Imported only to
render (it imports rich); the ckpt result types are imported for annotations only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.table import Table

from memplan.report.fitting import Fitting, records
from memplan.units import MiB

if TYPE_CHECKING:
    from memplan.ckpt.bench import BenchResult
    from memplan.ckpt.profile import ProfileResult

__all__ = ["bench_markdown", "bench_tables", "profile_table"]

_LEGEND = ("none / full: a plain loop with no checkpointing / every block (Hugging Face, non-reentrant); "
           "plain: auto_checkpoint + the plain loop; step: + model.memplan_ckpt.step(fn); trainer: an unchanged "
           "transformers.Trainer on the wrapped model (trainer-full / trainer-none: every block / none). "
           "Peaks by the benchmark's independent meter over the whole step; memplan's warm-up and learning "
           "steps are inside its runs.")
_HEADER = ["variant", "runs", "tokens/s median", "min-max", "x full (median, min-max)", "x full by CPU s",
           "steps over budget",
           "max peak MiB", "recomputed block fwds", "probe fwds", "sheltered", "misses"]


def _rows(result: BenchResult) -> list[list[str]]:
    summary = result.summary()
    rows = []
    for variant, v in summary["variants"].items():
        tp = v["throughput_tokens_per_s"]
        r = summary["throughput_ratio_to_full"].get(variant)
        c = summary.get("cpu_time_ratio_to_full", {}).get(variant)
        rows.append([
            variant, str(v["runs"]), f"{tp['median']:.1f}", f"{tp['min']:.1f}-{tp['max']:.1f}",
            f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})" if r else "",
            f"{c['median']:.3f} ({c['min']:.3f}-{c['max']:.3f})" if c else "",
            str(v["steps_over_budget_max"]), f"{v['max_peak_bytes'] / MiB:,.0f}",
            "/".join(map(str, v["recomputed_forwards"])), "/".join(map(str, v["probe_forwards"])),
            "/".join(map(str, v["sheltered_steps"])), "/".join(map(str, v["misses"])),
        ])
    return rows


def _target_rows(result: BenchResult) -> list[list[str]]:
    return [[variant, name, _value(t["value"]), t["target"], "yes" if t["met"] else "no"]
            for variant, per in result.summary()["targets"].items() for name, t in per.items()]


def _value(value: float | list[float]) -> str:
    """A measured value, or an interval ``[low, high]`` as ``low-high``."""
    return "-".join(f"{v:.3g}" for v in value) if isinstance(value, list) else f"{value:.3g}"


def _title(result: BenchResult) -> str:
    cfg = result.config
    smoke = "SMOKE TEST (tiny model; targets not meant to be met): " if cfg.smoke else ""
    return (f"{smoke}GPT-2-style {result.n_params / 1e6:.1f}M params, AdamW, {cfg.batch_size} sequences x "
            f"{cfg.steps} steps (lengths {min(result.lengths)}-{max(result.lengths)}), {cfg.repeats} interleaved "
            f"repetitions, budget {result.budget_bytes / MiB:,.0f} MiB")


def bench_tables(result: BenchResult) -> Group:
    """The comparison table and the targets table."""
    rows = _rows(result)
    table = Table(title=_title(result), title_justify="left", caption=_LEGEND, caption_justify="left")
    for i, name in enumerate(_HEADER):
        table.add_column(name, justify="left" if i == 0 else "right", no_wrap=i > 0)
    for row in rows:
        table.add_row(*row)
    title = "targets (SMOKE TEST: reported, not judged)" if result.config.smoke else "targets"
    targets = Table(title=title, title_justify="left")
    names = ("variant", "target", "measured", "wanted", "met")
    for name in names:
        targets.add_column(name, justify="left" if name in ("variant", "target") else "right",
                           no_wrap=name in ("measured", "met"), overflow="fold")
    target_rows = _target_rows(result)
    for row in target_rows:
        targets.add_row(*row)
    # a narrow terminal gets one small table per variant rather than a table whose numbers are cut
    return Group(Fitting(table, records(_title(result), _HEADER, rows, caption=_LEGEND)), targets)


def bench_markdown(result: BenchResult) -> str:
    """The comparison and target tables as Markdown (for docs)."""
    lines = [_title(result), "", "| " + " | ".join(_HEADER) + " |", "| --- |" + " ---: |" * (len(_HEADER) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(result)]
    lines += ["", "| variant | target | measured | wanted | met |", "| --- | --- | ---: | ---: | ---: |"]
    lines += ["| " + " | ".join(row) + " |" for row in _target_rows(result)]
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
