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
from operator import itemgetter
from typing import NamedTuple

from memplan.frozen import frozen_dataclass

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


class Contribution(NamedTuple):
    """Bytes one mechanic adds to one category of one GPU of a stage, and why (an immutable record;
    a named tuple because a stage enters some thirty of them per estimate)."""

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


@frozen_dataclass
class Peak:
    """The stage's peak moment and each category's bytes then."""

    phase: str
    by_category: dict[str, int]
    allocated: int
    #: Per moment, the communication buffers alive (``max_communication_bytes`` takes their maximum).
    communication_at: dict[str, int]

    def __getitem__(self, category: str) -> int:
        return self.by_category.get(category, 0)


#: The sign a category weighs with when the ledger chooses the peak moment (others weigh 0).
_SIGN = {**dict.fromkeys(_SUMMED, 1), ABSENT: -1}
_REPORTED = (*_SUMMED, ABSENT, LAYER_ACTIVATIONS)
_NBYTES, _NOTE = itemgetter(1), itemgetter(3)


class Ledger:
    """The contributions of one stage, in the order the mechanics gave them, summed as they enter:
    per category over the whole step and per category at each moment they are live at."""

    def __init__(self, phases: Iterable[str]) -> None:
        given = set(phases)
        self.phases = tuple(p for p in PHASES if p in given)
        self.entries: list[Contribution] = []
        self._lifetime: dict[str, int] = {}
        self._notes: dict[str, None] = {}
        self._at: dict[str, dict[str, int]] = {phase: {} for phase in PHASES}
        self._weighed = dict.fromkeys(self.phases, 0)

    def add(self, *items: Contribution) -> None:
        self.extend(items)

    def extend(self, items: Iterable[Contribution]) -> None:
        entries = self.entries
        start = len(entries)
        entries.extend(items)
        new = entries[start:]
        self._notes.update(dict.fromkeys(filter(None, map(_NOTE, new))))
        lifetime, at, weighed = self._lifetime, self._at, self._weighed
        for category, nbytes, live, _, weighs in filter(_NBYTES, new):  # only what has bytes adds up
            if not live:
                lifetime[category] = lifetime.get(category, 0) + nbytes
                continue
            sign = _SIGN.get(category, 0) if weighs else 0
            for phase in live:
                moment = at[phase]
                moment[category] = moment.get(category, 0) + nbytes
                if sign and phase in weighed:
                    weighed[phase] += sign * nbytes

    def total(self, category: str, phase: str | None = None) -> int:
        """Bytes of ``category`` alive at ``phase`` (None: its lifetime contributions only)."""
        out = self._lifetime.get(category, 0)
        if phase is not None:
            out += self._at[phase].get(category, 0)
        return out

    def weighed(self) -> dict[str, int]:
        """Per candidate moment, what chooses the peak: the moment's own bytes (no static state),
        gradients not yet made subtracted."""
        return dict(self._weighed)

    def peak(self) -> Peak:
        """The moment with the most weighed bytes (the first of :data:`PHASES` on a tie)."""
        weighed = self._weighed
        phase = max(self.phases, key=weighed.__getitem__)
        by_category = dict.fromkeys(_REPORTED, 0)
        for sums in (self._lifetime, self._at[phase]):
            for category, nbytes in sums.items():
                if category in by_category:
                    by_category[category] += nbytes
        comm = self._lifetime.get(COMMUNICATION, 0)
        comm_at = {p: comm + self._at[p].get(COMMUNICATION, 0) for p in self.phases}
        allocated = sum(map(by_category.__getitem__, _SUMMED)) - by_category[ABSENT]
        return Peak(phase=phase, by_category=by_category, allocated=allocated, communication_at=comm_at)

    def allocated_at(self, phase: str) -> int:
        """The bytes alive at ``phase`` (the whole step's and the moment's, gradients not yet made subtracted)."""
        sums = (self._lifetime, self._at[phase])
        alive = sum(s.get(c, 0) for s in sums for c in _SUMMED)
        return alive - sum(s.get(ABSENT, 0) for s in sums)

    def notes(self) -> list[str]:
        """The contributions' sentences, each once, in order."""
        return list(self._notes)
