"""What each Hugging Face TrainingArguments / TRL SFTConfig field does to training memory.

The tables behind :mod:`memplan.frameworks.hf_args`: the optimizer names of transformers'
``OptimizerNames`` (transformers 5.2x ``training_args.py``) and how memplan prices them, the
fields that cannot change GPU memory, and the fields that can and that memplan does not model.
Fields :mod:`memplan.frameworks.hf_args` maps itself are in neither table.
"""

from __future__ import annotations

from memplan.optimizers import OPTIMIZERS as REGISTERED

__all__ = ["NOT_MODELLED", "NO_MEMORY_EFFECT", "OPTIMIZERS", "UNMODELLED_OPTIMIZERS"]

#: ``optim`` name → (memplan --optimizer, --optimizer-impl), read from the optimizer registry
#: (:mod:`memplan.optimizers`: each entry's ``dialects.hf``). bitsandbytes names follow transformers'
#: trainer_optimizer._get_bitsandbytes_optimizer ("paged" → paged, "8bit" → 8-bit).
OPTIMIZERS: dict[str, tuple[str, str]] = {
    optim: (kind.name, impl) for kind in REGISTERED for optim, impl in kind.dialects.hf
}
#: transformers' ``OptimizerNames`` (5.2x ``training_args.py``) besides the bitsandbytes and torch ones above.
_TRANSFORMERS_OPTIMIZERS = (
    "adamw_torch_xla", "adamw_torch_npu_fused", "adamw_anyprecision", "adamw_torch_4bit", "adamw_torch_8bit",
    "ademamix", "adagrad", "ademamix_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit", "paged_lion_32bit",
    "rmsprop", "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit", "galore_adamw", "galore_adamw_8bit",
    "galore_adafactor", "galore_adamw_layerwise", "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise",
    "lomo", "adalomo", "grokadamw", "schedule_free_radam", "schedule_free_adamw", "schedule_free_sgd",
    "apollo_adamw", "apollo_adamw_layerwise", "stable_adamw",
)
#: Names transformers knows whose states memplan does not price (no registry entry names them).
UNMODELLED_OPTIMIZERS = tuple(name for name in _TRANSFORMERS_OPTIMIZERS if name not in OPTIMIZERS)

_EVAL = "evaluation, not the training step"
_SAVE = "checkpoint saving"
_LOG = "logging / tracking"
_HUB = "Hub upload"
_SCHEDULE = "learning-rate schedule / loop length"
_DATA = "data loading on the host"
_HYPER = "optimizer hyper-parameter (no state)"

#: Fields that cannot change GPU memory of a training step, with why.
NO_MEMORY_EFFECT: dict[str, str] = {
    **dict.fromkeys(("do_train", "do_eval", "do_predict", "eval_strategy", "eval_steps", "eval_delay", "eval_on_start",
                     "eval_accumulation_steps", "eval_do_concat_batches", "eval_use_gather_object",
                     "per_device_eval_batch_size", "bf16_full_eval", "fp16_full_eval", "prediction_loss_only",
                     "batch_eval_metrics", "include_for_metrics", "metric_for_best_model", "greater_is_better",
                     "load_best_model_at_end", "label_names", "evaluation_strategy"), _EVAL),
    **dict.fromkeys(("save_strategy", "save_steps", "save_total_limit", "save_on_each_node", "save_only_model",
                     "save_safetensors", "output_dir", "overwrite_output_dir", "resume_from_checkpoint",
                     "restore_callback_states_from_checkpoint", "enable_jit_checkpoint", "ignore_data_skip"), _SAVE),
    **dict.fromkeys(("logging_steps", "logging_strategy", "logging_first_step", "logging_nan_inf_filter",
                     "logging_dir", "log_level", "log_level_replica", "log_on_each_node", "report_to", "run_name",
                     "project", "disable_tqdm", "skip_memory_metrics", "include_num_input_tokens_seen",
                     "trackio_bucket_id", "trackio_space_id", "trackio_static_space_id", "debug"), _LOG),
    **dict.fromkeys(("push_to_hub", "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo",
                     "hub_always_push", "hub_revision"), _HUB),
    **dict.fromkeys(("learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio",
                     "num_train_epochs", "max_steps", "seed", "data_seed", "full_determinism"), _SCHEDULE),
    **dict.fromkeys(("weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm"), _HYPER),
    **dict.fromkeys(("dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory",
                     "dataloader_persistent_workers", "dataloader_prefetch_factor", "dataloader_in_order",
                     "dataloader_multiprocessing_context", "remove_unused_columns", "length_column_name",
                     "train_sampling_strategy", "group_by_length", "dataset_text_field", "dataset_num_proc",
                     "dataset_kwargs", "dataset_batch_size", "eos_token", "pad_token", "chat_template_path",
                     "completion_only_loss", "assistant_only_loss", "dataset_name", "dataset_config",
                     "dataset_train_split", "dataset_test_split", "shuffle_dataset", "pad_to_multiple_of"), _DATA),
    "local_rank": "set by the launcher",
    "ddp_backend": "communication backend",
    "ddp_timeout": "communication timeout",
    "ddp_find_unused_parameters": "gradient bookkeeping flag",
    "ddp_broadcast_buffers": "buffer sync, no extra storage",
    "ddp_static_graph": "graph bookkeeping",
    "tf32": "matmul precision mode, same storage",
    "use_cache": "the KV cache is off in training (memplan traces with use_cache=False)",
    "neftune_noise_alpha": "noise added to embeddings in place",
    "average_tokens_across_devices": "loss normalisation",
    "model_name_or_path": "the model when MODEL is not given (MODEL wins)",
    "model_revision": "MODEL names the model",
    "trust_remote_code": "loading option",
    "attn_implementation": "see --attention",
}

#: Fields that can change GPU memory and that memplan does not model, with what it assumes instead.
NOT_MODELLED: dict[str, str] = {
    "torch_empty_cache_steps": "emptying the cache changes reserved memory only; memplan predicts it without",
    "auto_find_batch_size": "the Trainer halves the batch after an OOM; memplan prices the given batch",
    "label_smoothing_factor": "the smoothed loss keeps extra logits-sized temporaries",
    "optim_args": "extra optimizer arguments are not read",
    "optim_target_modules": "GaLore/APOLLO targets are not modelled",
    "accelerator_config": "split_batches / dispatch_batches change the per-GPU batch; not read",
    "parallelism_config": "Accelerate ND parallelism (tp/cp sizes) is not read; give --tp/--cp",
    "ddp_bucket_cap_mb": "DDP gradient buckets are priced at the framework's default size",
    "use_cpu": "a CPU run has no GPU memory",
    "liger_kernel_config": "Liger kernels other than the fused linear cross-entropy are not modelled",
    "padding_free": "padding-free batches (flattened rows) are not modelled; use --packing",
    "model_init_kwargs": "model loading options (dtype, quantization) are not read from here",
    "activation_offloading": "offloading saved activations to CPU is not modelled for the hf framework",
    "use_peft_for_ref": "reference models are not modelled",
}
