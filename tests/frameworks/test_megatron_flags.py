"""Every Megatron-LM flag is classified, and a launch reports each flag it holds (never silent)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import memplan.frameworks.megatron_args as megatron_args_module
import memplan.frameworks.megatron_graphs as megatron_graphs_module
import memplan.frameworks.megatron_model as megatron_model_module
import memplan.frameworks.megatron_overlap as megatron_overlap_module
from memplan.cli import app
from memplan.frameworks.megatron_flag_table import GROUPS, MODELLED, OLDER_FLAGS
from memplan.frameworks.megatron_flags import classify, flag_list, flag_list_version, megatron_settings
from memplan.inputs import JobRequest, load_job
from memplan.optimizers import OPTIMIZERS

#: Modelled flags whose mapping lives in another change (the recompute-modules mapping).
_MAPPED_ELSEWHERE = {"--recompute-modules"}


def test_every_megatron_flag_is_classified() -> None:
    flags = flag_list()
    assert len(flags) > 800  # the whole parser, not a sample
    unclassified = sorted(flag for flag in flags if classify(flag) is None)
    assert unclassified == [], f"{len(unclassified)} Megatron flags have no classification: {unclassified}"
    for flag in flags:
        effect, note = classify(flag)  # type: ignore[misc]
        assert effect in ("modelled", "no-memory-effect", "not-modelled") and note, flag


def test_no_flag_is_classified_twice_and_every_entry_is_a_megatron_flag() -> None:
    seen: dict[str, str] = {}
    for _, note, flags in GROUPS:
        for flag in flags:
            assert flag not in seen, f"{flag} is in two groups: {seen[flag]!r} and {note!r}"
            assert flag not in MODELLED, f"{flag} is both modelled and in group {note!r}"
            seen[flag] = note
    known = flag_list() | OLDER_FLAGS
    assert sorted((set(seen) | set(MODELLED)) - known) == []


def test_shipped_list_header_matches_its_flags() -> None:
    text = (Path(megatron_args_module.__file__).parent / "megatron_flag_list.txt").read_text()
    count = int(re.search(r"^# (\d+) flags", text, re.MULTILINE).group(1))  # type: ignore[union-attr]
    assert count == len(flag_list())
    assert re.fullmatch(r"[0-9a-f]{7}", flag_list_version())


def _flags_read_by_the_reader() -> set[str]:
    source = "".join(Path(m.__file__).read_text() for m in (megatron_args_module, megatron_model_module,
                                                                 megatron_overlap_module, megatron_graphs_module))
    # the optimizer arguments the reader reads as the optimizer registry declares them
    registered = {spec.flag for kind in OPTIMIZERS for spec in kind.dialects.megatron_flags}
    return (set(re.findall(r'"(--[a-z0-9][a-z0-9-]*)"', source)) | registered) - {"--flag"}  # (a docstring's example)


def test_modelled_means_the_reader_reads_it() -> None:
    read = _flags_read_by_the_reader()
    assert sorted(set(MODELLED) - read - _MAPPED_ELSEWHERE) == []
    # ...and every flag the reader reads is classified (refused architectures as not modelled).
    assert sorted(flag for flag in read if classify(flag) is None) == []


def test_refused_means_the_reader_refuses_it() -> None:
    notes = {flag: classify(flag)[1] for flag in flag_list() | OLDER_FLAGS}  # type: ignore[index]
    refused = {flag for flag, note in notes.items() if note.startswith("refused")}
    assert refused == set(megatron_args_module._UNSUPPORTED)


@pytest.mark.parametrize("flag", ["--optimizer-cuda-graph", "--cpu-offloading-num-layers", "--muon-use-syrk"])
def test_issue_flags_are_stated_not_modelled(flag: str) -> None:
    assert classify(flag, "a2a")[0] == "not-modelled"  # type: ignore[index]


@pytest.mark.parametrize("flag", ["--cuda-graph-impl", "--cuda-graph-scope", "--cuda-graph-modules",
                                  "--external-cuda-graph", "--enable-cuda-graph"])
def test_cuda_graph_flags_are_modelled(flag: str) -> None:
    assert classify("--offload-modules", "core_attn")[0] == "modelled"  # type: ignore[index]
    assert classify(flag, "local")[0] == "modelled"  # type: ignore[index]
    assert classify("--cuda-graph-warmup-steps", 3)[0] == "no-memory-effect"  # type: ignore[index]


def test_value_decides_for_dispatcher_optimizer_and_cuda_graphs() -> None:
    assert classify("--moe-token-dispatcher-type", "alltoall")[0] == "modelled"  # type: ignore[index]
    assert classify("--moe-token-dispatcher-type", "flex")[0] == "modelled"  # type: ignore[index]
    assert classify("--optimizer", "adam")[0] == "modelled"  # type: ignore[index]
    assert classify("--optimizer", "muon")[0] == "modelled"  # type: ignore[index]
    assert classify("--muon-tp-mode", "distributed")[0] == "modelled"  # type: ignore[index]
    assert classify("--muon-scalar-optimizer", "lion")[0] == "not-modelled"  # type: ignore[index]
    assert classify("--muon-fp32-matmul-prec", "medium")[0] == "modelled"  # type: ignore[index]
    assert classify("--muon-fp32-matmul-prec", "high")[0] == "not-modelled"  # type: ignore[index]
    assert classify("--cuda-graph-impl", "none")[0] == "no-memory-effect"  # type: ignore[index]


def test_settings_keep_values_and_name_unknown_flags() -> None:
    settings = {s.key: s for s in megatron_settings({"--num-layers": "4", "--empty-unused-memory-level": 1,
                                                     "--tp-comm-overlap-rs-dgrad": "false", "--lr": "1e-4",
                                                     "--not-a-flag": ["a", "b"]})}
    assert settings["--num-layers"].value == "4" and settings["--num-layers"].effect == "modelled"
    assert settings["--empty-unused-memory-level"].effect == "not-modelled"
    assert settings["--tp-comm-overlap-rs-dgrad"].effect == "no-memory-effect"  # switched off in a mapping
    assert settings["--lr"].effect == "no-memory-effect"
    assert settings["--not-a-flag"].effect == "not-modelled"
    assert settings["--not-a-flag"].value == ["a", "b"]
    assert f"not a Megatron-LM flag (version {flag_list_version()})" in settings["--not-a-flag"].note


LAUNCH = """\
#!/bin/bash
TP=2
torchrun --nproc_per_node 2 pretrain_gpt.py \\
    --num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 \\
    --max-position-embeddings 1024 --micro-batch-size 2 --global-batch-size 16 --bf16 \\
    --tensor-model-parallel-size $TP --sequence-parallel \\
    --mlp-chunks-for-training 2 --empty-unused-memory-level 1 \\
    --lr 1e-4 --save /ckpt --log-interval 10
