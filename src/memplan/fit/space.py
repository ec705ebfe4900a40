"""The search space of ``memplan fit``: every parallel layout a framework could run on N GPUs.

A :class:`Layout` is the part of a job the search chooses apart from micro-batch and recompute:
TP, PP (with virtual stages and, where the layers do not divide, an uneven first/last stage), CP,
EP, expert TP, DP and the sharding of model states. :func:`enumerate_layouts` lists those that
obey the divisibility rules of :func:`memplan.jobcheck.validate_job_for_model` plus placement rules
(TP and the expert-parallel group inside one node by default) and records, per family, why the
others were left out.

Dominated choices are not enumerated, and the docs say so: Megatron's distributed optimizer
moves the same bytes as a plain all-reduce and keeps less, so it replaces plain DDP whenever
DP > 1; sequence parallelism is always on with TP > 1 (same bytes as TP all-reduces, fewer
activations).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memplan.errors import JobConfigError
from memplan.job import FrameworkName, Parallelism, Sharding, default_uneven_split
from memplan.model.attention_kinds import attention_kind
from memplan.model.spec import ModelSpec
from memplan.profiles import FrameworkProfile, get_profile
from memplan.profiles.pipeline_split import rule_chunk_layers

#: Below this many tokens per CP rank the ring exchange of context parallelism cannot hide
#: behind attention; such CP sizes are not searched.
MIN_TOKENS_PER_CP_RANK = 2048
#: Largest virtual-pipeline size searched (Megatron's interleaved schedule).
MAX_VPP = 4


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """Placement rules and limits of the search (the defaults follow common cluster practice)."""

    #: GPUs per node (``--gpus-per-node``): NVLink domain size.
    gpus_per_node: int = 8
    #: Keep tensor parallelism within a node (TP all-reduces every layer).
    tp_within_node: bool = True
    #: Keep the expert-parallel group (ep x etp) within a node (all-to-alls every MoE layer).
    ep_within_node: bool = True
    #: Largest virtual-pipeline size searched.
    max_vpp: int = MAX_VPP
    #: Smallest sequence share per context-parallel rank.
    min_tokens_per_cp_rank: int = MIN_TOKENS_PER_CP_RANK
    #: Micro-batch sizes are tried from 1 upwards while they fit, up to this.
    max_micro_batch: int = 64


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One parallel layout and sharding; with a micro-batch and recompute it makes a Job."""

    tp: int
    pp: int
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    dp: int
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    sharding: Sharding = field(default_factory=Sharding)

    def parallelism(self, world_size: int) -> Parallelism:
        return Parallelism(
            world_size=world_size, tp=self.tp, pp=self.pp, vpp=self.vpp, cp=self.cp, ep=self.ep,
            etp=self.etp, dp=self.dp, sequence_parallel=self.tp > 1,
            first_stage_layers=self.first_stage_layers, last_stage_layers=self.last_stage_layers,
        )

    @property
    def sharding_label(self) -> str:
        sh = self.sharding
        if sh.fsdp != "none":
            return f"fsdp-{sh.fsdp}" + (f"/{sh.fsdp_shard_size}" if sh.fsdp == "hybrid" else "")
        if sh.zero:
            return f"zero-{sh.zero}"
        return "dist-opt" if sh.distributed_optimizer else "ddp"

    @property
    def label(self) -> str:
        """Short text like ``tp8 pp4 vpp2 dp2 ep8 dist-opt``."""
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.etp is not None and self.etp != self.tp:
            parts.append(f"etp{self.etp}")
        parts.append(f"dp{self.dp}")
        if self.first_stage_layers is not None:
            parts.append(f"split{self.first_stage_layers}/{self.last_stage_layers}")
        parts.append(self.sharding_label)
        return " ".join(parts)


@dataclass(frozen=True, kw_only=True)
class Excluded:
    """A family of layouts left out of the search before estimating, and the rule that did it."""

    family: str
    reason: str


