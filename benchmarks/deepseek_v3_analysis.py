"""Reproduce the DeepSeek-V3 memory analysis (Zhang & Su, arXiv 2502.07846) with memplan.

Prints, and with ``--write`` saves as ``docs/deepseek-v3.md``, the paper's numbers beside
memplan's: parameters per layer type, the PP=16 stage sizes, the per-device parameters of a
4-MoE-layer stage at TP=2, EP=8, and the ZeRO 0/1/2/3 model-state table at DP=32 (1,024 GPUs).
Every memplan number comes from the public API (``load_model``, ``estimate``) or the CLI command
quoted in the page; ``tests/estimate/test_deepseek_v3.py`` asserts the same numbers.

Usage: python benchmarks/deepseek_v3_analysis.py [--write]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from dataclasses import dataclass
from pathlib import Path

from memplan import Batch, Job, MoEOptions, Parallelism, Precision, Recompute, Sharding, estimate, load_model
from memplan.model.params import attention_params, mlp_params, moe_params, total_params

GiB = 2**30
DOC = Path(__file__).resolve().parents[1] / "docs" / "deepseek-v3.md"

#: The paper's numbers (../shared/reference/published.md section 1).
PAPER = {
    "mla_per_layer": 187_105_280,
    "routed_expert": 44_040_192,
    "moe_layer_experts_router": 11_320_164_352,
    "total_params_b": 671.03,
    "total_gib_bf16": 1250,
    "stage_sizes_b": (14.18, 46.03, 12.43),
    "device_mla": 429_654_016,
    "device_norms": 65_536,
    "device_moe": 5_820_645_376,
    "device_total": 6_250_364_928,
    "device_gib": 11.64,
    # (params, grads, optimizer, total) GiB: the exact table, then what the paper prints.
    "zero": {0: (11.64, 23.28, 46.57, 81.50), 1: (11.64, 23.28, 5.52, 40.44),
             2: (11.64, 2.76, 5.52, 19.92), 3: (1.38, 2.76, 5.52, 9.65)},
    "zero_printed_totals": {0: 81.54, 1: 40.46, 2: 19.92, 3: 9.66},
    "recompute_stage_mib": 224,
}

#: W^QR (1536 x 128 heads x 64 rope dims): the paper keeps it whole on every TP rank.
W_QR = 1536 * 128 * 64


@dataclass(frozen=True)
class Reproduction:
    mla_per_layer: int
    routed_expert: int
    moe_layer_experts_router: int
    total_params: int
    stage_sizes: tuple[int, int, int]
    device_params_megatron: int
    device_params_paper_placement: int
    device_moe_paper_placement: int
    device_norms: int
    zero: dict[int, tuple[float, float, float, float]]
    zero_megatron: dict[int, tuple[float, float, float, float]]
    recompute_stage_bytes: int


def analysis_job(zero: int, *, shared_expert_parallel: str = "tp", recompute: str = "none") -> Job:
    """The paper's 1,024-GPU job: TP=2, PP=16 (4 + 14x4 + 1 layers), EP=8, ETP=1, DP=32, SP."""
    return Job(
        parallel=Parallelism(world_size=1024, tp=2, pp=16, ep=8, etp=1, sequence_parallel=True),
        sharding=Sharding(zero=zero),
        batch=Batch(micro_batch_size=1, seq_length=4096),
        precision=Precision(name="bf16-mixed", grad_dtype="fp32", optimizer_state_dtype="bf16", master_dtype="fp32"),
        recompute=Recompute(mode=recompute),
        moe=MoEOptions(shared_expert_parallel=shared_expert_parallel),  # type: ignore[arg-type]
    )


def _zero_row(zero: int, placement: str) -> tuple[float, float, float, float]:
    stage = estimate(load_model("deepseek-v3"), analysis_job(zero, shared_expert_parallel=placement)).stages[1]
    parts = (stage.parameters_bytes / GiB, stage.gradients_bytes / GiB, stage.optimizer_bytes / GiB)
    return (*parts, sum(parts))


