"""``--compile``: each decoder layer runs as AOT autograd's partitioned forward and backward graphs.

``torch.compile`` (inductor) hands every compiled region's joint forward-backward graph to
``torch._functorch.partitioners.min_cut_rematerialization_partition``, which decides what the
forward saves for the backward and what the backward recomputes. Here each decoder layer (the unit
torchtitan's ``apply_compile`` and torchtune's ``compile_model`` compile: one region per block) is
traced by :func:`torch._functorch.aot_autograd.aot_function` with that partitioner and a compiler that
returns the graph itself, so the traced step runs the partitioner's forward graph (autograd keeps its
saved set), then its backward graph, operator by operator, on fake tensors. No inductor code is
generated.

The tracing happens once per layer at its first call, unrecorded and with the module hooks paused (it
is not part of the step); the saved set of each layer is recorded (:class:`SavedTensor`) for ``memplan
trace --compile`` to show and for the estimator's per-family rules (:mod:`memplan.estimate.compiled`) to
be checked against.

Modelled: the partitioner's saved set with its default settings (``activation_memory_budget = 1``).
Not modelled: inductor's code generation (a fused kernel keeps no intermediate of its chain, so the
forward's transients inside a layer are lower on a GPU than the graph run here), its runtime buffers
and workspaces, CUDA graphs (``mode="reduce-overhead"``), dynamo graph breaks (each piece of a broken
layer is partitioned on its own) and compiled regions other than the decoder layers and the loss
(:mod:`memplan.trace.runners.compiled_loss`): the embedding, final norm and head.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from memplan.errors import UnsupportedError

__all__ = ["CompiledLayers", "SavedTensor", "compile_layers", "compiled_layer_modules", "partitioned_saved_set"]

Quiet = Callable[[], contextlib.AbstractContextManager[Any]]


@dataclass(frozen=True, slots=True)
class SavedTensor:
    """One value the partitioner's forward keeps for the backward (a graph input or a computed value)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    #: A forward input (layer input, weight, RoPE table) rather than a value the layer computed.
    graph_input: bool


@dataclass(slots=True)
class CompiledLayers:
    """What the partitioner kept for each compiled layer, by module path (filled as each is compiled)."""

    saved: dict[str, tuple[SavedTensor, ...]] = field(default_factory=dict)

    def computed_bytes(self) -> dict[str, int]:
        """Per layer, the bytes of the saved values the layer computed (its own new activations)."""
        return {path: sum(t.nbytes for t in tensors if not t.graph_input) for path, tensors in self.saved.items()}

    def to_dict(self) -> dict[str, Any]:
        return {path: [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "bytes": t.nbytes,
                        "graph_input": t.graph_input} for t in tensors] for path, tensors in self.saved.items()}


def compiled_layer_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The decoder layers (``GradientCheckpointingLayer`` in transformers, else the children of the first
    module list named ``layers``), outermost only, with their paths."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - transformers is a trace dependency
        GradientCheckpointingLayer = ()  # type: ignore[assignment,misc]
    found = [(path, m) for path, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]
    if not found:
        found = [(path, m) for path, m in model.named_modules()
                 if path.rsplit(".", 1)[0].rsplit(".", 1)[-1] == "layers"
                 and isinstance(model.get_submodule(path.rsplit(".", 1)[0]), torch.nn.ModuleList)]
    outer = [(p, m) for p, m in found if not any(p.startswith(q + ".") for q, _ in found)]
    if not outer:
        raise UnsupportedError("--compile found no decoder layers (transformers' GradientCheckpointingLayer "
                               "or a module list named layers) to compile")
    return outer


def compile_layers(layers: list[tuple[str, torch.nn.Module]], *, quiet: Quiet | None = None) -> CompiledLayers:
    """Run each ``(path, layer)`` as its partitioned graphs; returns the record of their saved sets.

    Layers of the same structure (class, weight shapes and dtypes, settings other than ``layer_idx``, call
    signature) share one compiled pair of graphs, as dynamo reuses one graph for identical blocks; each is
    given its own weights. ``quiet``: a context under which the one-time tracing runs (the tracker's
    ``unrecorded``, so that compiling allocates nothing in the trace)."""
    record = CompiledLayers()
    shared: dict[Any, dict[str, Any]] = {}
    for path, layer in layers:
        _compile_layer(path, layer, record, quiet, shared)
    return record


