"""Activation policies (:mod:`memplan.policies`) run for real on a traced Hugging Face model.

* ``full`` — what the Hugging Face Trainer does for ``gradient_checkpointing=True``
  (``activation_checkpointing_enable``, which also makes the embedding output require grad); with
  ``--recompute-method block --recompute-layers N`` only the first N decoder layers stay checkpointed;
  under ``--framework deepspeed`` every decoder layer runs under ``deepspeed.checkpointing.checkpoint``
  configured from the job's DeepSpeed switches (:mod:`memplan.trace.runners.ds_checkpoint`);
* ``attention-module`` — every attention module (``self_attn``/``attn``) under non-reentrant
  ``torch.utils.checkpoint``;
* ``torchtitan-sac`` — every decoder layer with torchtitan's per-op policy (:mod:`memplan.trace.runners.sac`);
* ``megatron-selective`` / ``attention-core`` — Megatron's sub-module checkpoints on the model's own
  sub-modules: each keeps its inputs and makes what it saves inside again in its backward
  (megatron/core/transformer ``tensor_parallel.checkpoint``). ``core_attn``: the attention function
  (transformers' ``AttentionInterface`` entry the attention modules call: SDPA, or the eager
  scores/softmax/PV); ``mlp``: a dense layer's ``mlp``; ``moe``: a sparse layer's MoE block;
  ``shared_experts``: its shared expert(s);
* ``layernorm`` / ``moe_act`` / ``mla_up_proj`` — Megatron's output-discarding checkpoint
  (``CheckpointWithoutOutput``, :mod:`memplan.trace.runners.discard`): ``layernorm`` on each layer's input norm
  and pre-MLP norm (the attention and the MLP/MoE block are the modules whose backward makes the output
  again); ``moe_act`` on the routed experts' activation (transformers' experts interface:
  ``_apply_gate``, or ``act_fn`` for experts without a gate), skipped where ``moe`` checkpoints the whole
  block; ``mla_up_proj`` on multi-latent attention's stretch from the latents to q, k, v
  (:mod:`memplan.trace.runners.mla_up`), made again when the attention core's backward starts.

Refused with one line: ``memory-budget`` (torch.compile's partitioner decides it, and the tracer
runs eager code), ``full`` with uniform groups of more than one layer (a Hugging Face decoder
calls its layers one by one), and ``layernorm`` / ``moe_act`` / ``mla_up_proj`` with
``--offload-activations`` (both replace saved tensors; the innermost hooks would win).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memplan.errors import ConfigError, UnsupportedError
from memplan.model.linears import ATTENTION_MODULES
from memplan.policies import HF_MODULES, ActivationPolicy

if TYPE_CHECKING:
    import torch

__all__ = ["TRACED_MODULES", "apply_policy", "check_runnable"]

#: ``--recompute-modules`` the tracer runs.
TRACED_MODULES = HF_MODULES
#: ``--recompute-modules`` run as Megatron's output-discarding checkpoint (:mod:`memplan.trace.runners.discard`).
_DISCARDING = ("layernorm", "mla_up_proj", "moe_act")
#: A decoder layer's input norm, pre-MLP norm (Gemma's pre-feedforward norm before its post-attention
#: one) and MLP block, by the attribute names of transformers' models (the attention module's: ATTENTION_MODULES).
_INPUT_NORMS = ("input_layernorm", "ln_1")
_PRE_MLP_NORMS = ("pre_feedforward_layernorm", "post_attention_layernorm", "ln_2")
_MLPS = ("mlp", "block_sparse_moe")
#: transformers' experts implementations that call ``_apply_gate`` / ``act_fn`` (integrations/moe.py).
_INTERFACE_EXPERTS = ("grouped_mm", "batched_mm")
#: Prefix of the attention implementations registered for ``core_attn``.
_CORE_KEY = "memplan_checkpointed_core_"


def check_runnable(policy: ActivationPolicy) -> None:
    """Refuse, in one line naming the flag, a policy the tracer cannot run (before any model is built)."""
    if policy.name == "memory-budget":
        raise ConfigError("--recompute", "memory-budget is decided by torch.compile's partitioner "
                          "(activation_memory_budget), which memplan trace does not run; use memplan estimate",
                          policy.name)
    if policy.name != "full" and (policy.num_layers is not None or policy.method != "uniform"):
        flag, value = (("--recompute-layers", policy.num_layers) if policy.num_layers is not None
                       else ("--recompute-method", policy.method))
        raise ConfigError(flag, f"only applies with --recompute full; the job has --recompute {policy.name}", value)
    if policy.name == "full" and policy.method == "uniform" and (policy.num_layers or 1) > 1:
        raise ConfigError("--recompute-layers", "memplan trace checkpoints single decoder layers (a Hugging Face "
                          "decoder calls them one by one): use 1 with --recompute-method uniform, or block; "
                          "memplan estimate prices groups", policy.num_layers)
    discarding = [name for name in policy.modules if name in _DISCARDING]
    if discarding and policy.offload:
        raise ConfigError("--offload-activations", f"cannot be traced with --recompute-modules "
                          f"{','.join(discarding)} (both replace the saved tensors of a layer); use memplan "
                          "estimate", True)
    missing = [name for name in policy.modules if name not in TRACED_MODULES]
    if missing:
        raise ConfigError("--recompute-modules", f"memplan trace runs {', '.join(TRACED_MODULES)} on a Hugging "
                          f"Face model's own sub-modules; {', '.join(missing)} has no such sub-module there (use "
                          "memplan estimate)", ",".join(policy.modules))


def apply_policy(model: torch.nn.Module, policy: ActivationPolicy, *, cuda_autocast: bool = False) -> None:
    """Apply ``policy`` to ``model`` (a Hugging Face model; see the module docstring).

    ``cuda_autocast``: the forward runs under CUDA's fp32 autocast policies (a ``--device cuda`` trace
    of ``*-mixed``); every recompute gets them too, or its dtypes would differ from the forward's.
    """
    check_runnable(policy)
    name = policy.name
    if name == "none":
        return
    if name == "full":
        _full(model, policy, cuda_autocast)
    elif name == "torchtitan-sac":
        from memplan.trace.runners.sac import apply_torchtitan_sac

        apply_torchtitan_sac(model, _cuda_policies if cuda_autocast else None)
    elif name == "attention-module":
        attention = [m for path, m in model.named_modules() if path.rsplit(".", 1)[-1] in ATTENTION_MODULES]
        if not attention:
            raise UnsupportedError(f"--recompute selective found no attention modules named {' or '.join(ATTENTION_MODULES)}")
        for module in attention:
            checkpoint_forward(module, cuda_autocast)
    else:
        _megatron_modules(model, policy.modules if name == "megatron-selective" else ("core_attn",), cuda_autocast)


def checkpoint_forward(module: torch.nn.Module, cuda_autocast: bool = False) -> None:
    """Run ``module``'s forward under non-reentrant ``torch.utils.checkpoint``."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward
    extra = _context(cuda_autocast)

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = checkpointed  # type: ignore[method-assign]


