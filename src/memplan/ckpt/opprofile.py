"""Per-op profile of one block: FLOPs, bytes, what backward saves; selective-checkpoint levels from it.

:class:`OpRecorder` is entered around one (fake or real) forward of a block. It is a
``TorchDispatchMode`` that records every operator the block runs — its FLOPs (the formulas of
``torch.utils.flop_counter``), the bytes it reads and the new storage bytes it writes — and a
``saved_tensors_hooks`` pair that marks which outputs autograd saves for the backward. Operators
are identified as PyTorch's selective checkpointing identifies them: ``(operator, n-th call of that
operator in the forward)``, the detaches checkpointing inserts left out.

Time of an op is predicted by a roofline, ``max(FLOPs / F, bytes moved / B) + c``, with rough
per-device constants; the controller rescales every prediction by measured block times (one factor
per model), so only the *ratios* of these constants matter for the plans.

**Selective checkpoint levels** (:func:`sac_levels`): the ops whose outputs backward saves are
ranked by predicted seconds per byte — the outputs most expensive to recompute per byte held come
first —, and level ``k`` saves the shortest prefix of that ranking that avoids at least
``LEVEL_SHARES[k]`` of the block's recompute seconds. Under ``torch.utils.checkpoint`` with
:func:`sac_context` the listed calls are ``MUST_SAVE`` and every other op ``PREFER_RECOMPUTE``.
:func:`block_levels` gives a block with matrix multiplies the compute-bound level
(:func:`compute_level`: every matrix multiply's and attention kernel's output saved — the static
per-op policy a user would write); the roofline's levels are for blocks without them. Which option
is fastest on the machine is measured, not assumed (:mod:`memplan.ckpt.optimes`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = [
    "COMPUTE_BOUND_OPS", "LEVEL_SHARES", "OpKey", "OpRecord", "OpRecorder", "Roofline", "SacLevel", "block_levels", "compute_level",
    "roofline_for", "sac_context", "sac_levels",
]

#: (operator, n-th call of it in the block's forward), as selective checkpointing counts them.
OpKey = tuple[Any, int]
#: Share of the block's recompute seconds each selective level avoids (ascending: more saved).
LEVEL_SHARES = (0.5, 0.75)
#: Operators whose outputs the compute-bound level saves (matrix multiplies, attention kernels).
COMPUTE_BOUND_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_cudnn_attention",
})
#: A level that would hold this share of the bytes a plain block saves is no level (keep the block).
MAX_LEVEL_SHARE = 0.8


@dataclass(frozen=True, kw_only=True)
class OpRecord:
    """One operator call of a block's forward."""

    key: OpKey
    name: str
    flops: int
    #: Bytes of the tensors it reads.
    in_bytes: int
    #: Bytes of the new storages it writes (0 for a view or an in-place op).
    out_bytes: int
    #: Whether autograd saved one of its outputs for the backward.
    saved: bool


@dataclass(frozen=True, kw_only=True)
class Roofline:
    """Rough seconds of an op: ``max(flops / flops_per_s, bytes / bytes_per_s) + overhead_s``."""

    flops_per_s: float
    bytes_per_s: float
    overhead_s: float

    def seconds(self, op: OpRecord) -> float:
        return max(op.flops / self.flops_per_s, (op.in_bytes + op.out_bytes) / self.bytes_per_s) + self.overhead_s


def roofline_for(device: torch.device) -> Roofline:
    """Starting constants (rescaled by measured block times): a GPU, or one CPU thread."""
    if device.type == "cuda":
        return Roofline(flops_per_s=4e14, bytes_per_s=2e12, overhead_s=5e-6)
    return Roofline(flops_per_s=5e10, bytes_per_s=1e10, overhead_s=2e-5)


def _ignored() -> set[Any]:
    from torch.utils.checkpoint import SAC_IGNORED_OPS

    return set(SAC_IGNORED_OPS)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _attention_flops(func: Any, args: Any) -> int:
    """Forward FLOPs of an attention kernel torch's counter has no formula for (the CPU flash kernel)."""
    if "scaled_dot_product" not in str(func) or len(args) < 3:
        return 0
    q, k = args[0], args[1]
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)) or q.dim() < 2:
        return 0
    batch_heads = q.numel() // (q.shape[-2] * q.shape[-1])
    return 4 * batch_heads * q.shape[-2] * k.shape[-2] * q.shape[-1]