def reproduce() -> Reproduction:
    model = load_model("deepseek-v3")
    hidden = model.hidden_size
    moe_layer = model.layers[3]
    attn = moe_layer.attention
    assert moe_layer.moe is not None and attn.q_lora_rank and attn.kv_lora_rank
    mla = attention_params(attn, hidden).total - attn.q_lora_rank - attn.kv_lora_rank
    single = Job(parallel=Parallelism(world_size=16, pp=16))
    stages = estimate(model, single).stages
    sizes = (stages[0].parameters_numel, stages[1].parameters_numel, stages[15].parameters_numel)
    megatron = estimate(model, analysis_job(0)).stages[1]
    paper_placement = estimate(model, analysis_job(0, shared_expert_parallel="expert")).stages[1]
    # Norms of a 4-layer stage: every non-GEMM weight of the layer except the router.
    norms = 4 * (model.layer_non_gemm_params[3] - hidden * moe_layer.moe.num_experts)
    expert = mlp_params(moe_layer.moe.expert, hidden).total
    device_moe = 4 * (32 * expert + expert + hidden * moe_layer.moe.num_experts)
    recompute = estimate(model, analysis_job(1, recompute="full")).stages[1]
    per_microbatch = recompute.transformer_layer_activations_bytes // recompute.inflight_microbatches
    return Reproduction(
        mla_per_layer=mla,
        routed_expert=expert,
        moe_layer_experts_router=moe_params(moe_layer.moe, hidden).total,
        total_params=total_params(model),
        stage_sizes=sizes,
        device_params_megatron=megatron.parameters_numel,
        device_params_paper_placement=paper_placement.parameters_numel,
        device_moe_paper_placement=device_moe,
        device_norms=norms,
        zero={z: _zero_row(z, "expert") for z in range(4)},
        zero_megatron={z: _zero_row(z, "tp") for z in range(4)},
        recompute_stage_bytes=per_microbatch,
    )


