"""A layer's backward under save_on_cpu node by node (memplan.estimate.offloaded_backward): a lumped term's
tensors come back one node's at a time, beside the layer's output gradient and the weight gradients made before."""

from __future__ import annotations

from memplan.estimate.layer_costs import largest_saved_term
from memplan.estimate.offloaded_backward import offloaded_backward
from tests.estimate.test_reserved_mechanics import _ctx

_FULL = {"seq": 4096, "mbs": 1, "precision": "bf16-mixed", "framework": "hf", "offload_activations": True,
         "attention": "sdpa"}


def test_gated_mlp_product_node() -> None:
    """Mistral 7B (eager SwiGLU, hf): the product act(gate) * up brings back two of the MLP's three f-wide
    tensors and makes their two gradients beside the one coming in, with the fp32 residual gradient. With the
    weight gradients made before, the attention block's worst node (two of the fp32 norm input, 64 MiB each)
    after the MLP block's and the output projection's fp32 gradients is worse than that node after the down
    projection's."""
    ctx = _ctx("mistral-7b", _FULL)
    one = 4096 * 14336 * 2  # one bf16 tensor of the intermediate width
    assert largest_saved_term(ctx.run, [0]) == 2 * one  # was the whole lump: 3 x one
    figures = offloaded_backward(ctx.run, 0)
    assert figures is not None
    assert figures.transient == 3 * one + 4096 * 4096 * 4  # was 2 x 3 x one, no output gradient
    block = (3 * 14336 * 4096 + 4096 * 4096) * 4
    assert 2 * 4096 * 4096 * 4 + block > 3 * one + 14336 * 4096 * 4
    assert figures.early_gradients == 2 * 4096 * 4096 * 4 + block - 3 * one


def test_adapters_make_no_early_gradients() -> None:
    """Under LoRA the base weights make no gradients: nothing is counted before the worst node."""
    ctx = _ctx("mistral-7b", {**_FULL, "peft": "lora", "lora_targets": "q_proj,v_proj"})
    figures = offloaded_backward(ctx.run, 0)
    assert figures is not None and figures.early_gradients == 0


def test_gpt2_gelu_new_pow_node() -> None:
    """GPT-2's gelu_new under autocast: pow's backward holds x^2, 3 x^2 and its product beside the incoming
    gradient and the two 16-bit gradients of x waiting (five fp32 tensors of the intermediate width); the
    bring-back is one of them."""
    ctx = _ctx("gpt2-xl", {**_FULL, "seq": 512})
    one = 512 * 6400 * 4
    assert largest_saved_term(ctx.run, [0]) == one
    figures = offloaded_backward(ctx.run, 0)
    assert figures is not None and figures.transient == 5 * one + 512 * 1600 * 4


def test_offload_never_above_none_with_early_gradients() -> None:
    """DeepSeek-V3 at 1,024 tokens on 8 GPUs (the monotonicity sweep's cell): its dense layers' MLP and output
    projection gradients (2 GB) made before the attention's nodes would put the offloaded job above the same job
    without offload, whose rule counts none of them; the figures are held to that rule's (OffloadedBackward.within)."""
    from memplan import estimate
    from memplan.inputs import JobRequest, load_job

    def peak(offload: bool) -> int:
        flags = {"framework": "hf", "gpus": 8, "seq": 1024, "offload_activations": offload}
        loaded = load_job(JobRequest(model="deepseek-v3", flags=flags))
        return estimate(loaded.model, loaded.job).peak_allocated_bytes

    assert peak(True) <= peak(False)


def test_eager_softmax_node_holds_the_value_gradient() -> None:
    """Eager attention under save_on_cpu (Mistral 7B, LoRA on q/v, 4,096 tokens): the softmax backward holds its
    two fp32 gradients of the probabilities, the layer's output gradient and the values' gradient the PV matmul's
    backward made just before, one per query head (repeat_kv's sum runs later) in 16 bits: the values were in
    host memory, so the PV node released nothing on the GPU beside it (the trace of the agreement grid's
    llama_v256 cell: 524,288 B at layer 1's _softmax_backward_data)."""
    from memplan.estimate.activations import output_gradient_bytes

    ctx = _ctx("mistral-7b", {**_FULL, "attention": "eager", "peft": "lora", "lora_targets": "q_proj,v_proj"})
    figures = offloaded_backward(ctx.run, 0)
    assert figures is not None
    softmax = 2 * 32 * 4096 * 4096 * 4
    value_gradient = 32 * 4096 * 128 * 2
    assert figures.transient == softmax + value_gradient + output_gradient_bytes(ctx.run.shape, 4096)


def test_value_gradient_split_by_tensor_parallelism() -> None:
    """Under TP 2 each rank holds half the heads' value gradient, as its softmax gradients."""
    from memplan.estimate.activations import output_gradient_bytes

    ctx = _ctx("mistral-7b", {**_FULL, "attention": "eager", "tp": 2, "gpus": 2})
    figures = offloaded_backward(ctx.run, 0)
    assert figures is not None
    worst = figures.transient - output_gradient_bytes(ctx.run.shape, 4096)
    assert worst == (2 * 32 * 4096 * 4096 * 4 + 32 * 4096 * 128 * 2) // 2


def test_frozen_experts_weight_node() -> None:
    """Mixtral 8x7B, LoRA on q/v (frozen bf16 experts), 1,024 tokens under save_on_cpu: the largest tensor a layer
    brings back is its stacked gate_up weight (the stage's bring-back); at that weight's grouped GEMM backward the
    MLP block holds beside it the gradient of the GEMM's output (one routed tokens x 2 x 14,336 tensor) and the
    routed tokens' input gradient it makes, not two of the output's size (the agreement grid's qwen3_moe_wide LoRA
    cell: +2.20% before)."""
    from memplan.estimate.activations import output_gradient_bytes
    from memplan.estimate.offload_weights import largest_saved_weight

    ctx = _ctx("mixtral-8x7b", {**_FULL, "seq": 1024, "peft": "lora", "lora_targets": "q_proj,v_proj"})
    routed = 1024 * 2
    assert largest_saved_weight(ctx.run, [0]) == 8 * 2 * 14336 * 4096 * 2 > largest_saved_term(ctx.run, [0])
    figures = offloaded_backward(ctx.run, 0)
    assert figures is not None
    grad_out, grad_in = routed * 2 * 14336 * 2, routed * 4096 * 2
    assert figures.transient == grad_out + grad_in + output_gradient_bytes(ctx.run.shape, 4096)
