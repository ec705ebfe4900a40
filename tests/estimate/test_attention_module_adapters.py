"""What the checkpointed attention module (``hf`` selective) keeps of a fine-tuned layer (helper selft13, session
13; against the trace: tests/trace/test_attention_module_adapters_trace.py): the attention projections' adapters
nothing (made again by the module's recompute), the MLP's their own, the frozen layer's input nothing."""

from __future__ import annotations

from memplan.estimate.engine import layer_activation_costs
from memplan.job import Batch, FineTuning, Job, Precision, Recompute
from memplan.model import model_from_hf_config

CONFIG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
          "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": False}


def _kept(targets: str, mode: str, index: int = 1) -> int:
    spec = model_from_hf_config(CONFIG, name="small-llama")
    job = Job(framework="hf", batch=Batch(seq_length=256), attention="sdpa", precision=Precision(name="bf16-mixed"),
              recompute=Recompute(mode=mode), finetune=FineTuning(peft="lora", lora_targets=targets))
    return layer_activation_costs(spec, job, index)[0]


def test_attention_adapters_keep_nothing_under_the_module_checkpoint() -> None:
    assert _kept("q_proj,v_proj,o_proj", "selective") == _kept("q_proj", "selective")
    assert _kept("q_proj,v_proj,o_proj", "none") > _kept("q_proj", "none")
    # an MLP adapter keeps its lora_A input (a 16-bit copy), its lora_B input and its weights' copies
    assert _kept("q_proj,down_proj", "selective") > _kept("q_proj", "selective")


def test_the_module_checkpoint_keeps_the_norm_output_not_the_layer_input() -> None:
    # layer 1 (its input needs a gradient): the RMSNorm's fp32 copy and 1/rms, the module's 16-bit input, the MLP's
    # norm and gated products; layer 0 (no enable_input_require_grads): no input norm terms
    tokens, hidden = 256, 256
    norm = 4 * tokens * hidden + 4 * tokens
    mlp = norm + 3 * 2 * tokens * 512
    assert _kept("q_proj,v_proj", "selective") == norm + 2 * tokens * hidden + mlp
    assert _kept("q_proj,v_proj", "selective", index=0) == 2 * tokens * hidden + mlp
