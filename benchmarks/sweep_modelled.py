"""Every Megatron-LM flag memplan says it models changes the answer, or is refused (never silent).

``megatron_flag_table.MODELLED`` lists the flags the Megatron reader maps. ``tests/frameworks/
test_megatron_flags.py`` checks that the reader's source names each of them; this sweep checks the behaviour:
for each flag, a launch where the flag should matter (the base) and the same launch with that one flag
changed (the variant) go through ``memplan estimate --megatron-args FILE --json``.

The rule, fixed before a run: the variant's result differs from the base's in something other than the
``input_settings`` list (which records every flag as given, so it differs always): a figure, the job record, an
assumption sentence or the unmodelled list; or the variant is refused in one sentence naming a flag (exit 2).
A variant answered with the base's figures and sentences is a flag that was read and dropped, unless the flag is
one of :data:`SAME_BYTES` (the same bytes by the mechanism, said why) and the model memplan builds differs. A
refusal is one line ``error: --flag: ...`` (exit 2 for bad usage, 1 for what memplan does not support); a
traceback or a refused base breaks the rule.

    python benchmarks/sweep_modelled.py            # the table; exit 1 when a flag breaks the rule
    python benchmarks/sweep_modelled.py --json     # the rows as JSON

Each row below names the base it starts from, what it adds to the base on both sides (the setting in which
the flag matters), and the change that makes the variant. A value ``None`` removes a flag; ``True`` gives it
bare.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

Args = dict[str, Any]

DENSE: Args = {
    "--num-layers": 8, "--hidden-size": 2048, "--num-attention-heads": 16, "--ffn-hidden-size": 5632,
    "--seq-length": 4096, "--max-position-embeddings": 4096, "--micro-batch-size": 1,
    "--global-batch-size": 64, "--bf16": True, "--swiglu": True, "--disable-bias-linear": True,
    "--normalization": "RMSNorm", "--position-embedding-type": "rope",
    "--untie-embeddings-and-output-weights": True, "--vocab-size": 32000, "--group-query-attention": True,
    "--num-query-groups": 4, "--use-distributed-optimizer": True, "--use-flash-attn": True,
}
MOE: Args = {**DENSE, "--num-experts": 8, "--moe-ffn-hidden-size": 1408, "--moe-router-topk": 2,
             "--expert-model-parallel-size": 2, "--moe-token-dispatcher-type": "alltoall"}
MLA: Args = {**MOE, "--multi-latent-attention": True, "--q-lora-rank": 512, "--kv-lora-rank": 256,
             "--qk-head-dim": 128, "--qk-pos-emb-head-dim": 64, "--v-head-dim": 128,
             "--group-query-attention": None, "--num-query-groups": None}
PP: Args = {**DENSE, "--pipeline-model-parallel-size": 2}
TP: Args = {**DENSE, "--tensor-model-parallel-size": 2, "--sequence-parallel": True}
BASES = {"dense": DENSE, "moe": MOE, "mla": MLA, "pp": PP, "tp": TP}

_CE = {"--cuda-graph-impl": "transformer_engine"}
_FLEX = {"--moe-token-dispatcher-type": "flex", "--moe-enable-deepep": True}
_A2A = {"--overlap-moe-expert-parallel-comm": True, "--moe-token-dispatcher-type": "alltoall"}
_FGO = {"--fine-grained-activation-offloading": True, "--offload-modules": "core_attn"}

#: (flag, base, added to both sides, the variant's change).
ROWS: tuple[tuple[str, str, Args, Args], ...] = (
    ("--num-layers", "dense", {}, {"--num-layers": 12}),
    ("--hidden-size", "dense", {}, {"--hidden-size": 2560}),
    ("--num-attention-heads", "dense", {}, {"--num-attention-heads": 32}),
    ("--kv-channels", "dense", {}, {"--kv-channels": 64}),
    ("--group-query-attention", "dense", {}, {"--group-query-attention": None}),
    ("--num-query-groups", "dense", {}, {"--num-query-groups": 8}),
    ("--disable-bias-linear", "dense", {}, {"--disable-bias-linear": None}),
    ("--swiglu", "dense", {}, {"--swiglu": None}),
    ("--squared-relu", "dense", {"--swiglu": None}, {"--squared-relu": True}),
    ("--ffn-hidden-size", "dense", {}, {"--ffn-hidden-size": 8192}),
    ("--add-qkv-bias", "dense", {}, {"--add-qkv-bias": True}),
    ("--qk-layernorm", "dense", {}, {"--qk-layernorm": True}),
    ("--normalization", "dense", {}, {"--normalization": "LayerNorm"}),
    ("--untie-embeddings-and-output-weights", "dense", {}, {"--untie-embeddings-and-output-weights": None}),
    ("--position-embedding-type", "dense", {}, {"--position-embedding-type": "learned_absolute"}),
    ("--use-rotary-position-embeddings", "dense", {"--position-embedding-type": None},
     {"--use-rotary-position-embeddings": True}),
    ("--max-position-embeddings", "dense", {"--position-embedding-type": "learned_absolute"},
     {"--max-position-embeddings": 8192}),
    ("--multi-latent-attention", "mla", {}, {"--multi-latent-attention": None}),
    ("--qk-head-dim", "mla", {}, {"--qk-head-dim": 192}),
    ("--qk-pos-emb-head-dim", "mla", {}, {"--qk-pos-emb-head-dim": 32}),
    ("--v-head-dim", "mla", {}, {"--v-head-dim": 64}),
    ("--q-lora-rank", "mla", {}, {"--q-lora-rank": 1024}),
    ("--kv-lora-rank", "mla", {}, {"--kv-lora-rank": 512}),
    ("--num-experts", "moe", {}, {"--num-experts": 16}),
    ("--moe-ffn-hidden-size", "moe", {}, {"--moe-ffn-hidden-size": 2048}),
    ("--moe-router-topk", "moe", {}, {"--moe-router-topk": 4}),
    ("--moe-shared-expert-intermediate-size", "moe", {}, {"--moe-shared-expert-intermediate-size": 2816}),
    ("--moe-shared-expert-gate", "moe", {"--moe-shared-expert-intermediate-size": 2816},
     {"--moe-shared-expert-gate": True}),
    ("--moe-router-enable-expert-bias", "moe", {"--moe-router-score-function": "sigmoid"},
     {"--moe-router-enable-expert-bias": True}),
    ("--moe-layer-freq", "moe", {}, {"--moe-layer-freq": 2}),
    ("--mtp-num-layers", "moe", {}, {"--mtp-num-layers": 1}),
    ("--vocab-size", "dense", {}, {"--vocab-size": 64000}),
    ("--make-vocab-size-divisible-by", "dense", {"--vocab-size": 32001}, {"--make-vocab-size-divisible-by": 1024}),
    ("--spec", "dense", {}, {"--spec": "megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec"}),
    ("--tokenizer-type", "dense", {"--vocab-size": None}, {"--tokenizer-type": "TikTokenizer"}),
    ("--tokenizer-model", "dense", {"--vocab-size": None, "--tokenizer-type": "SentencePieceTokenizer",
                                    "--tokenizer-model": "/data/tokenizer.model"},
     {"--tokenizer-model": "/data/nemotron_2_256k.model"}),
    ("--vocab-file", "dense", {"--vocab-size": None}, {"--vocab-file": "/data/vocab.txt"}),
    ("--merge-file", "dense", {"--vocab-size": None, "--vocab-file": "/data/vocab.txt"},
     {"--merge-file": "/data/merges.txt"}),
    ("--tensor-model-parallel-size", "dense", {}, {"--tensor-model-parallel-size": 2}),
    ("--context-parallel-size", "dense", {}, {"--context-parallel-size": 2}),
    ("--expert-model-parallel-size", "moe", {}, {"--expert-model-parallel-size": 4}),
    ("--expert-tensor-parallel-size", "moe", {"--tensor-model-parallel-size": 2, "--sequence-parallel": True},
     {"--expert-tensor-parallel-size": 1}),
    ("--sequence-parallel", "tp", {}, {"--sequence-parallel": None}),
    ("--pipeline-model-parallel-size", "dense", {}, {"--pipeline-model-parallel-size": 2}),
    ("--num-layers-per-virtual-pipeline-stage", "pp", {}, {"--num-layers-per-virtual-pipeline-stage": 2}),
    ("--num-virtual-stages-per-pipeline-rank", "pp", {}, {"--num-virtual-stages-per-pipeline-rank": 2}),
    ("--decoder-first-pipeline-num-layers", "pp", {}, {"--decoder-first-pipeline-num-layers": 2}),
    ("--decoder-last-pipeline-num-layers", "pp", {}, {"--decoder-last-pipeline-num-layers": 2}),
    ("--account-for-embedding-in-pipeline-split", "pp", {"--num-layers": 7},
     {"--account-for-embedding-in-pipeline-split": True}),
    ("--account-for-loss-in-pipeline-split", "pp", {"--num-layers": 7},
     {"--account-for-loss-in-pipeline-split": True}),
    ("--pipeline-model-parallel-layout", "pp", {}, {"--pipeline-model-parallel-layout": "Et*2|t*6L"}),
    ("--microbatch-group-size-per-virtual-pipeline-stage", "pp", {"--num-layers-per-virtual-pipeline-stage": 2},
     {"--microbatch-group-size-per-virtual-pipeline-stage": 4}),
    ("--micro-batch-size", "dense", {}, {"--micro-batch-size": 2}),
    ("--global-batch-size", "pp", {}, {"--global-batch-size": 8}),
    ("--seq-length", "dense", {}, {"--seq-length": 8192, "--max-position-embeddings": 8192}),
    ("--bf16", "dense", {}, {"--bf16": None}),
    ("--fp16", "dense", {"--bf16": None}, {"--fp16": True}),
    ("--accumulate-allreduce-grads-in-fp32", "dense", {"--bf16": None, "--fp16": True},
     {"--accumulate-allreduce-grads-in-fp32": True}),
    ("--grad-reduce-in-bf16", "dense", {}, {"--grad-reduce-in-bf16": True}),
    ("--fp8-format", "dense", {}, {"--fp8-format": "hybrid"}),
    ("--fp8-param-gather", "dense", {"--fp8-format": "hybrid"}, {"--fp8-param-gather": True}),
    ("--use-distributed-optimizer", "dense", {}, {"--use-distributed-optimizer": None}),
    ("--num-distributed-optimizer-instances", "dense", {}, {"--num-distributed-optimizer-instances": 2}),
    ("--use-megatron-fsdp", "dense", {}, {"--use-megatron-fsdp": True}),
    ("--use-torch-fsdp2", "dense", {"--use-distributed-optimizer": None}, {"--use-torch-fsdp2": True}),
    ("--data-parallel-sharding-strategy", "dense", {"--use-megatron-fsdp": True},
     {"--data-parallel-sharding-strategy": "optim_grads"}),
    ("--optimizer", "dense", {}, {"--optimizer": "sgd"}),
    ("--sgd-momentum", "dense", {"--optimizer": "sgd"}, {"--sgd-momentum": 0}),
    ("--muon-scalar-optimizer", "dense", {"--optimizer": "muon", "--use-distributed-optimizer": None},
     {"--muon-scalar-optimizer": "sgd"}),
    ("--muon-tp-mode", "tp", {"--optimizer": "muon", "--use-distributed-optimizer": None},
     {"--muon-tp-mode": "blockwise"}),
    ("--muon-nesterov", "dense", {"--optimizer": "muon", "--use-distributed-optimizer": None},
     {"--muon-nesterov": True}),
    ("--recompute-activations", "dense", {}, {"--recompute-activations": True}),
    ("--recompute-granularity", "dense", {}, {"--recompute-granularity": "full", "--recompute-method": "uniform",
                                              "--recompute-num-layers": 1}),
    ("--recompute-method", "dense", {"--recompute-granularity": "full", "--recompute-method": "uniform",
                                     "--recompute-num-layers": 4}, {"--recompute-method": "block"}),
    ("--recompute-num-layers", "dense", {"--recompute-granularity": "full", "--recompute-method": "block",
                                         "--recompute-num-layers": 4}, {"--recompute-num-layers": 2}),
    ("--recompute-modules", "dense", {"--recompute-granularity": "selective"}, {"--recompute-modules": "mlp"}),
    ("--optimizer-cpu-offload", "dense", {}, {"--optimizer-cpu-offload": True}),
    ("--optimizer-offload-fraction", "dense", {"--optimizer-cpu-offload": True},
     {"--optimizer-offload-fraction": 0.5}),
    ("--attention-backend", "dense", {"--use-flash-attn": None}, {"--attention-backend": "unfused"}),
    ("--use-flash-attn", "dense", {"--transformer-impl": "local"}, {"--use-flash-attn": None}),
    ("--transformer-impl", "dense", {"--use-flash-attn": None}, {"--transformer-impl": "local"}),
    ("--hidden-dropout", "dense", {}, {"--hidden-dropout": 0}),
    ("--attention-dropout", "dense", {"--attention-backend": "unfused", "--use-flash-attn": None},
     {"--attention-dropout": 0}),
    ("--cross-entropy-loss-fusion", "dense", {}, {"--cross-entropy-loss-fusion": True}),
    ("--defer-embedding-wgrad-compute", "tp", {"--gradient-accumulation-fusion": True},
     {"--defer-embedding-wgrad-compute": True}),
    ("--wgrad-deferral-limit", "tp", {"--defer-embedding-wgrad-compute": True}, {"--wgrad-deferral-limit": 2}),
    ("--tp-comm-overlap", "tp", {}, {"--tp-comm-overlap": True}),
    ("--tp-comm-overlap-cfg", "tp", {"--tp-comm-overlap": True}, {"--tp-comm-overlap-cfg": "/no/such/cfg.yaml"}),
    ("--fine-grained-activation-offloading", "dense", {"--offload-modules": "core_attn"},
     {"--fine-grained-activation-offloading": True}),
    ("--offload-modules", "dense", _FGO, {"--offload-modules": "core_attn,attn_proj"}),
    ("--min-offloaded-tensor-size", "dense", _FGO, {"--min-offloaded-tensor-size": 1 << 30}),
    ("--activation-offload-fraction", "dense", _FGO, {"--activation-offload-fraction": 0.5}),
    ("--delta-offload-bytes-across-pp-ranks", "pp", _FGO, {"--delta-offload-bytes-across-pp-ranks": 1 << 28}),
    ("--cuda-graph-impl", "dense", {}, _CE),
    ("--enable-cuda-graph", "dense", {}, {"--enable-cuda-graph": True}),
    ("--external-cuda-graph", "dense", {}, {"--external-cuda-graph": True}),
    ("--cuda-graph-modules", "dense", _CE, {"--cuda-graph-modules": "attn"}),
    ("--cuda-graph-scope", "dense", _CE, {"--cuda-graph-scope": "attn"}),
    ("--cp-comm-type", "dense", {"--context-parallel-size": 2}, {"--cp-comm-type": "a2a"}),
    ("--moe-token-dispatcher-type", "moe", {}, {"--moe-token-dispatcher-type": "allgather"}),
    ("--overlap-moe-expert-parallel-comm", "moe", {}, {"--overlap-moe-expert-parallel-comm": True}),
    ("--moe-enable-deepep", "moe", {}, {"--moe-enable-deepep": True}),
    ("--moe-flex-dispatcher-num-sms", "moe", _FLEX, {"--moe-flex-dispatcher-num-sms": 48}),
    ("--moe-deepep-num-sms", "moe", _FLEX, {"--moe-deepep-num-sms": 48}),
    ("--delay-wgrad-compute", "moe", _A2A, {"--delay-wgrad-compute": True}),
    ("--ep-overlap-early-attn-memory-release", "moe", _A2A, {"--ep-overlap-early-attn-memory-release": True}),
    ("--overlap-dispatch-backward-with-experts-wgrad", "moe", {**_A2A, "--delay-wgrad-compute": True},
     {"--overlap-dispatch-backward-with-experts-wgrad": True}),
    ("--moe-shared-expert-overlap", "moe", {"--moe-shared-expert-intermediate-size": 2816,
                                            "--tensor-model-parallel-size": 2, "--sequence-parallel": True},
     {"--moe-shared-expert-overlap": True}),
    ("--moe-flex-dispatcher-backend", "moe", {"--moe-token-dispatcher-type": "flex"},
     {"--moe-flex-dispatcher-backend": "hybridep"}),
    ("--moe-expert-capacity-factor", "moe", {}, {"--moe-expert-capacity-factor": 1.5}),
    ("--moe-pad-expert-input-to-capacity", "moe", {"--moe-expert-capacity-factor": 1.0},
     {"--moe-pad-expert-input-to-capacity": True}),
    ("--cpu-offloading", "dense", {}, {"--cpu-offloading": True}),
    ("--cpu-offloading-activations", "dense", {"--cpu-offloading": True}, {"--cpu-offloading-activations": False}),
    ("--fp8", "dense", {}, {"--fp8": "hybrid"}),
    ("--fp8-param", "dense", {"--fp8": "hybrid"}, {"--fp8-param": True}),
    ("--no-accumulate-allreduce-grads-in-fp32", "dense", {"--accumulate-allreduce-grads-in-fp32": True},
     {"--no-accumulate-allreduce-grads-in-fp32": True}),
)

GPUS = 8

#: Flags whose variant prices the same bytes by the mechanism, with why; the sweep then checks that the model
#: memplan builds differs (the flag is read, not dropped).
SAME_BYTES = {
    "--squared-relu": ("relu(x)**2 keeps relu's output (for both backwards) and its own (fc2's input): two "
                       "ffn-wide tensors, as GeLU keeps its input and output"),
    "--moe-router-enable-expert-bias": ("the score-correction bias and the token counts are two buffers of "
                                        "num_experts fp32 per MoE layer (not parameters: no gradient or state)"),
}


def _command(args: Args) -> str:
    words = ["torchrun --nproc_per_node 8 pretrain_gpt.py"]
    for flag, value in args.items():
        if value is None:
            continue
        words.append(flag if value is True else f"{flag} {value}")
    return " \\\n    ".join(words) + "\n"


def _launch_file(folder: Path, name: str, args: Args) -> Path:
    """``args`` as a launch command in ``folder/name/launch.sh`` (one file name: the assumptions cite it)."""
    path = folder / name / "launch.sh"
    path.parent.mkdir(parents=True)
    path.write_text(_command(args))
    return path


def _run(runner: Any, app: Any, folder: Path, name: str, args: Args) -> tuple[int, Any]:
    path = _launch_file(folder, name, args)
    result = runner.invoke(app, ["estimate", "--megatron-args", str(path), "--gpus", str(GPUS), "--json"])
    if result.exit_code != 0:
        lines = result.output.strip().splitlines()
        return result.exit_code, lines if lines and "Traceback" not in result.output else [repr(result.exception)]
    data = json.loads(result.output)
    data.pop("input_settings")
    data.pop("model")
    return 0, data


def _models_differ(base_args: Args, variant_args: Args, folder: Path) -> bool:
    from memplan.inputs import JobRequest, load_job

    specs = []
    for name, args in (("model_base", base_args), ("model_variant", variant_args)):
        path = _launch_file(folder, name, args)
        specs.append(load_job(JobRequest(megatron_args=str(path), flags={"gpus": GPUS})).model)
    return specs[0] != specs[1]


def judge(flag: str, base_code: int, base: Any, code: int, variant: Any) -> tuple[str, str]:
    """``(verdict, detail)``: ``changes``, ``refused`` (exit 2 naming a flag) or a failure of the rule."""
    if base_code != 0:
        return ("changes", "the base is refused, the variant is not") if code == 0 else ("BASE REFUSED", str(base))
    if code in (1, 2) and len(variant) == 1 and variant[0].startswith("error: "):
        line = variant[0]
        return ("refused", line[:160]) if "--" in line else ("REFUSED WITHOUT A FLAG", line[:160])
    if code != 0:
        return "CRASHED", str(variant)[:160]
    if variant == base:
        return "SILENT", "the same figures, job record and sentences as without it"
    moved = sorted(key for key in base if base.get(key) != variant.get(key))
    return "changes", ", ".join(moved)


def sweep() -> list[dict[str, str]]:
    from typer.testing import CliRunner

    from memplan.cli import app
    from memplan.frameworks.megatron_flag_table import MODELLED

    runner, rows = CliRunner(), []
    missing = sorted(set(MODELLED) - {row[0] for row in ROWS})
    with tempfile.TemporaryDirectory() as tmp:
        for index, (flag, base_name, common, change) in enumerate(ROWS):
            base_args = {**BASES[base_name], **common}
            base_code, base = _run(runner, app, Path(tmp), f"base{index}", base_args)
            code, variant = _run(runner, app, Path(tmp), f"variant{index}", {**base_args, **change})
            verdict, detail = judge(flag, base_code, base, code, variant)
            if verdict == "SILENT" and flag in SAME_BYTES and _models_differ(
                    base_args, {**base_args, **change}, Path(tmp) / f"models{index}"):
                verdict, detail = "same bytes", SAME_BYTES[flag]
            rows.append({"flag": flag, "base": base_name, "verdict": verdict, "detail": detail})
    rows += [{"flag": flag, "base": "", "verdict": "NO ROW", "detail": "MODELLED flag without a sweep row"}
             for flag in missing]
    return rows


#: The verdicts that keep the rule.
GOOD = ("changes", "refused", "same bytes")


def main() -> int:
    rows = sweep()
    if "--json" in sys.argv:
        print(json.dumps(rows, indent=1))
    else:
        for row in rows:
            print(f"{row['verdict']:<24} {row['flag']:<52} {row['base']:<6} {row['detail']}")
    bad = [row for row in rows if row["verdict"] not in GOOD]
    print(f"{len(rows)} flags: {len(rows) - len(bad)} change the answer or are refused, {len(bad)} break the rule",
          file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
