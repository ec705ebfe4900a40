"""Megatron's output-discarding checkpoint (memplan.trace.runners.discard) and the recompute modules built on it
(layernorm, moe_act): exact gradients on real tensors, the output really freed in the forward, and the
bytes both engines say each module drops."""

from __future__ import annotations

import contextlib
import json
import weakref
from pathlib import Path

import pytest
import torch

from memplan.errors import UnsupportedError
from memplan.policies import ActivationPolicy
from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate
from memplan.trace.runners.discard import DiscardScope
from memplan.trace.runners.policies import apply_policy


def _no_context() -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def test_the_output_is_freed_once_the_consumer_saved_it_and_made_again_for_the_backward() -> None:
    torch.manual_seed(0)
    norm, linear = torch.nn.LayerNorm(8), torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    scope = DiscardScope(lambda: _no_context)
    with scope.active():
        out, holder = scope.checkpoint(norm, x)
        y = linear(out)
    assert holder is not None
    storage = weakref.ref(out.untyped_storage())
    del out
    assert storage() is None  # the linear layer saved a placeholder, not the norm's output
    y.square().sum().backward()
    got = (x.grad.clone(), norm.weight.grad.clone(), linear.weight.grad.clone())
    for tensor in (x, norm.weight, norm.bias, linear.weight, linear.bias):
        tensor.grad = None
    linear(norm(x)).square().sum().backward()
    for a, b in zip(got, (x.grad, norm.weight.grad, linear.weight.grad), strict=True):
        torch.testing.assert_close(a, b)


def test_a_view_of_the_output_is_recomputed_as_the_same_view() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    scope = DiscardScope(lambda: _no_context)
    with scope.active():
        out, _ = scope.checkpoint(torch.tanh, x)
        y = out[:, 2:] * out[:, 2:]  # saves a strided view twice
    y.sum().backward()
    expected = 2 * torch.tanh(x)[:, 2:] * (1 - torch.tanh(x)[:, 2:] ** 2)
    torch.testing.assert_close(x.grad[:, 2:], expected)
    assert torch.count_nonzero(x.grad[:, :2]) == 0


def _model(path: str, experts: str | None = None) -> torch.nn.Module:
    import transformers

    config = json.loads(Path(path).read_text(encoding="utf-8"))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    if experts is not None:
        for module in model.modules():
            if hasattr(getattr(module, "config", None), "_experts_implementation"):
                module.config._experts_implementation = experts
    return model


@pytest.mark.parametrize(("which", "modules", "experts"), [
    ("llama", ("layernorm",), None),
    ("llama", ("core_attn", "layernorm", "mlp"), None),
    ("mixtral", ("layernorm", "moe_act"), "grouped_mm"),
    ("mixtral", ("moe_act",), "batched_mm"),
])
def test_gradients_equal_the_plain_models(which: str, modules: tuple[str, ...], experts: str | None,
                                          tiny_llama: str, tiny_mixtral: str) -> None:
    config = tiny_llama if which == "llama" else tiny_mixtral
    plain, recomputed = _model(config, experts), _model(config, experts)
    apply_policy(recomputed, ActivationPolicy(name="megatron-selective", framework="megatron", modules=modules))
    ids = torch.randint(0, 1000, (2, 16))
    for model in (plain, recomputed):
        model(input_ids=ids, labels=ids).loss.backward()
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_moe_act_needs_the_experts_interface(tiny_mixtral: str) -> None:
    model = _model(tiny_mixtral, experts="eager")
    with pytest.raises(UnsupportedError, match="moe_act runs on transformers' grouped_mm or batched_mm experts"):
        apply_policy(model, ActivationPolicy(name="megatron-selective", framework="megatron", modules=("moe_act",)))


COMMON = {"seq": 128, "mbs": 2, "device": "cuda", "iterations": 1, "attention": "sdpa", "moe_routing": "balanced"}


def _activations(path: str, precision: str, modules: str | None) -> tuple[int, int]:
    flags = ({"recompute": "none"} if modules is None
             else {"recompute": "megatron-selective", "recompute_modules": modules})
    result = trace(path, precision=precision, **COMMON, **flags)  # type: ignore[arg-type]
    row = next(r for r in compare_with_estimate(path, result.options, result.summary).rows
               if r.category == "activation")
    return row.traced_bytes, row.estimated_bytes


@pytest.mark.parametrize(("which", "precision", "modules"), [
    ("llama", "bf16-mixed", "layernorm"),  # the GEMMs save autocast copies: only the norms' insides go
    ("llama", "bf16", "layernorm"),  # the GEMMs save the norm output itself: it goes too
    ("llama", "bf16-mixed", "layernorm,mlp"),  # the MLP checkpoint's input is the discarded output
    ("mixtral", "bf16-mixed", "moe_act"),
    ("mixtral", "bf16", "layernorm,moe"),
])
def test_both_engines_drop_the_same_bytes(which: str, precision: str, modules: str, tiny_llama: str,
                                          tiny_mixtral: str) -> None:
    path = tiny_llama if which == "llama" else tiny_mixtral
    none, recomputed = _activations(path, precision, None), _activations(path, precision, modules)
    traced, estimated = none[0] - recomputed[0], none[1] - recomputed[1]
    assert traced > 0 and abs(estimated - traced) <= 0.03 * traced, (traced, estimated)
    assert abs(recomputed[1] - recomputed[0]) <= 0.03 * recomputed[0], recomputed


def test_layernorm_keeps_the_norm_input_and_drops_the_normalized_tensor(tiny_llama: str) -> None:
    """bf16-mixed Llama: each of a layer's two norms saved its fp32 input and its fp32 normalized tensor
    (x * rsqrt(mean(x^2))) plus the per-token rsqrt; under the checkpoint only the input stays."""
    config = json.loads(Path(tiny_llama).read_text(encoding="utf-8"))
    none, discarded = _activations(tiny_llama, "bf16-mixed", None), _activations(tiny_llama, "bf16-mixed", "layernorm")
    tokens, hidden, layers = 128 * 2, config["hidden_size"], config["num_hidden_layers"]
    assert none[0] - discarded[0] == layers * 2 * (4 * tokens * hidden + 4 * tokens)
