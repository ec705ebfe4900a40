"""Rich renderables of ``memplan fit``: the ranked layouts, a --max-mbs/--max-seq curve, GPU sharing.

Sizes in GiB = 2^30 bytes. Imported only to render (it imports rich); the fit result types are
imported for annotations only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from memplan.units import GiB

if TYPE_CHECKING:
    from memplan.fit.colocate import Colocation
    from memplan.fit.limits import Limit
    from memplan.fit.methods import MethodsResult
    from memplan.fit.results import FitResult
    from memplan.job import Job

__all__ = ["colocation_table", "fit_renderables", "limit_renderables", "methods_renderables"]


def _candidates_table(result: FitResult, top: int | None) -> Table:
    found = (f"{len(result.candidates)} fitting configurations (layout x micro-batch x recompute)" if result.exhaustive else
             f"the fastest fitting configurations ({result.layouts_pruned} layouts skipped as slower; --all lists every one)")
    table = Table(title=f"{found} of {result.layouts_searched} layouts ({result.estimates} estimates, "
                  f"{result.seconds:.2f} s), fastest first",
                  title_justify="left", show_edge=False, pad_edge=False, box=box.SIMPLE_HEAD, collapse_padding=True)
    # Numbers never wrap or shrink below their header; the layout and recompute labels fold
    # onto a second line in a narrow terminal instead.
    table.add_column("#", no_wrap=True, min_width=2)
    table.add_column("layout", overflow="fold")
    table.add_column("mbs", no_wrap=True, min_width=3)
    table.add_column("recompute", overflow="fold", min_width=9)
    for col in ("GiB/GPU", "headroom", "step s", "tokens/s", "MFU"):
        table.add_column(col, justify="right", no_wrap=True, min_width=len(col))
    for rank, cand in enumerate(result.candidates[:top], start=1):
        d = cand.to_dict()
        table.add_row(str(rank), cand.layout.label, str(d["micro_batch_size"]), d["recompute"],
                      f"{cand.reserved_bytes / GiB:.1f}", Text(f"{cand.headroom_bytes / GiB:.1f}", style="green"),
                      f"{cand.step.total_s:.3f}", f"{cand.step.tokens_per_s:,.0f}", f"{100 * cand.step.mfu:.1f}%")
    return table


def fit_renderables(result: FitResult, top: int | None) -> list[Any]:
    """The request, the ``top`` fastest candidates (``None``: all), the rejected families, a note on units."""
    head = Text(f"{result.model} on {result.gpus} x {result.gpu}: sequence {result.seq_length}, global batch "
                f"{result.global_batch_size}, {result.framework}; limit {result.limit_bytes / GiB:.1f} GiB per GPU "
                f"({result.usable_bytes / GiB:.1f} usable - {100 * result.margin:.0f}% margin)")
    out: list[Any] = [head]
    if result.candidates:
        out.append(_candidates_table(result, top))
    else:  # one Text, so that console.print does not run it on after the head
        head.append(f"\nno configuration fits: {result.layouts_searched} layouts searched ({result.estimates} "
                    f"estimates, {result.seconds:.2f} s)", style="bold red")
    if result.rejected:
        rejected = Table(title="Rejected families", title_justify="left", show_edge=False, pad_edge=False)
        rejected.add_column("family", no_wrap=True)
        rejected.add_column("layouts", justify="right")
        rejected.add_column("why")
        for fam in result.rejected[:top]:
            rejected.add_row(fam.family, str(fam.layouts), Text(fam.reason, style="red"))
        out.append(rejected)
    note = "Sizes: predicted peak reserved memory of the highest pipeline stage, GiB = 2^30 bytes. " \
           "Step time: memplan's analytical model (docs/fit.md)."
    out.append(Text(note, style="dim"))
    return out


def native_renderables(document: dict[str, Any]) -> list[Any]:
    """The fastest candidate in the framework's own settings (``candidates[0].native`` of ``fit --json``), and
    what those settings do not carry."""
    from memplan.frameworks.native_fix import native_lines

    candidates = document.get("candidates") or []
    lines = native_lines(candidates[0].get("native")) if candidates else []
    if not lines:
        return []
    return [Group(Text("Fastest (#1) in the framework's settings:", style="bold"),
                  *(Text(f"  {line}", style="dim" if line.startswith("(") else "") for line in lines))]


def limit_renderables(limit: Limit, job: Job, plot: str | None) -> list[Any]:
    """The layout searched, memory at each value tried, the verdict, and where ``plot`` was written."""
    par = job.parallel
    what = limit.quantity.replace("_", " ")
    layout = (f"tp{par.tp} pp{par.pp} vpp{par.vpp} cp{par.cp} ep{par.ep} dp{par.data_parallel}, "
              f"recompute {job.recompute.mode}, micro-batch {job.batch.micro_batch_size}, sequence {job.batch.seq_length}")
    table = Table(title=f"Memory by {what} on {limit.gpu} (limit {limit.limit_bytes / GiB:.1f} GiB)",
                  title_justify="left", show_edge=False, pad_edge=False)
    table.add_column(what, justify="right")
    table.add_column("allocated GiB", justify="right")
    table.add_column("reserved GiB", justify="right")
    table.add_column("fits")
    for p in limit.curve:
        table.add_row(str(p.value), f"{p.allocated_bytes / GiB:.2f}", f"{p.reserved_bytes / GiB:.2f}",
                      Text("yes", style="green") if p.fits else Text("no", style="red"))
    verdict = Text(f"largest {what} that fits: {limit.best}" if limit.best else f"no {what} fits this layout",
                   style="bold green" if limit.best else "bold red")
    out: list[Any] = [Text(f"layout: {layout}"), table, verdict]
    if plot:
        out.append(Text(f"plot written to {plot}", style="dim"))
    return out


def colocation_table(result: Colocation) -> Any:
    """One row per process sharing the device, the total, and whether they fit."""
    table = Table(title=f"Processes sharing {result.device} ({result.capacity_bytes / GiB:.1f} GiB, "
                  f"limit {result.limit_bytes / GiB:.1f} GiB with {100 * result.margin:.0f}% margin)",
                  title_justify="left", show_edge=False, pad_edge=False)
    for col, justify in (("job", "left"), ("CUDA context GiB", "right"), ("reserved GiB", "right"), ("total GiB", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for p in result.processes:
        table.add_row(p.name, f"{p.context_bytes / GiB:.2f}", f"{p.reserved_bytes / GiB:.2f}", f"{p.total_bytes / GiB:.2f}")
    table.add_row(Text("all", style="bold"), "", "", Text(f"{result.demand_bytes / GiB:.2f}", style="bold"))
    if result.fits:
        verdict = Text(f"fits: {result.headroom_bytes / GiB:.2f} GiB headroom", style="bold green")
    else:
        verdict = Text(f"does not fit: {-result.headroom_bytes / GiB:.2f} GiB over", style="bold red")
    return Group(table, verdict)


def _params(value: int | None) -> str:
    """A parameter count with three significant digits: 3.41M, 1.24B, 12.5K."""
    if value is None:
        return "-"
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return str(value)


def methods_renderables(result: MethodsResult) -> list[Any]:
    """Every fine-tuning method on the GPU: fitting ones fastest first, the verdict, the notes.
    The paged and trainable columns appear only when some method has them."""
    where = f"one {result.gpu}" if result.gpus == 1 else f"each of {result.gpus} data-parallel {result.gpu}"
    head = Text(f"{result.model} on {where}: sequence {result.seq_length}, micro-batch "
                f"{result.micro_batch_size}; limit {result.limit_bytes / GiB:.1f} GiB "
                f"({result.usable_bytes / GiB:.1f} usable - {100 * result.margin:.0f}% margin)")
    table = Table(title="Fine-tuning methods (fitting ones fastest first)", title_justify="left", show_edge=False,
                  pad_edge=False, box=box.SIMPLE_HEAD, collapse_padding=True)
    paged = any(m.paged_optimizer_bytes for m in result.methods)
    trainable = any(m.frozen_params for m in result.methods)
    columns = ["#", "method", "fits", "GiB", "headroom"] + ["paged GiB"] * paged + ["trainable"] * trainable
    for col in [*columns, "step s", "tokens/s"]:
        left = col in ("method", "fits")
        # the method's name folds in a narrow terminal; numbers never wrap or shrink below their header
        table.add_column(col, justify="left" if left else "right", no_wrap=col != "method", overflow="fold",
                         min_width=len(col) if col != "method" else 6)
    for rank, m in enumerate(result.methods, start=1):
        style = "green" if m.fits else "red"
        cells: list[Any] = [str(rank), m.label.replace(" + checkpointing", " + ckpt"),
                            Text("yes" if m.fits else "no", style=style), f"{m.reserved_bytes / GiB:.1f}",
                            Text(f"{m.headroom_bytes / GiB:.1f}", style=style)]
        if paged:
            cells.append(f"{m.paged_optimizer_bytes / GiB:.1f}")
        if trainable:
            cells.append(_params(m.trainable_params))
        table.add_row(*cells, f"{m.step.total_s:.3f}", f"{m.step.tokens_per_s:,.0f}")
    best = result.best
    verdict = Text(f"fastest that fits: {best.label}" if best else "no method fits this GPU at this sequence and "
                   "micro-batch (try a shorter --seq or --mbs 1)", style="bold green" if best else "bold red")
    notes = [("Sizes: predicted peak reserved memory, GiB = 2^30 bytes; paged: bitsandbytes paged optimizer "
              "states outside the allocator; ckpt: gradient checkpointing."), *result.notes]
    return [head, table, Group(verdict, Text("\n".join(notes), style="dim"))]
