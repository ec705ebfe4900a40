"""The optimizer registry: one :class:`~memplan.optimizers.kind.OptimizerKind` per ``--optimizer`` value.

Each entry carries its states and dtypes (the estimator prices them), its step's temporaries, the real
optimizer the tracer builds, the names Megatron-LM, DeepSpeed, Hugging Face and torchtitan give it, and
the frameworks that can run it. The engines and the dialect readers loop over :data:`OPTIMIZERS` or look
an entry up by name; nothing else compares an optimizer's name. Adding an optimizer is one entry in one
family module, listed here. Example::

    >>> optimizer_kind("adamw").dialects.hf
    (('adamw_torch', 'foreach'), ('adamw_torch_fused', 'fused'))

Importing this package imports neither torch nor the job: builders import torch (and the optimizer's
package) when the tracer calls them.
"""

from __future__ import annotations

from memplan.optimizers.bnb import BNB_KINDS
from memplan.optimizers.galore import GALORE_ADAMW
from memplan.optimizers.kind import OptimizerKind
from memplan.optimizers.muon import MUON
from memplan.optimizers.schedulefree import SCHEDULEFREE_ADAMW
from memplan.optimizers.torch_optim import ADAFACTOR, ADAM, ADAMW, SGD

__all__ = ["OPTIMIZERS", "OPTIMIZER_NAMES", "OptimizerKind", "by_dialect", "optimizer_kind"]

#: Every optimizer memplan prices, in the order messages list them.
OPTIMIZERS: tuple[OptimizerKind, ...] = (ADAMW, ADAM, ADAFACTOR, SGD, *BNB_KINDS, MUON, GALORE_ADAMW,
                                       SCHEDULEFREE_ADAMW)
OPTIMIZER_NAMES: tuple[str, ...] = tuple(kind.name for kind in OPTIMIZERS)
_BY_NAME = {kind.name: kind for kind in OPTIMIZERS}


def optimizer_kind(name: str) -> OptimizerKind:
    """The entry of ``--optimizer NAME`` (a name the job has validated; KeyError otherwise)."""
    return _BY_NAME[name]


def by_dialect(dialect: str) -> dict[str, OptimizerKind]:
    """``{name in the dialect: entry}`` for ``megatron``, ``deepspeed``, ``hf`` or ``torchtitan``, in
    registry order (a Hugging Face name maps to its entry; its implementation is in ``dialects.hf``)."""
    out: dict[str, OptimizerKind] = {}
    for kind in OPTIMIZERS:
        names = getattr(kind.dialects, dialect)
        for entry in names:
            out[entry[0] if isinstance(entry, tuple) else entry] = kind
    return out
