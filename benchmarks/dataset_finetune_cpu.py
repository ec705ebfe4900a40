"""A real fine-tune on CPU over a variable-length dataset, metered per step, against ``--dataset``'s steps.

**The witness** (parameters fixed before any result): a Llama-style model (hidden 256, 4 layers,
4 heads, FFN 688, vocab 4,000, fp32, eager attention) with random weights, trained by the Hugging
Face ``Trainer`` (``per_device_train_batch_size`` 4, seed 42, one epoch, AdamW, no accumulation) on a
JSONL file of 96 texts with log-normal lengths (a BPE tokenizer trained here, 4,000 tokens), the
examples tokenized by the tokenizer and padded by ``DataCollatorForLanguageModeling``. Bytes are read
from PyTorch's CPU allocator through ``torch.profiler`` (``profile_memory=True``, as
``finetune_cpu.py``): every allocation and free, summed in time order; a step is the range between the
``on_step_begin`` and ``on_step_end`` callbacks (forward, backward, optimizer step, zero_grad). The
meter shares no code with memplan.

**The comparison**: ``memplan.dataset.analyze`` of the same job (the model's config.json, ``--framework
hf --precision fp32``, ``--mbs 4``, the same file, tokenizer and seed): every step's shape against the
batch the Trainer fed (must be equal), the worst step's index against the measured worst, and every
step's predicted peak against the measured one. memplan's estimator prices a CUDA run (its allocator's
rounding, kernels' workspaces), so the per-step comparison on CPU bytes is reported as measured, with
the ratio's spread. The CPU witness: ``memplan.dataset.traced.traced_step_peaks`` (what ``memplan trace
--dataset --device cpu`` runs) traces each distinct step shape on the CPU's kernels, eager attention;
target: every step within 3% of the meter, and the worst step found.

Usage: PYTHONPATH=src python benchmarks/dataset_finetune_cpu.py [--json benchmarks/results/dataset_finetune_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

EXAMPLES, MBS, SEED, THREADS = 96, 4, 42, 2
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4000, "hidden_size": 256,
          "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
          "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
          "torch_dtype": "float32"}


def _data(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(SEED)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 7))) for _ in range(1500)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=4000, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((" ".join(rng.choices(words, k=100)) for _ in range(2000)), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    path = folder / "train.jsonl"
    with path.open("w") as out:
        for _ in range(EXAMPLES):
            out.write(json.dumps({"text": " ".join(rng.choices(words, k=min(1200, int(rng.lognormvariate(5, 0.9)))))})
                      + "\n")
    return path


def measure(folder: Path, data: Path) -> dict[str, Any]:
    """Train under the profiler; per-step shapes and peaks of live CPU bytes."""
    import torch
    from datasets import load_dataset
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import (AutoTokenizer, DataCollatorForLanguageModeling, LlamaConfig, LlamaForCausalLM, Trainer,
                              TrainerCallback, TrainingArguments)

    torch.set_num_threads(THREADS)
    tok = AutoTokenizer.from_pretrained(folder)
    ds = load_dataset("json", data_files=str(data), split="train").map(
        lambda b: tok(b["text"]), batched=True, remove_columns=["text"])
    shapes: list[tuple[int, int]] = []
    marks: list[Any] = []

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            marks.append(record_function(f"dsft:step:{state.global_step}"))
            marks[-1].__enter__()

        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            marks[-1].__exit__(None, None, None)

    class Shapes(Trainer):
        def training_step(self, model, inputs, *a, **kw):  # type: ignore[no-untyped-def]
            shapes.append(tuple(inputs["input_ids"].shape))
            return super().training_step(model, inputs, *a, **kw)

    profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    profiler.__enter__()  # the model's weights are allocated under the meter too
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures",)},
                                         attn_implementation="eager"))
    args = TrainingArguments(output_dir=str(folder / "out"), per_device_train_batch_size=MBS, seed=SEED,
                             num_train_epochs=1, report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                             dataloader_num_workers=0)
    trainer = Shapes(model=model, args=args, train_dataset=ds, callbacks=[Steps()],
                     data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    try:
        trainer.train()
    finally:
        profiler.__exit__(None, None, None)
    return {"shapes": shapes, "per_step_peak_bytes": _step_peaks(profiler)}


def _step_peaks(prof: Any) -> list[int]:
    from finetune_cpu import _flatten  # the profiler event tree walk of benchmarks/finetune_cpu.py

    nodes = _flatten(prof.profiler.kineto_results.experimental_event_tree())
    allocs = sorted((n.start_time_ns, n.extra_fields.alloc_size) for n in nodes
                    if type(n.extra_fields).__name__ == "_ExtraFields_Allocation"
                    and str(n.extra_fields.device.type) == "cpu")
    ranges = sorted((n.start_time_ns, n.end_time_ns) for n in nodes if n.name.startswith("dsft:step:"))
    live, timeline = 0, []
    for t, size in allocs:
        live += size
        timeline.append((t, live))
    peaks = []
    for start, end in ranges:
        before = [v for t, v in timeline if t < start][-1:]
        peaks.append(max([v for t, v in timeline if start <= t <= end] + before, default=0))
    return peaks


def predict(folder: Path, data: Path) -> tuple[Any, Any]:
    """The estimator's per-step peaks (a CUDA run's) and the tracer's with ``--device cpu`` (this run's)."""
    from memplan.dataset import Batching, DatasetRequest, Fields, analyze
    from memplan.dataset.traced import traced_step_peaks
    from memplan.inputs import JobRequest, load_job

    loaded = load_job(JobRequest(model=str(folder), flags={"framework": "hf", "precision": "fp32", "mbs": MBS,
                                                           "gpus": 1, "attention": "eager"}))
    peaks = analyze(loaded, DatasetRequest(path=str(data), fields=Fields(text="text"), tokenizer=str(folder),
                                           batching=Batching(rule="hf", micro_batch_size=MBS, seed=SEED)))
    return peaks, traced_step_peaks(str(folder), loaded.job, peaks.shapes, device="cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", dest="json_out")
    ns = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="memplan-dsft-"))
    os.environ["MEMPLAN_CACHE"] = str(folder / "cache")
    data = _data(folder)
    started = time.perf_counter()
    measured = measure(folder, data)
    peaks, traced = predict(folder, data)
    ours = list(zip(peaks.shapes.batch_size.tolist(), peaks.shapes.seq_length.tolist()))
    got = [int(x) for x in peaks.peak_allocated_bytes.tolist()]
    meas = measured["per_step_peak_bytes"]
    ratios = [g / m for g, m in zip(got, meas)] if len(meas) == len(got) else []
    by_trace = [int(x) for x in traced.peak_allocated_bytes.tolist()]
    traced_ratios = [g / m for g, m in zip(by_trace, meas)] if len(meas) == len(by_trace) else []
    worst_measured = max(range(len(meas)), key=meas.__getitem__) if meas else None
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": list(os.getloadavg()),
        "steps": len(ours), "shapes_equal": [list(s) for s in measured["shapes"]] == [list(s) for s in ours],
        "worst_step_predicted": peaks.worst.index, "worst_step_measured": worst_measured,
        "predicted_per_step_bytes": got, "measured_per_step_bytes": meas,
        "ratio_predicted_over_measured": {"min": min(ratios, default=None), "max": max(ratios, default=None)},
        "steps_within_3pct": sum(abs(r - 1) <= 0.03 for r in ratios),
        "traced_cpu": {"worst_step": traced.worst_index, "distinct_shapes": traced.distinct_shapes,
                       "ratio_traced_over_measured": [round(r, 4) for r in traced_ratios],
                       "steps_within_3pct": sum(abs(r - 1) <= 0.03 for r in traced_ratios),
                       "max_abs_error_pct": round(100 * max((abs(r - 1) for r in traced_ratios), default=0), 2)},
        "traced_per_step_bytes": by_trace, "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("per_step_bytes")}, indent=2), flush=True)
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
