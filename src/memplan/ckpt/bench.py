"""The ckpt benchmark: memplan in three real loops against checkpointing every block, on CPU.

A GPT-2-style model (transformers ``GPT2LMHeadModel`` from a config, random weights; 30M
parameters by default) trains with AdamW on random token batches of ``batch_size`` sequences
whose lengths are a stratified lognormal sample (the quantiles at ``(i + 0.5) / steps``, so the
tail always reaches ``max_length``), clipped and shuffled with a seed. Every run starts from the
same weights and sees the same batches in the same order. Variants:

* ``none`` / ``full`` — a plain loop with no checkpointing / every block checkpointed (Hugging
  Face ``activation_checkpointing_enable``, non-reentrant): the references;
* ``plain`` — ``model = auto_checkpoint(model, budget)``, then the plain loop
  (``loss.backward(); opt.step()``), the AdamW optimizer created after wrapping, never passed;
* ``step`` — the same with ``model.memplan_ckpt.step(fn)`` around forward + backward (the safety net);
* ``trainer`` / ``trainer-full`` / ``trainer-none`` — an unchanged ``transformers.Trainer`` (its own
  AdamW, schedule and clipping) on the wrapped model / with every block checkpointed / with none; the
  batches come from an iterable dataset in order. ``trainer`` is compared with ``trainer-full``.

The budget is measured before the runs: ``budget_fraction`` of the way from ``full``'s peak to
``none``'s, both on the longest batch with the AdamW moments already allocated.

**The judge** is :class:`~memplan.ckpt.bench_meter.StepMeter`, a live-storage counter sharing no
code with memplan's meter, entered around each whole run: each step's peak covers forward,
backward and the optimizer's step. memplan's warm-up (a few short batches of the training shape
before training, when ``warmup_lengths`` is set) and its sheltered learning steps run inside the timed, judged runs.

**Timing**: ``repeats`` repetitions; in each, the :data:`TIMED` variants run one after another in
an order rotated every repetition; ``none`` and ``trainer-none`` run once (first repetition) for
the losses. Throughput is training tokens over the run's wall time (warm-up included); ratios to
the loop's ``full`` are taken within a repetition, then their median and spread reported.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from statistics import NormalDist
from typing import Any

import numpy as np
import torch

from memplan.ckpt.bench_meter import StepMeter
from memplan.ckpt.bench_paired import paired_interval
from memplan.ckpt.bench_setup import (
    MEMPLAN,
    TIMED,
    VARIANTS,
    BenchConfig,
    LiveRecord,
    RecomputeCounter,
    Run,
    build_model,
    longest_step_peak,
    prepare_variant,
    seed_memplan,
)

__all__ = ["MEMPLAN", "STATIC_POLICIES", "TIMED", "VARIANTS", "BenchConfig", "BenchResult", "Run", "run_bench", "sample_lengths", "with_overrides"]

#: Static policies a user could pick instead (the best one that fits the worst batch is the bar).
STATIC_POLICIES = ("full", "half", "sac")
#: Slack of the "0 steps over budget" target (the issue's 2 %).
BUDGET_SLACK = 0.02


@dataclass(frozen=True, kw_only=True)
class BenchResult:
    """Every run, the budget, and the summary against the targets."""

    config: BenchConfig
    n_params: int
    lengths: tuple[int, ...]
    budget_bytes: int
    runs: tuple[Run, ...]
    machine: dict[str, str] = field(default_factory=dict)
    date: str = ""
    #: Peak of one step on the longest batch for each static policy considered (the fit check).
    static_peaks: dict[str, int] = field(default_factory=dict)

    def of(self, variant: str) -> list[Run]:
        return [r for r in self.runs if r.variant == variant]

    def ratios(self, variant: str) -> list[float]:
        """Throughput of ``variant`` over its loop's ``full`` (``trainer-full`` for ``trainer``), per repetition."""
        return self.ratios_to(variant, "trainer-full" if variant == "trainer" else "full")

    def cpu_ratios(self, variant: str) -> list[float]:
        """Like :meth:`ratios`, by process CPU seconds (empty where they were not recorded)."""
        return self.cpu_ratios_to(variant, "trainer-full" if variant == "trainer" else "full")

    def cpu_ratios_to(self, variant: str, other: str) -> list[float]:
        """``other``'s process CPU seconds over ``variant``'s, per repetition (above 1: ``variant`` used less)."""
        ref = {r.rep: r.cpu_s for r in self.of(other) if r.cpu_s}
        return [ref[r.rep] / r.cpu_s for r in self.of(variant) if r.rep in ref and r.cpu_s]

    def ratios_to(self, variant: str, other: str) -> list[float]:
        """Throughput of ``variant`` over ``other``'s, per repetition."""
        ref = {r.rep: r.throughput for r in self.of(other)}
        return [r.throughput / ref[r.rep] for r in self.of(variant) if r.rep in ref]

    def best_static(self, limit: float) -> str | None:
        """The fastest static policy (median throughput over ``full``) none of whose steps exceed ``limit``."""
        fits = [v for v in STATIC_POLICIES if self.of(v) and all(max(r.peaks) <= limit for r in self.of(v))]
        if not fits:
            return None
        return max(fits, key=lambda v: 1.0 if v == "full" else _spread(self.ratios(v))["median"])

    def summary(self) -> dict[str, Any]:
        """Per-variant medians and spreads, and each target with its value and verdict."""
        limit = self.budget_bytes * (1 + BUDGET_SLACK)
        variants = {v: _variant_summary(self.of(v), limit) for v in VARIANTS if self.of(v)}
        full_rec = statistics.median(r.recomputed_forwards for r in self.of("full"))  # same batches in every loop
        targets: dict[str, Any] = {}
        for v in MEMPLAN:
            runs = self.of(v)
            if not runs:
                continue
            refs = [r for name in (("trainer-none", "trainer-full") if v == "trainer" else ("none", "full"))
                    for r in self.of(name)]
            ref = refs[0]  # checkpointing changes no loss: full (or trainer-full) where none was not run
            loss_diff = max(abs(a - b) for r in runs for a, b in zip(ref.losses, r.losses))
            over = variants[v]["steps_over_budget_max"]
            rec = statistics.median(r.recomputed_forwards for r in runs) / max(1.0, full_rec)
            ratio = _spread(self.ratios(v))
            want = self.config.speed_target
            targets[v] = {
                "steps over budget (independent meter, 2% slack)": _target(over, "== 0", over == 0),
                f"losses equal to {ref.variant}": _target(loss_diff, "== 0", loss_diff == 0.0),
                "recomputed block forwards / full's": _target(rec, "<= 0.25", rec <= 0.25),
                "throughput / full's (median of repetitions)": _target(ratio["median"], f">= {want:g}",
                                                                      ratio["median"] >= want),
                "sheltered steps (predictions missed)": _target(max(r.sheltered_steps for r in runs), "report", True),
                "seeding seconds (max of runs, inside the timings)": _target(
                    max(r.seed_s for r in runs), f"<= {self.config.seed_target_s:g}",
                    max(r.seed_s for r in runs) <= self.config.seed_target_s),
            }
            best = self.best_static(limit)
            if best is not None and v != "trainer" and self.ratios_to(v, best):
                vs = _spread(self.ratios_to(v, best))["median"]
                targets[v][f"throughput / best static that fits ({best}; median of repetitions)"] = _target(
                    vs, ">= 1", vs >= 1.0)
                paired = [iv for r in runs for o in self.of(best) if o.rep == r.rep
                          if (iv := paired_interval(r, o)) is not None]
                if paired:
                    iv = paired[0]
                    targets[v][f"paired bootstrap {iv['level']:.0%} interval over steps vs {best} (report)"] = _target(
                        [round(iv["low"], 4), round(iv["high"], 4)], "report", True)
                cpu = _spread(self.cpu_ratios_to(v, best))["median"]
                targets[v][f"CPU time of best static that fits ({best}) / own (report)"] = _target(cpu, "report", True)
        return {
            "smoke_test": self.config.smoke,
            "budget_bytes": self.budget_bytes,
            "variants": variants,
            "throughput_ratio_to_full": {v: _spread(self.ratios(v)) for v in VARIANTS
                                         if not v.endswith("full") and self.ratios(v)},
            "cpu_time_ratio_to_full": {v: _spread(self.cpu_ratios(v)) for v in VARIANTS
                                       if not v.endswith("full") and self.cpu_ratios(v)},
            "best_static_that_fits": self.best_static(limit),
            "targets": targets,
            "all_targets_met": all(t["met"] for per in targets.values() for t in per.values()),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "date": self.date, "machine": self.machine, "config": asdict(self.config), "n_params": self.n_params,
            "lengths": list(self.lengths), "budget_bytes": self.budget_bytes, "summary": self.summary(),
            "static_peaks_on_longest_batch": self.static_peaks,
            "runs": [{**asdict(r), "throughput_tokens_per_s": r.throughput} for r in self.runs],
        }