def _context(cuda_autocast: bool) -> dict[str, Any]:
    return {"context_fn": _recompute_with_cuda_policies} if cuda_autocast else {}


def _recompute_with_cuda_policies() -> tuple[Any, Any]:
    from memplan.trace.cuda.autocast import CudaAutocastFp32

    return contextlib.nullcontext(), CudaAutocastFp32()


def _cuda_policies() -> Any:
    from memplan.trace.cuda.autocast import CudaAutocastFp32

    return CudaAutocastFp32()


def _full(model: torch.nn.Module, policy: ActivationPolicy, cuda_autocast: bool) -> None:
    if policy.framework == "deepspeed":  # each layer under deepspeed.checkpointing.checkpoint
        from memplan.trace.runners.ds_checkpoint import apply_deepspeed_checkpoint

        apply_deepspeed_checkpoint(model, policy)
    else:
        _hf_full(model, policy, cuda_autocast)
    if policy.method == "block" and policy.num_layers is not None:
        from memplan.trace.runners.sac import decoder_layers

        for layer in decoder_layers(model)[policy.num_layers:]:
            layer.gradient_checkpointing = False  # type: ignore[assignment]


def _hf_full(model: torch.nn.Module, policy: ActivationPolicy, cuda_autocast: bool) -> None:
    kwargs: dict[str, Any] = {"use_reentrant": policy.reentrant}
    if cuda_autocast and not policy.reentrant:
        kwargs["context_fn"] = _recompute_with_cuda_policies
    if callable(getattr(model, "activation_checkpointing_enable", None)):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)  # type: ignore[operator]
    elif callable(getattr(model, "gradient_checkpointing_enable", None)):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]
    else:
        raise UnsupportedError("--recompute full needs a Hugging Face model (activation_checkpointing_enable)")


def _megatron_modules(model: torch.nn.Module, modules: tuple[str, ...], cuda_autocast: bool) -> None:
    import torch

    from memplan.trace.runners.sac import decoder_layers

    for layer in decoder_layers(model):
        mlp = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
        sparse = mlp is not None and hasattr(mlp, "experts")
        if mlp is not None and (("mlp" in modules and not sparse) or ("moe" in modules and sparse)):
            checkpoint_forward(mlp, cuda_autocast)
        elif sparse and "shared_experts" in modules:
            for attr in ("shared_expert", "shared_experts", "shared_mlp"):
                if isinstance(getattr(mlp, attr, None), torch.nn.Module):
                    checkpoint_forward(getattr(mlp, attr), cuda_autocast)
    if "core_attn" in modules:
        _checkpoint_attention_core(model, cuda_autocast)
    if any(name in modules for name in _DISCARDING):
        _output_discarding(model, modules, cuda_autocast)


