"""--batching axolotl (Axolotl's sample packing) and --emit axolotl.

first_fit_bins is compared with a plain re-statement of Axolotl's ``pack_group``/``pack_parallel`` (written
from reading ``axolotl/utils/samplers/multipack.py``): the same loop over bins, without the max-tree, and the
emitted YAML is checked against the option names and types of Axolotl's config reference
(https://docs.axolotl.ai/docs/config-reference.html). Axolotl's own sampler and validator are run in
test_axolotl_sampler.py where they are importable."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from memplan.cli import app
from memplan.dataset import Batching, plan_steps
from memplan.dataset.multipack import first_fit_bins, pad_multiple

#: Axolotl config reference: the keys --emit axolotl writes and their types.
AXOLOTL_KEYS = {"sequence_len": int, "sample_packing": bool, "pad_to_sequence_len": bool, "micro_batch_size": int,
                "gradient_accumulation_steps": int, "num_epochs": (int, float), "seed": int,
                "gradient_checkpointing": bool, "optimizer": str}
#: transformers' OptimizerNames values Axolotl's ``optimizer`` accepts (a subset).
AXOLOTL_OPTIMIZERS = {"adamw_torch", "adamw_bnb_8bit", "paged_adamw_8bit", "adafactor", "sgd", "lion_32bit",
                      "lion_8bit"}


def _pack_group_restated(lengths, capacity, bin_size):
    """Axolotl's pack_group: each example to the first bin with room and fewer than bin_size examples."""
    rooms, members = [], []
    for size in lengths:
        for i, room in enumerate(rooms):
            if room >= size and len(members[i]) < bin_size:
                rooms[i] -= size
                members[i].append(size)
                break
        else:
            rooms.append(capacity - size)
            members.append([size])
    return [sum(m) for m in members]


def _pack_parallel_restated(lengths, capacity, bin_size, group_size):
    out = []
    for start in range(0, len(lengths), group_size):
        out += _pack_group_restated(lengths[start:start + group_size], capacity, bin_size)
    return out


@pytest.mark.parametrize(("seed", "capacity", "bin_size", "group_size"),
                         [(0, 2048, 200, 100_000), (1, 1024, 3, 100_000), (2, 4096, 200, 257), (3, 512, 5, 64)])
def test_first_fit_equals_axolotls_packer(seed, capacity, bin_size, group_size):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(5.0, 0.9, size=1500).astype(np.int64) + 2, capacity)
    ours = first_fit_bins(lengths, capacity, bin_size=bin_size, group_size=group_size)
    assert ours.tolist() == _pack_parallel_restated(lengths.tolist(), capacity, bin_size, group_size)


def test_axolotl_steps():
    rng = np.random.default_rng(7)
    lengths = rng.lognormal(5.5, 0.8, size=3000).astype(np.int64) + 1
    lengths[:5] = [1, 0, 5000, 1001, 1000]
    steps = plan_steps(lengths, Batching(rule="axolotl", micro_batch_size=4, max_length=1000, epochs=2))
    kept = lengths[(lengths >= 2) & (lengths <= 1000)]
    assert steps.packed and set(steps.batch_size.tolist()) == {1}
    assert int(steps.tokens.sum()) == 2 * int(kept.sum())  # every kept example once per epoch, the rest dropped
    assert steps.tokens.max() <= 4000 and (steps.seq_length % pad_multiple(1000) == 0).all()
    assert (steps.seq_length >= steps.tokens).all() and pad_multiple(1000) == 1024
    explicit = plan_steps(lengths, Batching(rule="axolotl", micro_batch_size=4, max_length=1000, pad_to_multiple_of=64))
    assert (explicit.seq_length % 64 == 0).all() and explicit.tokens.tolist() == steps.tokens[:len(explicit)].tolist()


def test_axolotl_needs_sequence_len():
    from memplan.errors import ConfigError

    with pytest.raises(ConfigError, match="--max-length"):
        Batching(rule="axolotl")


@pytest.fixture
def model_dir(make_model_dir) -> Path:
    from tests.dataset.test_fit_dataset import CONFIG

    return make_model_dir(CONFIG)


def test_emit_axolotl_yaml(model_dir, text_rows, tmp_path, write_jsonl, isolated_cache):
    """The YAML has Axolotl's keys and types, and its values batched with --batching axolotl give the chosen
    setting's worst step."""
    path = write_jsonl(tmp_path / "t.jsonl", text_rows)
    emitted = tmp_path / "axolotl.yaml"
    out = CliRunner().invoke(app, ["fit", str(model_dir), "--dataset", str(path), "--mbs", "2", "--gbs", "4",
                                   "--gpu", "rtx-4090", "--batching", "axolotl", "--max-length", "128", "--emit",
                                   "axolotl", str(emitted), "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    config = yaml.safe_load(emitted.read_text())
    assert doc["emitted"]["config"] == config and emitted.read_text().startswith("# memplan fit --emit axolotl")
    for key, value in config.items():
        assert key in AXOLOTL_KEYS and isinstance(value, AXOLOTL_KEYS[key]), key
    assert config.get("optimizer", "adamw_torch") in AXOLOTL_OPTIMIZERS
    assert config["sample_packing"] and config["pad_to_sequence_len"] and config["sequence_len"] == 128
    chosen = doc["chosen"]
    assert config["micro_batch_size"] * config["gradient_accumulation_steps"] == 4
    assert (config["micro_batch_size"], config["gradient_accumulation_steps"]) == \
        (chosen["micro_batch_size"], chosen["gradient_accumulation_steps"])
    again = CliRunner().invoke(app, ["estimate", str(model_dir), "--dataset", str(path), "--batching", "axolotl",
                                     "--max-length", str(config["sequence_len"]), "--mbs",
                                     str(config["micro_batch_size"]), "--seed", str(config["seed"]), "--json"])
    assert again.exit_code == 0, again.output
    worst = json.loads(again.stdout)["dataset"]["worst_step"]
    assert worst["batch_size"] == 1 and worst["seq_length"] <= config["micro_batch_size"] * 128


def test_emit_axolotl_refuses_another_family(model_dir, text_rows, tmp_path, write_jsonl, isolated_cache):
    path = write_jsonl(tmp_path / "t.jsonl", text_rows)
    out = CliRunner().invoke(app, ["fit", str(model_dir), "--dataset", str(path), "--mbs", "2", "--gpu", "rtx-4090",
                                   "--batching", "torchtune", "--emit", "axolotl", str(tmp_path / "a.yaml")])
    assert out.exit_code == 2 and "--emit" in out.output and not (tmp_path / "a.yaml").exists()
