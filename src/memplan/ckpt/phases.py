"""One step's record and the inversion of the phase model: what each measured phase implies.

The planner (:mod:`memplan.ckpt.planner`) predicts each phase's peak from the per-block activation
bytes and the non-block terms ``H_*``; :func:`phase_terms` runs that formula backwards, turning the
meter's measured phase peaks into observations of the ``H_*`` terms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from memplan.ckpt.planner import CheckpointPlan

__all__ = ["CkptStepState", "PhaseKey", "block_seconds", "grad_tensor", "new_bytes", "phase_terms", "skip_output",
           "tensors_in"]

#: "head", "tail", a block index (its backward) or ("forward", block index).
PhaseKey = str | int | tuple[str, int]


@dataclass(kw_only=True)
class CkptStepState:
    """What one forward/backward is doing and what was measured during it."""

    size: int
    plan: CheckpointPlan
    static_bytes: int
    grad_bytes: tuple[int, ...]
    #: Probe checkpointed blocks with one plain forward (sheltered and warm-up steps).
    probe: bool
    #: Whether the meter was counting (on CPU only inside it), i.e. whether the numbers mean anything.
    metered: bool
    #: A fake-tensor pass of ``seed_from_fake``: bytes are observed, times and training counters are not.
    seed: bool = False
    acts: dict[int, int] = field(default_factory=dict)
    #: Bytes a selectively checkpointed or offloading block held from its forward to its backward.
    kept: dict[int, int] = field(default_factory=dict)
    #: Blocks a fast seeding pass skipped (identity), and the per-op profiles it recorded.
    skip: frozenset[int] = frozenset()
    ops: dict[int, Any] = field(default_factory=dict)
    templates: dict[type, Any] = field(default_factory=dict)
    times: dict[int, float] = field(default_factory=dict)
    #: Per block: seconds of its forward whatever its option, and when its output's gradient was complete
    #: (block -1: the first block's input) — a block's backward runs between its mark and the one before.
    forward_s: dict[int, float] = field(default_factory=dict)
    marks: dict[int, float] = field(default_factory=dict)
    #: Whether the step is timed whole (a sample of per-op SAC's step price), and the step clock at its start.
    timed: bool = False
    clock0: float = 0.0
    peaks: dict[PhaseKey, int] = field(default_factory=dict)
    #: The phase running now: "head" until the first block's output gradient, then block indices, then "tail".
    phase: str | int = "head"
    #: Whether a gradient hook of this step has fired (the end-of-backward callback is queued then).
    backward_started: bool = False


def block_seconds(st: CkptStepState, n_blocks: int) -> list[float | None]:
    """Each block's seconds in the step (forward + backward, recomputation included; None: not measured)."""
    out: list[float | None] = []
    for j in range(n_blocks):
        fwd, start, end = st.forward_s.get(j), st.marks.get(j), st.marks.get(j - 1)
        out.append(None if fwd is None or start is None or end is None or end < start else fwd + end - start)
    return out


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nest of tuples, lists and dicts."""
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def new_bytes(out: Any, inputs: Any) -> int:
    """Bytes of the storages of ``out`` that are not storages of ``inputs``."""
    old = {t.untyped_storage()._cdata for t in tensors_in(inputs)}
    new = {}
    for t in tensors_in(out):
        st = t.untyped_storage()
        if st._cdata not in old:
            new[st._cdata] = st.nbytes()
    return sum(new.values())


def grad_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor in ``obj`` that requires grad (a block's hidden states)."""
    return next((t for t in tensors_in(obj) if t.requires_grad), None)


def skip_output(template: Any, args: Any, kwargs: Any) -> Any:
    """What a skipped block returns in a fast seeding pass: its input hidden states, in the structure
    a block of its class returned (``template``; the hidden states alone when there is none)."""
    hidden = grad_tensor((args, kwargs))
    if template is None or isinstance(template, torch.Tensor):
        return hidden
    inner = grad_tensor(template)
    return tree_map(lambda x: hidden if x is inner else x, template)


def phase_terms(st: CkptStepState, acts: list[float], kept: list[float] | None = None) -> dict[str, float]:
    """Invert the planner's phase formulas: the non-block bytes each measured phase implies.

    ``acts[i]`` are the bytes block ``i`` builds (its intermediates), ``kept[i]`` the bytes it held
    from its forward to its backward (default: ``acts[i]`` for a kept block, 0 for a checkpointed one).
    """
    recomputed = st.plan.checkpoint
    if kept is None:
        kept = [0.0 if c else a for a, c in zip(acts, recomputed)]
    terms: dict[str, float] = {}
    forward_terms, kept_before = [], 0.0
    for i, a in enumerate(acts):
        if ("forward", i) in st.peaks:
            forward_terms.append(st.peaks[("forward", i)] - st.static_bytes - kept_before - a)
        kept_before += kept[i]
    if forward_terms:
        terms["forward"] = max(forward_terms)
    if "head" in st.peaks:
        terms["head"] = st.peaks["head"] - st.static_bytes - sum(kept)
    grads, kept_before = 0.0, sum(kept)
    block_terms: dict[str, list[float]] = {"block": [], "recompute": []}
    for i in reversed(range(len(acts))):
        kept_before -= kept[i]
        grads += st.grad_bytes[i]
        if i in st.peaks:
            name = "recompute" if recomputed[i] else "block"
            block_terms[name].append(st.peaks[i] - st.static_bytes - grads - kept_before - acts[i])
    terms.update({name: max(values) for name, values in block_terms.items() if values})
    if "tail" in st.peaks:
        terms["tail"] = st.peaks["tail"] - st.static_bytes - grads
    return terms
