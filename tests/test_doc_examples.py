"""Every ``memplan ...`` example in the README and docs/ runs, as written, and succeeds.

Each document's shell examples run in document order in one folder (so an example can read what
an earlier one wrote, as a reader following the page would), with the input files the examples
name (job files, a Megatron launch script, a DeepSpeed config, a config.json, a script) made
there first. A pipe into ``jq`` is dropped and the JSON checked instead; ``a && b`` runs both.
Usage synopses (``[--flag N]``) are not examples and are skipped, and so is ``memplan serve`` (a
server that runs until stopped; tests/serve/test_api.py starts it). The README's Python API block
runs too.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"```(?:bash|sh|shell|console)?\n(.*?)```", re.DOTALL)

runner = CliRunner()

_FILES = {
    "job1.yaml": "model: llama-3.2-1b\ngpus: 1\nseq: 2048\nrecompute: full\nframework: hf\n",
    "job2.yaml": "model: gpt2\ngpus: 1\nseq: 1024\nmbs: 4\nframework: hf\n",
    "llama-70b.yaml": ("model: llama-3.1-70b\ngpus: 64\ntp: 8\npp: 2\nsequence-parallel: true\n"
                       "distributed-optimizer: true\nseq: 8192\ngbs: 512\nrecompute: selective\ngpu: h100-80gb\n"),
    "my-job.yaml": ("model: llama-3.1-8b\ngpus: 8\ntp: 2\nsequence-parallel: true\ndistributed-optimizer: true\n"
                    "recompute: selective\n"),
    "ds_config.json": json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
                                  "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}),
    "train_args.sh": ("#!/bin/bash\nGPUS_PER_NODE=8\ntorchrun --nproc_per_node $GPUS_PER_NODE pretrain_gpt.py \\\n"
                      "    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 \\\n"
                      "    --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 1024 \\\n"
                      "    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --sequence-parallel \\\n"
                      "    --use-distributed-optimizer --bf16 --vocab-size 32000 --swiglu --ffn-hidden-size 11008\n"),
    "train.py": ("import torch\n\n\ndef make_job():\n"
                 "    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))\n"
                 "    batch = torch.randn(16, 512)\n"
                 "    optimizer = torch.optim.AdamW(model.parameters())\n"
                 "    return model, batch, optimizer, lambda out, batch: out.square().mean()\n"),
    "buffers.csv": "id,lower,upper,size\n0,0,3,4\n1,1,4,4\n2,3,6,8\n3,5,8,4\n",
    "training_args.json": json.dumps({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4,
                                      "bf16": True, "fp16": False, "gradient_checkpointing": True,
                                      "optim": "adamw_torch_fused", "learning_rate": 2e-4, "logging_steps": 10,
                                      "torch_compile": True}),
    "adapter_config.json": json.dumps({"peft_type": "LORA", "r": 16, "lora_alpha": 32, "lora_dropout": 0.05,
                                       "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                                       "base_model_name_or_path": "meta-llama/Llama-3.2-1B", "bias": "none",
                                       "task_type": "CAUSAL_LM", "inference_mode": True}),
    "llama3_8b.toml": (Path(__file__).parent / "data" / "torchtitan" / "llama3_8b.toml").read_text(encoding="utf-8"),
    "llama3_debug.toml": (Path(__file__).parent / "data" / "torchtitan" / "llama3_debug.toml").read_text(
        encoding="utf-8"),
    "train.toml": ('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 2\nseq_len = 8192\n'
                   '[parallelism]\ntensor_parallel_degree = 2\n[activation_checkpoint]\nmode = "full"\n'),
    "sft.sh": ("torchrun --nproc_per_node 2 sft.py --model_name_or_path meta-llama/Llama-3.2-1B \\\n"
               "    --per_device_train_batch_size 2 --gradient_accumulation_steps 8 --bf16 --max_length 2048 \\\n"
               "    --packing --gradient_checkpointing --use_peft --lora_r 16 --load_in_4bit --optim paged_adamw_8bit\n"),
}
#: The Hub ids the docs name, in an offline Hugging Face cache made in the examples' folder.
_HUB_MODELS = {"meta-llama/Llama-3.2-1B": "llama-3.2-1b"}


def _examples(doc: Path) -> list[str]:
    out = []
    for block in _BLOCK.findall(doc.read_text(encoding="utf-8")):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            # memplan serve runs until stopped: tests/serve/test_api.py starts it for real
            if line.startswith("memplan ") and not re.search(r"\[--", line) and not line.startswith("memplan serve"):
                out.extend(part.strip() for part in line.split("&&"))
    return out


def _prepare(folder: Path) -> None:
    from memplan.model.presets import preset_config

    for name, text in _FILES.items():
        (folder / name).write_text(text, encoding="utf-8")
    for repo, preset in _HUB_MODELS.items():
        snapshot = folder / "hf-cache" / f"models--{repo.replace('/', '--')}" / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (snapshot.parents[1] / "refs").mkdir()
        (snapshot.parents[1] / "refs" / "main").write_text("0" * 40, encoding="utf-8")
        (snapshot / "config.json").write_text(json.dumps(preset_config(preset)), encoding="utf-8")
    for sub in ("my-model", "path/to"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
        (folder / sub / "config.json").write_text(json.dumps(preset_config("llama-3.2-1b")), encoding="utf-8")
    # the repository's config files, as an example run from its root names them (gpt-oss's published configs)
    (folder / "benchmarks").mkdir(exist_ok=True)
    (folder / "benchmarks" / "configs").symlink_to(ROOT / "benchmarks" / "configs")


def _run(line: str) -> None:
    command, _, piped = line.partition("|")
    args = shlex.split(command, comments=True)[1:]
    result = runner.invoke(app, args, env={"COLUMNS": "120", "NO_COLOR": "1"})
    assert result.exit_code == 0, f"{line}\n{result.output}"
    assert "Traceback" not in result.output
    if piped.strip().startswith("jq"):
        json.loads(result.stdout)


def _with_inputs(line: str, folder: Path) -> str:
    """Inputs an example reads that an earlier example of another page wrote."""
    for name, maker in (("step.mptrace", "trace"), ("snapshot.pickle", "snapshot")):
        if name in line and not (folder / name).exists():
            flag = "-o" if maker == "trace" else "--snapshot"
            _run(f"memplan trace gpt2 --seq 256 --precision fp32 {flag} {name}")
    return line


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_shell_example_runs(doc: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    examples = _examples(doc)
    if not examples:
        pytest.skip(f"{doc.name} has no memplan command examples")
    _prepare(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for line in examples:
        if " --torchtitan " in f"{line} " and importlib.util.find_spec("torchtitan") is None:
            continue  # memplan trace --torchtitan needs the torchtitan extra (its own tests skip the same way)
        _run(_with_inputs(line, tmp_path))


def test_readme_python_api_block_runs() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("## Python API", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    exec(compile(block, "README.md (Python API)", "exec"), {})  # noqa: S102 - our own documentation