def _spread(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _target(value: float, wanted: str, met: bool) -> dict[str, Any]:
    return {"value": value, "target": wanted, "met": bool(met)}


def _variant_summary(runs: Sequence[Run], limit: float) -> dict[str, Any]:
    over = [sum(p > limit for p in r.peaks) + (r.warmup_peak > limit) for r in runs]
    return {
        "runs": len(runs),
        "throughput_tokens_per_s": _spread([r.throughput for r in runs]),
        "steps_over_budget_max": max(over),
        "max_peak_bytes": max(max(r.peaks) for r in runs),
        "median_peak_bytes": int(statistics.median(p for r in runs for p in r.peaks)),
        "warmup_peak_bytes": max(r.warmup_peak for r in runs),
        "recomputed_forwards": sorted({r.recomputed_forwards for r in runs}),
        "probe_forwards": sorted({r.probe_forwards for r in runs}),
        "sheltered_steps": sorted({r.sheltered_steps for r in runs}),
        "misses": sorted({r.misses for r in runs}),
        "warmup_s_median": statistics.median(r.warmup_s for r in runs),
        "seed_s": _spread([r.seed_s for r in runs]),
        "seed_cpu_s": _spread([r.seed_cpu_s for r in runs]),
        "load_1min": _spread([r.load_1min for r in runs]),
        "selective_forwards": sorted({r.selective_forwards for r in runs}),
        "explored_steps": sorted({r.explored_steps for r in runs}),
        "metered_steps": sorted({r.metered_steps for r in runs}),
        "optimizer_states": sorted({r.optimizer_states for r in runs}),
    }


# ------------------------------------------------------------------------------------ inputs
def sample_lengths(cfg: BenchConfig) -> list[int]:
    """Stratified lognormal lengths: the quantiles at (i + 0.5) / steps, clipped, shuffled with the seed."""
    normal = NormalDist()
    raw = [cfg.length_median * math.exp(cfg.length_sigma * normal.inv_cdf((i + 0.5) / cfg.steps))
           for i in range(cfg.steps)]
    lengths = [int(min(cfg.max_length, max(cfg.min_length, round(x)))) for x in raw]
    order = np.random.default_rng(cfg.seed).permutation(cfg.steps)
    return [lengths[i] for i in order]


def _batches(cfg: BenchConfig, lengths: Sequence[int], seed: int, batch: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (batch, n), generator=gen) for n in lengths]


