"""What each key of a DeepSpeed JSON config does to memplan's estimate: modelled, no memory effect, not modelled.

Every key DeepSpeed reads (``deepspeed_key_list.txt``, extracted from DeepSpeed's sources by
``scripts/extract_deepspeed_keys.py``; its first line names the DeepSpeed version and commit) is
classified here, by exact dotted key or, where a whole section has one honest answer (monitors,
profilers, free-form sub-keys), by section. :func:`deepspeed_settings` turns a config into one
:class:`~memplan.settings.InputSetting` per key it contains (leaves, dotted). A key DeepSpeed does not
know is "not modelled" ("not a DeepSpeed config key"). ``"auto"`` (Hugging Face's integration fills
it in) is reported as such. Example::

    >>> [s.effect for s in deepspeed_settings({"bf16": {"enabled": True}, "wandb": {"enabled": True}})]
    ['modelled', 'no-memory-effect']

Known limitations: the classification is by key, with a few value rules (a switch left off, a
value equal to what memplan assumes); what memplan assumes for the rest is in each note.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from typing import Any

from memplan.settings import Effect, InputSetting, dotted_leaves

__all__ = ["KEYS", "SECTIONS", "classify", "deepspeed_key_list", "deepspeed_settings"]

_M: Effect = "modelled"
_N: Effect = "no-memory-effect"
_U: Effect = "not-modelled"


def _group(effect: Effect, note: str, *keys: str) -> dict[str, tuple[Effect, str]]:
    return {key: (effect, note) for key in keys}


_Z = "zero_optimization."
_Z3 = "ZeRO-3 parameter gathering"
#: Exact keys (they win over the section rules below).
KEYS: dict[str, tuple[Effect, str]] = {
    # What memplan reads (deepspeed_config.job_with_deepspeed).
    **_group(_M, "the job's batch (--mbs / --gbs)", "train_batch_size", "train_micro_batch_size_per_gpu",
             "gradient_accumulation_steps"),
    **_group(_M, "--zero", _Z + "stage"),
    **_group(_M, "cpu or nvme → the optimizer states leave the GPU (--offload-optimizer); none → on "
             "the GPU", _Z + "offload_optimizer.device"),
    **_group(_M, "cpu or nvme → the parameters leave the GPU (--offload-params); none → on the GPU",
             _Z + "offload_param.device"),
    **_group(_M, "true: 16-bit weights with fp32 master weights (--precision bf16-mixed / fp16-mixed); false with "
             "neither enabled: --precision fp32", "bf16.enabled", "bfloat16.enabled", "fp16.enabled"),
    **_group(_M, "--optimizer (adam, adamw, fusedadam, onebitadam, sgd; other types are refused)", "optimizer.type"),
    **_group(_M, "SGD's momentum buffer (read for type sgd)", "optimizer.params.momentum"),
    # Run control and logging.
    **_group(_N, "logging / run control", "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state",
             "log_level", "dataloader_drop_last", "zero_allow_untested_optimizer", "managed_gradient_accumulation",
             "use_data_before_expert_parallelism", "optimizer.legacy_fusion"),
    **_group(_N, "gradient arithmetic (scaling, clipping, reduce op); no buffers beyond the ones priced",
             "gradient_clipping", "prescale_gradients", "gradient_predivide_factor", "gradient_allreduce_op",
             "disable_allgather"),
    **_group(_N, "picks DeepSpeedCPUAdam for offloaded states (host memory)", "zero_force_ds_cpu_optimizer"),
    **_group(_M, "the gradients' reduction copies its bucket to this dtype where the gradients are in another "
             "(priced per ZeRO stage)", "communication_data_type"),
    **_group(_U, "the dtype of DeepSpeed-Ulysses' sequence-parallel gradient reductions; not priced",
             "seq_parallel_communication_data_type"),
    **_group(_U, "sparse embedding gradients (smaller gradient all-reduce); memplan prices dense gradients",
             "sparse_gradients"),
    **_group(_U, "CUDA-graph capture keeps a private memory pool", "graph_harvesting"),
    **_group(_U, "DeepSpeed-Ulysses sequence parallelism / its device mesh (activations split by sequence); "
             "memplan takes --cp and data parallelism from the flags", "sequence_parallel_size",
             "data_parallel_size"),
    # Precision details memplan does not price.
    **_group(_N, "loss-scaling / overflow checks", "fp16.loss_scale", "fp16.initial_scale_power",
             "fp16.loss_scale_window", "fp16.hysteresis", "fp16.consecutive_hysteresis", "fp16.min_loss_scale",
             "bf16.check_grad_overflow", "bfloat16.check_grad_overflow"),
    **_group(_U, "keeps master weights and gradients in 16 bits (no fp32 copies); memplan prices fp32 master "
             "weights and gradients", "fp16.fp16_master_weights_and_grads", "bf16.bf16_master_weights_and_grads",
             "bfloat16.bf16_master_weights_and_grads"),
    **_group(_U, "keeps the optimizer states in bf16; memplan prices fp32 states", "bf16.bf16_optimizer_states",
             "bfloat16.bf16_optimizer_states"),
    **_group(_U, "applies each gradient to the fp32 gradient buffer at once (frees the 16-bit gradients early)",
             "bf16.immediate_grad_update", "bfloat16.immediate_grad_update"),
    **_group(_U, "autocasts the forward (fp32 weights cast per op); memplan prices DeepSpeed's 16-bit weights",
             "fp16.auto_cast"),
    **_group(_U, "DeepSpeed's torch.autocast mode: fp32 weights cast per op; memplan prices the bf16/fp16 "
             "sections' 16-bit weights with fp32 master copies", "torch_autocast.enabled", "torch_autocast.dtype",
             "torch_autocast.lower_precision_safe_modules"),
    **_group(_U, "dtype of parameters / buffers; memplan takes dtypes from the precision sections",
             "data_types.param_dtype", "data_types.buffer_dtype"),
    "data_types.grad_accum_dtype": (_U, ("the gradients' dtype (--grad-dtype), read with ZeRO; DeepSpeed refuses a "
                                    "dtype other than the model's without it")),
    **_group(_U, "NVIDIA apex AMP (its opt_level decides the weight copies); memplan prices DeepSpeed's own "
             "bf16/fp16 modes", "amp.enabled"),
    # ZeRO buffers and schedules memplan does not model (at ZeRO-3 some are priced: _STAGE3 below).
    # The ZeRO optimizers' buckets: priced per stage (_STAGE12, _STAGE3), read by no stage-0 engine (_STAGE0).
    _Z + "reduce_bucket_size": (_U, "the ZeRO optimizers' gradient reduce bucket"),
    _Z + "allgather_bucket_size": (_U, "ZeRO-1/2 parameter all-gather bucket after the step; not priced"),
    **_group(_U, "ZeRO: copies gradients into the preallocated reduce bucket (false: none)",
             _Z + "contiguous_gradients"),
    **_group(_U, "ZeRO: overlapping communication; not priced", _Z + "overlap_comm"),
    **_group(_U, "ZeRO-3: false reduces through the contiguous path (__avg_scatter_contiguous_grads); not priced",
             _Z + "reduce_scatter"),
    **_group(_U, "ZeRO-1/2 reduction / all-gather collectives' grouping; not priced",
             _Z + "use_multi_rank_bucket_allreduce", _Z + "allgather_partitions"),
    **_group(_N, "the ZeRO-3 optimizer's sub-groups: read only at ZeRO stage 3", _Z + "sub_group_size"),
    **_group(_N, f"{_Z3}: read only at ZeRO stage 3", _Z + "prefetch_bucket_size", _Z + "stage3_prefetch_bucket_size",
             _Z + "max_live_parameters", _Z + "stage3_max_live_parameters", _Z + "max_reuse_distance",
             _Z + "stage3_max_reuse_distance"),
    **_group(_N, f"{_Z3}: read only at ZeRO stage 3",
             _Z + "param_persistence_threshold", _Z + "stage3_param_persistence_threshold",
             _Z + "model_persistence_threshold", _Z + "stage3_model_persistence_threshold"),
    **_group(_U, f"{_Z3}: module fetch granularity / fetch collective; not priced", _Z + "module_granularity_threshold",
             _Z + "stage3_module_granularity_threshold", _Z + "use_all_reduce_for_fetch_params",
             _Z + "stage3_use_all_reduce_for_fetch_params", _Z + "allgather_sequential",
             _Z + "stage3_allgather_sequential", _Z + "leaf_module.classes", _Z + "leaf_module.names",
             _Z + "leaf_module.name_suffixes"),
    **_group(_U, "gathers full 16-bit weights at checkpoint save; memplan prices training steps",
             _Z + "gather_16bit_weights_on_model_save", _Z + "stage3_gather_16bit_weights_on_model_save",
             _Z + "stage3_gather_fp16_weights_on_model_save"),
    **_group(_U, "ZeRO++: hierarchical partitioning keeps a secondary weight shard per node; not priced",
             _Z + "zero_hpz_partition_size"),
    **_group(_U, "ZeRO++ quantized communication buffers; not priced", _Z + "zero_quantized_weights",
             _Z + "zero_quantized_nontrainable_weights", _Z + "zero_quantized_gradients"),
    **_group(_U, "MiCS shards over a sub-group (more memory per GPU than ZeRO-3 over all); memplan shards over "
             "all data-parallel GPUs", _Z + "mics_shard_size", _Z + "mics_hierarchical_params_gather"),
    **_group(_U, "ZeRO-3's memory-efficient linear (does not save the gathered weight for backward); not priced",
             _Z + "memory_efficient_linear"),
    **_group(_U, "legacy CPU offload switches (use offload_optimizer / offload_param); not read by memplan",
             _Z + "cpu_offload", _Z + "cpu_offload_param", _Z + "cpu_offload_use_pin_memory"),
    **_group(_N, "checkpoint loading / checks / stage-1 implementation choice", _Z + "load_from_fp32_weights",
             _Z + "elastic_checkpoint", _Z + "ignore_unused_parameters", _Z + "legacy_stage1",
             _Z + "round_robin_gradients", _Z + "enable_sanity_checks", _Z + "log_trace_cache_warnings",
             _Z + "override_module_apply", _Z + "pipeline_loading_checkpoint",
             _Z + "save_muon_momentum_buffer_in_memory"),
    # Offload details: host-side settings, and the ones that change GPU memory.
    **_group(_N, "host-side offload setting (pinned host memory, NVMe paths, CPU threads)",
             _Z + "offload_optimizer.pin_memory", _Z + "offload_optimizer.nvme_path",
             _Z + "offload_optimizer.buffer_count", _Z + "offload_optimizer.pipeline_read",
             _Z + "offload_optimizer.pipeline_write", _Z + "offload_optimizer.fast_init",
             _Z + "offload_optimizer.cpuadam_cores_perc", _Z + "offload_param.pin_memory",
             _Z + "offload_param.nvme_path", _Z + "offload_param.max_in_cpu"),
    **_group(_U, "NVMe parameter swap buffers (buffer_count x buffer_size elements) staged in pinned memory; "
             "not priced", _Z + "offload_param.buffer_count", _Z + "offload_param.buffer_size"),
    _Z + "offload_optimizer.ratio": (_U, ("partial offload: this fraction of the optimizer states leaves the GPU; "
                                     "memplan offloads all or none")),
    _Z + "offload_optimizer.super_offload": (_U, "SuperOffload (pipelined CPU optimizer for superchips); not priced"),
    # Activation checkpointing (deepspeed.checkpointing, used by Megatron-DeepSpeed models).
    "activation_checkpointing.partition_activations": (_M, ("--partition-activations: each tensor-parallel rank "
                                                       "keeps 1/tp of every layer input --recompute full "
                                                       "checkpoints, gathered in its backward (no effect "
                                                       "without --recompute full)")),
    "activation_checkpointing.cpu_checkpointing": (_M, ("--cpu-checkpointing: the checkpointed layer inputs "
                                                   "are kept in CPU memory and fetched in their backward (no "
                                                   "effect without --recompute full)")),
    "activation_checkpointing.contiguous_memory_optimization": (_M, ("--contiguous-checkpoints: partitions are "
                                                                "copied into number_checkpoints preallocated "
                                                                "buffers; needs partition_activations")),
    "activation_checkpointing.number_checkpoints": (_M, ("sizes the contiguous checkpoint buffers "
                                                    "(--contiguous-checkpoints N; read with "
                                                    "contiguous_memory_optimization)")),
    **_group(_N, "synchronisation / timing of each checkpoint call; no tensors kept",
             "activation_checkpointing.synchronize_checkpoint_boundary", "activation_checkpointing.profile"),
    # Pipeline engine.
    **_group(_U, "DeepSpeed's pipeline engine; memplan takes --pp / --recompute from the flags and splits layers "
             "evenly", "pipeline.stages", "pipeline.partition", "pipeline.activation_checkpoint_interval",
             "pipeline.pipe_partitioned", "pipeline.grad_partitioned"),
    "pipeline.seed_layers": (_N, "random seeds per layer"),
    "aio.use_gds": (_U, "GPUDirect Storage stages NVMe swaps in GPU buffers; not priced"),
}

_GATHERED = ("sizes the gathered parameters (memplan.estimate.zero3_buffers: the module computing with what the "
             "prefetcher fetches ahead up to stage3_max_live_parameters, or the parameters kept for reuse within "
             "stage3_max_reuse_distance, whichever is more)")
#: At ZeRO stage 3 (they win over :data:`KEYS` there): the keys :mod:`memplan.estimate.zero3_buffers` prices.
_STAGE3: dict[str, tuple[Effect, str]] = {
    _Z + "reduce_bucket_size": (_M, ("the ZeRO-3 gradient reduce bucket, allocated when the optimizer is built "
                                "(\"auto\": Hugging Face's hidden_size^2)")),
    _Z + "contiguous_gradients": (_M, "true (DeepSpeed's default): ZeRO-3 keeps the reduce bucket; false: none"),
    _Z + "sub_group_size": (_M, ("the optimizer step's largest sub-group: its fp32 gradient is made from the 16-bit "
                            "gradient partition (memplan.estimate.zero3_buffers)")),
    _Z + "overlap_comm": (_N, ("ZeRO-3 reduces on a side stream with its one bucket per communication dtype; no "
                          "second buffer (stage3.py ipg_buckets)")),
    **_group(_M, _GATHERED + "; \"auto\": Hugging Face's int(0.9 * hidden_size^2)", _Z + "prefetch_bucket_size",
             _Z + "stage3_prefetch_bucket_size"),
    **_group(_M, _GATHERED, _Z + "max_live_parameters", _Z + "stage3_max_live_parameters", _Z + "max_reuse_distance",
             _Z + "stage3_max_reuse_distance"),
    **_group(_M, ("parameter tensors of at most this many elements stay gathered on every GPU for the whole step "
                  "(\"auto\": Hugging Face's 10 * hidden_size); the model threshold caps their total"),
             _Z + "param_persistence_threshold", _Z + "stage3_param_persistence_threshold",
             _Z + "model_persistence_threshold", _Z + "stage3_model_persistence_threshold"),
    "communication_data_type": (_M, ("the ZeRO-3 reduce bucket's dtype, and the reduction's copy of the gradients "
                                "it reduces in that dtype (memplan.estimate.zero3_buffers)")),
}
#: At ZeRO stages 1 and 2 (they win over :data:`KEYS` there): the reduce buckets :mod:`memplan.estimate.zero12_bucket`
#: prices.
_STAGE12: dict[str, tuple[Effect, str]] = {
    _Z + "reduce_bucket_size": (_M, ("the ZeRO-1/2 gradient reduce bucket, set up by each backward at this size "
                                "whatever the model's (\"auto\": Hugging Face's hidden_size^2)")),
    _Z + "contiguous_gradients": (_M, "true (DeepSpeed's default): ZeRO-1/2 keeps the reduce bucket; false: none"),
    _Z + "overlap_comm": (_M, "ZeRO-1/2 double-buffers the reduce bucket (DeepSpeed's default below stage 3: off)"),
    "communication_data_type": (_M, ("each ZeRO-1/2 reduction copies its bucket (or one larger parameter; "
                                "BF16_Optimizer: its whole fp32 gradient buffer) to this dtype where the gradients "
                                "are in another (memplan.estimate.zero12_bucket)")),
    _Z + "reduce_scatter": (_N, ("ZeRO-1/2 reduce each bucket through its copy in communication_data_type on both "
                            "paths; false (all-reduce) allocates nothing more (measured on DeepSpeed 0.19.8)")),
}
#: At ZeRO stage 0 (they win over :data:`KEYS` there): keys only DeepSpeed's ZeRO optimizers read.
_STAGE0: dict[str, tuple[Effect, str]] = _group(
    _N, ("read only by DeepSpeed's ZeRO optimizers (stages 1 to 3): at stage 0 the engine all-reduces the gradients "
         "in buckets of its own fixed 5e8 elements (engine.py MEMORY_OPT_ALLREDUCE_SIZE), whatever this says"),
    _Z + "reduce_bucket_size", _Z + "contiguous_gradients", _Z + "overlap_comm", _Z + "reduce_scatter",
    _Z + "allgather_bucket_size", _Z + "use_multi_rank_bucket_allreduce", _Z + "allgather_partitions") | {
    "communication_data_type": (_M, ("without ZeRO the engine's all-reduce copies its flattened bucket (up to 5e8 "
                                     "elements and the tensor that passes them) to this dtype where the gradients "
                                     "are in another (memplan.estimate.ds_allreduce)"))}
#: ``data_types.grad_accum_dtype`` per ZeRO stage (it wins over :data:`KEYS` there).
_GRAD_ACCUM: dict[Any, tuple[Effect, str]] = {
    1: (_M, ("the gradients' dtype (--grad-dtype): with bf16 weights and fp32, DeepSpeed's BF16_Optimizer keeps an "
             "fp32 gradient buffer of the whole model beside the bf16 param.grad (both priced); otherwise the ZeRO-1 "
             "optimizer's grad_accum gradients and its reduce bucket in this dtype")),
    2: (_M, "the gradients' dtype (--grad-dtype): DeepSpeed's gradient partitions (ZeRO-2's averaged_gradients)"),
    3: (_M, ("the gradients' dtype (--grad-dtype): DeepSpeed's gradient partitions (ZeRO-3's "
             "grad_partitions_flat_buffer)")),
}

#: Section rules: every key at or under the prefix not in :data:`KEYS` (longest prefix wins).
SECTIONS: dict[str, tuple[Effect, str]] = {
    **_group(_N, "monitoring / logging", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "timers"),
    **_group(_N, "profiling (counts FLOPs with hooks; no tensors kept)", "flops_profiler"),
    **_group(_N, "checkpoint storage (host / disk)", "checkpoint", "nebula", "datastates_ckpt"),
    **_group(_N, "the autotuner's search runs separate trial jobs; this config's own settings are what train",
             "autotuning"),
    **_group(_N, "learning-rate schedule", "scheduler"),
    **_group(_N, "optimizer hyper-parameter", "optimizer.params"),
    **_group(_N, "host-side NVMe I/O settings", "aio"),
    "amp": (_U, "apex AMP option (decides the weight copies); not priced"),
    "elasticity": (_U, ("elastic training picks the batch and GPU count at launch; memplan prices the config's "
                   "batch and --gpus")),
    "eigenvalue": (_U, "eigenvalue estimation runs extra backward passes with create_graph; not priced"),
    "progressive_layer_drop": (_U, "skips layers at random (fewer activations); memplan prices every layer"),
    "sparse_attention": (_U, "DeepSpeed block-sparse attention kernels; memplan prices dense attention"),
    "compression_training": (_U, ("compression training (quantization / pruning masks, layer reduction); not "
                             "priced")),
    "quantize_training": (_U, "MoQ quantize-aware training; not priced"),
    "weight_quantization": (_U, "weight quantization; not priced"),
    "data_efficiency": (_U, ("curriculum learning / random-LTD change the tokens per step and layer; memplan "
                        "prices the full --seq")),
    "curriculum_learning": (_U, ("legacy curriculum learning changes the sequence length per step; memplan "
                            "prices the full --seq")),
    "hybrid_engine": (_U, "RLHF hybrid engine (inference containers, KV cache); not priced"),
    "compile": (_U, "DeepCompile (its own offload / activation-freeing passes); memplan prices eager DeepSpeed"),
    "tensor_parallel": (_U, "AutoTP training; memplan takes --tp from the flags"),
    "expert_parallel": (_U, "AutoEP expert parallelism; memplan takes --ep from the flags"),
    _Z + "zenflow": (_U, "ZenFlow (stall-free offload: selected gradients stay on the GPU); not priced"),
    _Z + "zeropp_loco_param": (_U, "ZeRO++ LoCo error-feedback buffers for quantized gradients; not priced"),
}

#: Values that leave a not-modelled switch with no effect (DeepSpeed's default off state).
_OFF: dict[str, Any] = {
    "fp16.auto_cast": False,
    "fp16.fp16_master_weights_and_grads": False, "bf16.bf16_master_weights_and_grads": False,
    "bf16.bf16_optimizer_states": False, "bf16.immediate_grad_update": False,
    "bfloat16.bf16_master_weights_and_grads": False, "bfloat16.bf16_optimizer_states": False,
    "bfloat16.immediate_grad_update": False, "sparse_gradients": False,
    "graph_harvesting": False, "aio.use_gds": False, _Z + "zero_quantized_weights": False,
    _Z + "zero_quantized_nontrainable_weights": False, _Z + "zero_quantized_gradients": False,
    _Z + "zero_hpz_partition_size": 1, _Z + "mics_shard_size": -1, _Z + "cpu_offload": False,
    _Z + "cpu_offload_param": False, "torch_autocast.enabled": False, "amp.enabled": False,
    _Z + "offload_optimizer.ratio": 1.0,
}
#: Offload devices whose ``nvme`` value is only half modelled: the GPU side is exact (the states
#: leave the GPU as with ``cpu``); the host side is not (disk behind pinned swap buffers).
_NVME_DEVICE_KEYS = frozenset({_Z + "offload_optimizer.device", _Z + "offload_param.device"})
_NVME_NOTE = ("NVMe offload: GPU memory is priced (the states leave the GPU, as with cpu), but memplan's "
              "host-memory figure counts them as CPU memory; DeepSpeed keeps them on disk behind pinned swap "
              "buffers that are not priced")
_AUTO = "\"auto\": Hugging Face's DeepSpeed integration fills it in from TrainingArguments; "


def deepspeed_key_list() -> tuple[str, ...]:
    """DeepSpeed's dotted config keys (``section.*``: free-form sub-keys), from the shipped list."""
    text = resources.files("memplan.frameworks").joinpath("deepspeed_key_list.txt").read_text()
    return tuple(line for line in text.splitlines() if line and not line.startswith("#"))


