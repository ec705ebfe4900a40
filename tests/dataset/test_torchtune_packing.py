"""torchtune's PackedDataset (its own source file, loaded without the torchtune package, whose import
needs torchao) packs exactly as memplan's greedy_packs."""

from __future__ import annotations

import importlib.util
import sys
import types

import numpy as np
import pytest

from memplan.dataset.packing import greedy_packs

torch = pytest.importorskip("torch")


def _packed_dataset_class(monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.find_spec("torchtune")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtune is not installed")
    source = f"{list(spec.submodule_search_locations)[0]}/datasets/_packed.py"
    common = types.ModuleType("torchtune.data._common")
    common.CROSS_ENTROPY_IGNORE_IDX, common.PACK_TYPE = -100, dict
    for name, module in (("torchtune", types.ModuleType("torchtune")),
                         ("torchtune.data", types.ModuleType("torchtune.data")),
                         ("torchtune.data._common", common)):
        monkeypatch.setitem(sys.modules, name, module)
    loaded = importlib.util.spec_from_file_location("memplan_test_torchtune_packed", source)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module.PackedDataset


@pytest.mark.parametrize("max_seq_len", [64, 100, 257])
def test_greedy_packs_equal_torchtune(max_seq_len, monkeypatch):
    packed_dataset = _packed_dataset_class(monkeypatch)
    rng = np.random.default_rng(max_seq_len)
    lengths = np.minimum(rng.lognormal(3.3, 0.8, size=300).astype(np.int64) + 1, max_seq_len)
    samples = [{"tokens": list(range(n)), "labels": list(range(n))} for n in lengths.tolist()]
    packs = packed_dataset(samples, max_seq_len=max_seq_len)
    theirs = [int((p["labels"] != -100).sum()) for p in packs]  # the samples' labels are never -100
    assert all(len(p["tokens"]) == max_seq_len for p in packs)  # every pack padded to max_seq_len
    ours = greedy_packs(lengths, max_seq_len)
    assert len(ours) == len(packs)
    assert ours.tolist() == theirs

