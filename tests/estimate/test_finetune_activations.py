"""The estimator's per-layer activations of fine-tuning jobs equal what autograd really keeps.

A small Llama is built in bf16 (a frozen base loaded with ``torch_dtype=bfloat16``), wrapped by real
peft and run forward on the CPU, with and without ``torch.autocast`` (the hf profile's bf16-mixed
and pure bf16). Every tensor autograd saves is recorded with ``saved_tensors_hooks``; the ones
still alive when the forward ends are summed per decoder layer (each storage once, parameters
excluded) and compared with :func:`memplan.estimate.engine.layer_activation_costs`.

QLoRA: the decoder linear layers are replaced by bitsandbytes ``Linear4bit`` or ``Linear8bitLt``
(its CPU backend) and wrapped by peft's bitsandbytes LoRA layers.

Known differences, added explicitly below: the RoPE cos/sin tables are first saved by layer 0
(the estimator counts them once per stage, outside the layers); and on the CPU dropout keeps a mask
in its input's dtype (fp32 after peft's cast) where CUDA keeps one byte per element.
"""

from __future__ import annotations

import warnings
import weakref
from collections import defaultdict
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from memplan.estimate.engine import layer_activation_costs
from memplan.job import Batch, FineTuning, Job, Precision
from memplan.model import model_from_hf_config

CONFIG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
          "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": False}
SEQ = 64
HEAD_DIM = 32


def _quantize(module: Any, method: str) -> None:
    """Replace every decoder linear layer by a bitsandbytes ``Linear4bit`` (NF4, double quant, bf16
    compute) or ``Linear8bitLt`` (int8, ``has_fp16_weights=False``), as ``from_pretrained`` with a
    ``BitsAndBytesConfig(load_in_4bit=True, ...)`` or ``load_in_8bit=True`` does."""
    bnb = pytest.importorskip("bitsandbytes")
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            if method == "int8":
                layer = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=child.bias is not None,
                                            has_fp16_weights=False, threshold=0.0)
                layer.weight = bnb.nn.Int8Params(child.weight.data.half(), requires_grad=False,
                                                 has_fp16_weights=False)
            else:
                layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=True)
                layer.weight = bnb.nn.Params4bit(child.weight.data.float(), requires_grad=False, quant_type="nf4",
                                                 compress_statistics=True)
            setattr(module, name, layer.to("cpu"))
        else:
            _quantize(child, method)


def saved_bytes_per_layer(lora: dict[str, Any], autocast: bool, quantize: str = "none",
                          config: dict[str, Any] | None = None, dtype: Any = None) -> dict[int, int]:
    """Bytes autograd keeps per decoder layer at the end of the forward (see the module docstring)."""
    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = config or CONFIG
        attention = "eager" if cfg["model_type"] == "gemma2" else "sdpa"
        hf_config = transformers.AutoConfig.for_model(**cfg, attn_implementation=attention)
        model = transformers.AutoModelForCausalLM.from_config(hf_config).to(dtype or torch.bfloat16)
        if quantize != "none":
            _quantize(model.model, quantize)
            # what peft reads to wrap the bitsandbytes layers with its bnb LoRA layers
            setattr(model, "is_loaded_in_8bit" if quantize == "int8" else "is_loaded_in_4bit", True)
        model = peft.get_peft_model(model, peft.LoraConfig(**lora))
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current: list[int | None] = [None]
    for i, layer in enumerate(model.base_model.model.model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None))
    refs: list[tuple[int, Any]] = []

    def pack(t: Any) -> Any:
        if current[0] is not None and t.untyped_storage().data_ptr() not in params:
            refs.append((current[0], weakref.ref(t)))
        return t

    if quantize == "int8":
        # MatMul8bitLt keeps its input in ctx.tensors, which saved_tensors_hooks do not see
        import bitsandbytes as bnb

        def keep_input(module: Any, args: Any) -> None:
            if current[0] is not None and args[0].requires_grad:
                refs.append((current[0], weakref.ref(args[0])))

        for module in model.modules():
            if isinstance(module, bnb.nn.Linear8bitLt):
                module.register_forward_pre_hook(keep_input)
    ids = torch.randint(0, (config or CONFIG)["vocab_size"], (1, SEQ))
    with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
          torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)):
        loss = model(input_ids=ids, labels=ids).loss
    per: dict[int, int] = defaultdict(int)
    seen: set[int] = set()
    for layer, ref in refs:
        t = ref()
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            per[layer] += t.untyped_storage().nbytes()
    del loss
    return dict(per)


QV = {"target_modules": ["q_proj", "v_proj"]}
CASES = {
    "lora-r8-qv": ({"r": 8, **QV}, FineTuning(peft="lora", lora_targets="q_proj,v_proj")),
    "lora-r8-qv-dropout": ({"r": 8, "lora_dropout": 0.1, **QV},
                           FineTuning(peft="lora", lora_targets="q_proj,v_proj", lora_dropout=0.1)),
    "lora-r64-all-linear": ({"r": 64, "target_modules": "all-linear"},
                            FineTuning(peft="lora", lora_rank=64, lora_targets="all-linear")),
    "dora-r16-qv": ({"r": 16, "use_dora": True, **QV}, FineTuning(peft="dora", lora_rank=16, lora_targets="q_proj,v_proj")),
    "dora-r16-qv-dropout": ({"r": 16, "use_dora": True, "lora_dropout": 0.1, **QV},
                            FineTuning(peft="dora", lora_rank=16, lora_targets="q_proj,v_proj", lora_dropout=0.1)),
}