"""


def test_launch_reports_every_flag_in_json(tmp_path: Path) -> None:
    path = tmp_path / "launch.sh"
    path.write_text(LAUNCH)
    result = CliRunner().invoke(app, ["estimate", "--megatron-args", str(path), "--gpus", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    by_key = {s["key"]: s for s in data["input_settings"]}
    assert len(by_key) == 15  # every flag of the command (not the launcher's), nothing else
    assert by_key["--tensor-model-parallel-size"]["effect"] == "modelled"
    assert by_key["--tensor-model-parallel-size"]["value"] == "2"
    assert by_key["--save"]["effect"] == "no-memory-effect"
    assert "--nproc_per_node" not in by_key  # torchrun's, before the script
    unmodelled = {s["key"]: s["value"] for s in data["input_settings"] if s["effect"] == "not-modelled"}
    assert unmodelled == {"--mlp-chunks-for-training": "2", "--empty-unused-memory-level": "1"}
    assert len(data["unmodelled_settings"]) == 2
    assert all(isinstance(line, str) for line in data["unmodelled_settings"])
    assert any(line.startswith("--megatron-args --empty-unused-memory-level = ") for line in data["unmodelled_settings"])


def test_launch_text_output_has_one_yellow_warning_line(tmp_path: Path) -> None:
    path = tmp_path / "launch.sh"
    path.write_text(LAUNCH)
    result = CliRunner().invoke(app, ["estimate", "--megatron-args", str(path), "--gpus", "2"], color=True)
    assert result.exit_code == 0, result.output
    assert result.output.count("Not modelled (2 input settings") == 1
    yellow = [line for line in result.output.splitlines() if line.startswith("\x1b[33m")]
    assert len(yellow) == 1
    assert "--mlp-chunks-for-training" in yellow[0] and "--empty-unused-memory-level" in yellow[0]


def test_load_job_carries_the_settings(tmp_path: Path) -> None:
    path = tmp_path / "launch.sh"
    path.write_text(LAUNCH)
    loaded = load_job(JobRequest(megatron_args=str(path), flags={"gpus": 2}))
    assert [s.key for s in loaded.unmodelled] == ["--mlp-chunks-for-training", "--empty-unused-memory-level"]


def test_extraction_script_reads_literal_flags(tmp_path: Path) -> None:
    script = Path(__file__).parents[2] / "scripts" / "extract_megatron_flags.py"
    spec = importlib.util.spec_from_file_location("extract_megatron_flags", script)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    source = tmp_path / "arguments.py"
    source.write_text("def f(parser):\n    g = parser.add_argument_group('x')\n"
                      "    g.add_argument('--alpha', '--alpha-old', type=int)\n"
                      "    if True:\n        g.add_argument('--beta', action='store_true')\n"
                      "    parser.add_argument('positional')\n")
    assert module.literal_flags(source) == {"--alpha", "--alpha-old", "--beta"}
