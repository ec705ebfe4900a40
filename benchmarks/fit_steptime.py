"""memplan's step-time model against public, measured training throughputs.

Each run is laid out as its paper says; ``memplan.fit.steptime.step_time`` predicts the step time;
we compare predicted and measured throughput (tokens/s per GPU) and MFU, and whether the model
ranks the runs (by MFU) as reality does. No constant is fitted to these runs.

Sources (numbers transcribed from the papers; see docs/fit.md):

* Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (SC'21, arXiv 2104.04473): the 1T-parameter GPT (h 25600, 128 layers, 160 heads,
  TP8 PP64, batch 3072, sequence 2048, vocabulary 51,200, full recompute) at 502 petaFLOP/s on
  3,072 A100s (163 teraFLOP/s per GPU, 52% of peak), counted with the paper's formula
  96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) per iteration (recompute included).
* Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (MLSys'23,
  arXiv 2205.05198), abstract: the 530B GPT on 2,240 A100s reaches 54.2% MFU with sequence
  parallelism + selective recompute and 42.1% with full recompute; MFU counted with
  72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) per iteration.
* Llama Team, "The Llama 3 Herd of Models" (arXiv 2407.21783), Table 4: Llama 3 405B on H100,
  16M tokens per batch, BF16 MFU 43% / 41% / 38%.
* DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv 2412.19437), §2/§3: 2,048 H800 GPUs,
  180K H800 GPU hours per trillion tokens (= 1,543 tokens/s per GPU), PP16 (DualPipe), EP64,
  ZeRO-1 DP, FP8 training, 4K sequences, batch ramped to 15,360.
* NVIDIA NeMo AutoModel performance summary (docs.nvidia.com/nemo/automodel, "System: DGX-H100,
  Precision: BF16"): measured tokens/s per GPU with the full layout (GBS, MBS, TP, PP, CP, EP, VP,
  FSDP) for DeepSeek-V3 on 1,024 and 256 H100s, Llama 3 70B on 64 and Qwen3-30B-A3B on 8.

Usage: python benchmarks/fit_steptime.py [--json benchmarks/results/fit_steptime.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from memplan import Batch, Job, Parallelism, Recompute, Sharding, load_model
from memplan.fit.hardware import HARDWARE
from memplan.fit.space import pipeline_split
from memplan.fit.steptime import model_flops_per_token, step_time
from memplan.model.hf import model_from_hf_config
from memplan.model.spec import ModelSpec


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    model: ModelSpec
    gpu: str
    gpus: int
    tp: int
    pp: int
    cp: int
    ep: int
    seq: int
    gbs: int
    recompute: str
    #: measured tokens/s per GPU (derived from the paper's numbers as stated in `how`)
    measured_tokens_per_gpu_s: float
    measured_mfu: float | None
    how: str


def gpt(h: int, layers: int, heads: int, name: str) -> ModelSpec:
    return model_from_hf_config({"model_type": "gpt2", "n_embd": h, "n_layer": layers, "n_head": heads,
                                 "vocab_size": 51200, "n_positions": 2048, "tie_word_embeddings": True}, name=name)


def narayanan_1t() -> Run:
    h, layers, heads, s, v, gpus, batch, tflops = 25600, 128, 160, 2048, 51200, 3072, 3072, 502e3 / 3072
    flops_iter = 96 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    seconds = flops_iter / (gpus * tflops * 1e12)
    return Run("Megatron GPT 1T, 3072 A100", "Narayanan et al. 2021", gpt(h, layers, heads, "GPT 1T"),
               "a100-80gb", gpus, 8, 64, 1, 1, s, batch, "full", batch * s / seconds / gpus, None,
               "502 PFLOP/s on 3,072 GPUs (paper's formula, recompute counted)")


def korthikanti(mfu: float, recompute: str) -> Run:
    h, layers, heads, s, v, gpus, batch = 20480, 105, 128, 2048, 51200, 2240, 2240
    per_token = 72 * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
    tokens = mfu * gpus * 312e12 / per_token
    return Run(f"Megatron GPT 530B, 2240 A100, {recompute}", "Korthikanti et al. 2022, abstract",
               gpt(h, layers, heads, "GPT 530B"), "a100-80gb", gpus, 8, 35, 1, 1, s, batch, recompute,
               tokens / gpus, mfu, f"MFU {100 * mfu:.1f}% (paper's formula)")


def llama3(gpus: int, cp: int, seq: int, mfu: float) -> Run:
    model = load_model("llama-3.1-405b")
    tokens = mfu * 989e12 / model_flops_per_token(model, seq)
    return Run(f"Llama 3 405B, {gpus} H100, seq {seq}", "Llama 3 paper, Table 4", model, "h100-80gb", gpus,
               8, 16, cp, 1, seq, 2**24 // seq, "none", tokens, mfu,
               f"BF16 MFU {100 * mfu:.0f}% (tokens/s derived with memplan's FLOPs per token)")


def deepseek() -> Run:
    tokens = 1e12 / (180_000 * 3600)
    return Run("DeepSeek-V3, 2048 H800 (FP8)", "DeepSeek-V3 report, 180K GPU-h per 1T tokens",
               load_model("deepseek-v3"), "h800", 2048, 1, 16, 1, 64, 4096, 15360, "none", tokens, None,
               "tokens/s per GPU from GPU hours per trillion tokens")


@dataclass(frozen=True)
class NemoRun:
    name: str
    model: str
    gpus: int
    gbs: int
    mbs: int
    seq: int
    pp: int
    cp: int
    ep: int
    vpp: int
    tokens_per_gpu_s: float


NEMO = [
    NemoRun("DeepSeek-V3, 1024 H100, AutoModel BF16", "deepseek-v3", 1024, 8192, 1, 4096, 4, 1, 64, 8, 865),
    NemoRun("DeepSeek-V3, 256 H100, AutoModel BF16", "deepseek-v3", 256, 512, 1, 4096, 4, 1, 64, 8, 1002),
    NemoRun("Llama 3 70B, 64 H100, AutoModel BF16", "llama-3.1-70b", 64, 128, 1, 8192, 1, 2, 1, 1, 866.77),
    NemoRun("Qwen3-30B-A3B, 8 H100, AutoModel BF16", "qwen3-30b-a3b", 8, 512, 4, 4096, 1, 1, 8, 1, 12040),
]


RUNS = [
    narayanan_1t(),
    korthikanti(0.542, "selective"),
    korthikanti(0.421, "full"),
    llama3(8192, 1, 8192, 0.43),
    llama3(16384, 1, 8192, 0.41),
    llama3(16384, 16, 131072, 0.38),
    deepseek(),
]


def predict(run: Run) -> dict:  # type: ignore[type-arg]
    split = pipeline_split(run.model.num_layers, run.pp, 1) or (None, None)
    par = Parallelism(world_size=run.gpus, tp=run.tp, pp=run.pp, cp=run.cp, ep=run.ep,
                      etp=1 if run.ep > 1 else None, sequence_parallel=run.tp > 1,
                      first_stage_layers=split[0], last_stage_layers=split[1])
    job = Job(parallel=par, sharding=Sharding(distributed_optimizer=True),
              batch=Batch(micro_batch_size=1, seq_length=run.seq, global_batch_size=run.gbs),
              recompute=Recompute(mode=run.recompute))
    hw = HARDWARE[run.gpu]
    t = step_time(run.model, job, hw)
    predicted = t.tokens_per_s / run.gpus
    measured_mfu = run.measured_mfu
    if measured_mfu is None:
        measured_mfu = run.measured_tokens_per_gpu_s * model_flops_per_token(run.model, run.seq) / hw.peak_flops
    return {
        "run": run.name, "source": run.source, "measured": run.how, "gpus": run.gpus, "gpu": run.gpu,
        "layout": f"tp{run.tp} pp{run.pp} cp{run.cp} ep{run.ep} dp{par.data_parallel}, mbs 1, gbs {run.gbs}, "
                  f"seq {run.seq}, recompute {run.recompute}",
        "measured_tokens_per_gpu_s": run.measured_tokens_per_gpu_s,
        "predicted_tokens_per_gpu_s": predicted,
        "ratio": predicted / run.measured_tokens_per_gpu_s,
        "measured_mfu": measured_mfu, "predicted_mfu": t.mfu,
        "step_time_s": t.total_s,
        "breakdown_s": {k: v for k, v in t.to_dict().items() if k.endswith("_s")},
    }


def predict_nemo(run: NemoRun) -> dict:  # type: ignore[type-arg]
    """FSDP2 (torchtitan-like) over all data-parallel ranks, EP across nodes, no recompute."""
    model = load_model(run.model)
    counts = -(-model.num_layers // run.pp)
    last = model.num_layers - counts * (run.pp - 1)
    par = Parallelism(world_size=run.gpus, pp=run.pp, vpp=run.vpp, cp=run.cp, ep=run.ep, etp=1 if run.ep > 1 else None,
                      last_stage_layers=last if last != counts else None)
    job = Job(parallel=par, sharding=Sharding(fsdp="full"), framework="torchtitan",
              batch=Batch(micro_batch_size=run.mbs, seq_length=run.seq, global_batch_size=run.gbs))
    hw = HARDWARE["h100-80gb"]
    t = step_time(model, job, hw)
    predicted = t.tokens_per_s / run.gpus
    measured_mfu = run.tokens_per_gpu_s * model_flops_per_token(model, run.seq) / hw.peak_flops
    return {
        "run": run.name, "source": "NeMo AutoModel performance summary (DGX-H100, BF16)",
        "measured": "tokens/s per GPU as published", "gpus": run.gpus, "gpu": "h100-80gb",
        "layout": f"tp1 pp{run.pp} vpp{run.vpp} cp{run.cp} ep{run.ep} fsdp{par.data_parallel}, mbs {run.mbs}, "
                  f"gbs {run.gbs}, seq {run.seq}, recompute none",
        "measured_tokens_per_gpu_s": run.tokens_per_gpu_s, "predicted_tokens_per_gpu_s": predicted,
        "ratio": predicted / run.tokens_per_gpu_s, "measured_mfu": measured_mfu, "predicted_mfu": t.mfu,
        "step_time_s": t.total_s, "breakdown_s": {k: v for k, v in t.to_dict().items() if k.endswith("_s")},
    }


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", dest="json_out", help="write the rows here")
    ns = parser.parse_args(argv)
    rows = [predict(r) for r in RUNS] + [predict_nemo(r) for r in NEMO]
    print("| run | layout | measured tok/s/GPU | predicted | pred/meas | measured MFU | predicted MFU |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['run']} | {r['layout']} | {r['measured_tokens_per_gpu_s']:,.0f} | "
              f"{r['predicted_tokens_per_gpu_s']:,.0f} | {r['ratio']:.2f} | {100 * r['measured_mfu']:.1f}% | "
              f"{100 * r['predicted_mfu']:.1f}% |")
    ratios = [r["ratio"] for r in rows]
    rho = spearman([r["measured_mfu"] for r in rows], [r["predicted_mfu"] for r in rows])
    geo = 1.0
    for x in ratios:
        geo *= x
    geo **= 1 / len(ratios)
    sel, full = rows[1], rows[2]
    print()
    print(f"runs: {len(rows)}; predicted/measured throughput: min {min(ratios):.2f}, max {max(ratios):.2f}, "
          f"geometric mean {geo:.2f}")
    print(f"Spearman rank correlation of MFU (predicted vs measured): {rho:.2f}")
    print(f"Korthikanti 530B: selective recompute predicted faster than full: "
          f"{sel['predicted_tokens_per_gpu_s'] > full['predicted_tokens_per_gpu_s']} "
          f"(predicted speed-up {sel['predicted_tokens_per_gpu_s'] / full['predicted_tokens_per_gpu_s']:.2f}x, "
          f"measured {sel['measured_tokens_per_gpu_s'] / full['measured_tokens_per_gpu_s']:.2f}x)")
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps({"rows": rows, "spearman_mfu": rho, "geomean_ratio": geo}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
