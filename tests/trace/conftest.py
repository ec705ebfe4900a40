"""Tiny Hugging Face configs (a few hundred thousand parameters) so that each trace takes ~1 s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

#: GPT-2 shaped: learned positions, LayerNorm, gelu_new MLP, tied head. Sizes are multiples of
#: 128 fp32 elements so that CUDA's 512-byte rounding does not change state sizes.
TINY_GPT2 = {"model_type": "gpt2", "n_embd": 128, "n_head": 4, "n_layer": 2, "n_positions": 256,
             "vocab_size": 1024, "bos_token_id": 0, "eos_token_id": 0}
#: Llama shaped: RoPE, RMSNorm, SwiGLU, GQA, untied head.
TINY_LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0}
#: Mixtral shaped: top-2 routing over 4 experts (data-dependent without --moe-routing balanced).
TINY_MIXTRAL = {"model_type": "mixtral", "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1024, "num_local_experts": 4,
                "num_experts_per_tok": 2, "max_position_embeddings": 512, "bos_token_id": 0, "eos_token_id": 0}


def _write(tmp_path_factory: pytest.TempPathFactory, name: str, config: dict[str, object]) -> str:
    folder = tmp_path_factory.mktemp(name)
    path = Path(folder) / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _write(tmp_path_factory, "tiny-gpt2", TINY_GPT2)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _write(tmp_path_factory, "tiny-llama", TINY_LLAMA)


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _write(tmp_path_factory, "tiny-mixtral", TINY_MIXTRAL)
