"""The ledger of one pipeline stage: what each mechanic contributes, when it is live, and the peak.

Every mechanic (:mod:`memplan.estimate.mechanics`) returns :class:`Contribution` records: a
category (which figure of :class:`~memplan.estimate.result.StageEstimate` it adds to), the bytes,
when they are live (some of the candidate peak moments, or the whole step) and the sentence that
explains them. The ledger sums them per moment, takes the peak and builds the stage's figures, so a
number and its explanation come from the same branch of the same function.

Candidate moments (:data:`PHASES`, in the order a tie is broken): a layer's ``backward`` with
every in-flight forward alive, the ``optimizer step``, the ``end of backward``, the ``loss`` of the
newest micro-batch (last stage), and the end of the ``forward`` (only where something peaks then:
DeepSpeed's unfilled checkpoint buffers, DoRA's weight temporaries).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

PHASES = ("backward", "optimizer step", "end of backward", "loss", "forward")
#: ``Contribution.live`` for what is allocated for the whole step.
LIFETIME: tuple[str, ...] = ()

#: Categories that add to the peak (``absent`` subtracts: gradients not made yet).
PARAMETERS, GRADIENTS, MASTER, OPTIMIZER, WORKSPACE = "parameters", "gradients", "master", "optimizer", "workspace"
ACTIVATIONS, LOGITS, TEMPORARY, INPUT, COMMUNICATION = "activations", "logits", "temporary", "input", "communication"
ABSENT, GRAPHS = "absent", "graphs"
#: Reported at the peak but not part of its sum (the layers' share of ``activations``).
LAYER_ACTIVATIONS = "layer activations"
#: Not in the device peak at all: CPU memory, memory outside the allocator, figures of record.
CPU, OUTSIDE, NOTE = "cpu", "outside", "note"

_STATIC = (PARAMETERS, GRADIENTS, MASTER, OPTIMIZER, WORKSPACE)
_SUMMED = _STATIC + (ACTIVATIONS, LOGITS, TEMPORARY, INPUT, COMMUNICATION, GRAPHS)


@dataclass(frozen=True)
class Contribution:
    """Bytes one mechanic adds to one category of one GPU of a stage, and why."""

    category: str
    nbytes: int
    #: The candidate moments it is alive at (:data:`PHASES`); :data:`LIFETIME` for the whole step.
    live: tuple[str, ...] = LIFETIME
    #: The assumption sentence that explains it ("" when another contribution's sentence does).
    note: str = ""
    #: Whether it counts when the ledger chooses the peak moment. The batch a stage holds is counted
    #: at the peak but does not choose it (the moment with the most else is the peak).
    weighs: bool = True

    def live_at(self, phase: str) -> bool:
        return not self.live or phase in self.live


@dataclass(frozen=True)
class Peak:
    """The stage's peak moment and each category's bytes then."""

    phase: str
    by_category: dict[str, int]
    allocated: int
    #: Per moment, the communication buffers alive (``max_communication_bytes`` takes their maximum).
    communication_at: dict[str, int]

    def __getitem__(self, category: str) -> int:
        return self.by_category.get(category, 0)


class Ledger:
    """The contributions of one stage, in the order the mechanics gave them."""

    def __init__(self, phases: Iterable[str]) -> None:
        self.phases = tuple(p for p in PHASES if p in set(phases))
        self.entries: list[Contribution] = []

    def add(self, *items: Contribution) -> None:
        self.entries.extend(items)

    def extend(self, items: Iterable[Contribution]) -> None:
        self.entries.extend(items)

    def total(self, category: str, phase: str | None = None) -> int:
        """Bytes of ``category`` alive at ``phase`` (None: its lifetime contributions only)."""
        return sum(c.nbytes for c in self.entries if c.category == category
                   and (c.live_at(phase) if phase is not None else not c.live))

    def weighed(self) -> dict[str, int]:
        """Per candidate moment, what chooses the peak: the moment's own bytes (no static state),
        gradients not yet made subtracted."""
        out = dict.fromkeys(self.phases, 0)
        for c in self.entries:
            if c.live and c.weighs and c.nbytes:
                sign = -1 if c.category == ABSENT else (1 if c.category in _SUMMED else 0)
                for phase in c.live:
                    if phase in out:
                        out[phase] += sign * c.nbytes
        return out

    def peak(self) -> Peak:
        """The moment with the most weighed bytes (the first of :data:`PHASES` on a tie)."""
        weighed = self.weighed()
        phase = max(self.phases, key=weighed.__getitem__)
        by_category = dict.fromkeys((*_SUMMED, ABSENT, LAYER_ACTIVATIONS), 0)
        comm = dict.fromkeys(self.phases, 0)
        for c in self.entries:
            if not c.nbytes:
                continue
            if c.category in by_category and (not c.live or phase in c.live):
                by_category[c.category] += c.nbytes
            if c.category == COMMUNICATION:
                for p in self.phases:
                    if not c.live or p in c.live:
                        comm[p] += c.nbytes
        allocated = sum(by_category[c] for c in _SUMMED) - by_category[ABSENT]
        return Peak(phase=phase, by_category=by_category, allocated=allocated, communication_at=comm)

    def notes(self) -> list[str]:
        """The contributions' sentences, each once, in order."""
        return list(dict.fromkeys(c.note for c in self.entries if c.note))
