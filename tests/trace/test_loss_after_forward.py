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
