"""Trainable and frozen parameter counts equal peft's ``get_nb_trainable_parameters()`` exactly.

Real peft models are built on the meta device from every preset's config (at most 2 decoder layers, DeepSeek's leading dense ones and one MoE layer;
see :mod:`tests.model.test_linears`) and a few variants, for LoRA r8 on two attention projections,
LoRA r64 all-linear, DoRA r16, a rank pattern, ``modules_to_save=lm_head`` and LoRA on the embedding.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from test_linears import ALL, meta_model, small_config

from memplan.job import FineTuning
from memplan.model import model_from_hf_config
from memplan.model.linears import layer_linears
from memplan.peft.params import finetune_params


def _two_attention_linears(spec: Any) -> tuple[str, str]:
    """q_proj,v_proj where the model has them, else its first and last attention linear layers."""
    names = [m.name.rpartition(".")[2] for m in layer_linears(spec.layers[0], spec.hidden_size, spec.model_type)]
    if "q_proj" in names and "v_proj" in names:
        return "q_proj", "v_proj"
    attention = names[: names.index(next(n for n in names if n in ("o_proj", "c_proj", "dense")))+ 1]
    return attention[0], attention[-1]


def _cases(spec: Any) -> dict[str, tuple[dict[str, Any], FineTuning]]:
    first, second = _two_attention_linears(spec)
    two = f"{first},{second}"
    return {
        "lora-r8-two": ({"r": 8, "target_modules": [first, second]}, FineTuning(peft="lora", lora_targets=two)),
        "lora-r64-all-linear": ({"r": 64, "target_modules": "all-linear"},
                                FineTuning(peft="lora", lora_rank=64, lora_targets="all-linear")),
        "dora-r16": ({"r": 16, "target_modules": [first, second], "use_dora": True},
                     FineTuning(peft="dora", lora_rank=16, lora_targets=two)),
        "rank-pattern": ({"r": 8, "target_modules": "all-linear", "rank_pattern": {second: 32}},
                         FineTuning(peft="lora", lora_targets="all-linear", lora_rank_pattern=f"{second}=32")),
        "modules-to-save-head": ({"r": 8, "target_modules": [first, second], "modules_to_save": ["lm_head"]},
                                 FineTuning(peft="lora", lora_targets=two, modules_to_save="lm_head")),
    }


def _peft_counts(name: str, config: dict[str, Any]) -> tuple[int, int]:
    model = copy.deepcopy(meta_model(name))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = peft.get_peft_model(model, peft.LoraConfig(**config))
    trainable, total = wrapped.get_nb_trainable_parameters()
    return trainable, total - trainable


@pytest.mark.parametrize("name", ALL)
def test_counts_equal_peft(name: str) -> None:
    spec = model_from_hf_config(small_config(name), name=name)
    for case, (config, ft) in _cases(spec).items():
        ours = finetune_params(spec, ft)
        assert (ours.trainable, ours.frozen) == _peft_counts(name, config), case


def test_lora_on_the_embedding_equals_peft() -> None:
    spec = model_from_hf_config(small_config("llama-3.2-1b"), name="llama-3.2-1b")
    ours = finetune_params(spec, FineTuning(peft="lora", lora_targets="embed_tokens,q_proj"))
    assert (ours.trainable, ours.frozen) == _peft_counts(
        "llama-3.2-1b", {"r": 8, "target_modules": ["embed_tokens", "q_proj"]})


def test_trainable_names_train_whole_modules() -> None:
    """--trainable layers.1,norm trains every parameter under model.layers.1 and model.norm."""
    name = "llama-3.2-1b"
    spec = model_from_hf_config(small_config(name), name=name)
    ours = finetune_params(spec, FineTuning(trainable="layers.1,norm"))
    model = meta_model(name)
    expected = sum(p.numel() for n, p in model.named_parameters()
                   if n.startswith(("model.layers.1.", "model.norm.")))
    assert ours.trainable == expected
    assert ours.trainable + ours.frozen == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ALL)
def test_auto_targets_are_pefts_default(name: str) -> None:
    """``--lora-targets auto`` adapts what ``LoraConfig(target_modules=None)`` adapts on the real model (counts
    equal peft's); where peft has no default for the model type it refuses, and memplan says it has none."""
    from memplan.errors import JobConfigError
    from memplan.peft.checks import check_finetune_names
    from memplan.peft.default_targets import peft_has_default

    from memplan.peft.params import converts_moe_targets

    spec = model_from_hf_config(small_config(name), name=name)
    ft = FineTuning(peft="lora")
    table = peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    try:
        expected = _peft_counts(name, {"r": 8})
    except ValueError as error:  # peft: "Please specify `target_modules` in `peft_config`"
        assert "target_modules" in str(error)
        if not converts_moe_targets(spec.model_type):
            assert not peft_has_default(spec.model_type), spec.model_type
            return
        # peft 0.21's MoE conversion empties a missing list before the default is looked up (Mixtral): the
        # default is its table's entry, given explicitly
        if spec.model_type not in table:
            assert not peft_has_default(spec.model_type), spec.model_type
            return
        expected = _peft_counts(name, {"r": 8, "target_modules": list(table[spec.model_type])})
    assert peft_has_default(spec.model_type), spec.model_type
    check_finetune_names(spec, ft)  # peft's own default names modules the model has
    ours = finetune_params(spec, ft)
    assert (ours.trainable, ours.frozen) == expected
    with pytest.raises(JobConfigError):  # sanity: the check is live
        check_finetune_names(spec, FineTuning(peft="lora", lora_targets="no_such_proj"))