def _known(key: str, known: frozenset[str]) -> bool:
    parts = key.split(".")
    return key in known or any(".".join(parts[:i]) + ".*" in known for i in range(1, len(parts)))


def classify(key: str, value: Any = None, *, known: frozenset[str] | None = None, zero_stage: Any = 0
             ) -> tuple[Effect, str]:
    """The effect of dotted ``key`` with ``value`` and why (see the module docstring); ``zero_stage``
    is the config's ``zero_optimization.stage``: each ZeRO stage prices its own buffer keys (ZeRO-3's gathered
    parameters and bucket, ZeRO-1/2's buckets and reduction copy); stage 0 reads none of them."""
    known = known if known is not None else frozenset(deepspeed_key_list())
    if not _known(key, known):
        return _U, "not a DeepSpeed config key"
    by_stage = _STAGE3 if zero_stage == 3 else _STAGE12 if zero_stage in (1, 2) else _STAGE0 if zero_stage == 0 else {}
    staged = by_stage.get(key) or (_GRAD_ACCUM.get(zero_stage) if key == "data_types.grad_accum_dtype" else None)
    if staged is not None:
        effect, note = staged
        return effect, (f"\"auto\": {note}" if value == "auto" else note)
    if key in KEYS:
        effect, note = KEYS[key]
    else:
        prefixes = [p for p in SECTIONS if key == p or key.startswith(p + ".")]
        if not prefixes and any(k.startswith(key + ".") for k in known):
            return _N, "a section; its keys are classified one by one"
        if not prefixes:
            return _U, "a DeepSpeed key memplan has not classified"
        effect, note = SECTIONS[max(prefixes, key=len)]
    if value == "auto":
        return effect, _AUTO + ("memplan keeps the job's value" if effect == _M else note)
    if effect == _U and (key.endswith(".enabled") and _switched_off(value) or _OFF.get(key, object()) == value):
        return _N, f"off ({note})"
    if key in _NVME_DEVICE_KEYS and value == "nvme":
        return _U, _NVME_NOTE
    return effect, note


def _switched_off(value: Any) -> bool:
    """``value`` is false as DeepSpeed's pydantic sections read ``enabled``: false, 0, or "no"/"off"/"false"/..."""
    if isinstance(value, str):
        return value.strip().lower() in ("0", "off", "f", "false", "n", "no")
    return value is False or (type(value) is int and value == 0)


def deepspeed_settings(config: Mapping[str, Any], source: str = "--deepspeed-config") -> tuple[InputSetting, ...]:
    """One setting per key (dotted leaf) of DeepSpeed config ``config``, classified by :func:`classify`."""
    known = frozenset(deepspeed_key_list())
    zero = config.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    out = []
    for key, value in dotted_leaves(config, empty_is_leaf=True):
        effect, note = classify(key, value, known=known, zero_stage=stage)
        out.append(InputSetting(source=source, key=key, value=value, effect=effect, note=note))
    return tuple(out)