def _child(module: torch.nn.Module, names: tuple[str, ...]) -> Any:
    return next((getattr(module, name) for name in names if getattr(module, name, None) is not None), None)


def _output_discarding(model: torch.nn.Module, modules: tuple[str, ...], cuda_autocast: bool) -> None:
    """``layernorm`` / ``moe_act``: each decoder layer's forward runs in a :class:`DiscardScope` whose
    checkpoints are its norms (the attention / MLP block recomputes their output at its backward's start,
    as Megatron's hook on the next module's output does) and its experts' activation."""
    from memplan.trace.runners.discard import DiscardScope, autocast_restorer
    from memplan.trace.runners.sac import decoder_layers

    capture = autocast_restorer(cuda_autocast)
    for layer in decoder_layers(model):
        scope = DiscardScope(capture)
        if "layernorm" in modules:
            pairs = ((_child(layer, _INPUT_NORMS), _child(layer, ATTENTION_MODULES)),
                     (_child(layer, _PRE_MLP_NORMS), _child(layer, _MLPS)))
            if any(part is None for pair in pairs for part in pair):
                raise UnsupportedError(f"--recompute-modules layernorm found no input norm, pre-MLP norm, attention "
                                       f"and MLP ({', '.join(_INPUT_NORMS + _PRE_MLP_NORMS)}; "
                                       f"{', '.join(ATTENTION_MODULES + _MLPS)}) in {type(layer).__name__}")
            for norm, consumer in pairs:
                _discard_norm(scope, norm, consumer)
        if "mla_up_proj" in modules:
            from memplan.trace.runners.mla_up import discard_mla_up

            discard_mla_up(scope, _child(layer, ATTENTION_MODULES))
        mlp = _child(layer, _MLPS)
        if "moe_act" in modules and "moe" not in modules and hasattr(mlp, "experts"):
            _discard_activation(scope, mlp.experts)
        forward = layer.forward

        def scoped(*args: Any, _forward: Any = forward, _scope: Any = scope, **kwargs: Any) -> Any:
            with _scope.active():
                return _forward(*args, **kwargs)

        layer.forward = scoped  # type: ignore[method-assign]


def _discard_norm(scope: Any, norm: torch.nn.Module, consumer: torch.nn.Module) -> None:
    forward = norm.forward
    pending: list[Any] = []

    def discarding(hidden_states: torch.Tensor) -> torch.Tensor:
        out, holder = scope.checkpoint(forward, hidden_states)
        pending[:] = [holder] if holder is not None else []
        return out  # type: ignore[no-any-return]

    def recompute_at(_module: Any, _args: Any, output: Any) -> None:
        if pending:
            pending.pop().recompute_at(output)

    norm.forward = discarding  # type: ignore[method-assign]
    consumer.register_forward_hook(recompute_at)


def _discard_activation(scope: Any, experts: torch.nn.Module) -> None:
    implementation = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    if implementation not in _INTERFACE_EXPERTS or not hasattr(experts, "has_gate"):
        raise UnsupportedError(f"--recompute-modules moe_act runs on transformers' {' or '.join(_INTERFACE_EXPERTS)} "
                               f"experts (their _apply_gate / act_fn); {type(experts).__name__} runs its own "
                               f"forward ({implementation}): use --moe-routing balanced")
    if experts.has_gate:
        gate = experts._apply_gate

        def discarding_gate(gate_up: torch.Tensor) -> torch.Tensor:
            return scope.checkpoint(gate, gate_up)[0]  # type: ignore[no-any-return]

        experts._apply_gate = discarding_gate  # type: ignore[assignment]
    else:
        act = experts.act_fn
        act_forward = act.forward

        def discarding_act(x: torch.Tensor) -> torch.Tensor:
            return scope.checkpoint(act_forward, x)[0]  # type: ignore[no-any-return]

        act.forward = discarding_act  # type: ignore[method-assign]


def _checkpoint_attention_core(model: torch.nn.Module, cuda_autocast: bool) -> None:
    """Register, beside the model's attention implementation, one that runs it under
    ``torch.utils.checkpoint`` (with the same mask function), and switch the model's config to it."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    config: Any = model.config
    base = config._attn_implementation
    if base.startswith(_CORE_KEY):
        return
    key = _CORE_KEY + base + ("_cuda_autocast" if cuda_autocast else "")
    AttentionInterface.register(key, _checkpointed_core(base, cuda_autocast))
    AttentionMaskInterface.register(key, ALL_MASK_ATTENTION_FUNCTIONS[base])
    config._attn_implementation = key


def _checkpointed_core(base: str, cuda_autocast: bool) -> Callable[..., Any]:
    from torch.utils.checkpoint import checkpoint

    from memplan.trace.runners.hf_attention import attention_function

    extra = _context(cuda_autocast)

    def core(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(attention_function(module, base), module, *args, use_reentrant=False, **extra, **kwargs)

    return core
