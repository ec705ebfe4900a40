"""``memplan trace``'s loss after the model's forward (:class:`memplan.trace.run.LossAfterForward`), used where the
framework's trainer computes the loss on the model's output under FSDP2 (torchtitan's ``train.py``: ``pred =
model(inputs)``, then ``loss_fn(pred, labels)``): the model is called without labels and the same causal-LM loss
(its ``loss_function``) runs on its logits once the forward has returned."""

from __future__ import annotations

import torch
import transformers

from memplan.trace.run import LossAfterForward


def _tiny() -> torch.nn.Module:
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=1, vocab_size=64,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_same_loss_as_the_model_computes() -> None:
    model = _tiny()
    ids = torch.randint(0, 64, (2, 16))
    batch = {"input_ids": ids, "labels": ids.clone()}
    after = LossAfterForward(model, 64)
    output = after.call(**batch)
    assert output.loss is None  # the model got no labels: no loss inside its forward
    torch.testing.assert_close(after(output, batch), model(**batch).loss)


def test_torchtitan_profile_runs_torchtitans_summed_loss() -> None:
    """``--framework torchtitan``: the step's loss is torchtitan's ``cross_entropy_loss`` (the labels as the loader
    shifted them, summed) divided by the tokens, run after the model's forward, also on one rank without FSDP."""
    from memplan.trace.run import hf_step_job, token_sum_cross_entropy
    from memplan.trace.setup import trace_setup

    model = _tiny()
    options = trace_setup(framework="torchtitan", seq=16, mbs=2, precision="fp32", device="cpu")
    job = hf_step_job(model, options, autocast=False)
    assert isinstance(job.loss_fn, LossAfterForward) and job.loss_fn.token_sum
    assert model.loss_function is token_sum_cross_entropy
    output = job.call(**job.batch)
    labels = job.batch["labels"]
    expected = torch.nn.functional.cross_entropy(output.logits.reshape(-1, 64), labels.reshape(-1))  # no shift
    torch.testing.assert_close(job.loss_fn(output, job.batch), expected)


def test_hf_profile_keeps_the_models_own_loss() -> None:
    from memplan.trace.run import hf_loss, hf_step_job
    from memplan.trace.setup import trace_setup

    options = trace_setup(framework="hf", seq=16, mbs=2, precision="fp32", device="cpu")
    assert hf_step_job(_tiny(), options, autocast=False).loss_fn is hf_loss


def test_torchtitan_trace_has_no_label_shift_at_the_loss(tmp_path) -> None:
    """The fake-tensor trace: no ``constant_pad_nd`` / ``clone`` of the labels (transformers' shift) in the loss, so
    the logits category is the fp32 log-softmax output alone (+ the 0-dim sum), as the estimate prices it."""
    import json

    from memplan.trace import trace

    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
                                "vocab_size": 512, "max_position_embeddings": 256}), encoding="utf-8")
    result = trace(str(path), framework="torchtitan", seq=64, mbs=2, precision="bf16-mixed", attention="sdpa",
                   optimizer="adamw", optimizer_impl="foreach", device="cuda", iterations=1)
    ops = {e.op for e in result.trace.events if e.kind == "alloc" and e.phase == "forward" and e.module == ""}
    assert "aten.constant_pad_nd.default" not in ops and "aten.clone.default" not in ops
    log_softmax = 4 * 2 * 64 * 512
    assert log_softmax <= result.summary.max_requested_by_category["logits"] <= log_softmax + 8
