"""``--batching axolotl`` against Axolotl's own ``MultipackBatchSampler``, step by step, on the same order.

Axolotl itself does not install beside this environment (0.19.0 pins transformers 5.16.1, peft 0.20.0,
datasets 4.8.4 ...), but its sampler module needs only torch, numpy, numba, accelerate and transformers:
``pip install axolotl==0.19.0 numba==0.65.0 llvmlite==0.47.0 addict==2.4.0 --no-deps`` makes it and
Axolotl's ``validate_config`` importable (requirements-nodeps.txt). The order is memplan's stand-in (``torch.randperm`` seeded
``seed + epoch``; Axolotl's RandomSampler draws from torch's global RNG, which no seed alone replays);
fed that order, Axolotl's packer gives the same bins, so every step's row is the same.
"""

from __future__ import annotations

import numpy as np
import pytest

from memplan.dataset import Batching, plan_steps
from memplan.dataset.multipack import BIN_SIZE, GROUP_SIZE, MIN_SAMPLE_LEN, pad_multiple
from memplan.dataset.rng import torch_randperm

multipack = pytest.importorskip("axolotl.utils.samplers.multipack",
                                reason="Axolotl's sampler is not importable (requirements-nodeps.txt: axolotl --no-deps "
                                       "with numba)")


@pytest.mark.parametrize(("mbs", "limit", "seed"), [(1, 512, 42), (4, 300, 7), (2, 1024, 0)])
def test_steps_equal_axolotls_multipack_sampler(mbs: int, limit: int, seed: int) -> None:
    import torch

    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(5.0, 1.0, size=3000).astype(np.int64))
    ours = plan_steps(lengths, Batching(rule="axolotl", micro_batch_size=mbs, max_length=limit, seed=seed))
    kept = lengths[(lengths >= MIN_SAMPLE_LEN) & (lengths <= limit)]  # Axolotl drops these while preparing data
    order = torch_randperm(len(kept), seed)
    assert order.tolist() == torch.randperm(len(kept), generator=torch.Generator().manual_seed(seed)).tolist()
    sampler = multipack.MultipackBatchSampler(order.tolist(), batch_size=1, batch_max_len=mbs * limit, lengths=kept,
                                              bin_size=BIN_SIZE, group_size=GROUP_SIZE, num_processes=1,
                                              drop_last=True)
    theirs = [sum(int(kept[i]) for i in batch[0]) for batch in sampler]
    assert len(theirs) > 50
    assert ours.tokens.tolist() == theirs
    multiple = pad_multiple(limit)
    assert ours.seq_length.tolist() == [-(-t // multiple) * multiple for t in theirs]
    assert set(ours.batch_size.tolist()) == {1}


def test_emitted_yaml_passes_axolotls_validation_and_gives_the_steps(fit_emit, isolated_cache) -> None:
    """The emitted keys merged into a user's config pass Axolotl's own ``validate_config`` unchanged, and the
    sampler built from the validated values (as ``AxolotlTrainer._create_multipack_sampler`` builds it) packs
    the steps memplan priced."""
    import yaml

    from memplan.dataset import Fields, find_tokenizer
    from memplan.dataset.lengths import token_lengths

    config_module = pytest.importorskip("axolotl.utils.config", reason="Axolotl's config validation is not "
                                        "importable (it needs addict; requirements-nodeps.txt)")
    from axolotl.utils.dict import DictDefault

    model, data, emitted, document = fit_emit("axolotl", "axolotl", 2, 4)
    tmp_path = emitted.parent
    ours = yaml.safe_load(emitted.read_text())
    user = {"base_model": str(model), "datasets": [{"path": str(data), "type": "completion"}],
            "output_dir": str(tmp_path / "out"), "learning_rate": 2e-5, "bf16": False, "fp16": False}
    cfg = config_module.validate_config(DictDefault({**user, **ours}),
                                        capabilities={"bf16": False, "fp8": False, "n_gpu": 1, "n_node": 1},
                                        env_capabilities={"torch_version": "2.13.0"})
    for key, value in ours.items():
        assert cfg[key] == value, key  # nothing the file says is refused or rewritten
    assert (cfg.sample_packing_bin_size, cfg.sample_packing_group_size) == (BIN_SIZE, GROUP_SIZE)
    lengths, _ = token_lengths(str(data), Fields(text="text"), find_tokenizer(str(model), None))
    limit = cfg.sequence_len
    kept = lengths[(lengths >= MIN_SAMPLE_LEN) & (lengths <= limit)]
    order = torch_randperm(len(kept), cfg.seed)
    sampler = multipack.MultipackBatchSampler(order.tolist(), batch_size=1,
                                              batch_max_len=cfg.micro_batch_size * limit, lengths=kept,
                                              bin_size=cfg.sample_packing_bin_size,
                                              group_size=cfg.sample_packing_group_size, num_processes=1,
                                              drop_last=True)
    theirs = [sum(int(kept[i]) for i in batch[0]) for batch in sampler]
    steps = plan_steps(lengths, Batching(rule="axolotl", micro_batch_size=cfg.micro_batch_size, max_length=limit,
                                         seed=cfg.seed))
    assert steps.tokens.tolist() == theirs and len(theirs) > 3
    assert document["chosen"]["micro_batch_size"] == cfg.micro_batch_size
