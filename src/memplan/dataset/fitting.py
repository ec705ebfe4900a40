"""``memplan fit MODEL --dataset ...``: search the trainer settings on the user's data, emit the winner.

The document (``--json``) holds ``dataset`` (the job as given, priced per step, as ``memplan estimate
--dataset`` prints it), ``settings`` (every searched setting, fitting and fastest first; see
:mod:`memplan.dataset.search`), ``chosen`` and, with ``--emit``, ``emitted`` {``kind``, ``path``,
``config``}. A long length tail is also answered with what ``memplan ckpt``'s selective checkpointing
would be worth: the recompute the chosen setting pays on every step, against only the steps above the
GPU without it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memplan.errors import ConfigError
from memplan.units import GiB

__all__ = ["fit_dataset"]


def fit_dataset(loaded: Any, flags: dict[str, Any], *, margin: float) -> tuple[dict[str, Any], Any]:
    """The ``memplan fit --dataset`` document and the :class:`~memplan.dataset.DatasetPeaks` of the given job."""
    from memplan.dataset.options import dataset_request, images_section, require_packages

    require_packages()
    from memplan.dataset import analyze, dataset_lengths
    from memplan.dataset.search import search_settings
    from memplan.gpus import get_gpu

    if loaded.gpu is None:
        raise ConfigError("--gpu", "memplan fit --dataset needs the GPU to fit")
    request = dataset_request(flags, loaded)
    given = dataset_lengths(loaded, request)
    peaks = analyze(loaded, request, lengths=given)
    lengths = given[0]
    gpu = get_gpu(loaded.gpu)
    settings = search_settings(loaded.model, loaded.job, lengths, request.batching, gpu, margin=margin)
    chosen = next((s for s in settings if s.fits), None)
    document: dict[str, Any] = {
        "dataset": peaks.to_dict(), "gpu": gpu.name, "margin": margin,
        "settings": [s.to_dict() for s in settings],
        "chosen": chosen.to_dict() if chosen is not None else None,
        "not_searched": ["LoRA rank"],
    }
    images = images_section(request, loaded)
    if images is not None:
        document["dataset"]["images"] = images
    if chosen is not None and chosen.recompute == "full":
        no_recompute = next((s for s in settings if s.batching == chosen.batching and s.recompute == "none"), None)
        if no_recompute is not None:
            document["selective_checkpointing"] = _tail(loaded, lengths, no_recompute, chosen, gpu, margin)
    emit = flags.get("emit")
    if emit is not None:
        if chosen is None:
            raise ConfigError("--emit", "no searched setting fits: nothing to emit", emit[0])
        from memplan.dataset.emit import emit_config

        config = emit_config(emit[0], chosen, emit[1])
        document["emitted"] = {"kind": emit[0], "path": emit[1], "config": config}
    return document, peaks


def _tail(loaded: Any, lengths: Any, plain: Any, chosen: Any, gpu: Any, margin: float) -> dict[str, Any]:
    """What checkpointing only the steps that need it would save (memplan.ckpt's per-step decision)."""
    from memplan.dataset.batching import plan_steps
    from memplan.dataset.peaks import step_peaks

    job = replace(loaded.job, recompute=replace(loaded.job.recompute, mode="none"))
    peaks = step_peaks(loaded.model, job, plan_steps(lengths, plain.batching), lengths, rule=plain.batching.rule,
                       accumulation=plain.gradient_accumulation_steps)
    limit = int(gpu.usable_bytes * (1.0 - margin))
    over = int((peaks.peak_allocated_bytes > limit).sum())
    steps = len(peaks.shapes)
    saved = max(0.0, chosen.epoch_s - plain.epoch_s) * (1 - over / steps)
    return {"steps_needing_checkpointing": over, "steps": steps, "predicted_epoch_s_saved": round(saved, 3),
            "note": f"full checkpointing on every step; only {over} of {steps} steps exceed the GPU without it: "
                    f"checkpointing just those (memplan.ckpt.auto_checkpoint decides per step from the "
                    f"memory budget) would save about {saved:.1f} s per epoch"}


def render_fit(document: dict[str, Any]) -> Any:
    """The search's rich table: fitting settings first, fastest first."""
    from rich.table import Table

    table = Table(title=f"Trainer settings on the dataset ({document['gpu']}, margin {document['margin']:.0%})",
                  title_justify="left")
    for column in ("batching", "mbs x accum", "max_length", "recompute", "worst step", "worst peak GiB", "fits",
                   "epoch s", "changes"):
        table.add_column(column, justify="right")
    for row in document["settings"][:12]:
        rule = row["batching"] + (" (grouped)" if row["group_by_length"] else "")
        table.add_row(rule, f"{row['micro_batch_size']} x {row['gradient_accumulation_steps']}",
                      str(row["max_length"]), row["recompute"], "x".join(map(str, row["worst_step_shape"])),
                      f"{row['worst_peak_allocated_bytes'] / GiB:.2f}", "yes" if row["fits"] else "no",
                      f"{row['predicted_epoch_s']:.1f}", ", ".join(row["changes"]) or "-")
    if document.get("selective_checkpointing"):
        table.caption = document["selective_checkpointing"]["note"]
    return table



def fit_dataset_answer(model: str, job_flags: dict[str, Any], flags: dict[str, Any], *, gpu: str,
                       margin: float | None, hf_args: str | None, peft_config: str | None,
                       plot: str | None) -> tuple[dict[str, Any], list[Any]]:
    """The command's ``--dataset`` branch: load the job, search, write --plot/--emit (their paths checked
    by the command); the JSON document and what the tables show."""
    from memplan.dataset.options import require_packages

    require_packages()
    from memplan.dataset.render import render_peaks
    from memplan.fit.results import FIT_MARGIN
    from memplan.inputs import JobRequest, load_job

    loaded = load_job(JobRequest(model=model, flags={"gpus": 1, **job_flags}, gpu=gpu, hf_args=hf_args,
                                 peft_config=peft_config))
    document, peaks = fit_dataset(loaded, flags, margin=FIT_MARGIN if margin is None else margin)
    if plot is not None:
        from memplan.dataset.plot import plot_steps

        plot_steps(peaks, plot)
    shown = [render_peaks(peaks, document["dataset"].get("images")), render_fit(document)]
    chosen = document["chosen"]
    if chosen is None:
        shown.append("No searched setting fits: the worst step needs more than the GPU.")
    else:
        shown.append(f"Chosen: --batching {chosen['batching']} mbs {chosen['micro_batch_size']} x accumulation "
                     f"{chosen['gradient_accumulation_steps']}, max_length {chosen['max_length']}, recompute "
                     f"{chosen['recompute']}; worst step {chosen['worst_peak_allocated_bytes'] / GiB:.2f} GiB; "
                     f"changes: {', '.join(chosen['changes']) or 'none'}.")
    if "emitted" in document:
        shown.append(f"Wrote {document['emitted']['kind']} config: {document['emitted']['path']}")
    return document, shown