def _structure(layer: torch.nn.Module) -> tuple[Any, ...]:
    """What decides a layer's graphs besides its call: its modules' classes, weights' metadata and plain
    settings (``layer_idx`` indexes a KV cache, which training does not use)."""
    out: list[Any] = []
    for name, module in layer.named_modules():
        settings = tuple(sorted((k, v) for k, v in vars(module).items()
                                if isinstance(v, (int, float, str, bool, type(None))) and k != "layer_idx"
                                and not k.startswith("_")))
        out.append((name, type(module).__qualname__, settings))
    out += [(n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in (*layer.named_parameters(), *layer.named_buffers())]
    return tuple(out)


def _compile_layer(path: str, layer: torch.nn.Module, record: CompiledLayers, quiet: Quiet | None,
                   shared: dict[Any, dict[str, Any]]) -> None:
    forward = layer.forward
    structure = _structure(layer)

    def compiled(*args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        slots = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        names = [n for n, _ in layer.named_parameters()] + [n for n, _ in layer.named_buffers()]
        weights = _weights(layer, names)
        inputs = [leaves[i] for i in slots]
        plain = tuple(repr(leaf) for i, leaf in enumerate(leaves) if i not in slots)
        key = (structure, str(spec), slots, plain,
               tuple((tuple(t.shape), t.stride(), t.dtype, t.requires_grad) for t in inputs))
        state = shared.get(key)
        if state is None:
            state = shared[key] = {}
            state["fn"] = _traced(forward, layer, names, leaves, slots, spec, state)
            with (quiet() if quiet is not None else contextlib.nullcontext()), _without_module_hooks():
                _warm(state["fn"], weights, inputs)
        record.saved[path] = state["saved"]
        flat = state["fn"](*weights, *inputs)
        return tree_unflatten(list(flat), state["out_spec"])

    layer.forward = compiled  # type: ignore[method-assign]


def partitioned_saved_set(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> tuple[SavedTensor, ...]:
    """What inductor's partitioner saves for the backward of ``fn(*args)`` (a scalar loss, or any tensor whose
    sum is taken), traced on fake tensors of ``args``' metadata; nothing is computed.

    Example: a compiled cross-entropy on 16-bit logits upcast to fp32 keeps the 16-bit logits and two fp32
    values per row (max and log-sum-exp), not an fp32 log-softmax (tests/trace/test_compiled_trace.py)."""
    from torch._functorch.aot_autograd import aot_function
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    state: dict[str, Any] = {}
    compiled = aot_function(fn, fw_compiler=_boxed, bw_compiler=_boxed, decompositions=select_decomp_table(),
                            partition_fn=_partition(lambda saved: state.__setitem__("saved", saved)))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a).requires_grad_(a.requires_grad) if a.is_floating_point() else mode.from_tensor(a)
                for a in args]
        compiled(*fake).sum().backward()
    return state["saved"]


def _weights(layer: torch.nn.Module, names: list[str]) -> list[torch.Tensor]:
    own = dict(layer.named_parameters())
    own.update(dict(layer.named_buffers()))
    return [own[name] for name in names]


def _traced(forward: Callable[..., Any], layer: torch.nn.Module, names: list[str], leaves: list[Any],
            slots: tuple[int, ...], spec: Any, state: dict[str, Any]) -> Any:
    """The layer as a function of (weights, tensor inputs), compiled by ``aot_function``."""
    from torch._functorch.aot_autograd import aot_function
    from torch.nn.utils.stateless import _reparametrize_module

    count = len(names)
    leaves = [None if i in slots else leaf for i, leaf in enumerate(leaves)]  # keep no tensor of the first call

    def fn(*flat: torch.Tensor) -> tuple[Any, ...]:
        filled = list(leaves)
        for slot, tensor in zip(slots, flat[count:], strict=True):
            filled[slot] = tensor
        args, kwargs = tree_unflatten(filled, spec)
        with _reparametrize_module(layer, dict(zip(names, flat[:count], strict=True))):
            out = forward(*args, **kwargs)
        out_leaves, state["out_spec"] = tree_flatten(out)
        return tuple(out_leaves)

    from torch._inductor.decomposition import select_decomp_table

    return aot_function(fn, fw_compiler=_boxed, bw_compiler=_boxed, partition_fn=_partition(lambda saved: state.__setitem__("saved", saved)),
                        decompositions=select_decomp_table())


def _boxed(gm: torch.fx.GraphModule, _inputs: Any) -> Callable[..., Any]:
    """The "compiler": the graph itself, run operator by operator."""
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(gm.forward)


def _partition(record: Callable[[tuple[SavedTensor, ...]], None]) -> Callable[..., Any]:
    """inductor's own partition step (``torch._inductor.compile_fx.partition_fn``: its joint-graph passes, then
    ``min_cut_rematerialization_partition(compiler="inductor")`` with default settings), recording the saved set."""
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.virtualized import V

    def partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        with V.set_fake_mode(detect_fake_mode(joint_inputs)):  # as inductor's compile sets it
            fw_module, bw_module = partition_fn(joint, joint_inputs, **kwargs)
        inputs = {node.name for node in fw_module.graph.nodes if node.op == "placeholder"}
        record(_saved_set(bw_module, inputs))
        return fw_module, bw_module

    return partition


def _saved_set(bw_module: torch.fx.GraphModule, forward_inputs: set[str]) -> tuple[SavedTensor, ...]:
    """The backward graph's inputs other than the incoming gradients: the saved set."""
    out = []
    for node in bw_module.graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents"):
            continue
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            out.append(SavedTensor(node.name, tuple(int(s) for s in value.shape),
                                   str(value.dtype).removeprefix("torch."), int(value.numel() * value.element_size()),
                                   node.name in forward_inputs))
    return tuple(out)


def _warm(fn: Any, weights: list[torch.Tensor], inputs: list[Any]) -> None:
    """Trace the forward and the backward graphs once, on fresh inputs of the same metadata (AOT autograd keeps
    the tensors it traced with, and their gradients must reach no hook of the step): one call, one
    ``autograd.grad``."""
    inputs = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).requires_grad_(t.requires_grad)
              for t in inputs]
    out = fn(*weights, *inputs)
    wrt = [t for t in (*weights, *inputs) if t.requires_grad]
    outs = [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]
    if outs and wrt:
        torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)


@contextlib.contextmanager
def _without_module_hooks() -> Iterator[None]:
    """Global module hooks (the tracer's module path) paused while a layer is traced into graphs: the
    trace-time calls of its sub-modules are not part of the step."""
    from torch.nn.modules import module as nn_module

    names = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called")
    saved = [getattr(nn_module, name) for name in names]
    for name, hooks in zip(names, saved, strict=True):
        setattr(nn_module, name, type(hooks)())
    try:
        yield
    finally:
        for name, hooks in zip(names, saved, strict=True):
            setattr(nn_module, name, hooks)
