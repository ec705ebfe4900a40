"""Fast seeding: every predictor seeded before the first step from fake runs of a few blocks.

``seed_from_fake`` (:mod:`memplan.ckpt.seed`) runs whole sample steps on fake tensors, twice per
size; fake dispatch is Python (about 0.25 ms per operator), so on the benchmark's 8-layer 30M GPT-2
three sizes took 8-11 s, nearly all of it in the blocks. The blocks of one class are alike, so this
seeding runs each sample step once, under ``FakeTensorMode`` and the CPU meter, with:

* the first block of each class run plainly inside an :class:`~memplan.ckpt.opprofile.OpRecorder`
  (per op: FLOPs, bytes, whether backward saves its output) — its kept bytes and the kept-block
  backward phase are measured;
* the second block of each class checkpointed and probed — its recompute phase is measured;
* every other block skipped: it returns its input hidden states in the structure a block of its
  class returned (an identity), and its gradients are not counted.

The non-block phase terms (embedding, head and loss, the tail) are measured as in a whole step,
because the phase model subtracts the blocks' own bytes. Each block of a class then gets the
traced block's bytes at each size, and the op profile gives its FLOP-based forward seconds and its
selective-checkpoint levels (:mod:`memplan.ckpt.opcosts`). Three sizes make every predictor ready;
seed up to the largest batch expected and no training step is sheltered.

Assumptions and limits: blocks of one class keep the same bytes for the same input (a class whose
layers differ, e.g. sliding-window and global attention, is corrected by the first real steps and,
under ``step()``, by the safety net); a class with a single block gets a second pass with that block
checkpointed. Runs with the CPU meter whatever the device (storage bytes: no allocator rounding —
the margin covers it on CUDA). Steps that read tensor values cannot run on fake tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from memplan.ckpt.meter import CpuMeter
from memplan.ckpt.opprofile import block_levels
from memplan.ckpt.safety import rng_state, set_rng_state
from memplan.ckpt.seed import fake_parameters
from memplan.errors import ConfigError, UnsupportedError

if TYPE_CHECKING:
    from memplan.ckpt.controller import CheckpointController
    from memplan.ckpt.phases import CkptStepState

__all__ = ["seed_fast", "seed_specs"]

#: (mode per block, blocks skipped, blocks whose ops are recorded)
Spec = tuple[tuple[str, ...], frozenset[int], frozenset[int]]


def seed_specs(classes: list[type]) -> list[Spec]:
    """The passes per sample step for blocks of these classes (forward order): one, or two when a
    class has a single block (then checkpointed in the second pass)."""
    first: dict[type, int] = {}
    second: dict[type, int] = {}
    for j, cls in enumerate(classes):
        if cls not in first:
            first[cls] = j
        elif cls not in second:
            second[cls] = j
    traced = set(first.values()) | set(second.values())
    skip = frozenset(j for j in range(len(classes)) if j not in traced)
    record = frozenset(first.values())
    modes = tuple("full" if j in second.values() else "keep" for j in range(len(classes)))
    specs = [(modes, skip, record)]
    lonely = [j for cls, j in first.items() if cls not in second]
    if lonely:
        flipped = tuple("full" if j in lonely else m for j, m in enumerate(modes))
        specs.append((flipped, skip, frozenset()))
    return specs


def seed_fast(controller: CheckpointController, steps: Iterable[Callable[[], object]]) -> int:
    """Seed ``controller`` from fake runs of each sample step (see the module docstring); the passes run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if controller.meter.active:
        raise UnsupportedError("seed: call it before training or between steps, not inside one")
    fns = list(steps)
    if not fns:
        raise ConfigError("steps", "must hold at least one sample step (three sizes make every predictor ready)", [])
    classes = [type(b) for b in controller.blocks]
    specs = seed_specs(classes)
    meter, rng, passes = controller.meter, rng_state(controller.device), 0
    if not isinstance(meter, CpuMeter):
        controller.meter = CpuMeter()  # fake tensors are invisible to the allocator's statistics
    profiles: list[tuple[int, dict[int, object]]] = []
    try:
        for fn in fns:
            for spec in specs:
                controller._seed_spec = spec
                mode = FakeTensorMode(allow_non_fake_inputs=True)
                with fake_parameters(controller.model, mode), mode:
                    record = _pass(controller, fn)
                passes += 1
                if record is not None and record.ops:
                    profiles.append((record.size, dict(record.ops)))
                    _share(controller, record, classes)
    finally:
        controller._seed_spec = None
        if controller.meter is meter and isinstance(meter, CpuMeter):
            meter.forget_all()  # fake storages kept alive by torch's fake-tensor caches are no memory
        controller.meter = meter
        set_rng_state(rng, controller.device)
    _seed_op_costs(controller, profiles, classes)
    controller._version += 1
    return passes


def _pass(controller: CheckpointController, fn: Callable[[], object]) -> CkptStepState | None:
    """One fake pass; returns its step record (kept for the profiles it holds)."""
    seen: list[CkptStepState] = []
    original = controller._observe

    classes = [type(b) for b in controller.blocks]

    def observe(st: CkptStepState) -> None:
        # the checkpointed traced block builds what the kept one of its class measured
        by_class = {classes[j]: v for j, v in st.acts.items()}
        for j in range(len(classes)):
            if j not in st.skip and j not in st.acts and classes[j] in by_class:
                st.acts[j] = by_class[classes[j]]
        seen.append(st)
        original(st)

    controller._observe = observe  # type: ignore[method-assign]
    try:
        controller.run_seed_pass(fn, force="seed")
    finally:
        del controller._observe
    return seen[-1] if seen else None


def _share(controller: CheckpointController, st: CkptStepState, classes: list[type]) -> None:
    """Give every block of a class the bytes its traced blocks measured at this size (largest)."""
    measured: dict[type, int] = {}
    for j, value in st.acts.items():
        measured[classes[j]] = max(measured.get(classes[j], 0), value)
    for j, cls in enumerate(classes):
        if cls in measured:
            controller._acts[j].add(st.size, measured[cls])


def _seed_op_costs(controller: CheckpointController, profiles: list[tuple[int, dict[int, object]]],
                   classes: list[type]) -> None:
    """Per-op profiles → each block's FLOP-based seconds and selective levels (fixed at the largest size)."""
    by_class: dict[type, list[tuple[int, object]]] = {}
    for size, ops in profiles:
        for j, records in ops.items():
            by_class.setdefault(classes[j], []).append((size, records))
    for cls, points in by_class.items():
        largest = max(points, key=lambda p: p[0])[1]
        levels = block_levels(largest, controller.ops.roof)  # type: ignore[arg-type]
        same = [(size, records) for size, records in points
                if [op.key for op in records] == [op.key for op in largest]]  # type: ignore[attr-defined]
        for j, c in enumerate(classes):
            if c is cls:
                for size, records in same:
                    controller.ops.add_profile(j, size, records, levels)  # type: ignore[arg-type]