# ------------------------------------------------------------------------------------ the variants
def _warm_up(model: torch.nn.Module, cfg: BenchConfig, judge: StepMeter, live: LiveRecord) -> None:
    from memplan.ckpt.wrapper import controller_of

    if not cfg.warmup_lengths:
        return
    t0 = time.perf_counter()
    judge.peak = judge.live_bytes
    batches = _batches(cfg, cfg.warmup_lengths, cfg.seed + 7, cfg.batch_size)
    controller_of(model).warm_up([lambda b=b: model(input_ids=b, labels=b).loss.backward() for b in batches])
    live.warmup_peak, live.warmup_s = judge.peak, time.perf_counter() - t0


def _loop(variant: str, model: torch.nn.Module, cfg: BenchConfig, batches: Sequence[torch.Tensor],
          judge: StepMeter, live: LiveRecord) -> None:
    """The plain loop (``step``: forward + backward through ``model.memplan_ckpt.step``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    ctl = getattr(model, "memplan_ckpt", None)
    for b in batches:
        judge.peak = judge.live_bytes

        def fwd_bwd(b: torch.Tensor = b) -> torch.Tensor:
            loss = model(input_ids=b, labels=b).loss
            loss.backward()
            return loss.detach()

        loss = ctl.step(fwd_bwd) if variant == "step" and ctl is not None else fwd_bwd()
        opt.step()
        opt.zero_grad(set_to_none=True)
        live.losses.append(float(loss))
        live.peaks.append(judge.peak)


def _trainer(model: torch.nn.Module, cfg: BenchConfig, batches: Sequence[torch.Tensor], judge: StepMeter,
             live: LiveRecord, out_dir: str) -> None:
    """An unchanged ``transformers.Trainer``; losses read by a forward hook, peaks by a callback."""
    from transformers import PrinterCallback, ProgressCallback, Trainer, TrainerCallback, TrainingArguments

    class InOrder(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter({"input_ids": b, "labels": b} for b in batches)

    class Peaks(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            judge.peak = judge.live_bytes

        def on_step_end(self, *_: Any, **__: Any) -> None:
            live.peaks.append(judge.peak)

    def record_loss(module: torch.nn.Module, _args: Any, output: Any) -> None:
        if module.training and torch.is_grad_enabled():
            live.losses.append(float(output.loss.detach()))

    handle = model.register_forward_hook(record_loss)
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=1, max_steps=len(batches), learning_rate=cfg.lr,
        report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
        seed=cfg.seed, dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=InOrder(), data_collator=lambda items: items[0],
                      callbacks=[Peaks()])
    for printer in (PrinterCallback, ProgressCallback):  # they print to stdout (the CLI's JSON)
        trainer.remove_callback(printer)
    trainer.train()
    handle.remove()


def _run(variant: str, rep: int, cfg: BenchConfig, init: dict[str, torch.Tensor], batches: Sequence[torch.Tensor],
         budget: int, out_dir: str) -> Run:
    model = prepare_variant(variant, cfg, init, budget)
    counter, live, judge = RecomputeCounter(model), LiveRecord(), StepMeter()
    t0, c0 = time.perf_counter(), time.process_time()
    with judge:
        judge.start(model, None)
        if variant in MEMPLAN:
            seed_memplan(model, cfg, judge, live)
            _warm_up(model, cfg, judge, live)
        if variant.startswith("trainer"):
            _trainer(model, cfg, batches, judge, live, out_dir)
        else:
            _loop(variant, model, cfg, batches, judge, live)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    stats = model.memplan_ckpt.stats() if variant in MEMPLAN else None
    if stats is not None:
        from memplan.ckpt.wrapper import remove_checkpointing

        remove_checkpointing(model)
    return Run(
        variant=variant, rep=rep, wall_s=wall, warmup_s=live.warmup_s, tokens=sum(b.numel() for b in batches),
        losses=tuple(live.losses), peaks=tuple(live.peaks), warmup_peak=live.warmup_peak,
        recomputed_forwards=counter.backward, probe_forwards=stats.probe_forwards if stats else 0,
        sheltered_steps=stats.sheltered_steps if stats else 0, misses=stats.misses if stats else 0,
        optimizer_states=stats.optimizer_states if stats else "", cpu_s=cpu, seed_s=live.seed_s,
        seed_cpu_s=live.seed_cpu_s, load_1min=os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0,
        selective_forwards=stats.selective_forwards if stats else 0,
        explored_steps=stats.explored_steps if stats else 0, metered_steps=stats.metered_steps if stats else 0,
    )


# ------------------------------------------------------------------------------------ setup
def _calibrate(cfg: BenchConfig, init: dict[str, torch.Tensor], longest: torch.Tensor) -> int:
    """``full``'s peak plus ``budget_fraction`` of the way to ``none``'s on the longest batch."""
    peaks = {variant: longest_step_peak(variant, cfg, init, longest) for variant in ("full", "none")}
    return int(peaks["full"] + cfg.budget_fraction * (peaks["none"] - peaks["full"]))


def _machine() -> dict[str, str]:
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),  # called while the benchmark's thread count is set
        "load_average_at_start": "",
        "load_average_at_end": " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def run_bench(cfg: BenchConfig | None = None, *, progress: Callable[[str], None] | None = None,
              out_dir: str | None = None) -> BenchResult:
    """Run the benchmark (see the module docstring) and return every run with its summary."""
    import copy
    import tempfile

    # The benchmark runs on the CPU: DeepSpeed (which transformers' Trainer imports when it is installed) is told
    # so, instead of probing for an accelerator and printing a warning that it found none.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from transformers import Trainer  # noqa: F401  (imported before the first timed run, not inside it)

    # every module a run imports lazily, loaded now: not inside a timed run, and not a newer copy of a
    # file edited while a long benchmark runs
    import memplan.ckpt.bench_interleave  # noqa: F401
    import memplan.ckpt.bench_procs  # noqa: F401
    import memplan.ckpt.fastseed  # noqa: F401
    import memplan.ckpt.wrapper  # noqa: F401

    cfg = cfg or BenchConfig()
    say = progress or (lambda _msg: None)
    start_load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else ""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        lengths = sample_lengths(cfg)
        model = build_model(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        init = copy.deepcopy(model.state_dict())
        del model
        batches = _batches(cfg, lengths, cfg.seed + 1, cfg.batch_size)
        budget = _calibrate(cfg, init, max(batches, key=lambda b: b.shape[1]))
        say(f"{n_params / 1e6:.1f}M params, budget {budget / 2**20:,.0f} MiB, lengths {lengths}")
        runs: list[Run] = []
        static_peaks: dict[str, int] = {}
        longest = max(batches, key=lambda b: b.shape[1])
        if cfg.interleave in ("step", "process"):
            from memplan.ckpt.bench_interleave import fitting_statics, run_interleaved
            from memplan.ckpt.bench_procs import run_in_processes

            statics = [v for v in cfg.timed if v in STATIC_POLICIES and v != "full"]
            static_peaks = fitting_statics(cfg, init, longest, budget, statics)
            timed = [v for v in cfg.timed if static_peaks.get(v, 0) <= budget * (1 + BUDGET_SLACK)]
            say("static peaks on the longest batch (MiB): "
                + ", ".join(f"{v} {p / 2**20:,.0f}" for v, p in static_peaks.items()) + f"; timed {timed}")
            if cfg.interleave == "process":
                runs += run_in_processes(cfg, timed, batches, budget, say)
            else:
                runs += run_interleaved(cfg, timed, init, batches, budget, say)
        with tempfile.TemporaryDirectory() as tmp:
            timed = cfg.timed if cfg.interleave == "run" else ()
            for rep in range(cfg.repeats):
                order = list(timed[rep % len(timed):] + timed[:rep % len(timed)]) if timed else []
                for variant in (order + list(cfg.once) if rep == 0 else order):
                    run = _run(variant, rep, cfg, init, batches, budget, out_dir or tmp)
                    say(f"rep {rep + 1}/{cfg.repeats} {variant}: {run.throughput:.1f} tokens/s, "
                        f"max peak {max(run.peaks) / 2**20:,.0f} MiB, {run.recomputed_forwards} recomputed")
                    runs.append(run)
        machine = _machine()
        machine["load_average_at_start"] = start_load
    finally:
        torch.set_num_threads(threads)
    return BenchResult(
        config=cfg, n_params=n_params, lengths=tuple(lengths), budget_bytes=budget, runs=tuple(runs),
        static_peaks=static_peaks,
        machine=machine, date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )


def with_overrides(cfg: BenchConfig, **changes: Any) -> BenchConfig:
    """``cfg`` with the given fields replaced (``None`` values ignored)."""
    return replace(cfg, **{k: v for k, v in changes.items() if v is not None})