def render(r: Reproduction) -> str:
    p = PAPER
    lines = [
        "# DeepSeek-V3 memory analysis, reproduced",
        "",
        "Generated by `python benchmarks/deepseek_v3_analysis.py --write` on "
        f"{datetime.date.today().isoformat()}; the numbers are asserted by "
        "`tests/estimate/test_deepseek_v3.py`. Paper: Zhang & Su, *Memory Analysis on the Training "
        "Course of DeepSeek Models* (arXiv 2502.07846); its numbers as quoted in "
        "`../shared/reference/published.md` section 1. Model: the shipped `deepseek-v3` preset "
        "(the released config.json).",
        "",
        "## Parameters per layer type",
        "",
        "| quantity | paper | memplan | note |",
        "| --- | ---: | ---: | --- |",
        f"| MLA weights per layer (without its two latent norms) | {p['mla_per_layer']:,} | {r.mla_per_layer:,} | exact |",
        f"| one routed expert (3·h·h_E) | {p['routed_expert']:,} | {r.routed_expert:,} | exact |",
        f"| one MoE layer's experts + router | {p['moe_layer_experts_router']:,} | {r.moe_layer_experts_router:,} | exact (256 routed + 1 shared; the router's score-correction bias is a buffer) |",
        f"| whole model | ≈ {p['total_params_b']} B | {r.total_params:,} ({r.total_params / 1e9:.2f} B) | exact to the paper's rounding; without the MTP module |",
        f"| whole model in BF16 | ≈ {p['total_gib_bf16']:,} GiB | {2 * r.total_params / GiB:,.1f} GiB | |",
        "",
        "## PP=16 stage sizes (TP=1, EP=1)",
        "",
        "memplan splits 61 layers over 16 stages as 4 + 14 × 4 + 1 when no split is given "
        "(ceil(61/16) per stage, the remainder last), the paper's layout.",
        "",
        "| stage | paper | memplan |",
        "| --- | ---: | ---: |",
    ]
    for name, paper, ours in zip(("0: embedding + layers 0-3", "1-14: 4 MoE layers", "15: layer 60 + head"),
                                 p["stage_sizes_b"], r.stage_sizes):
        lines.append(f"| {name} | {paper} B | {ours:,} ({ours / 1e9:.2f} B) |")
    diff_qr = 4 * W_QR // 2
    lines += [
        "",
        "## Per-device parameters of a 4-MoE-layer stage (TP=2, EP=8, ETP=1)",
        "",
        "Command: `memplan estimate deepseek-v3 --gpus 1024 --tp 2 --pp 16 --ep 8 --zero 1 "
        "--grad-dtype fp32 --optimizer-state-dtype bf16 --master-dtype fp32 --json` "
        "(stage 1 is a 4-MoE-layer stage); add `--shared-expert-parallel expert` for the paper's "
        "placement of the shared expert.",
        "",
        "| part | paper | memplan (paper's placement) | memplan (Megatron's placement) |",
        "| --- | ---: | ---: | ---: |",
        f"| norms (4 layers) | {p['device_norms']:,} | {r.device_norms:,} | {r.device_norms:,} |",
        f"| MoE: 32 routed + 1 shared expert + router, 4 layers | {p['device_moe']:,} | {r.device_moe_paper_placement:,} | shared expert split by TP |",
        f"| total | {p['device_total']:,} | {r.device_params_paper_placement:,} | {r.device_params_megatron:,} |",
        f"| total in BF16 | {p['device_gib']} GiB | {2 * r.device_params_paper_placement / GiB:.2f} GiB | {2 * r.device_params_megatron / GiB:.2f} GiB |",
        "",
        f"* **A slip in the paper: W^QR.** The paper keeps W^QR (the query's RoPE up-projection, "
        f"1536 × 128 heads × 64 = {W_QR:,} weights per layer) whole on both TP ranks, listing it "
        "with the shared down-projections. But W^QR is per head, like W^UQ: splitting heads over TP "
        "splits it too (Megatron's `linear_q_up_proj` produces the no-RoPE and RoPE parts of every "
        "head in one column-parallel GEMM). Only W^KR, one key shared by all heads, is replicated. "
        f"memplan therefore holds {diff_qr:,} fewer weights per device on a 4-layer stage: "
        f"{p['device_mla']:,} − {diff_qr:,} = {p['device_mla'] - diff_qr:,} MLA weights; "
        f"{p['device_total']:,} − {diff_qr:,} = {p['device_total'] - diff_qr:,} in all, "
        "which is what memplan prints.",
        "* **A choice, not a slip: the shared expert.** The paper places the shared expert with the "
        "routed experts (whole on every rank, its states sharded over expert-DP = 8). Megatron-LM's "
        "`SharedExpertMLP` is split by TP and sharded over DP = 32 like the attention. memplan "
        "follows Megatron by default and the paper with `--shared-expert-parallel expert`.",
        "",
        "## Model states per device at DP=32 (ZeRO 0-3)",
        "",
        "Bytes per parameter as in the paper: BF16 weights, FP32 gradients, FP32 master + BF16 Adam "
        "moments; non-expert states shard over DP=32, expert states over EDP=8. GiB = 2^30 bytes.",
        "",
        "| ZeRO | paper: params / grads / optimizer / total | memplan, paper's placement | memplan, Megatron's placement |",
        "| --- | --- | --- | --- |",
    ]
    for z in range(4):
        paper = p["zero"][z]
        ours = r.zero[z]
        meg = r.zero_megatron[z]
        lines.append(
            f"| {z} | {paper[0]:.2f} / {paper[1]:.2f} / {paper[2]:.2f} / {paper[3]:.2f} (printed {p['zero_printed_totals'][z]}) "
            f"| {ours[0]:.2f} / {ours[1]:.2f} / {ours[2]:.2f} / {ours[3]:.2f} "
            f"| {meg[0]:.2f} / {meg[1]:.2f} / {meg[2]:.2f} / {meg[3]:.2f} |"
        )
    lines += [
        "",
        "* The paper prints totals of 81.54 / 40.46 / 19.92 / 9.66 GiB: sums of parts it had already "
        "rounded; the exact sums of its own parts are 81.50 / 40.44 / 19.92 / 9.65.",
        "* memplan's column with the paper's placement is lower by exactly the W^QR slip above: "
        f"{diff_qr:,} weights × (2 + 4 + 8 bytes unsharded at ZeRO 0) = "
        f"{diff_qr * 14 / GiB:.3f} GiB at ZeRO 0.",
        "",
        "## Activations with full recomputation",
        "",
        f"The paper: each layer keeps its input and each MoE layer its routing map, \"about "
        f"{p['recompute_stage_mib']} MiB for a 4-layer stage\" at b=1, s=4096, TP=SP=2. memplan: "
        f"{r.recompute_stage_bytes / 2**20:.1f} MiB per micro-batch for the 4-layer stage: four "
        "layer inputs of s·b·h·2/SP = 28 MiB each (Megatron recomputes the router, so no routing map is "
        "kept). The paper's 224 MiB equals four inputs without the division by SP (56 MiB each); with "
        "SP=2 as stated the inputs take 112 MiB, so the figure looks like a slip by that factor of 2. "
        "On a pipeline stage, 1F1B keeps these for every micro-batch in flight (stage 1 of 16: 15).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(DOC.parents[1])}")
    ns = parser.parse_args(argv)
    text = render(reproduce())
    print(text)
    if ns.write:
        DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