class OpRecorder(TorchDispatchMode):
    """Records the operators of the forward run inside it (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self._flops = flop_registry
        self._ignored = _ignored()
        self._calls: dict[Any, int] = defaultdict(int)
        self._raw: list[tuple[OpKey, str, int, int, int, tuple[int, ...]]] = []
        self._saved: set[int] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._saved.add(_storage_key(t))
        return t

    def __enter__(self) -> OpRecorder:  # noqa: PYI034
        self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._hooks.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in self._ignored:
            return out
        idx = self._calls[func]
        self._calls[func] = idx + 1
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        old = {_storage_key(t) for t in ins}
        new: dict[int, int] = {}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage_key(t) not in old:
                new[_storage_key(t)] = t.untyped_storage().nbytes()
        formula = self._flops.get(func._overloadpacket)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else _attention_flops(func, args)
        in_bytes = sum(t.numel() * t.element_size() for t in ins)
        self._raw.append(((func, idx), str(func), flops, in_bytes, sum(new.values()), tuple(new)))
        return out

    def records(self) -> tuple[OpRecord, ...]:
        """The operators recorded, in order, with ``saved`` resolved."""
        return tuple(
            OpRecord(key=key, name=name, flops=flops, in_bytes=ib, out_bytes=ob,
                     saved=any(k in self._saved for k in keys))
            for key, name, flops, ib, ob, keys in self._raw)


@dataclass(frozen=True, kw_only=True)
class SacLevel:
    """Ops whose outputs one selective-checkpoint level saves, and what that holds and avoids."""

    keys: frozenset[OpKey]
    #: Bytes of the saved outputs (at the size profiled).
    saved_bytes: int
    #: Predicted seconds of the ops still recomputed (at the size profiled, before rescaling).
    recompute_s: float


def sac_levels(ops: Sequence[OpRecord], roof: Roofline, shares: Sequence[float] = LEVEL_SHARES) -> tuple[SacLevel, ...]:
    """Selective levels of a block: the saved outputs most expensive to recompute per byte first."""
    total = sum(roof.seconds(op) for op in ops)
    ranked = sorted((op for op in ops if op.saved and op.out_bytes > 0),
                    key=lambda op: -roof.seconds(op) / op.out_bytes)
    everything = sum(op.out_bytes for op in ranked)
    levels: list[SacLevel] = []
    chosen: list[OpRecord] = []
    rest = iter(ranked)
    for share in shares:
        while total - sum(roof.seconds(op) for op in chosen) > (1.0 - share) * total:
            nxt = next(rest, None)
            if nxt is None:
                break
            chosen.append(nxt)
        if not chosen or (levels and len(levels[-1].keys) == len(chosen)):
            continue
        if sum(op.out_bytes for op in chosen) >= MAX_LEVEL_SHARE * everything:
            break  # about what a plain block keeps, for more bookkeeping: not a level
        levels.append(SacLevel(keys=frozenset(op.key for op in chosen), saved_bytes=sum(op.out_bytes for op in chosen),
                               recompute_s=total - sum(roof.seconds(op) for op in chosen)))
    return tuple(levels)


def compute_level(ops: Sequence[OpRecord], roof: Roofline) -> SacLevel | None:
    """The level of per-op activation checkpointing as torchtitan's op-level policy writes it: every
    matrix multiply's and attention kernel's output saved, every other op recomputed (None: no such op)."""
    chosen = [op for op in ops if op.name.split(".")[1:2] and op.name.split(".")[1] in COMPUTE_BOUND_OPS]
    if not chosen:
        return None
    keys = frozenset(op.key for op in chosen)
    return SacLevel(keys=keys, saved_bytes=sum(op.out_bytes for op in chosen),
                    recompute_s=sum(roof.seconds(op) for op in ops if op.key not in keys))


def block_levels(ops: Sequence[OpRecord], roof: Roofline) -> tuple[SacLevel, ...]:
    """A block's selective levels: the compute-bound level where the block has matrix multiplies, else the
    roofline's levels (:func:`sac_levels`).

    Measured on the benchmark's GPT-2 block (CPU, 4 x 64 to 4 x 1,024 tokens, forward + backward of one
    block, 3 alternating repetitions): the roofline's 50 % level, which recomputes the output projections,
    took 9 % and 12 % more time than the compute-bound level at 4 x 512 and 4 x 1,024 tokens (within 4 %
    either way at 4 x 64 and 4 x 256), for a middle amount of memory that a plan mixing
    compute-bound and fully checkpointed blocks also reaches; exploring it cost more than it gave.
    """
    first = compute_level(ops, roof)
    return sac_levels(ops, roof) if first is None else (first,)


def level_bytes_and_seconds(ops: Sequence[OpRecord], level: SacLevel, roof: Roofline) -> tuple[int, float]:
    """What ``level`` holds and recomputes for the ops of another size's profile (same op sequence)."""
    saved = sum(op.out_bytes for op in ops if op.key in level.keys)
    return saved, sum(roof.seconds(op) for op in ops if op.key not in level.keys)


def sac_context(keys: frozenset[OpKey]) -> Callable[[], Any]:
    """A ``context_fn`` for ``torch.utils.checkpoint``: the listed op calls saved, every other op recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ignored = _ignored()

    def make() -> Any:
        calls: dict[Any, int] = defaultdict(int)

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if func in ignored:
                return CheckpointPolicy.PREFER_RECOMPUTE
            idx = calls[func]
            calls[func] = idx + 1
            return CheckpointPolicy.MUST_SAVE if (func, idx) in keys else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return make
