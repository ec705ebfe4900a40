"""A layer's backward transient under the general rule (memplan.estimate.activations.backward_transient_bytes):
the most one term's first backward node holds beside the layer's saved tensors, a lumped term priced by one of its
tensors (memplan trace on GPT-2 and Llama toys: tests/trace/test_dropout_trace.py, tests/trace/test_agreement_grid.py).
"""

from __future__ import annotations

from memplan.estimate.engine import layer_activation_costs
from memplan.job import Batch, Job, Precision
from memplan.model import load_model


def _job(precision: str = "bf16-mixed") -> Job:
    return Job(framework="hf", precision=Precision(name=precision), batch=Batch(seq_length=512), attention="sdpa")


def test_gelu_new_last_product() -> None:
    """GPT-2's gelu_new under autocast saves three fp32 intermediates; its last product (0.5 * x times
    1 + tanh(...)) holds the fp32 gradient coming in and one per factor: three fp32 tensors, not two of the
    three-tensor term."""
    one = 512 * 6400 * 4
    # (since helper mlpbwd13 a trained MLP is walked node by node, memplan.estimate.mlp_backward_nodes: the product
    # comes after c_proj's node freed its saved input and weight copy; c_proj's node, its 16-bit weight gradient
    # (6,400 x 1,600) and input gradient beside the fp32 output gradient and its 16-bit cast, holds the most)
    walked = 512 * 1600 * (4 + 2) + 6400 * 1600 * 2 + 512 * 6400 * 2
    assert layer_activation_costs(load_model("gpt2-xl"), _job(), 1)[2] == walked < 3 * one  # was 6 x one


def test_gelu_new_without_autocast() -> None:
    """In pure bf16 the same node holds three 16-bit tensors."""
    one = 512 * 6400 * 2
    # (walked: beside the layer's output gradient, once c_proj's node freed its saved input)
    assert layer_activation_costs(load_model("gpt2-xl"), _job("bf16"), 1)[2] == 3 * one - one + 512 * 1600 * 2


def test_eager_swiglu_product() -> None:
    """Eager SwiGLU lumps gate, up and act(gate): the product act(gate) * up holds the gradient coming in
    and the gradients of both factors, three intermediate-sized tensors (was two of the lump, six)."""
    one = 512 * 14336 * 2
    assert layer_activation_costs(load_model("mistral-7b"), _job("bf16"), 1)[2] == 3 * one - one + 512 * 4096 * 2
