"""Megatron's ``--recompute-modules mla_up_proj`` on Hugging Face's multi-latent attention.

Megatron (megatron/core/transformer/multi_latent_attention.py) runs MLA's up-projections and RoPE
— from the compressed latents to q, k and v — under ``CheckpointWithoutOutput`` and discards q, k
and v once the attention core has saved them, making them again when the core's backward starts
(``discard_output_and_register_recompute(core_attn_out)``). What stays is the latents; what goes
is everything the up-projection saves inside (the latent norms, the up-projection inputs, RoPE)
and q, k, v wherever the core saved them.

transformers computes that stretch inline in the attention's ``forward`` (DeepSeek-V2/V3 and the
models built like them: ``q_a_proj``/``q_proj``, ``kv_a_proj_with_mqa``, then norms, ``q_b_proj``,
``kv_b_proj``, RoPE and concatenations, then the attention function). So the stretch is run as a
function of the latents by calling the model's own ``forward`` with its two down-projections
answering the given latents and the attention function stopping the call with q, k, v
(:func:`_region`): no line of transformers' MLA is restated. That function runs under
:class:`memplan.trace.runners.discard.DiscardScope` (the output-discarding checkpoint ``layernorm`` and
``moe_act`` use), and the rest of the forward — the attention function on q, k, v and the output
projection — is run here as transformers writes it (``attn_output.reshape(b, s, -1).contiguous()``
then ``o_proj``); a test compares outputs and gradients with the plain module.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memplan.errors import UnsupportedError

__all__ = ["discard_mla_up"]

#: The attention-function key that stops a forward at the attention core (registered once).
_STOP_KEY = "memplan_mla_up_stop"
#: Sub-modules an MLA attention must have for the stretch to be run as a function of its latents.
_NEEDED = ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


class _Stopped(Exception):
    """Raised by the stop function: the attention core's inputs and arguments."""

    def __init__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        super().__init__("stopped at the attention core")
        self.qkv = (query, key, value)
        self.args, self.kwargs = args, kwargs


def _stop(_module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
          **kwargs: Any) -> Any:
    raise _Stopped(query, key, value, args, kwargs)


def _register_stop() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if _STOP_KEY not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(_STOP_KEY, _stop)


@contextlib.contextmanager
def _answering(module: torch.nn.Module, value: torch.Tensor) -> Iterator[None]:
    """``module(anything)`` returns ``value`` while inside."""
    had = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    module.forward = lambda *_args, **_kwargs: value  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had:
            module.forward = previous  # type: ignore[method-assign]
        else:
            del module.forward


@contextlib.contextmanager
def _stopping_at_core(config: Any) -> Iterator[str]:
    base = config._attn_implementation
    config._attn_implementation = _STOP_KEY
    try:
        yield base
    finally:
        config._attn_implementation = base


def _check(attention: torch.nn.Module) -> None:
    missing = [name for name in _NEEDED if not isinstance(getattr(attention, name, None), torch.nn.Module)]
    q_in = getattr(attention, "q_a_proj", None) or getattr(attention, "q_proj", None)
    if missing or not isinstance(q_in, torch.nn.Module) or not hasattr(attention, "config"):
        raise UnsupportedError(f"--recompute-modules mla_up_proj runs on transformers' multi-latent attention "
                               f"(q_a_proj or q_proj, {', '.join(_NEEDED)}); {type(attention).__name__} has "
                               f"{'no ' + ', '.join(missing) if missing else 'another layout'}")


def discard_mla_up(scope: Any, attention: torch.nn.Module) -> None:
    """Run ``attention``'s up-projections and RoPE output-discarding in ``scope`` (see the module docstring)."""
    _check(attention)
    _register_stop()
    forward = attention.forward
    low_rank_q = getattr(attention, "q_a_proj", None) is not None

    def forward_discarding_up(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        from memplan.trace.runners.hf_attention import attention_function

        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            # The stretch is run again in the backward: a cache would be written twice.
            raise UnsupportedError("--recompute-modules mla_up_proj traces training steps without a KV cache "
                                   "(use_cache=False)")
        q_in = attention.q_a_proj(hidden_states) if low_rank_q else hidden_states
        kv_latent = attention.kv_a_proj_with_mqa(hidden_states)
        core_call: dict[str, Any] = {}
        region = _region(forward, attention, low_rank_q, [args, kwargs, True], core_call)
        (query, key, value), holder = scope.checkpoint(region, q_in, kv_latent)
        core = attention_function(attention, core_call["base"])
        attn_output, weights = core(attention, query, key, value, *core_call["args"], **core_call["kwargs"])
        core_call.clear()  # the region lives until the backward: it must not keep the mask
        if holder is not None:
            holder.recompute_at(attn_output)
        batch, seq = hidden_states.shape[:-1]
        return attention.o_proj(attn_output.reshape(batch, seq, -1).contiguous()), weights

    attention.forward = forward_discarding_up  # type: ignore[method-assign]


def _region(forward: Callable[..., Any], attention: torch.nn.Module, low_rank_q: bool, call: list[Any],
            core_call: dict[str, Any]) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The stretch from the latents to (q, k, v), as a function of the latents: the model's own forward with
    its down-projections answering them and its attention function stopping the call."""

    def region(q_in: torch.Tensor, kv_latent: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with contextlib.ExitStack() as stack:
            if low_rank_q:
                stack.enter_context(_answering(attention.q_a_proj, q_in))
            stack.enter_context(_answering(attention.kv_a_proj_with_mqa, kv_latent))
            base = stack.enter_context(_stopping_at_core(attention.config))
            try:
                # Without a low-rank q the first input is the hidden states themselves (q_proj's input).
                forward(q_in, *call[0], **call[1])
            except _Stopped as stopped:
                if call[2]:  # the forward's own run: the core's arguments, then none for the recompute
                    core_call.update(base=base, args=stopped.args, kwargs=stopped.kwargs)
                    call[:] = (*_without_mask(forward, q_in, call[0], call[1]), False)
                return stopped.qkv
        raise UnsupportedError(f"--recompute-modules mla_up_proj: {type(attention).__name__}.forward returned "
                               "without calling its attention function")

    return region


def _without_mask(forward: Callable[..., Any], first: torch.Tensor, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The forward's arguments for the recompute, with ``attention_mask`` set to None.

    Only the attention function reads the mask, and the recompute stops before it (the first run
    recorded the core's arguments, mask included). Keeping the ``(b, 1, s, s)`` mask in the
    checkpoint until the backward would hold memory Megatron's ``mla_up_proj`` does not (its fused
    core takes the causal flag, not a mask)."""
    try:
        bound = inspect.signature(forward).bind_partial(first, *args, **kwargs)
    except TypeError:
        return args, kwargs
    if bound.arguments.get("attention_mask") is None:
        return args, kwargs
    bound.arguments["attention_mask"] = None
    return bound.args[1:], bound.kwargs
