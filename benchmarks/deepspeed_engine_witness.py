"""DeepSpeed's real engine (0.19.8) on CPU against memplan's ledger: ZeRO-1/2/3 at world size 1 and 2 (helper
zero17, session 17; ds16's and dsfree15's witnesses rebuilt and committed).

The engine runs with ``DS_ACCELERATOR=cpu`` and gloo, one process per rank, one launch per cell. The model is the
tiny4 Llama of tests/estimate/test_zero3_dtypes.py (4 layers, h 256, ffn 688, vocab 1000, untied, 3,676,416
parameters), torch AdamW (one parameter group), micro-batch 1, seq 32, ``reduce_bucket_size`` 1e5, two steps. The
census counts live storage bytes: every tensor the garbage collector sees plus every tensor autograd saved for the
backward (kept through ``saved_tensors_hooks``), each storage once. It is taken after ``deepspeed.initialize``,
after each decoder layer's forward and the loss (the second step's forward), after each decoder layer's backward and
at each collective and ZeRO reduction method (the backward), after the backward, at the entry and exit of the inner
optimizer's ``step`` and ZeRO-3's sub-group methods (the optimizer step), and after the step. Under
``offload_optimizer`` the host's tensors (the fp32 partitions, their gradients, the optimizer's moments, the bf16
staging copies of the partition and of one gradient) are named by identity and left out (the CPU accelerator puts "device" and host in one memory).

memplan's matching moments come from the ledger of the same job (``--gpus WORLD --seq 32 --deepspeed-config``):
the ``forward``, ``backward`` and ``optimizer step`` moments (allocated, less the CUDA workspaces), the model states at the ``end of backward``
and at the ``forward`` less what is absent then (after the step). Usage::

    PYTHONPATH=src python benchmarks/deepspeed_engine_witness.py OUT.json [Z1 Z2 ...]

Run against another tree by pointing PYTHONPATH at its ``src`` (memplan's figures; the engine's do not depend on
it). Results: benchmarks/results/deepspeed_engine_witness.json.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

TINY4 = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000, "tie_word_embeddings": False,
         "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "hidden_act": "silu"}
SEQ = 32
#: cell: (ZeRO stage, world size, extra zero_optimization keys, LoRA under zero.Init)
CELLS: dict[str, tuple[int, int, dict[str, Any], bool]] = {
    "Z1": (2, 1, {}, False),
    "Z2": (2, 2, {}, False),
    "Z3": (3, 1, {}, False),
    "Z4": (3, 2, {}, False),
    "Z5": (3, 2, {}, True),
    "Z6": (1, 2, {}, False),
    "Z7": (2, 1, {"offload_optimizer": {"device": "cpu"}}, False),
    # helper zero18, session 18 (fixed before any behaviour change; base f30d0e2)
    "Z8": (3, 2, {"stage3_prefetch_bucket_size": 2_000_000}, False),
    "Z9": (2, 2, {}, False),
    "Z10": (3, 2, {"stage3_param_persistence_threshold": 1_000}, True),
    "Z11": (3, 2, {}, True),
    # Z11 is ill-posed on the engine (stage3.py _create_fp16_partitions_with_defragmentation asserts one dtype over
    # the trained partitions: peft's fp32 adapters beside the bf16 copy of the zero.Init'd head); beside it, the
    # adapters kept in the base's bf16 (peft ``autocast_adapter_dtype=False``; memplan ``--adapter-dtype bf16``)
    "Z11b": (3, 2, {}, True),
}
#: cell: more of the run than CELLS says: ``groups`` (the HF Trainer's decay / no-decay parameter groups,
#: ``Trainer.get_decay_parameter_names``), ``modules_to_save`` (peft's, beside the LoRA adapters)
OPTIONS: dict[str, dict[str, Any]] = {"Z9": {"groups": True}, "Z11": {"modules_to_save": ["lm_head"]},
                                       "Z11b": {"modules_to_save": ["lm_head"], "adapter_dtype": "bf16"}}
TITLES = {"Z1": "ZeRO-2 bf16, world 1", "Z2": "ZeRO-2 bf16, world 2", "Z3": "ZeRO-3 bf16, world 1",
          "Z4": "ZeRO-3 bf16, world 2", "Z5": "ZeRO-3 bf16 zero.Init + LoRA r8 q,v, world 2",
          "Z6": "ZeRO-1 bf16, world 2", "Z7": "ZeRO-2 bf16 offload_optimizer cpu, world 1",
          "Z8": "ZeRO-3 bf16 stage3_prefetch_bucket_size 2e6 (2+ layers per prefetch), world 2",
          "Z9": "ZeRO-2 bf16, the HF Trainer's two parameter groups (decay / no-decay), world 2",
          "Z10": "ZeRO-3 bf16 zero.Init + LoRA r8 q,v, stage3_param_persistence_threshold 1e3 (adapters not "
                 "persistent), world 2",
          "Z11": "ZeRO-3 bf16 zero.Init + LoRA r8 q,v + modules_to_save lm_head, world 2",
          "Z11b": "ZeRO-3 bf16 zero.Init + LoRA r8 q,v in bf16 + modules_to_save lm_head, world 2"}
FIGURES = ("init", "forward", "backward", "after backward", "step", "after step")
#: Figures of their own (helper zero18), each the moment a memplan figure prices: ``loss (inside)`` at the exit of
#: ``cross_entropy`` (its fp32 input and log-softmax still alive; memplan's ``loss`` moment), ``backward (layer
#: entry)`` at each decoder layer's backward pre-hook (its parameters gathered, its activations alive; memplan's
#: ``backward``), ``end of backward`` inside the engine's reduction epilogue (ZeRO-1/2's ``reduce_gradients`` /
#: ``overlapping_partition_gradients_reduce_epilogue``, ZeRO-3's ``independent_gradient_partition_epilogue``, and each
#: ``copy_grads_in_partition`` there; memplan's ``end of backward``).
EXTRA = ("loss (inside)", "backward (layer entry)", "end of backward")
#: memplan's figure for each extra one
PRICED = {"loss (inside)": "loss", "backward (layer entry)": "backward", "end of backward": "end of backward"}


def ds_config(cell: str) -> dict[str, Any]:
    stage, _, extra, _ = CELLS[cell]
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                              "bf16": {"enabled": True},
                              "zero_optimization": {"stage": stage, "reduce_bucket_size": 100_000, **extra}}
    if extra.get("offload_optimizer"):
        # the Trainer's torch AdamW as a client optimizer beside ZeRO-Offload (DeepSpeedCPUAdam needs a C++ build)
        config["zero_force_ds_cpu_optimizer"] = False
        config["zero_allow_untested_optimizer"] = True
    return config


# ---------------------------------------------------------------- the engine (one rank) ----------------------------

class _Census:
    def __init__(self) -> None:
        import weakref

        self.saved: weakref.WeakSet[Any] = weakref.WeakSet()
        self.host: set[int] = set()
        self.phase = "init"
        self.most: dict[str, tuple[int, str]] = {}
        self.at: dict[str, int] = {}
        #: WITNESS_DETAIL: a function naming the live storages, and per phase its table at the phase's most live
        self.namer: Any = None
        self.detail: dict[str, dict[str, int]] = {}
        #: set inside the reduction epilogue: every census there is filed under this figure too
        self.also = ""

    def live(self) -> int:
        import torch

        seen: dict[int, int] = {}

        def add(t: Any) -> None:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                try:
                    s = t.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    return
                if s.data_ptr() and s.data_ptr() not in self.host:
                    seen[s.data_ptr()] = s.nbytes()

        for obj in gc.get_objects():
            add(obj)
        for box in list(self.saved):
            add(box.t)
        return sum(seen.values())

    def note(self, where: str, key: str = "") -> None:
        """Census now; ``key`` files it under a figure of its own (the phase's figure does not see it)."""
        if self.phase in ("init", "done"):
            return
        n = self.live()
        for phase in {key or self.phase, self.also} - {""}:
            if n > self.most.get(phase, (-1, ""))[0]:
                self.most[phase] = (n, where)
                if self.namer is not None:
                    self.detail[phase] = self.namer()


class _Box:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: Any) -> None:
        self.t = t


