"""Rich renderables for terminal output: estimate tables, fit verdicts, preset and GPU lists.

Everything here turns typed results into ``rich`` objects and nothing else: no maths beyond
presentation (bytes → GiB), no printing. Sizes are shown in GiB = 2**30 bytes and every table
says so.

Example::

    from rich.console import Console
    from memplan import estimate, load_model
    from memplan.report.text import render_estimate

    Console().print(render_estimate(estimate(load_model("llama-3.1-8b")), explain=True))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from memplan.estimate.result import Estimate, StageEstimate
from memplan.gpus import GPU
from memplan.model.presets import PresetInfo
from memplan.units import GiB

__all__ = [
    "BREAKDOWN_ROWS",
    "assumptions_list",
    "estimate_header",
    "fit_verdict",
    "gpus_table",
    "layout_words",
    "peak_summary",
    "presets_table",
    "render_estimate",
    "stage_breakdown",
    "stage_table",
    "stage_tables",
    "training_split",
]

#: Stages shown side by side in one table; more stages are split over several tables.
STAGES_PER_TABLE = 4

#: The rows of the per-stage breakdown, in order. They add up to ``peak_allocated_bytes``.
BREAKDOWN_ROWS: tuple[tuple[str, Callable[[StageEstimate], int]], ...] = (
    ("parameters", lambda s: s.parameters_bytes),
    # alive at the peak: a framework that frees gradients after each step peaks before most are made
    ("gradients", lambda s: s.gradients_bytes - s.gradients_absent_at_peak_bytes),
    ("optimizer states (moments)", lambda s: s.optimizer_moments_bytes),
    ("master weights", lambda s: s.master_weights_bytes),
    ("activations: transformer layers", lambda s: s.transformer_layer_activations_bytes),
    ("activations: other", lambda s: s.activations_bytes - s.transformer_layer_activations_bytes),
    ("loss / logits (transient)", lambda s: s.logits_bytes),
    ("communication buffers", lambda s: s.communication_bytes),
    ("workspace (cuBLAS / TE)", lambda s: s.workspace_bytes),
    ("temporaries + inputs", lambda s: s.temporary_bytes + s.input_bytes),
    ("CUDA graphs (pool, static inputs)", lambda s: s.cuda_graph_extra_bytes),
)


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / GiB:,.2f}"


def _cell(n_bytes: int) -> Text:
    return Text("—", style="dim") if n_bytes == 0 else Text(_gib(n_bytes))


def stage_breakdown(stage: StageEstimate) -> tuple[tuple[str, int], ...]:
    """``(label, bytes)`` for each row of :data:`BREAKDOWN_ROWS`; the bytes sum to the peak."""
    return tuple((label, get(stage)) for label, get in BREAKDOWN_ROWS)


def _layer_ranges(indices: Sequence[int]) -> str:
    """``(0, 1, 2, 8, 9)`` → ``"0-2, 8-9"``."""
    if not indices:
        return "none"
    parts: list[str] = []
    start = prev = indices[0]
    tail: list[int | None] = [*indices[1:], None]
    for i in tail:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(parts)


def stage_table(est: Estimate, stages: Sequence[StageEstimate], *, title: str | None = None) -> Table:
    """One table with a column per stage of ``stages`` and a row per memory category."""
    many = len(est.stages) > 1
    lines = ["* the stage with the highest peak"] if many and any(s.stage == est.peak_stage for s in stages) else []
    absent = [s for s in stages if s.gradients_absent_at_peak_bytes]
    if absent:
        lines.append("gradients: those alive at the peak (the step makes "
                     + ", ".join(f"{_gib(s.gradients_bytes)}" for s in absent) + " GiB"
                     + (f" in stage{'s' if len(absent) > 1 else ''} " + ", ".join(str(s.stage) for s in absent)
                        if many else "") + ")")
    caption = "\n".join(lines) or None
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left",
                  show_edge=False, pad_edge=False)
    table.add_column("GiB (2^30 bytes)", no_wrap=True)
    for s in stages:
        header = f"stage {s.stage}" if many else "per GPU"
        style = "bold" if (many and s.stage == est.peak_stage) else None
        table.add_column(header + (" *" if many and s.stage == est.peak_stage else ""),
                         justify="right", header_style=style)
    table.add_row("decoder layers", *(Text(_layer_ranges(s.layer_indices), style="dim") for s in stages))
    table.add_row("micro-batches in flight", *(Text(str(s.inflight_microbatches), style="dim") for s in stages))
    table.add_row("peak during", *(Text(s.peak_phase, style="dim") for s in stages), end_section=True)
    for label, get in BREAKDOWN_ROWS:
        table.add_row(label, *(_cell(get(s)) for s in stages))
    table.rows[-1].end_section = True
    table.add_row(Text("peak allocated", style="bold"), *(Text(_gib(s.peak_allocated_bytes), style="bold") for s in stages))
    table.add_row(Text("predicted reserved", style="bold"),
                  *(Text(_gib(s.peak_reserved_bytes), style="bold") for s in stages))
    return table


def stage_tables(est: Estimate, *, per_table: int = STAGES_PER_TABLE) -> list[Table]:
    """The breakdown of every pipeline stage, ``per_table`` stages side by side."""
    stages = est.stages
    chunks = [stages[i:i + per_table] for i in range(0, len(stages), per_table)]
    if len(chunks) == 1:
        return [stage_table(est, chunks[0], title="Per-GPU memory" + (" by pipeline stage" if len(stages) > 1 else ""))]
    return [
        stage_table(est, chunk, title=f"Per-GPU memory, pipeline stages {chunk[0].stage}-{chunk[-1].stage} of {len(stages)}")
        for chunk in chunks
    ]


def training_split(est: Estimate) -> str:
    """`` (X B trainable, Y B frozen)`` when the estimate reports them, else empty; and the paged
    optimizer states outside the allocator when there are any."""
    data = est.to_dict()
    trainable, frozen = data.get("trainable_params"), data.get("frozen_params")
    out = ""
    if isinstance(trainable, int) and isinstance(frozen, int):
        out = f" ({trainable / 1e9:,.3f} B trainable, {frozen / 1e9:,.2f} B frozen)"
    if est.paged_optimizer_bytes:
        out += f" · {_gib(est.paged_optimizer_bytes)} GiB paged optimizer states (outside the allocator)"
    if est.outside_allocator_bytes:
        out += f" · {_gib(est.outside_allocator_bytes)} GiB library buffers outside the allocator"
    return out


def layout_words(par: dict[str, object]) -> str:
    """``dp x tp x pp x cp``, then the degrees a layout adds where they are above 1 (vpp, ep, etp) and sequence
    parallelism: the header names every split the figures assume."""
    out = f"dp {par.get('dp')} x tp {par.get('tp')} x pp {par.get('pp')} x cp {par.get('cp')}"
    for key in ("vpp", "ep", "etp"):
        value = par.get(key)
        if isinstance(value, int) and value > 1:
            out += f", {key} {value}"
    return out + (", sequence parallel" if par.get("sequence_parallel") and (par.get("tp") or 1) > 1 else "")


def estimate_header(est: Estimate) -> Text:
    """One line: model, size, framework, precision and layout."""
    job = est.to_dict()["job"]
    par, batch = job.get("parallel", {}), job.get("batch", {})
    text = Text()
    text.append(est.model, style="bold")
    text.append(f" · {est.total_parameters / 1e9:,.2f} B parameters{training_split(est)} · {est.framework}")
    text.append(f" · {job.get('precision', {}).get('name', '?')}")
    text.append(f" · {par.get('world_size')} GPU{'' if par.get('world_size') == 1 else 's'} = {layout_words(par)}")
    text.append(f" · mbs {batch.get('micro_batch_size')} x seq {batch.get('seq_length')}")
    if est.frozen_params:
        text.append(f" · trainable {est.trainable_params:,} / frozen {est.frozen_params:,} parameters")
    return text


def peak_summary(est: Estimate) -> Text:
    """The peak and where it occurs."""
    peak = est.stages[[s.stage for s in est.stages].index(est.peak_stage)]
    text = Text("Peak: ", style="bold")
    text.append(f"{_gib(est.peak_allocated_bytes)} GiB allocated, {_gib(est.peak_reserved_bytes)} GiB reserved",
                style="bold")
    where = f"pipeline stage {est.peak_stage} of {len(est.stages)}, " if len(est.stages) > 1 else ""
    simulated = any(a.startswith("reserved = the caching-allocator simulator") for a in est.assumptions)
    how = (f"reserved simulated, {est.fragmentation:.0%} of it unallocated" if simulated
           else f"reserved assumes {est.fragmentation:.0%} fragmentation")
    text.append(f" ({where}during {peak.peak_phase}; {how})")
    if est.peak_cpu_bytes:
        cpu = max(est.stages, key=lambda s: s.cpu_bytes)
        parts = [(cpu.cpu_parameters_bytes, "weights"), (cpu.cpu_gradients_bytes, "gradients"),
                 (cpu.cpu_optimizer_bytes, "optimizer state"), (cpu.cpu_activations_bytes, "activations")]
        detail = ", ".join(f"{label} {_gib(n)}" for n, label in parts if n)
        text.append(f"\nCPU memory for offloaded state: {_gib(est.peak_cpu_bytes)} GiB per GPU process ({detail})",
                    style="bold")
    return text


def fit_verdict(est: Estimate) -> Text | None:
    """Whether the peak reserved memory fits the GPU, with the headroom or the shortfall; None without a GPU."""
    gpu, headroom = est.gpu, est.headroom_bytes
    if gpu is None or headroom is None:
        return None
    usable = (f"{_gib(gpu.usable_bytes)} GiB usable = {_gib(gpu.total_bytes)} GiB total - "
              f"{_gib(gpu.outside_allocator_bytes)} GiB CUDA context/NCCL")
    if est.fits:
        return Text(f"Fits on {gpu.name} ({gpu.description}): headroom {_gib(headroom)} GiB ({usable}).",
                    style="bold green")
    return Text(f"Does not fit on {gpu.name} ({gpu.description}): short by {_gib(-headroom)} GiB ({usable}).",
                style="bold red")


def _notes(est: Estimate) -> list[Text]:
    notes = []
    if est.job.parallel.pp > 1 and est.job.batch.global_batch_size is None:
        notes.append(Text(
            "note: --gbs not given, so 1 micro-batch per step and no pipeline warm-up micro-batches "
            "are counted; pass --gbs for the real in-flight count.", style="yellow"))
    return notes


def assumptions_list(est: Estimate) -> Table:
    """The numbered assumptions behind the estimate (``--explain``), with hanging indents."""
    grid = Table.grid(padding=(0, 1))
    grid.title, grid.title_justify, grid.title_style = "Assumptions", "left", "bold"
    grid.add_column(justify="right", style="dim", no_wrap=True)
    grid.add_column()
    for i, line in enumerate(est.assumptions, 1):
        grid.add_row(f"{i}.", line)
    return grid


def render_estimate(est: Estimate, *, explain: bool = False) -> RenderableType:
    """Everything ``memplan estimate`` prints: header, stage tables, peak, fit verdict, notes."""
    parts: list[RenderableType] = [estimate_header(est), Text()]
    for table in stage_tables(est):
        parts += [table, Text()]
    parts.append(peak_summary(est))
    verdict = fit_verdict(est)
    if verdict is not None:
        parts.append(verdict)
    parts += _notes(est)
    if explain:
        parts += [Text(), assumptions_list(est)]
    return Group(*parts)


def presets_table(presets: Iterable[PresetInfo]) -> Table:
    """Shipped presets: name, model type, parameters (billions), layers, hidden size, MoE."""
    table = Table(title="Model presets (params in billions, 10^9)", title_justify="left", show_edge=False)
    for name, justify in (("name", "left"), ("type", "left"), ("params (B)", "right"), ("layers", "right"),
                          ("hidden", "right"), ("MoE", "center")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for p in presets:
        table.add_row(p.name, p.model_type, f"{p.total_params / 1e9:,.2f}", str(p.num_layers),
                      str(p.hidden_size), "yes" if p.is_moe else "")
    return table


def gpus_table(gpus: Iterable[GPU]) -> Table:
    """The GPU catalogue: driver-reported total and allocator-usable memory (GiB)."""
    table = Table(title="GPUs (GiB = 2^30 bytes)", title_justify="left", show_edge=False)
    table.add_column("name", no_wrap=True)
    table.add_column("description")
    table.add_column("total GiB", justify="right")
    table.add_column("usable GiB", justify="right")
    table.add_column("16-bit TFLOP/s", justify="right")
    for g in gpus:
        table.add_row(g.name, g.description, _gib(g.total_bytes), _gib(g.usable_bytes),
                      f"{g.bf16_flops / 1e12:,.0f} {g.half_dtype}" if g.bf16_flops else "")
    return table
