"""Fine-tuning in the tracer: real peft LoRA/DoRA on fake tensors, frozen bases, --trainable,
--optimizer-in-backward, parameter counts against peft's own, and the refusals (one line, exit 2)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from memplan.cli import app
from memplan.peft.params import target_names
from memplan.trace import trace
from memplan.trace.build import hf_config_dict

peft = pytest.importorskip("peft")

runner = CliRunner()
WIDE = {"COLUMNS": "300", "NO_COLOR": "1"}
SEQ = 32


def _peft_reference(config_path: str, **lora: object) -> tuple[int, int]:
    """(trainable, all) of the same model wrapped by peft on the meta device, as peft counts them."""
    import transformers

    _, config = hf_config_dict(config_path)
    values = dict(config)
    hf = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        net = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
        wrapped = peft.get_peft_model(net, peft.LoraConfig(**lora))  # type: ignore[arg-type]
    return wrapped.get_nb_trainable_parameters()


def _adapter_bytes(trainable_params: int) -> int:
    return 4 * trainable_params  # peft keeps adapters in fp32 (autocast_adapter_dtype)


@pytest.mark.parametrize(("flags", "lora"), [
    ({"peft": "lora"}, {"r": 8, "target_modules": ["q_proj", "v_proj"]}),
    ({"peft": "lora", "lora_rank": 4, "lora_targets": "all-linear", "lora_rank_pattern": "down_proj=16"},
     {"r": 4, "target_modules": "all-linear", "rank_pattern": {"down_proj": 16}}),
    ({"peft": "dora", "lora_targets": "q_proj,k_proj,v_proj,o_proj"},
     {"r": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "use_dora": True}),
], ids=["lora", "lora-all-linear-pattern", "dora"])
def test_adapters_alone_train_and_counts_equal_peft(tiny_llama: str, flags: dict[str, object],
                                                    lora: dict[str, object]) -> None:
    result = trace(tiny_llama, seq=SEQ, mbs=1, **flags)
    trainable, total = _peft_reference(tiny_llama, **lora)
    summary = result.summary
    assert (summary.trainable_params, summary.frozen_params) == (trainable, total - trainable)
    # only adapters have gradients (frozen weights never get one) and optimizer states (AdamW: two
    # moments, plus a 4-byte step counter per adapter tensor)
    assert summary.max_requested_by_category["gradient"] == _adapter_bytes(trainable)
    states = summary.max_requested_by_category["optimizer_state"]
    assert 2 * _adapter_bytes(trainable) <= states <= 2 * _adapter_bytes(trainable) + 4 * 64
    data = result.to_dict()
    assert data["trainable_params"] == trainable and data["frozen_params"] == total - trainable


def test_the_frozen_base_is_in_the_frozen_dtype(tiny_llama: str) -> None:
    bf16 = trace(tiny_llama, seq=SEQ, mbs=1, peft="lora").summary
    fp32 = trace(tiny_llama, seq=SEQ, mbs=1, peft="lora", frozen_dtype="fp32").summary
    frozen = bf16.frozen_params or 0
    adapters = _adapter_bytes(bf16.trainable_params or 0)
    assert bf16.max_requested_by_category["parameter"] == 2 * frozen + adapters
    assert fp32.max_requested_by_category["parameter"] == 4 * frozen + adapters


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_adapter_dtype_is_traced_and_priced_alike(tiny_llama: str, dtype: str) -> None:
    """--adapter-dtype casts the real peft adapters; their weights, gradients and AdamW moments are in
    that dtype, and the estimator prices the same bytes."""
    from memplan.estimate import estimate
    from memplan.inputs import JobRequest, load_job

    traced = trace(tiny_llama, seq=SEQ, mbs=1, peft="lora", adapter_dtype=dtype).summary
    size = 2 if dtype == "bf16" else 4
    trainable, frozen = traced.trainable_params or 0, traced.frozen_params or 0
    assert traced.max_requested_by_category["parameter"] == 2 * frozen + size * trainable
    assert traced.max_requested_by_category["gradient"] == size * trainable
    states = traced.max_requested_by_category["optimizer_state"]
    assert 2 * size * trainable <= states <= 2 * size * trainable + 4 * 64
    loaded = load_job(JobRequest(model=tiny_llama, flags={"peft": "lora", "adapter_dtype": dtype, "seq": SEQ,
                                                          "mbs": 1, "framework": "hf"}))
    stage = estimate(loaded.model, loaded.job).stages[0]
    assert stage.gradients_bytes == size * trainable
    assert stage.parameters_bytes == 2 * frozen + size * trainable


def test_trainable_modules_without_peft(tiny_llama: str) -> None:
    summary = trace(tiny_llama, seq=SEQ, mbs=1, trainable="layers.1,norm").summary
    layer = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384 + 2 * 128  # q,o + k,v (GQA: half) + MLP + two norms
    assert summary.trainable_params == layer + 128
    # trained in fp32 under bf16-mixed (as full training), the rest frozen in bf16
    assert summary.max_requested_by_category["gradient"] == 4 * summary.trainable_params
    assert summary.max_requested_by_category["parameter"] == 4 * summary.trainable_params + 2 * summary.frozen_params


def test_modules_to_save_train_a_copy_beside_the_frozen_original(tiny_llama: str) -> None:
    plain = trace(tiny_llama, seq=SEQ, mbs=1, peft="lora").summary
    saved = trace(tiny_llama, seq=SEQ, mbs=1, peft="lora", modules_to_save="lm_head").summary
    head = 128 * 1024
    assert saved.trainable_params == (plain.trainable_params or 0) + head
    assert saved.frozen_params == plain.frozen_params
    # peft deep-copies the bf16 head and nothing casts the copy: bf16 weight and gradient (as the estimator prices it)
    assert saved.max_requested_by_category["gradient"] == plain.max_requested_by_category["gradient"] + 2 * head
    assert saved.max_requested_by_category["parameter"] == plain.max_requested_by_category["parameter"] + 2 * head


def test_foreach_adamw_steps_each_state_dtype_with_its_own_temporary(tiny_llama: str) -> None:
    """fp32 adapters and bf16 ``modules_to_save`` copies step in two dtype groups; foreach AdamW's ``sqrt(v)``
    of each group is in that group's dtype and both are alive at the second one (estimate and trace equal;
    the estimate priced the copies' temporary in fp32 before: +16% on this job's peak)."""
    from memplan.estimate import estimate
    from memplan.inputs import JobRequest, load_job

    flags = {"seq": SEQ, "mbs": 1, "precision": "bf16-mixed", "optimizer": "adamw", "optimizer_impl": "foreach",
             "peft": "lora", "lora_targets": "all-linear", "modules_to_save": "embed_tokens,lm_head"}
    result = trace(tiny_llama, **flags)
    step = [e for e in result.trace.events if e.phase == "optimizer" and e.op == "aten._foreach_sqrt.default"
            and e.is_alloc]
    loaded = load_job(JobRequest(model=tiny_llama, flags=flags))
    stage = estimate(loaded.model, loaded.job).stages[0]
    # the step's sqrt(v) temporaries of one iteration: one per dtype group
    per_iteration = sum(e.size for e in step if e.iteration == step[0].iteration)
    assert stage.peak_phase == "optimizer step" and stage.temporary_bytes == per_iteration
    assert stage.optimizer_bytes == 2 * per_iteration


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_lora_under_full_recompute_keeps_fewer_activations(tiny_llama: str, reentrant: bool) -> None:
    kept = trace(tiny_llama, seq=SEQ, mbs=1, peft="lora").summary
    recomputed = trace(tiny_llama, seq=SEQ, mbs=1, peft="lora", recompute="full",
                       checkpoint_reentrant=reentrant).summary
    assert recomputed.max_requested_by_category["gradient"] == kept.max_requested_by_category["gradient"]
    assert recomputed.max_requested_by_category["activation"] < kept.max_requested_by_category["activation"]


def test_optimizer_in_backward_keeps_one_gradient_at_a_time(tiny_llama: str) -> None:
    normal = trace(tiny_llama, seq=SEQ, mbs=1, precision="fp32").summary
    in_backward = trace(tiny_llama, seq=SEQ, mbs=1, precision="fp32", optimizer_in_backward=True).summary
    largest = 4 * 1024 * 128  # the embedding's (or head's) gradient
    assert in_backward.max_requested_by_category["gradient"] == largest
    assert normal.max_requested_by_category["gradient"] == 4 * (normal.trainable_params or 0)
    assert in_backward.max_requested_by_category["optimizer_state"] == \
        normal.max_requested_by_category["optimizer_state"]
    assert in_backward.peak_allocated_bytes < normal.peak_allocated_bytes


def test_packing_keeps_a_mask_under_sdpa_but_not_under_flash(tiny_llama: str) -> None:
    seq, mbs = 64, 2
    plain = trace(tiny_llama, seq=seq, mbs=mbs, attention="sdpa").summary
    flash = trace(tiny_llama, seq=seq, mbs=mbs, packing=True).summary
    sdpa = trace(tiny_llama, seq=seq, mbs=mbs, attention="sdpa", packing=True).summary
    mask = mbs * seq * seq  # one bool per (query, key) of each row: transformers' packed-sequence mask
    act = {name: s.max_requested_by_category["activation"] for name, s in (("plain", plain), ("flash", flash),
                                                                          ("sdpa", sdpa))}
    assert act["sdpa"] - act["flash"] >= mask
    # flash: only RoPE's cos/sin tables become per row (fp32, head_dim 32) with per-row position ids
    assert act["flash"] - act["plain"] == 2 * (mbs - 1) * seq * 32 * 4


def test_offloaded_activations_leave_the_device_and_come_back_in_the_backward(tiny_llama: str) -> None:
    kept = trace(tiny_llama, seq=SEQ, mbs=2, peft="lora").summary
    offloaded = trace(tiny_llama, seq=SEQ, mbs=2, peft="lora", offload_activations=True)
    summary = offloaded.summary
    assert kept.max_requested_by_category["activation"] > 100_000
    assert summary.max_requested_by_category["activation"] < 1024  # the host copies are not device memory
    assert summary.max_requested_by_category["temporary"] > kept.max_requested_by_category["temporary"]
    assert summary.peak_allocated_bytes < kept.peak_allocated_bytes
    assert summary.max_requested_by_category["gradient"] == kept.max_requested_by_category["gradient"]


@pytest.mark.parametrize("loss", ["fused-linear"])
def test_fused_linear_cross_entropy_never_holds_the_whole_logits(tiny_llama: str, loss: str) -> None:
    from memplan.trace.standins.fused_loss import chunk_tokens

    seq, mbs, vocab, hidden = 256, 2, 1024, 128
    whole = trace(tiny_llama, seq=seq, mbs=mbs, peft="lora").summary
    fused = trace(tiny_llama, seq=seq, mbs=mbs, peft="lora", loss=loss).summary
    tokens = seq * mbs
    assert chunk_tokens(tokens, vocab, hidden) == tokens // 8
    assert whole.max_requested_by_category["logits"] >= 4 * tokens * vocab  # fp32 logits, whole
    # one chunk of logits at a time, plus the input-gradient buffer (fp32 hidden states under bf16-mixed)
    assert fused.max_requested_by_category["logits"] <= 4 * tokens * hidden + 64
    assert fused.max_requested_by_category["temporary"] < 4 * tokens * vocab
    assert fused.max_requested_by_category["gradient"] == whole.max_requested_by_category["gradient"]
    assert fused.peak_allocated_bytes < whole.peak_allocated_bytes


def test_the_chunked_loss_runs_torchtunes_algorithm(tiny_llama: str) -> None:
    """``--loss chunked`` is torchtune's CEWithChunkedOutputLoss: the head per sequence chunk, each chunk upcast to
    fp32 alone, the fp32 log-softmax of every chunk saved for the backward (not a fused linear cross-entropy,
    which never holds the whole logits)."""
    from memplan.trace.standins.chunked_loss import CHUNKS

    seq, mbs, vocab = 256, 2, 1024
    tokens = seq * mbs
    whole = trace(tiny_llama, seq=seq, mbs=mbs, peft="lora").summary
    chunked = trace(tiny_llama, seq=seq, mbs=mbs, peft="lora", loss="chunked").summary
    logits = chunked.max_requested_by_category["logits"]
    # saved when the forward ends: the fp32 log-softmax of every chunk (the chunks' logits are dropped with the
    # model's output, each chunk's upcast as its cross-entropy returns)
    assert 4 * tokens * vocab <= logits <= 4 * tokens * vocab + 4 * tokens * vocab // CHUNKS
    assert chunked.peak_allocated_bytes < whole.peak_allocated_bytes


def test_the_cli_says_the_compiled_chunked_loss_runs_as_its_graphs(tiny_llama: str) -> None:
    result = runner.invoke(app, ["trace", tiny_llama, "--seq", "16", "--loss", "chunked", "--compile", "--json"],
                           env=WIDE)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert "loss" in data["compiled_layers"]
    notes = [n for n in data["unmodelled_settings"] if n.startswith("--compile compiled model")]
    assert len(notes) == 1 and "the embedding, final norm and head, which" in notes[0], notes


def test_cli_json_has_the_counts_and_text_names_them(tiny_llama: str) -> None:
    result = runner.invoke(app, ["trace", tiny_llama, "--seq", "16", "--peft", "lora", "--json"], env=WIDE)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["trainable_params"] > 0 and data["frozen_params"] > data["trainable_params"]
    text = runner.invoke(app, ["trace", tiny_llama, "--seq", "16", "--peft", "lora"], env=WIDE)
    assert "trainable parameters" in text.output


@pytest.mark.parametrize(("args", "words"), [
    (["--offload-activations", "--device", "cpu"], "--offload-activations: moves saved tensors from the GPU"),
    (["--offload-activations", "--gpus", "2", "--fsdp", "2"], "--offload-activations: is traced on one rank"),
    (["--loss", "fused"], "--loss: memplan trace runs the model's own loss"),
    (["--loss", "fused-linear", "--gpus", "2", "--fsdp", "2"], "--loss: the fused linear cross-entropy is traced"),
    (["--peft", "lora", "--quantize-base", "nf4", "--gpus", "2", "--fsdp", "2"], "--gpus: memplan trace runs fine-tuning"),
    (["--trainable", "layers.0", "--gpus", "2", "--fsdp", "2"], "--gpus: memplan trace runs fine-tuning"),
    (["--peft", "lora", "--modules-to-save", "lm_head", "--gpus", "2", "--fsdp", "2"],
     "--gpus: memplan trace runs fine-tuning"),
    (["--peft", "lora", "--lora-targets", "nothing_here"], "--lora-targets: peft cannot wrap this model"),
    (["--trainable", "no_such_module"], "--trainable: names no module of the model"),
    (["--peft", "lora", "--quantize-base", "nf4", "--trainable", "q_proj"],
     "--trainable: 'q_proj' holds only quantized weights"),
])
def test_untraced_fine_tuning_tools_are_refused_in_one_line(tiny_llama: str, args: list[str], words: str) -> None:
    result = runner.invoke(app, ["trace", tiny_llama, "--seq", "16", *args], env=WIDE)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if not line.startswith("memplan trace:")]
    assert len(lines) == 1 and words in lines[0], result.output
    assert "Traceback" not in result.output


# ------------------------------------------------------------------------------ QLoRA stand-ins
@pytest.mark.parametrize("double_quant", [False, True], ids=["single", "double-quant"])
@pytest.mark.parametrize("shape", [(96, 200), (128, 128), (384, 128), (1000, 72)])
def test_the_4bit_stand_in_holds_exactly_what_bitsandbytes_stores(shape: tuple[int, int],
                                                                   double_quant: bool) -> None:
    functional = pytest.importorskip("bitsandbytes.functional")
    from memplan.trace.standins.quantized import Linear4bitStandIn

    out_features, in_features = shape
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    packed, state = functional.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
    tensors = [packed, state.absmax, state.code]
    if double_quant:
        tensors += [state.state2.absmax, state.state2.code, state.offset]
    stand_in = Linear4bitStandIn(torch.nn.Linear(in_features, out_features, bias=False), double_quant=double_quant,
                                 compute_dtype=torch.bfloat16)
    assert stand_in.storage_bytes() == sum(t.nbytes for t in tensors)
    assert stand_in.weight.shape == packed.shape and stand_in.weight.dtype == packed.dtype
    assert stand_in.absmax.dtype == state.absmax.dtype


@pytest.mark.parametrize("quant", ["nf4", "fp4"])
def test_qlora_trace_runs_with_peft_lora_around_the_stand_ins(tiny_llama: str, quant: str) -> None:
    from memplan.trace.standins.quantized import BLOCKSIZE

    plain = trace(tiny_llama, seq=SEQ, mbs=1, peft="lora").summary
    qlora = trace(tiny_llama, seq=SEQ, mbs=1, peft="lora", quantize_base=quant, double_quant=False).summary
    trainable, total = _peft_reference(tiny_llama, r=8, target_modules=["q_proj", "v_proj"])
    assert (qlora.trainable_params, qlora.frozen_params) == (trainable, total - trainable)
    assert qlora.max_requested_by_category["gradient"] == plain.max_requested_by_category["gradient"]
    # decoder linears: half a byte per weight, an fp32 absmax per 64 weights and a 16-entry fp32 code
    # per layer (the quantization state is part of the weight: parameter memory, as the estimator has it)
    shapes = [(128, 128)] * 2 + [(64, 128)] * 2 + [(384, 128)] * 3  # per decoder layer, 2 layers
    state = 2 * sum(4 * (o * i // BLOCKSIZE) + 4 * 16 for o, i in shapes)
    linear = 2 * sum(o * i for o, i in shapes)
    unquantized = 2 * (total - trainable - linear)  # embeddings, norms, head stay bf16
    assert qlora.max_requested_by_category["parameter"] == (linear // 2 + state + unquantized
                                                            + _adapter_bytes(trainable))
    assert qlora.max_requested_by_category["buffer"] == plain.max_requested_by_category["buffer"]
    assert qlora.peak_allocated_bytes < plain.peak_allocated_bytes


@pytest.mark.parametrize("shape", [(96, 200), (128, 384), (1000, 72)])
def test_the_int8_stand_in_holds_exactly_what_linear8bitlt_stores(shape: tuple[int, int]) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    from memplan.trace.standins.quantized import Linear8bitStandIn

    out_features, in_features = shape
    real = bnb.nn.Linear8bitLt(in_features, out_features, bias=False, has_fp16_weights=False).to("cpu")
    stand_in = Linear8bitStandIn(torch.nn.Linear(in_features, out_features, bias=False))
    assert stand_in.storage_bytes() == real.weight.nbytes + real.weight.SCB.nbytes
    assert stand_in.weight.dtype == real.weight.dtype and stand_in.weight.shape == real.weight.shape


def test_int8_base_trace_runs(tiny_llama: str) -> None:
    plain = trace(tiny_llama, seq=SEQ, mbs=1, peft="lora").summary
    int8 = trace(tiny_llama, seq=SEQ, mbs=1, peft="lora", quantize_base="int8").summary
    assert (int8.trainable_params, int8.frozen_params) == (plain.trainable_params, plain.frozen_params)
    linear = 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384)
    # one byte per quantized weight instead of two (bf16), plus an fp32 scale per output row
    rows = 2 * (2 * 128 + 2 * 64 + 2 * 384 + 128)
    assert int8.max_requested_by_category["parameter"] == (plain.max_requested_by_category["parameter"]
                                                           - linear + 4 * rows)
    assert int8.max_requested_by_category["gradient"] == plain.max_requested_by_category["gradient"]


def test_the_stand_ins_dequantize_as_peft_does_for_dora() -> None:
    # DoRA's weight norm reads peft's dequantize_module_weight (utils/integrations.py), which calls a module's
    # dequantize() where it has W_q: the stand-ins answer what bitsandbytes' own dequantization returns (helper dora15)
    functional = pytest.importorskip("bitsandbytes.functional")
    from peft.utils.integrations import dequantize_module_weight

    from memplan.trace.standins.quantized import Linear4bitStandIn, Linear8bitStandIn

    weight = torch.randn(128, 96, dtype=torch.bfloat16)
    packed, state = functional.quantize_4bit(weight, blocksize=64, quant_type="nf4")
    real = functional.dequantize_4bit(packed, state)
    four = Linear4bitStandIn(torch.nn.Linear(96, 128, bias=False, dtype=torch.bfloat16), double_quant=False,
                             compute_dtype=torch.bfloat16)
    got = dequantize_module_weight(four)
    assert (got.shape, got.dtype) == (real.shape, real.dtype)
    rows = torch.randint(-127, 127, (128, 96), dtype=torch.int8)
    real8 = functional.int8_vectorwise_dequant(rows, torch.rand(128))
    got8 = dequantize_module_weight(Linear8bitStandIn(torch.nn.Linear(96, 128, bias=False)))
    assert (got8.shape, got8.dtype) == (real8.shape, real8.dtype)


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_dora_on_a_quantized_base_is_traced(tiny_llama: str, quant: str) -> None:
    pytest.importorskip("bitsandbytes")  # peft defines its bitsandbytes LoRA layers only where it imports
    result = runner.invoke(app, ["trace", tiny_llama, "--seq", "16", "--peft", "dora", "--quantize-base", quant],
                           env=WIDE)
    assert result.exit_code == 0, result.output


# ------------------------------------------------------------------- bitsandbytes optimizer stand-ins
_BNB_CLASSES = {"adam8bit": "Adam8bit", "adamw8bit": "AdamW8bit", "paged-adamw8bit": "PagedAdamW8bit",
                "paged-adamw": "PagedAdamW", "lion": "Lion", "lion8bit": "Lion8bit", "paged-lion8bit": "PagedLion8bit"}


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    storages = {id(v.untyped_storage()): v.untyped_storage().nbytes() for state in optimizer.state.values()
                for v in state.values() if isinstance(v, torch.Tensor)}
    return sum(storages.values())


@pytest.mark.parametrize("name", sorted(_BNB_CLASSES))
def test_bitsandbytes_optimizer_stand_ins_allocate_what_bitsandbytes_allocates(name: str) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    from memplan.job import Optimizer
    from memplan.optimizers import optimizer_kind
    from memplan.optimizers.kind import TraceRequest

    def stand_in_of(params: object) -> torch.optim.Optimizer:
        trained = list(params)  # type: ignore[call-overload]
        build = optimizer_kind(name).build
        assert build is not None
        return build(TraceRequest(params=trained, groups=[{"params": trained}], model=None, implementation="fused",
                                  device="cpu", learning_rate=1e-3, settings=Optimizer(name=name)))  # type: ignore[arg-type]

    def stepped(make: object) -> torch.optim.Optimizer:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 10))  # 8-bit and 32-bit states
        optimizer = make(model.parameters())  # type: ignore[operator]
        model(torch.randn(4, 300)).sum().backward()
        optimizer.step()
        return optimizer

    real = stepped(lambda params: getattr(bnb.optim, _BNB_CLASSES[name])(params, lr=1e-3))
    stand_in = stepped(stand_in_of)
    assert _state_bytes(stand_in) == _state_bytes(real)


def test_paged_states_of_large_parameters_are_outside_the_device_total(tiny_llama: str) -> None:
    eight_bit = trace(tiny_llama, seq=SEQ, mbs=1, precision="fp32", optimizer="adamw8bit").summary
    paged = trace(tiny_llama, seq=SEQ, mbs=1, precision="fp32", optimizer="paged-adamw8bit").summary
    large = 2 * 2 * 1024 * 128  # uint8 moments of the embedding and the head (>= 1e5 elements each)
    assert eight_bit.max_requested_by_category["optimizer_state"] - paged.max_requested_by_category[
        "optimizer_state"] == large
    adamw = trace(tiny_llama, seq=SEQ, mbs=1, precision="fp32").summary
    assert eight_bit.max_requested_by_category["optimizer_state"] < adamw.max_requested_by_category[
        "optimizer_state"] / 3


# ------------------------------------------------------------------ against a real peft step on CPU
@pytest.mark.parametrize("flags", [{"peft": "lora"}, {"peft": "dora", "lora_targets": "q_proj,v_proj,o_proj"},
                                   {"peft": "lora", "recompute": "full"}, {"peft": "lora", "adapter_dtype": "bf16"}],
                         ids=["lora", "dora", "lora-recompute", "lora-bf16-adapters"])
def test_cpu_trace_peak_matches_a_real_peft_step(tiny_llama: str, flags: dict[str, object]) -> None:
    """The same LoRA step on real CPU tensors — transformers model loaded in bf16, wrapped by peft
    directly (not through memplan's fine-tuning code) — measured by the profiler's memory timeline."""
    import transformers

    from profiler_reference import profiler_peak_bytes
    from memplan.trace.run import apply_recompute, hf_step_job, run_iterations
    from memplan.trace.setup import trace_setup

    options = trace_setup(seq=32, mbs=2, device="cpu", iterations=2, **flags)  # bf16-mixed
    _, config = hf_config_dict(tiny_llama)
    values = dict(config)
    hf = transformers.AutoConfig.for_model(values.pop("model_type"), use_cache=False, **values)
    hf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
    finetune = options.job.finetune
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=finetune.lora_rank, lora_alpha=finetune.lora_alpha, target_modules=list(target_names(hf.model_type, finetune) or ()),
        use_dora=finetune.peft == "dora"),
        # bf16 adapters: peft leaves them in the bf16 base's dtype without its fp32 upcast
        autocast_adapter_dtype=finetune.adapter_dtype != "bf16").train()
    apply_recompute(model, options.policy)
    job = hf_step_job(model, options)
    measured = profiler_peak_bytes(lambda: run_iterations(job, options.iterations))
    traced = trace(tiny_llama, seq=32, mbs=2, device="cpu", **flags).summary
    assert abs(traced.peak_allocated_bytes - measured) / measured < 0.02, (traced.peak_allocated_bytes, measured)


def _bnb_quantized(model: torch.nn.Module, quant: str) -> None:
    """Every decoder linear replaced by the real bitsandbytes layer, quantized on the CPU."""
    bnb = pytest.importorskip("bitsandbytes")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear or name == "lm_head":
                continue
            if quant == "int8":
                layer = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=False,
                                            has_fp16_weights=False, threshold=0.0)
                layer.weight = bnb.nn.Int8Params(child.weight.data.half(), requires_grad=False,
                                                 has_fp16_weights=False)
            else:
                layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False, quant_type=quant,
                                          compute_dtype=torch.bfloat16, compress_statistics=False)
                layer.weight = bnb.nn.Params4bit(child.weight.data.float(), requires_grad=False, quant_type=quant,
                                                 compress_statistics=False)
            setattr(module, name, layer.to("cpu"))


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_cpu_trace_of_a_quantized_base_matches_real_bitsandbytes_layers(tiny_llama: str, quant: str) -> None:
    """QLoRA with bitsandbytes' own layers quantized and run on the CPU (its CPU kernels), peft
    LoRA around them, against the trace's stand-ins; peak within 2%, counts equal peft's."""
    import transformers

    from profiler_reference import profiler_peak_bytes
    from memplan.trace.run import hf_step_job, run_iterations
    from memplan.trace.setup import trace_setup

    flags = {"peft": "lora", "quantize_base": quant, "double_quant": False}
    options = trace_setup(seq=32, mbs=2, device="cpu", iterations=2, **flags)
    _, config = hf_config_dict(tiny_llama)
    values = dict(config)
    hf = transformers.AutoConfig.for_model(values.pop("model_type"), use_cache=False, **values)
    hf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
    _bnb_quantized(model, quant)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"])).train()
    job = hf_step_job(model, options)
    measured = profiler_peak_bytes(lambda: run_iterations(job, options.iterations))
    traced = trace(tiny_llama, seq=32, mbs=2, device="cpu", **flags).summary
    trainable, total = model.get_nb_trainable_parameters()
    assert (traced.trainable_params, traced.frozen_params) == (trainable, total - trainable)
    assert abs(traced.peak_allocated_bytes - measured) / measured < 0.02, (traced.peak_allocated_bytes, measured)


def test_cuda_autocast_emulation_answers_for_cuda_while_entered() -> None:
    """peft's bitsandbytes LoRA layers ask torch.is_autocast_enabled() (CUDA); a --device cuda trace
    runs CPU autocast and must answer as a GPU run would, and restore the functions afterwards."""
    from memplan.trace.cuda.autocast import CudaAutocastFp32

    before = (torch.is_autocast_enabled, torch.get_autocast_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16), CudaAutocastFp32():
        assert torch.is_autocast_enabled() and torch.is_autocast_enabled("cuda")
        assert torch.get_autocast_dtype("cuda") == torch.bfloat16
    with CudaAutocastFp32():
        assert not torch.is_autocast_enabled()
    assert (torch.is_autocast_enabled, torch.get_autocast_dtype) == before
    assert not torch.is_autocast_enabled()


def test_quantized_base_without_bitsandbytes_is_refused_naming_the_extra(tiny_llama: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from peft.tuners.lora import bnb as peft_bnb

    monkeypatch.delattr(peft_bnb, "Linear4bit", raising=False)
    result = runner.invoke(app, ["trace", tiny_llama, "--seq", "16", "--peft", "lora", "--quantize-base", "nf4"],
                           env=WIDE)
    assert result.exit_code == 1, result.output
    assert "needs bitsandbytes" in result.output and "memplan[qlora]" in result.output
    assert "Traceback" not in result.output