def _wrap(obj: Any, name: str, census: _Census, label: str) -> None:
    fn = getattr(obj, name, None)
    if fn is None:
        return

    def wrapped(*a: Any, **k: Any) -> Any:
        census.note(f"{label} entry")
        out = fn(*a, **k)
        census.note(f"{label} exit")
        return out

    setattr(obj, name, wrapped)


def _wrap_epilogue(obj: Any, name: str, census: _Census) -> None:
    """Census at the entry and exit of the reduction epilogue ``name``, and file every census inside it under
    ``end of backward`` too."""
    fn = getattr(obj, name, None)
    if fn is None:
        return

    def wrapped(*a: Any, **k: Any) -> Any:
        outer = census.also  # (the epilogues call one another)
        census.also = "end of backward" if census.phase == "backward" else outer
        census.note(f"{name} entry")
        try:
            out = fn(*a, **k)
            census.note(f"{name} exit")
        finally:
            census.also = outer
        return out

    setattr(obj, name, wrapped)


def _wrap_inside_epilogue(obj: Any, name: str, census: _Census) -> None:
    """Census at the entry and exit of ``name`` only while the reduction epilogue runs (its own figure)."""
    fn = getattr(obj, name, None)
    if fn is None:
        return

    def wrapped(*a: Any, **k: Any) -> Any:
        if census.also:
            census.note(f"{name} entry", census.also)
        out = fn(*a, **k)
        if census.also:
            census.note(f"{name} exit", census.also)
        return out

    setattr(obj, name, wrapped)


