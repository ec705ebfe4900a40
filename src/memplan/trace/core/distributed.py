"""Simulated ranks: FSDP2 and tensor parallelism on one process with PyTorch's fake process group.

``torch.testing._internal.distributed.fake_pg`` provides a process group whose collectives return
at once without moving data; with fake tensors nothing is computed either, so one process runs
exactly the code rank 0 of an ``fsdp x tp`` job runs, with its real shard sizes, all-gather and
reduce-scatter buffers and DTensor redistributions.

* ``--fsdp N``: FSDP2 ``fully_shard`` on every decoder layer and on the root, with a
  ``MixedPrecisionPolicy`` (``*-mixed``: bf16/fp16 parameters for compute; the gradients reduced in
  fp32 without autocast, as torchtitan applies it, or, for ``--framework hf``, in the compute dtype with
  the forward under ``torch.autocast``, as accelerate's FSDP2 does: ``TraceSetup.fsdp_reduce_dtype`` /
  ``fsdp_autocast``).
* ``--tp N``: Hugging Face's tensor-parallel plan for Llama-style models (transformers
  ``base_model_tp_plan`` and ``_tp_plan``): ``ColwiseParallel`` q/k/v/gate/up projections,
  ``RowwiseParallel`` o/down projections, an untied head column-parallel with its logits gathered;
  the embedding (and a head tied to it) and the norms stay whole on every rank.
* both: a 2-D mesh (``dp`` x ``tp``), TP inside each FSDP unit.
* ``--fsdp hybrid``: HSDP, ``fully_shard`` on a 2-D (``dp_replicate``, ``dp_shard``) mesh: parameters sharded
  within a shard group of ``--fsdp-shard-size`` ranks and replicated across the groups; each unit's gradients
  reduce-scattered within the group, then all-reduced in place across the replicas (``foreach_reduce``), the
  reduce-dtype output held by its unit (``FSDPParamGroup._all_reduce_state``) until the backward ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from memplan.errors import ConfigError, UnsupportedError
from memplan.trace.build import TORCH_DTYPES
from memplan.trace.setup import TraceSetup

__all__ = ["TP_PLAN", "decoder_layers", "parallelize", "simulated_ranks"]

#: The tensor-parallel plan of one Llama-style decoder layer (module path → style).
TP_PLAN: dict[str, str] = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}


@contextmanager
def simulated_ranks(options: TraceSetup) -> Iterator[Any]:
    """A fake process group of ``fsdp * tp`` ranks (this process is rank 0) and its device mesh.

    Yields ``None`` for a single rank. Refuses to run when a process group already exists.
    DTensor's sharding propagation is not recorded while inside (see
    :func:`~memplan.trace.core.tracker.unrecorded_sharding_propagation`), and DTensor's caches of
    results that hold a device mesh are emptied on the way in and out (:func:`_forget_meshes`).
    """
    if options.world_size == 1 and not options.fsdp_wrapped:
        yield None
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise UnsupportedError("--fsdp/--tp simulate ranks with a fake process group; this process already "
                               "has a process group (call memplan.trace outside torch.distributed jobs)")
    from memplan.trace.core.tracker import unrecorded_sharding_propagation

    _forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=options.world_size)
    try:
        shape, names = _mesh_dims(options)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        with unrecorded_sharding_propagation():
            yield mesh
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _mesh_dims(options: TraceSetup) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The world's mesh: ``dp`` (FSDP) and/or ``tp``; under hybrid sharding ``dp`` is two dimensions, the
    shard group's replicas (``dp_replicate``) and its ranks (``dp_shard``), as torchtitan's and accelerate's
    HSDP meshes (``fully_shard`` shards over the last, replicates over the first)."""
    dims = [("dp_replicate", options.fsdp_replicas), ("dp_shard", options.fsdp)] if options.fsdp_replicas > 1 \
        else [("dp", options.fsdp)]
    dims = [(name, size) for name, size in [*dims, ("tp", options.tp)] if size > 1] or [("dp", options.world_size)]
    return tuple(size for _, size in dims), tuple(name for name, _ in dims)


def _dp_mesh(mesh: Any, options: TraceSetup) -> Any:
    """The mesh ``fully_shard`` takes: 1-D over the FSDP ranks, or HSDP's 2-D (replicate, shard) mesh."""
    return mesh["dp_replicate", "dp_shard"] if options.fsdp_replicas > 1 else mesh["dp"]


