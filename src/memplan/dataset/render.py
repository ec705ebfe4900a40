"""The dataset section as rich text (tables of the worst step, step-peak percentiles, length histogram)."""

from __future__ import annotations

from typing import Any

from memplan.dataset.peaks import DatasetPeaks, length_histogram
from memplan.units import GiB

__all__ = ["render_peaks"]



def render_peaks(peaks: DatasetPeaks, images: dict[str, Any] | None = None) -> Any:
    """A rich renderable: what the dataset's steps need, the worst step first; ``images`` is the JSON
    ``dataset.images`` entry of ``--images-field`` (its image tokens and what is not modelled)."""
    from rich.console import Group
    from rich.table import Table

    data = peaks.to_dict()
    worst = peaks.worst
    summary = Table(title=f"Dataset: {peaks.examples:,} examples, {len(peaks.shapes):,} steps "
                          f"(--batching {peaks.rule}, {peaks.distinct_shapes:,} distinct shapes)",
                    show_header=False, title_justify="left")
    summary.add_column("what")
    summary.add_column("value", justify="right")
    summary.add_row("worst step", f"#{worst.index} ({worst.batch_size} x {worst.seq_length} tokens)")
    summary.add_row("worst step peak allocated", f"{worst.peak_allocated_bytes / GiB:.2f} GiB ({worst.peak_phase})")
    for name, value in data["step_peak_percentiles_bytes"].items():
        summary.add_row(f"step peak {name}", f"{value / GiB:.2f} GiB")
    if peaks.gpu_usable_bytes is not None:
        summary.add_row("GPU usable", f"{peaks.gpu_usable_bytes / GiB:.2f} GiB")
        summary.add_row("steps over the GPU", f"{peaks.steps_over_gpu:,} of {len(peaks.shapes):,}")
    lengths = ", ".join(f"{k} {v:,}" for k, v in data["length_percentiles"].items())
    summary.add_row("example tokens", lengths)
    summary.caption = peaks.pricing
    if images is not None:
        _image_rows(summary, images)
    return Group(summary, _histogram(peaks))


def _image_rows(summary: Any, images: dict[str, Any]) -> None:
    """The ``--images-field`` rows: the processor's rule, the image tokens counted, and the caveat."""
    rows = images["rows_with_image_tokens"]
    per_row = images["image_tokens"] / rows if rows else 0.0
    if "tokens_per_image" in images:
        rule = f"{images['tokens_per_image']} tokens per image"
    else:
        rule = (f"patch {images['patch_size']}, merge {images['merge_size']}, pixels {images['min_pixels']:,}-"
                f"{images['max_pixels']:,}")
    summary.add_row("vision model", f"{images['vision_model']} ({images['family']}: {rule})")
    summary.add_row(f"image tokens ({images['field']})",
                    f"{images['image_tokens']:,} in {rows:,} examples ({per_row:,.1f} per example with images)")
    summary.caption = f"{summary.caption}. Not modelled: {images['not_modelled']}"


def _histogram(peaks: DatasetPeaks) -> Any:
    from rich.table import Table

    rows = length_histogram(peaks.lengths, bins=10)
    top = max(r["count"] for r in rows) or 1
    table = Table(title="Example lengths (tokens)", title_justify="left")
    table.add_column("tokens", justify="right")
    table.add_column("examples", justify="right")
    table.add_column("")
    for row in rows:
        table.add_row(f"{row['from']:,}-{row['to']:,}", f"{row['count']:,}", "#" * round(30 * row["count"] / top))
    return table
