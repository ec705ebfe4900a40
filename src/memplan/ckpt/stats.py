"""Counters of a checkpointing controller, as a frozen snapshot."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["CkptStats"]


@dataclass(frozen=True, kw_only=True)
class CkptStats:
    """What :class:`~memplan.ckpt.CheckpointController` has done so far."""

    #: Training forwards planned (micro-steps of gradient accumulation count one each; a redone step once).
    steps: int
    #: Steps run to measure the predictors (one block checkpointed and probed; or, sheltered, all of them).
    sheltered_steps: int
    #: Steps that exceeded the budget (out-of-memory, or the CPU meter's limit) and were redone.
    misses: int
    #: Steps that ended above the budget without an error (possible on CUDA, which has room beyond the budget).
    over_budget_steps: int
    #: Block forwards run under checkpoint, i.e. block forwards recomputed in backward.
    recomputed_forwards: int
    #: Extra block forwards run to measure activations (sheltered steps and warm-up).
    probe_forwards: int
    #: Seconds spent choosing plans, in total.
    plan_seconds: float
    plan_cache_hits: int
    plan_cache_misses: int
    #: Highest peak the meter measured over the steps (bytes).
    max_peak_bytes: int
    #: Optimizer steps metered through the optimizer's step hooks, their highest peak, and how many
    #: exceeded the budget (weights + gradients + states + the update's temporaries).
    optimizer_steps: int = 0
    max_optimizer_peak_bytes: int = 0
    optimizer_over_budget_steps: int = 0
    #: "measured" once an optimizer holding the model's parameters was passed or seen stepping.
    optimizer_states: str = "assumed"
    #: Fake-tensor passes run by ``seed_from_fake`` (two per sample step; no compute, no memory).
    seeded_passes: int = 0
    #: Seconds spent in ``seed()`` (fast fake seeding).
    seed_seconds: float = 0.0
    #: Block forwards run under selective checkpointing (some ops saved), and with saved tensors offloaded.
    selective_forwards: int = 0
    offloaded_forwards: int = 0
    #: Measured seconds per FLOP-model second (1.0 before any measured block forward).
    time_scale: float = 1.0
    #: Steps run with every block under per-op SAC to measure its whole-step price where a plan had to shed
    #: memory and SAC was not measured near the size (exploration, :mod:`memplan.ckpt.explore`).
    explored_steps: int = 0
    #: Training steps whose forward and backward the meter measured (on CPU a plain loop's step predicted far
    #: below the budget runs unmetered; its optimizer step, a few operators, is always metered).
    metered_steps: int = 0
    #: What memplan did to the host allocator (CPU: glibc told to keep freed memory, memplan.ckpt.hostmem).
    host_memory: str = ""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)