def divisors(n: int) -> tuple[int, ...]:
    """Positive divisors of ``n`` in increasing order."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def pipeline_split(num_layers: int, pp: int, vpp: int) -> tuple[int | None, int | None] | None:
    """(first, last) stage layers for ``pp`` stages, (None, None) when even; None when impossible.

    When ``pp·vpp`` does not divide the layers: without interleaving, every stage but the last takes
    ``ceil(L/pp)`` and the last the remainder (the estimator's default split, and DeepSeek-V3's
    published 4 + 14x4 + 1 on 16 stages: the last stage also holds the head and the loss). Otherwise
    the middle stages take ``ceil(L/pp)`` rounded up to a multiple of ``vpp`` and the first and last
    stages share the rest (first gets the larger half): Megatron's
    ``--decoder-first/last-pipeline-num-layers``.
    """
    if num_layers % (pp * vpp) == 0:
        return (None, None)
    if vpp == 1 and (split := default_uneven_split(num_layers, pp)) is not None:
        return split
    if pp < 3:
        return None
    middle = -(-num_layers // pp)
    middle = -(-middle // vpp) * vpp
    rest = num_layers - middle * (pp - 2)
    if rest < 2:
        return None
    first, last = -(-rest // 2), rest // 2
    if vpp > 1 and (first % vpp or last % vpp):
        return None
    return (first, last)


def profile_split(profile: FrameworkProfile, num_layers: int, pp: int,
                  vpp: int) -> tuple[tuple[int | None, int | None] | None, str]:
    """((first, last) stage layers, or None when impossible; the reason) under the profile's split rule.

    A profile with a rule of its own (:mod:`memplan.profiles.pipeline_split`, torchtitan's weighted
    split) leaves the split to the estimator, which applies that rule: (None, None), or None with the
    rule's sentence where the rule refuses the split. The even-or-ceil rule is :func:`pipeline_split`'s.
    """
    if profile.pipeline_split != "even-or-ceil":
        try:
            rule_chunk_layers(profile.pipeline_split, num_layers, pp, vpp)
        except JobConfigError as error:
            return None, error.rule
        return (None, None), ""
    split = pipeline_split(num_layers, pp, vpp)
    return split, f"{num_layers} layers cannot be split over {pp} stages"


#: What each sharding choice of a profile's ``fit_shardings`` builds.
_SHARDINGS: dict[str, Sharding] = {
    "ddp": Sharding(), "dist-opt": Sharding(distributed_optimizer=True), "zero-1": Sharding(zero=1),
    "zero-2": Sharding(zero=2), "zero-3": Sharding(zero=3), "fsdp-full": Sharding(fsdp="full"),
}


def _shardings(profile: FrameworkProfile, dp: int, cp: int, gpus_per_node: int) -> tuple[Sharding, ...]:
    """Non-dominated sharding choices of a framework at this data-parallel size (its profile's
    ``fit_shardings``; hybrid FSDP only when data parallelism spans nodes)."""
    if dp * cp == 1:
        return (Sharding(),)
    out = []
    for choice in profile.fit_shardings:
        if choice == "fsdp-hybrid":
            if dp > gpus_per_node:
                out.append(Sharding(fsdp="hybrid", fsdp_shard_size=gpus_per_node))
        else:
            out.append(_SHARDINGS[choice])
    return tuple(out)


def enumerate_layouts(
    model: ModelSpec, world_size: int, *, seq: int, framework: FrameworkName, space: SearchSpace
) -> tuple[tuple[Layout, ...], tuple[Excluded, ...]]:
    """Every valid layout of ``model`` on ``world_size`` GPUs, and the families left out with why."""
    gpn = space.gpus_per_node
    excluded: list[Excluded] = []
    if world_size > gpn and world_size % gpn:
        excluded.append(Excluded(family=f"{world_size} GPUs", reason=(
            f"more than one node must be a whole number of nodes of {gpn} GPUs (--gpus-per-node)")))
        return (), tuple(excluded)
    attn = model.layers[0].attention
    moe = next((layer.moe for layer in model.layers if layer.moe is not None), None)
    profile = get_profile(framework)
    model_parallel, pipelines = profile.fit_tensor_parallel, profile.fit_pipelines
    layouts: list[Layout] = []
    for tp in divisors(world_size):
        if tp > 1 and not model_parallel:
            excluded.append(Excluded(family=f"tp{tp}", reason=f"the {framework} profile has no tensor parallelism"))
            continue
        if attn.num_heads % tp:
            excluded.append(Excluded(family=f"tp{tp}", reason=f"TP must divide the {attn.num_heads} attention heads"))
            continue
        if not attention_kind(attn).tp_divides_kv_heads(attn, tp):
            excluded.append(Excluded(family=f"tp{tp}", reason=f"TP must divide the {attn.num_kv_heads} KV heads or be a multiple of them"))
            continue
        if space.tp_within_node and tp > gpn:
            excluded.append(Excluded(family=f"tp{tp}", reason=f"TP stays within a node of {gpn} GPUs"))
            continue
        for pp in divisors(world_size // tp):
            if pp > 1 and not pipelines:
                continue
            if pp > model.num_layers:
                excluded.append(Excluded(family=f"tp{tp} pp{pp}", reason=f"more stages than the {model.num_layers} layers"))
                continue
            for cp in divisors(world_size // (tp * pp)):
                if cp > 1 and (not model_parallel or seq % (2 * cp) or seq // cp < space.min_tokens_per_cp_rank):
                    continue
                dp = world_size // (tp * pp * cp)
                layouts += _expert_layouts(model, moe, tp, pp, cp, dp, world_size, profile, space, excluded)
    return tuple(layouts), tuple(excluded)


def _expert_layouts(
    model: ModelSpec, moe: object, tp: int, pp: int, cp: int, dp: int, world: int,
    profile: FrameworkProfile, space: SearchSpace, excluded: list[Excluded],
) -> list[Layout]:
    """Layouts for one (tp, pp, cp, dp): EP/ETP choices, virtual stages, shardings."""
    experts = getattr(moe, "num_experts", None)
    expert_choices: list[tuple[int, int | None]] = [(1, None)]
    if experts is not None and profile.fit_expert_parallel:
        expert_choices = []
        for ep in divisors(experts):
            for etp in sorted({1, tp}):
                group = ep * etp
                if world % (group * pp) or group * pp > world:
                    continue
                if space.ep_within_node and group > space.gpus_per_node:
                    continue
                expert_choices.append((ep, None if etp == tp else etp))
    out: list[Layout] = []
    for vpp in range(1, (space.max_vpp if profile.fit_interleaved and pp > 1 else 1) + 1):
        split, reason = profile_split(profile, model.num_layers, pp, vpp)
        if split is None:
            if vpp == 1:
                excluded.append(Excluded(family=f"tp{tp} pp{pp}", reason=reason))
            continue
        for ep, expert_tp in expert_choices:
            for sharding in _shardings(profile, dp, cp, space.gpus_per_node):
                out.append(Layout(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=expert_tp, dp=dp,
                                  first_stage_layers=split[0], last_stage_layers=split[1], sharding=sharding))
    return out