def _forget_meshes() -> None:
    """Empty DTensor's process-wide caches whose results hold a :class:`DeviceMesh`.

    A mesh compares equal to any mesh of the same shape, dimension names and ranks, whatever its
    process groups, and ``destroy_process_group`` restarts the group names at 0. A sharding
    propagated in an earlier world (the C++ fast path's cache and the Python one) would otherwise
    be reused in the next with the earlier world's mesh, whose collectives name groups that no
    longer exist (``Could not resolve the process group registered under the name 15``) or, worse,
    other groups that now carry the same name. Each clear is skipped where a torch release lacks it.
    """
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    clears = (getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),  # the dispatch fast path
              getattr(propagator.propagate_op_sharding, "cache_clear", None),
              getattr(propagator._propagate_tensor_meta_cached, "cache_clear", None))
    for clear in clears:
        if clear is not None:
            clear()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face decoder (``model.layers``, ``transformer.h``, ...), also inside
    a peft wrapper (``get_base_model``)."""
    model = _unwrapped(model)
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers", "layers"):
        module: Any = model
        for part in path.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
        if isinstance(module, torch.nn.ModuleList) and len(module):
            return list(module)
    raise UnsupportedError("--fsdp/--tp: cannot find the decoder layers (looked for model.layers, transformer.h, "
                           "gpt_neox.layers); use --script to shard the model yourself")


def parallelize(model: torch.nn.Module, options: TraceSetup, mesh: Any,
                blocks: list[torch.nn.Module] | None = None) -> None:
    """Apply the TP plan and/or FSDP2 to ``model`` in place (no-op for one rank).

    ``blocks``: the repeated blocks to shard one by one (default: the Hugging Face decoder layers).
    """
    if mesh is None:
        return
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    layers = decoder_layers(model) if blocks is None else blocks
    # Device meshes are small real tensors (fully_shard slices a 2-D mesh with nonzero()); the
    # parameters stay fake because a fake tensor's operators always run in its own fake mode.
    with unset_fake_temporarily():
        if options.tp > 1:
            _check_tp(model, options.tp)
            _apply_tp(layers, mesh["tp"])
            if blocks is None:
                _apply_tp_head(model, mesh["tp"])
        if options.fsdp_wrapped:
            _apply_fsdp(model, layers, _dp_mesh(mesh, options), options)


def _check_tp(model: torch.nn.Module, tp: int) -> None:
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads is not None and heads % tp:
        raise ConfigError("--tp", f"must divide the number of attention heads ({heads})", tp)
    if kv_heads is not None and kv_heads % tp:
        raise ConfigError("--tp", f"must divide the number of key/value heads ({kv_heads}) for the DTensor plan", tp)


def _apply_tp(layers: list[torch.nn.Module], mesh: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in layers:
        missing = [path for path in TP_PLAN if not _has(layer, path)]
        if missing:
            raise UnsupportedError(f"--tp supports Llama-style blocks; this model's layers have no {', '.join(missing)}")
        parallelize_module(layer, mesh, {path: styles[style]() for path, style in TP_PLAN.items()})


def _apply_tp_head(model: torch.nn.Module, mesh: Any) -> None:
    """Hugging Face's plan for the head (``_tp_plan = {"lm_head": "colwise_gather_output"}``): an untied
    head is column-parallel and its logits are gathered whole; the embedding, and a head tied to it,
    stay whole on every rank."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    embedding, head = _embedding_and_head(model)
    if head is None or (embedding is not None and head.weight is embedding.weight):
        return
    path = next(name for name, module in model.named_modules() if module is head)
    parallelize_module(model, mesh, {path: ColwiseParallel(output_layouts=Replicate())})


def _embedding_and_head(model: torch.nn.Module) -> tuple[Any, Any]:
    """The model's input embedding and output head (Hugging Face's accessors), each None where it has none."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    return (get_in() if callable(get_in) else None), (get_out() if callable(get_out) else None)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model peft wraps (``PeftModel.get_base_model``), or ``model`` itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _has(module: torch.nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _apply_fsdp(model: torch.nn.Module, layers: list[torch.nn.Module], mesh: Any, options: TraceSetup) -> None:
    """Each decoder layer a unit, the root the rest; under a framework whose profile shards the embedding and
    the head as units of their own (torchtitan's ``apply_fsdp``, accelerate's ``fsdp2_prepare_model``), those two
    units as well; the policy's reduce dtype is the profile's (:attr:`TraceSetup.fsdp_reduce_dtype`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[options.compute_dtype],
                                  reduce_dtype=TORCH_DTYPES[options.fsdp_reduce_dtype]) \
        if options.mixed else MixedPrecisionPolicy()
    outer = _outer_units(model, options)
    if outer:
        fully_shard(outer[0], mesh=mesh, mp_policy=policy)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    if outer:
        fully_shard(outer[1], mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy)


#: Where Hugging Face models keep the final norm (Llama/Qwen/Mistral, GPT-2, GPT-NeoX).
_FINAL_NORMS = ("model.norm", "transformer.ln_f", "gpt_neox.final_layer_norm")


def _outer_units(model: torch.nn.Module, options: TraceSetup) -> tuple[Any, list[torch.nn.Module]] | None:
    """(the embedding, [final norm, head]) when the job's framework shards them apart
    (``FrameworkProfile.fsdp_outer_units``, without pipeline parallelism) and the head is untied; else None."""
    from memplan.profiles import get_profile

    job = options.job
    if get_profile(job.framework).fsdp_outer_units != "embedding-and-head" or job.parallel.pp > 1:
        return None
    model = _unwrapped(model)
    embedding, head = _embedding_and_head(model)
    if embedding is None or head is None or head.weight is embedding.weight:
        return None
    norms = [model.get_submodule(path) for path in _FINAL_NORMS if _has(model, path)]
    return embedding, [*norms[:1], head]