def _watch_loss(census: _Census) -> None:
    """Census at the exit of ``torch.nn.functional.cross_entropy`` (HF's loss calls it by attribute), its fp32
    input still alive in the caller's frame and the log-softmax output saved: a figure of its own."""
    import torch.nn.functional as F

    ce = F.cross_entropy

    def cross_entropy(*a: Any, **k: Any) -> Any:
        out = ce(*a, **k)
        census.note("cross_entropy exit", "loss (inside)")
        return out

    F.cross_entropy = cross_entropy


def _watch_casts(census: _Census) -> None:
    """The step's flat 16-bit gradient cast to fp32 (``flatten(...).to(fp32)``): census at the cast's exit, while
    its input is still alive (a Python frame holds it), for casts of at least 1e5 elements."""
    import torch

    cast = torch.Tensor.to

    def to(self: Any, *a: Any, **k: Any) -> Any:
        out = cast(self, *a, **k)
        if census.phase == "step" and out is not self and out.numel() >= 100_000:
            census.note(f"{self.dtype}->{out.dtype} cast of {out.numel():,}")
        return out

    torch.Tensor.to = to  # type: ignore[method-assign]


def _host_tensors(engine: Any) -> set[int]:
    import torch

    opt, ptrs = engine.optimizer, set()
    tensors = list(getattr(opt, "single_partition_of_fp32_groups", []))
    tensors += [t.grad for t in tensors if t.grad is not None]
    for state in opt.optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    tensors += list(getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", []))  # the bf16 staging copy
    if getattr(opt, "temp_grad_buffer_for_cpu_offload", None) is not None:  # (its _gpu_ twin is on the device)
        tensors.append(opt.temp_grad_buffer_for_cpu_offload)
    for name in ("accumulated_grads_in_cpu",):
        tensors += list(getattr(opt, name, {}).values())
    for t in tensors:
        ptrs.add(t.untyped_storage().data_ptr())
    return ptrs


def run_rank(cell: str, out: str) -> None:  # noqa: PLR0915 - one witness, read top to bottom
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    stage, world, extra, lora = CELLS[cell]
    options = OPTIONS.get(cell, {})
    torch.manual_seed(0)
    config = ds_config(cell)
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = LlamaConfig(**{k: v for k, v in TINY4.items() if k != "model_type"})
    if lora:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = LlamaForCausalLM(cfg)
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                 modules_to_save=options.get("modules_to_save")),
                               autocast_adapter_dtype=options.get("adapter_dtype") != "bf16")
    else:
        model = LlamaForCausalLM(cfg)
    census = _Census()
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if options.get("groups"):  # the HF Trainer's create_optimizer: weight decay on all but biases and norms
        from transformers import Trainer

        decay = set(Trainer.get_decay_parameter_names(None, model))  # (it reads no attribute of the Trainer)
        groups = [{"params": [p for n, p in trained if n in decay], "weight_decay": 0.0},
                  {"params": [p for n, p in trained if n not in decay], "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=1e-4)
    else:
        optimizer = torch.optim.AdamW([p for _, p in trained], lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if extra.get("offload_optimizer"):
        census.host = _host_tensors(engine)
    gc.collect()
    census.at["init"] = census.live()
    if os.environ.get("WITNESS_DETAIL"):
        census.namer = lambda: _census_detail(engine, census)
    for name in ("all_reduce", "reduce_scatter_tensor"):
        _wrap(dist, name, census, f"dist.{name}")
    opt = engine.optimizer
    for name in ("reduce_ipg_grads", "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads",
                 "_optimizer_step", "_prepare_fp32_grad_for_sub_group", "flatten", "flatten_dense_tensors_aligned"):
        _wrap(opt, name, census, name)
    _wrap(opt.optimizer, "step", census, "inner optimizer step")
    for name in ("reduce_gradients", "overlapping_partition_gradients_reduce_epilogue",
                 "independent_gradient_partition_epilogue"):
        _wrap_epilogue(opt, name, census)
    _wrap_inside_epilogue(opt, "copy_grads_in_partition", census)
    _watch_casts(census)
    _watch_loss(census)
    layers = [m for n, m in engine.module.named_modules() if type(m).__name__ == "LlamaDecoderLayer"]
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda *_a, i=i: census.note(f"layer {i} forward"))
        layer.register_full_backward_hook(lambda *_a, i=i: census.note(f"layer {i} backward"))
        # a figure of its own: the layer's own parameters still gathered (helper zlora17; always since zero18)
        layer.register_full_backward_pre_hook(
            lambda *_a, i=i: census.note(f"layer {i} backward entry", "backward (layer entry)"))
    ids = torch.randint(0, TINY4["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(dist.get_rank()))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: _box(census, t), lambda b: b.t):
        for step in range(2):
            census.phase = "forward" if step else "done"
            loss = engine(input_ids=ids, labels=ids).loss
            census.note("loss")
            census.phase = "backward" if step else "done"
            engine.backward(loss)
            del loss
            gc.collect()
            if step:
                census.at["after backward"] = census.live()
            census.phase = "step" if step else "done"
            engine.step()
            census.phase = "done"
            gc.collect()
            if extra.get("offload_optimizer"):
                census.host = _host_tensors(engine)
    census.at["after step"] = census.live()
    if os.environ.get("WITNESS_DEBUG"):
        _debug(engine, census)
    result = {"rank": dist.get_rank(), "optimizer": type(opt).__name__, **census.at,
              **{k: v[0] for k, v in census.most.items()}, "where": {k: v[1] for k, v in census.most.items()}}
    if census.detail:
        result["detail"] = census.detail
    if lora:
        adapters = [p for n, p in engine.module.named_parameters() if "lora_" in n]
        result["adapter dtype"] = str(adapters[0].dtype)
        result["adapter elements"] = sum(getattr(p, "ds_numel", p.numel()) for p in adapters)
    Path(out).write_text(json.dumps(result))


def _debug(engine: Any, census: _Census) -> None:
    """Name the large storages the census counts after the step by the optimizer attribute holding them."""
    import torch

    names: dict[int, str] = {}
    for owner, prefix in ((engine.optimizer, "opt"), (engine, "engine")):
        for name, value in vars(owner).items():
            items = value if isinstance(value, (list, tuple)) else (
                list(value.values()) if isinstance(value, dict) else [value])
            for item in items:
                for t in (item if isinstance(item, (list, tuple)) else [item]):
                    if isinstance(t, torch.Tensor):
                        names.setdefault(t.untyped_storage().data_ptr(), f"{prefix}.{name}")
    sizes: dict[int, tuple[int, str]] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
            ptr = obj.untyped_storage().data_ptr()
            if ptr and ptr not in census.host and obj.untyped_storage().nbytes() >= 100_000:
                sizes[ptr] = (obj.untyped_storage().nbytes(), f"{obj.dtype} {tuple(obj.shape)}")
    for ptr, (n, what) in sorted(sizes.items(), key=lambda kv: -kv[1][0]):
        print(f"{n:>12,} {what:30} {names.get(ptr, '?')}", file=sys.stderr)


def _census_detail(engine: Any, census: _Census) -> dict[str, int]:
    """WITNESS_DETAIL: the live storages by what holds them (bytes per kind; each gathered parameter and each
    parameter's gradient by name): a parameter's gathered copy (``param.data`` while ZeRO-3 has it available), its
    partition (``ds_tensor``), its ``.grad``, the optimizer's flat buffers and moments by attribute, the rest by
    dtype and shape (autograd's saved tensors and the activations among them)."""
    import torch

    names: dict[int, str] = {}
    for name, p in engine.module.named_parameters():
        ptr = p.data.untyped_storage().data_ptr() if p.data.numel() else 0
        short = name.replace("base_model.model.", "")
        if ptr:
            names[ptr] = f"gathered {short}" if hasattr(p, "ds_tensor") else f"param {short}"
        if getattr(p, "ds_tensor", None) is not None and p.ds_tensor.numel():
            names.setdefault(p.ds_tensor.untyped_storage().data_ptr(), "partition (bf16/fp32 ds_tensor)")
        if p.grad is not None:
            names.setdefault(p.grad.untyped_storage().data_ptr(), f"grad {short}")
    for owner, prefix in ((engine.optimizer, "opt"), (getattr(engine.optimizer, "optimizer", None), "inner")):
        for attr, value in vars(owner or object()).items():
            items = value if isinstance(value, (list, tuple)) else (
                list(value.values()) if isinstance(value, dict) else [value])
            for item in items:
                for t in (item if isinstance(item, (list, tuple)) else [item]):
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr():
                        names.setdefault(t.untyped_storage().data_ptr(), f"{prefix}.{attr}")
    for state in engine.optimizer.optimizer.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.numel() > 1:
                names.setdefault(t.untyped_storage().data_ptr(), "optimizer moments")
    seen: dict[int, tuple[int, str]] = {}

    def add(t: Any, kind: str) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return
            if s.data_ptr() and s.data_ptr() not in census.host and s.data_ptr() not in seen:
                seen[s.data_ptr()] = (s.nbytes(), names.get(s.data_ptr(), f"{kind} {t.dtype}"))

    for obj in gc.get_objects():
        add(obj, "other")
    for box in list(census.saved):
        add(box.t, "saved")
    table: dict[str, int] = {}
    for nbytes, what in seen.values():
        table[what] = table.get(what, 0) + nbytes
    return dict(sorted(table.items(), key=lambda kv: -kv[1]))


def _box(census: _Census, t: Any) -> _Box:
    box = _Box(t)
    census.saved.add(box)
    return box


def engine_cell(cell: str) -> list[dict[str, Any]]:
    world = CELLS[cell][1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(world):
            env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen([sys.executable, __file__, "--rank", cell, f"{tmp}/{rank}.json"], env=env,
                                          stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/{rank}.err", "w")))
        codes = [p.wait(timeout=float(os.environ.get("WITNESS_TIMEOUT", "1800"))) for p in procs]
        if any(codes):
            raise RuntimeError(f"{cell}: {codes}\n" + Path(f"{tmp}/0.err").read_text()[-3000:])
        return [json.loads(Path(f"{tmp}/{r}.json").read_text()) for r in range(world)]


# ---------------------------------------------------------------- memplan's ledger ---------------------------------

STATES = ("parameters", "gradients", "master", "optimizer")


def memplan_cell(cell: str) -> dict[str, Any]:
    from memplan.estimate.engine import _stage_parts
    from memplan.estimate.memo import Same
    from memplan.inputs import JobRequest, load_job

    _, world, _, lora = CELLS[cell]
    options = OPTIONS.get(cell, {})
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(TINY4))
        (Path(tmp) / "ds.json").write_text(json.dumps(ds_config(cell)))
        flags: dict[str, Any] = {"gpus": world, "seq": SEQ, "deepspeed_config": str(Path(tmp) / "ds.json")}
        if lora:
            flags.update(peft="lora", lora_rank=8, lora_targets="q_proj,v_proj")
        if options.get("modules_to_save"):
            flags["modules_to_save"] = ",".join(options["modules_to_save"])
        if options.get("adapter_dtype"):
            flags["adapter_dtype"] = options["adapter_dtype"]
        loaded = load_job(JobRequest(model=str(Path(tmp) / "config.json"), flags=flags))
        _, parts = _stage_parts(Same(loaded.model), loaded.job, 0.0)
    ledger = parts[0][2].ledger

    # the buffers kept between steps, by their sentences: ZeRO-3's reduce bucket and persistent parameters
    kept = ledger.total("communication") + sum(
        c.nbytes for c in ledger.entries if c.category == "communication" and c.live
        and ("ZeRO-3 reduce bucket:" in c.note or "persistent parameters:" in c.note))

    def states(phase: str) -> int:
        return sum(ledger.total(c, phase) for c in STATES) - ledger.total("absent", phase) + kept

    def at(phase: str) -> int:  # the CUDA workspaces memplan prices are no part of the CPU engine's census
        return ledger.allocated_at(phase) - ledger.total("workspace", phase)

    return {"forward": max(at("forward"), at("loss")), "backward": at("backward"), "after backward": states("end of backward"),
            "step": at("optimizer step"), "after step": states("forward"), "peak": ledger.peak().phase,
            "loss": at("loss"), "end of backward": at("end of backward")}


def main(argv: list[str]) -> None:
    if argv[0] == "--rank":
        run_rank(argv[1], argv[2])
        return
    out, cells = Path(argv[0]), argv[1:] or list(CELLS)
    results = json.loads(out.read_text()) if out.exists() else {}
    for cell in cells:
        engine = results.get(cell, {}).get("engine") if "--memplan-only" in os.environ.get("WITNESS", "") else None
        results[cell] = {"title": TITLES[cell], "engine": engine or engine_cell(cell)}
        out.write_text(json.dumps(results, indent=1))
        results[cell]["memplan"] = memplan_cell(cell)
        row = results[cell]
        print(f"{cell} {TITLES[cell]} ({row['engine'][0]['optimizer']})")
        extra = tuple(fig for fig in EXTRA if any(fig in r for r in row["engine"]))
        for fig in FIGURES + extra:  # memplan prices the worst GPU: against the rank holding the most
            e0 = max(row["engine"], key=lambda r, fig=fig: r.get(fig, 0))
            eng = " / ".join(f"{r.get(fig, 0):,}" for r in row["engine"])
            mp = row["memplan"].get(PRICED.get(fig, fig))
            rel = f"{(mp - e0[fig]) / e0[fig]:+.2%}" if mp and e0.get(fig) else ""
            where = f"rank {e0['rank']} " * (len(row["engine"]) > 1) + e0["where"].get(fig, "")
            print(f"  {fig:15} engine {eng:>26} {where:42} memplan {mp or 0:>12,} {rel}")
        out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
