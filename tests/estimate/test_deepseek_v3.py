"""The DeepSeek-V3 memory analysis (published.md section 1), number by number.

Where memplan differs from the paper the difference is one stated, exact quantity: the paper keeps
W^QR whole on every TP rank (a slip: it is per head and TP splits it); see docs/deepseek-v3.md.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GiB = 2**30


@pytest.fixture(scope="module")
def analysis():
    spec = importlib.util.spec_from_file_location("deepseek_v3_analysis", REPO / "benchmarks" / "deepseek_v3_analysis.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def result(analysis):
    return analysis.reproduce()


def test_parameters_per_layer_type(result, analysis):
    paper = analysis.PAPER
    assert result.mla_per_layer == paper["mla_per_layer"]
    assert result.routed_expert == paper["routed_expert"]
    assert result.moe_layer_experts_router == paper["moe_layer_experts_router"]
    assert round(result.total_params / 1e9, 2) == paper["total_params_b"]
    assert round(2 * result.total_params / GiB, -1) == paper["total_gib_bf16"]


def test_pp16_stage_sizes(result, analysis):
    assert tuple(round(n / 1e9, 2) for n in result.stage_sizes) == analysis.PAPER["stage_sizes_b"]


def test_per_device_parameters(result, analysis):
    paper = analysis.PAPER
    assert result.device_norms == paper["device_norms"]
    assert result.device_moe_paper_placement == paper["device_moe"]
    w_qr_half_per_stage = 4 * analysis.W_QR // 2
    assert result.device_params_paper_placement + w_qr_half_per_stage == paper["device_total"]
    assert result.device_params_paper_placement == 6_225_199_104
    # Megatron's placement also splits the shared expert (4 layers x 44,040,192 / 2).
    assert result.device_params_megatron == 6_225_199_104 - 4 * 44_040_192 // 2


def test_zero_table(result, analysis):
    """Each part equals the paper's once the W^QR slip (non-expert weights, sharded over DP=32
    where the stage shards) is added back; the totals are the exact sums, not the printed ones."""
    slip = 4 * analysis.W_QR // 2
    for zero, paper_row in analysis.PAPER["zero"].items():
        ours = result.zero[zero]
        for part, (bytes_per_param, sharded) in enumerate(((2, zero == 3), (4, zero >= 2), (8, zero >= 1))):
            corrected = ours[part] + slip * bytes_per_param / (32 if sharded else 1) / GiB
            assert corrected == pytest.approx(paper_row[part], abs=0.005), (zero, part)
        assert sum(ours[:3]) == pytest.approx(ours[3])
        assert ours[3] == pytest.approx(paper_row[3], abs=0.35)


def test_full_recompute_keeps_the_layer_inputs(result):
    assert result.recompute_stage_bytes == 4 * 4096 * 7168 * 2 // 2


def test_cli_reaches_the_numbers():
    from typer.testing import CliRunner

    from memplan.cli import app

    args = ["estimate", "deepseek-v3", "--gpus", "1024", "--tp", "2", "--pp", "16", "--ep", "8", "--zero", "1",
            "--grad-dtype", "fp32", "--optimizer-state-dtype", "bf16", "--master-dtype", "fp32",
            "--shared-expert-parallel", "expert", "--json"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    stage = json.loads(out.stdout)["stages"][1]
    assert stage["layers"] == 4
    assert stage["parameters_numel"] == 6_225_199_104
    assert stage["optimizer_bytes"] / GiB == pytest.approx(5.51, abs=0.005)
