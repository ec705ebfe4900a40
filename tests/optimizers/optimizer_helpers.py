"""What the optimizer tests share: a Llama-shaped tiny config and the one-line refusal check."""

from __future__ import annotations

from typer.testing import CliRunner

from memplan.cli import app

#: Llama-3.2-1B's shape, shrunk (GQA, SwiGLU, untied head), as tests/trace/conftest.py's tiny llama.
TINY_LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0}


def assert_refused(optimizer: str, flags: list[str], words: str) -> None:
    """``memplan estimate`` refuses ``--optimizer OPTIMIZER FLAGS`` with one line naming --optimizer, exit 2."""
    result = CliRunner().invoke(app, ["estimate", "llama-3.2-1b", "--optimizer", optimizer, *flags])
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "--optimizer" in message and words in message and "Traceback" not in result.output