QLORA = {
    "qlora-r64-all-linear": ({"r": 64, "target_modules": "all-linear"},
                             FineTuning(peft="lora", lora_rank=64, lora_targets="all-linear", quantize_base="nf4")),
    "qlora-r8-qv": ({"r": 8, **QV}, FineTuning(peft="lora", lora_targets="q_proj,v_proj", quantize_base="nf4")),
    "int8-r64-all-linear": ({"r": 64, "target_modules": "all-linear"},
                            FineTuning(peft="lora", lora_rank=64, lora_targets="all-linear", quantize_base="int8")),
    "int8-r8-qv": ({"r": 8, **QV}, FineTuning(peft="lora", lora_targets="q_proj,v_proj", quantize_base="int8")),
}


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16", "fp32"])
@pytest.mark.parametrize("case", [*CASES, *QLORA])
def test_layer_activations_equal_autograd(case: str, precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    lora, ft = {**CASES, **QLORA}[case]
    if precision == "fp32" and case in QLORA:
        pytest.skip("a quantized base computes in 16 bits")
    if precision == "bf16-mixed":
        # peft's bitsandbytes layers skip the fp32 input cast when torch.is_autocast_enabled() (CUDA autocast);
        # on the CPU that check is False under CPU autocast, so it answers as on a GPU.
        original = torch.is_autocast_enabled
        monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: True if not a else original(*a))
    measured = saved_bytes_per_layer(lora, autocast=precision == "bf16-mixed",
                                     quantize=ft.quantize_base,
                                     dtype=torch.float32 if precision == "fp32" else torch.bfloat16)
    spec = model_from_hf_config(CONFIG, name="small-llama")
    job = Job(framework="hf", precision=Precision(name=precision), batch=Batch(seq_length=SEQ), finetune=ft,
              attention="sdpa")
    rope_tables = 2 * SEQ * HEAD_DIM * (4 if precision == "fp32" else 2)
    # CPU dropout keeps an fp32 mask of each adapter's input (q and v read the hidden size) where CUDA keeps
    # a bool; the first layer keeps none (its input needs no gradient).
    cpu_mask = (4 - 1) * SEQ * CONFIG["hidden_size"] * 2 if ft.lora_dropout else 0
    first, second = (layer_activation_costs(spec, job, i)[1] for i in range(2))
    assert measured[1] == second + cpu_mask  # (each eager norm's fp32 1/rms per token is estimated)
    assert measured[0] == first + rope_tables


SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
         "head_dim": HEAD_DIM, "vocab_size": 1000}
FAMILIES = {
    # Gemma 2 needs eager attention (soft-capping); each of its 4 norms also keeps the fp32 (1 + weight).
    "gemma2": ({"model_type": "gemma2", **SMALL, "num_key_value_heads": 4, "sliding_window": 4096,
                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}, 4 * (4 * 256)),
    # (Qwen3's per-head q/k norms' fp32 rsqrt per head and token is priced, as every norm's.)
    "qwen3": ({"model_type": "qwen3", **SMALL, "num_key_value_heads": 2, "tie_word_embeddings": False}, 0),
}


@pytest.mark.parametrize("case", ["lora-r8-qv", "lora-r64-all-linear"])
@pytest.mark.parametrize("family", FAMILIES)
def test_layer_activations_equal_autograd_gemma2_qwen3(family: str, case: str) -> None:
    """A decoder layer after the first (the first one's q/k may need no gradient, a detail not priced)."""
    config, unpriced = FAMILIES[family]
    lora, ft = CASES[case]
    measured = saved_bytes_per_layer(lora, autocast=True, config=config)
    spec = model_from_hf_config(config, name=family)
    job = Job(framework="hf", batch=Batch(seq_length=SEQ), finetune=ft,
              attention="eager" if family == "gemma2" else "sdpa")
    assert measured[1] == layer_activation_costs(spec, job, 1)[1] + unpriced


def test_layers_before_the_first_adapter_save_nothing() -> None:
    """LoRA on the last layer's q_proj only: nothing requires grad before it, so layer 0 saves nothing."""
    lora = {"r": 8, "target_modules": ["layers.1.self_attn.q_proj"]}
    measured = saved_bytes_per_layer(lora, autocast=True)
    spec = model_from_hf_config(CONFIG, name="small-llama")
    job = Job(framework="hf", batch=Batch(seq_length=SEQ), attention="sdpa",
              finetune=FineTuning(peft="lora", lora_targets="layers.1.self_attn.q_proj"))
    assert measured.get(0, 0) == layer_activation_costs(spec, job, 0)[1] == 0
    rope_tables = 2 * SEQ * HEAD_DIM * 2
    assert measured[1] == layer_activation_costs(spec, job, 1)[1] + rope_tables
