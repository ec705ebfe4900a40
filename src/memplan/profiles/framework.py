"""Framework profiles: named, documented facts about what each training framework allocates.

Where frameworks differ (a fp32 gradient buffer, all-gather buckets, the dtype of the loss,
workspaces) the difference is a field here, with its source, never a bare factor in a formula.
"""

from __future__ import annotations

from typing import Literal

from memplan.errors import JobConfigError
from memplan.frozen import frozen_dataclass
from memplan.profiles import megatron_rules
from memplan.profiles.defaults import DefaultRule
from memplan.profiles.partial_recompute import PartialRecompute
from memplan.profiles.rules import JobRule, ModelRule
from memplan.profiles.zero3 import DEEPSPEED_ZERO3, Zero3Defaults
from memplan.units import MiB

KernelStyle = Literal["fused", "eager"]
MixedWeights = Literal["master-copy", "autocast", "fsdp-cast"]
#: A sharding of model states that ``memplan fit`` searches (``zero-N``: DeepSpeed ZeRO stage N;
#: ``dist-opt``: Megatron's distributed optimizer; ``fsdp-hybrid`` only where DP spans nodes).
ShardingChoice = Literal["ddp", "dist-opt", "zero-1", "zero-2", "zero-3", "fsdp-full", "fsdp-hybrid"]
#: How a framework splits decoder layers over its pipeline stages when no split is given
#: (see :func:`memplan.estimate.layout.rule_chunk_layers`).
PipelineSplit = Literal["even-or-ceil", "embedding-output-weighted"]

#: cuBLAS workspace PyTorch allocates through its caching allocator per handle/stream on
#: Hopper: CUBLAS_WORKSPACE_CONFIG ":4096:8" = 8 chunks of 4096 KiB (aten/src/ATen/cuda/CublasHandlePool.cpp).
TORCH_CUBLAS_WORKSPACE_BYTES = 32 * MiB
#: cuBLAS workspaces PyTorch holds in a training step whose forward and backward both run torch
#: matmuls (any PyTorch model; in Megatron the non-TE output layer, router and wgrad accumulation): the autograd engine
#: runs the backward of CUDA ops on its own per-device worker thread
#: (torch/csrc/autograd/engine.cpp, ``Engine::start_device_threads``); a cuBLAS handle is reserved
#: per thread until the thread exits (aten/src/ATen/cuda/detail/DeviceThreadHandles.h,
#: ``PoolWindow::reserve``); and the workspace is cached per (handle, stream)
#: (aten/src/ATen/cuda/CublasHandlePool.cpp, ``cublas_handle_stream_to_workspace``). So the
#: forward (main) thread and the backward thread each keep one :data:`TORCH_CUBLAS_WORKSPACE_BYTES`.
#: A real snapshot shows both (shared/reference/snapshots/01: one workspace allocated under a
#: forward ``bmm``, the other under ``BmmBackward0`` in ``Engine::thread_main``;
#: tests/estimate/test_cublas_workspaces.py).
TORCH_CUBLAS_WORKSPACE_THREADS = 2
#: Transformer Engine's own cuBLASLt workspace, also allocated with torch.empty
#: (transformer_engine/pytorch/module/base.py get_workspace: 32 MiB on Hopper).
TE_CUBLAS_WORKSPACE_BYTES = 32 * MiB
#: Transformer Engine's grouped GEMM (``GroupedLinear``, Megatron's TEGroupedMLP under
#: ``--moe-grouped-gemm``) runs its GEMMs on several streams, each with a cuBLAS workspace of its own
#: allocated with torch.empty on first use and kept (transformer_engine/pytorch/module/base.py
#: ``get_multi_stream_cublas_workspace``: ``tex.get_num_cublas_streams()`` = 4 workspaces of
#: ``get_cublas_workspace_size_bytes()`` = 32 MiB + 256 B on Hopper).
TE_GROUPED_GEMM_WORKSPACES = 4
TE_GROUPED_GEMM_WORKSPACE_BYTES = 32 * MiB + 256


@frozen_dataclass(kw_only=True)
class FrameworkProfile:
    """What one training framework keeps on the GPU, beyond the model's own tensors."""

    name: str
    description: str
    #: How ``*-mixed`` precision is realised.
    #: ``master-copy``: 16-bit weights in the model, fp32 master copy inside the optimizer
    #: (Megatron Float16Module + DistributedOptimizer, DeepSpeed). ``autocast``: fp32 weights,
    #: ``torch.autocast`` casts a 16-bit copy per use and autograd saves it (HF Trainer, plain
    #: PyTorch AMP). ``fsdp-cast``: sharded fp32 weights, FSDP all-gathers 16-bit copies per block
    #: (FSDP2 ``MixedPrecisionPolicy``, torchtitan).
    mixed_weights: MixedWeights
    #: Gradient dtype under mixed precision when ``--grad-dtype`` is not given (None: param dtype).
    mixed_grad_dtype: str | None
    #: Optimizer implementation when ``--optimizer-impl auto``.
    default_optimizer_impl: Literal["foreach", "fused", "for-loop"] = "fused"
    #: Loss path when ``--loss auto``.
    default_loss: Literal["fp32-logits", "vocab-parallel", "fused", "chunked"] = "fp32-logits"
    #: The estimate's reserved memory when ``--reserved auto`` (issue 25, item 8; see
    #: :data:`memplan.job.ReservedMode`).
    default_reserved: Literal["fixed", "simulated"] = "fixed"
    #: Vocabulary padded to a multiple of this times TP (Megatron ``--make-vocab-size-divisible-by``).
    vocab_divisible_by: int = 1
    #: How the layers save activations: ``fused`` (TE/Apex fused norm, bias-gelu/swiglu kernels:
    #: Korthikanti et al.'s accounting) or ``eager`` (PyTorch reference modules as in HF
    #: transformers: RMSNorm saves an fp32 copy of its input, SwiGLU saves gate, up and product).
    kernels: KernelStyle = "fused"
    #: The framework builds its own layers, which drop out the embeddings and each block's output
    #: whatever the model's family (Megatron's GPTModel: the embedding's ``embedding_dropout`` and
    #: ``bias_dropout_add`` after attention and MLP, ``--hidden-dropout``). False: the model's own
    #: transformers code runs, with the sites its family has (:attr:`memplan.model.spec.ModelSpec.hidden_dropout`).
    own_hidden_dropout: bool = False
    #: DDP keeps gradients in separate bucket buffers (``gradient_as_bucket_view=False``, the
    #: PyTorch default): one extra gradient-sized copy when DP > 1.
    ddp_bucket_copy: bool = False
    #: Library workspaces served by the caching allocator (cuBLAS of the forward and the backward
    #: thread; Transformer Engine's).
    workspace_bytes: int = TORCH_CUBLAS_WORKSPACE_THREADS * TORCH_CUBLAS_WORKSPACE_BYTES
    #: Unsharded blocks alive at once under FSDP/ZeRO-3 (the one computing + prefetched ones).
    fsdp_live_blocks: int = 2
    #: Under pipeline parallelism FSDP2 keeps the stage's blocks unsharded for the whole step and
    #: accumulates unsharded gradients in the reduce dtype until the last micro-batch (torchtitan's
    #: ``reshard_after_forward = not pp_enabled`` with torch's pipelining stage;
    #: :mod:`memplan.estimate.pipeline_fsdp`).
    pipeline_fsdp_unsharded: bool = False
    #: FSDP units of the parts outside the decoder layers. ``root``: one unit (the root module) holds
    #: the embedding, the final norm and the head, unsharded from its forward to the end of the
    #: backward. ``embedding-and-head``: the embedding is a unit resharded after its forward and
    #: gathered again for its backward at the end; the final norm and the head are one unit kept
    #: unsharded from its forward through its backward (torchtitan's ``apply_fsdp``:
    #: ``fully_shard(model.tok_embeddings)``, ``fully_shard([model.norm, model.output],
    #: reshard_after_forward=False)``; an untied head only).
    fsdp_outer_units: Literal["root", "embedding-and-head"] = "root"
    #: The dtype FSDP2 reduce-scatters gradients in under ``*-mixed`` (``MixedPrecisionPolicy.reduce_dtype``).
    #: ``grad``: the gradient dtype (torchtitan's ``mixed_precision_reduce`` float32). ``compute``: the 16-bit
    #: compute dtype, as the parameters (accelerate's ``FullyShardedDataParallelPlugin.set_mixed_precision``:
    #: ``param_dtype`` and ``reduce_dtype`` both the mixed-precision dtype); the sharded gradients are cast back
    #: to the fp32 parameters' dtype after the reduce-scatter either way.
    fsdp_reduce_dtype: Literal["grad", "compute"] = "grad"
    #: Under FSDP's mixed precision the forward also runs under ``torch.autocast`` in the compute dtype
    #: (accelerate's ``Accelerator.prepare_model`` wraps ``model.forward`` in its autocast context whenever
    #: ``native_amp``, FSDP2 included). False: FSDP's ``MixedPrecisionPolicy`` alone casts (torchtitan's
    #: ``maybe_enable_amp`` applies no autocast with FSDP).
    fsdp_autocast: bool = False
    #: The loss is computed inside the model's forward (a Hugging Face causal LM given ``labels``, as the Trainer
    #: calls it), so under FSDP2 the forward's last unit's all-gather output, freed at the root module's
    #: post-forward, is alive through the loss's forward (:mod:`memplan.estimate.fsdp_loss_gather`). False: the
    #: trainer computes it on the model's output (torchtitan's ``train.py``: ``loss_fn(pred, labels)``).
    loss_in_model_forward: bool = False
    #: ``--fsdp`` wraps the model with FSDP2 at one data-parallel rank too: accelerate under its launcher
    #: (``accelerate launch --use_fsdp`` starts torchrun, which sets ``LOCAL_RANK``, so ``PartialState``'s
    #: ``_prepare_backend`` says ``MULTI_GPU`` and ``AcceleratorState`` turns it into ``FSDP`` whatever the world
    #: size; ``fsdp2_prepare_model`` calls ``fully_shard`` with no size test). False: torchtitan's
    #: ``ParallelDims.fsdp_enabled`` is ``dp_shard > 1`` (or context parallelism), so one rank runs unwrapped.
    #: Read by ``memplan trace`` (whether to call ``fully_shard`` on a fake process group of one rank) and by the
    #: estimate, which prices a job that is not wrapped as ``--fsdp none`` (:mod:`memplan.profiles.unwrapped_fsdp`).
    #: True by default (what FSDP2 itself does given one rank), False where a framework is known not to wrap.
    fsdp_at_one_rank: bool = True
    #: The loss the trainer computes on the model's output. ``model``: the model's own ``loss_function``
    #: (transformers' causal-LM loss: the labels shifted inside it, the mean over them). ``token-sum``:
    #: torchtitan's ``cross_entropy_loss`` (torchtitan/components/loss.py: the logits flattened and upcast to
    #: fp32, the labels as the data loader shifted them, ``reduction="sum"``), divided in ``train.py``'s
    #: ``forward_backward_step`` by the step's count of valid tokens (a number after the data-parallel
    #: all-reduce). ``memplan trace`` runs it after the model's forward.
    trainer_loss: Literal["model", "token-sum"] = "model"
    #: The model's forward returns its 16-bit floating outputs converted to fp32 whenever the 16-bit precision is
    #: the trainer's own (accelerate's ``Accelerator.prepare_model`` under ``native_amp``, FSDP included, not
    #: under DeepSpeed: ``convert_outputs_to_fp32`` in accelerate/utils/operations.py rebuilds the output with an
    #: fp32 copy of the logits; the Trainer's ``compute_loss`` keeps only the loss). See
    #: :mod:`memplan.estimate.fp32_outputs`.
    fp32_outputs: bool = False
    #: The trainer runs its forward under ``torch.autocast`` also when the weights are 16-bit (``bf16`` / ``fp16``
    #: without an fp32 master): accelerate sets ``native_amp`` from the trainer's ``mixed_precision``, not from the
    #: weights' dtype (``Accelerator.__init__``; not under DeepSpeed), and ``prepare_model`` wraps the forward in
    #: autocast. Not modelled (ops on CUDA autocast's fp32 lists return fp32 there): said in the assumptions
    #: (:func:`memplan.estimate.precision.resolve_precision`). Measured by helper tracefid18 (docs/benchmarks.md).
    autocast_16bit_weights: bool = False
    #: DeepSpeed ZeRO-1/2 all-gather bucket, elements (``allgather_bucket_size``, default 5e8).
    allgather_bucket_elements: int = 0
    #: Without ZeRO, the engine's all-reduce flattens the gradients into buckets flushed once they hold more than
    #: this many elements (DeepSpeed's ``allreduce_gradients`` -> ``allreduce_no_retain``, ``MEMORY_OPT_ALLREDUCE_SIZE``
    #: 5e8; :mod:`memplan.estimate.ds_allreduce`); 0: no such copy.
    stage0_allreduce_elements: int = 0
    #: ``--zero N`` is DeepSpeed's ZeRO, whose buffers are priced from the job's DeepSpeed config keys or these
    #: defaults (ZeRO-3's gathered parameters and bucket: :mod:`memplan.estimate.zero3_buffers`; ZeRO-1/2's reduce
    #: buckets: :mod:`memplan.estimate.zero12_bucket`); None: another ZeRO (Megatron-FSDP's sharding strategies),
    #: ZeRO-3 priced by DeepSpeed's own estimator's largest-layer rule.
    zero3_buffers: Zero3Defaults | None = None
    #: Optimizer offload also moves the gradient partition to CPU memory (DeepSpeed
    #: ZeRO-Offload, FSDP ``CPUOffloadPolicy``); Megatron's ``--optimizer-cpu-offload`` keeps its
    #: fp32 gradient buffer on the GPU and copies it to CPU memory for the step.
    offload_moves_gradients: bool = True
    #: What ``--offload-activations`` runs. ``layer-pipelined``: Transformer Engine's CPU offload
    #: (Megatron ``--cpu-offloading``, ``get_cpu_offload_context``), which moves each layer's saved
    #: tensors after its forward while the next layer computes, so the GPU keeps the layer being
    #: computed and the one being copied. ``per-tensor``: PyTorch's
    #: ``torch.autograd.graph.save_on_cpu`` around the forward and the loss (what a Hugging Face or
    #: torchtitan loop wraps; TRL's ``activation_offloading`` works the same way, tensor by tensor):
    #: every saved tensor leaves the GPU when it is saved and the backward brings back one
    #: operator's at a time.
    activation_offload: Literal["layer-pipelined", "per-tensor"] = "layer-pipelined"
    #: Tensor parallelism splits the vocabulary (Megatron's VocabParallelEmbedding and
    #: vocab-parallel loss; torchtitan's RowwiseParallel embedding and loss_parallel). False:
    #: Hugging Face's TP plan (transformers ``_tp_plan``): the embedding stays whole on every rank and
    #: an untied ``lm_head`` is column-parallel with its output gathered (``colwise_gather_output``),
    #: so every rank computes the loss on full-vocabulary logits.
    vocab_parallel: bool = True
    #: Under TP the loss runs in DTensor's ``loss_parallel`` on the vocabulary-sharded logits
    #: (torchtitan's ``get_train_context``; :mod:`memplan.estimate.loss_parallel`).
    dtensor_loss_parallel: bool = False
    #: The optimizer is ``torch.optim``'s (HF Trainer, torchtitan): its fused (and capturable)
    #: Adam/AdamW keep a float32 ``step`` tensor per parameter on the GPU (torch/optim/adam.py,
    #: ``_init_group``). Megatron's and DeepSpeed's fused Adam keep the step count on the host.
    #: ``_init_group`` also makes the states lazily in the first ``step()``, tensor by tensor in the param
    #: groups' order, and a foreach step's ops run over the same lists: ``model.parameters()``' order (the
    #: embedding, the decoder layers, the final norm and head) for torchtitan's one group
    #: (``build_optimizers``) and, for every tensor above the allocator's small pool, for the HF Trainer's
    #: weight-decay group (``create_optimizer``; its other group holds the norms and biases). The
    #: reserved-memory schedule makes them in that order (:func:`memplan.estimate.reserved_sizes.piece_sizes`);
    #: other profiles' states keep the schedule's unit order, the root's first (DeepSpeed makes its flat
    #: partitions' states when the optimizer is built; Megatron's distributed optimizer in its buffers' order,
    #: not modelled).
    torch_optimizer: bool = False
    #: ``optimizer.zero_grad(set_to_none=True)`` (PyTorch's and the HF Trainer's default; FSDP2)
    #: frees every gradient after the step, so none exist until the next backward makes them.
    #: Megatron and DeepSpeed keep persistent gradient buffers.
    frees_gradients: bool = False
    #: The ZeRO stages (0: without ZeRO) whose engine frees every gradient after the step though the framework
    #: keeps gradient buffers otherwise (:mod:`memplan.estimate.step_gradients`): DeepSpeed's ZeRO-1/2 optimizer and
    #: its stage-0 FP16 optimizers (``zero_grad(set_to_none=True)`` after ``step``); ZeRO-3 keeps its flat gradient
    #: partition buffer.
    frees_gradients_zero: tuple[int, ...] = ()
    #: The ZeRO stages whose engine moves every trained parameter's partition into one flat buffer of one dtype
    #: when the weights stay on the GPU: DeepSpeed ZeRO-3 (stage3.py ``_create_fp16_partitions_with_defragmentation``
    #: -> zero/utils.py ``defragment`` asserts a single dtype; its model is built under ``zero.Init`` and not cast,
    #: so peft's fp32 adapters meet 16-bit ``modules_to_save`` copies). ZeRO-1/2 cast every parameter to the 16-bit
    #: dtype first (``_cast_module_mixed_precision``); with ``offload_param`` ZeRO-3 copies into a CPU buffer of its
    #: dtype instead. A job whose trained tensors differ in dtype there is refused (``Job._check_trained_dtypes``).
    one_trained_dtype_zero: tuple[int, ...] = ()
    #: The activation policies this framework has (:mod:`memplan.policies`); others are refused.
    activation_policies: tuple[str, ...] = ("none", "full", "megatron-selective")
    #: What ``--recompute selective`` means here: ``megatron-selective`` (Megatron
    #: ``--recompute-granularity selective`` with its ``--recompute-modules``), ``attention-core``
    #: (Megatron-DeepSpeed's selective: the attention core, Korthikanti et al.), ``attention-module``
    #: (every attention module under non-reentrant ``torch.utils.checkpoint``: what a Hugging Face
    #: model can wrap) or ``torchtitan-sac`` (torchtitan's ``SelectiveAC``: every block checkpointed with
    #: a per-op policy that keeps the outputs of matmuls, attention kernels and collectives, every
    #: second mm recomputed).
    selective_policy: str = "megatron-selective"
    #: Where an MoE layer applies the routing probabilities. ``combine``: the expert outputs are
    #: weighted when tokens are combined, and that product keeps them for backward (how memplan
    #: prices every other profile). ``experts``: the experts scale their activation output by the
    #: probabilities and the combine does not weight (Megatron-LM: ``TEGroupedMLP.forward``'s
    #: ``bias_act_func`` and ``MLP.forward``'s ``per_token_scale`` in
    #: megatron/core/transformer/moe/experts.py and mlp.py; every token dispatcher calls
    #: ``unpermute`` without ``probs``).
    moe_probs_at: Literal["combine", "experts"] = "combine"
    #: ``*-mixed`` without FSDP runs under ``torch.autocast`` also with tensor or pipeline parallelism.
    #: False (torchtitan's ``maybe_enable_amp``, torchtitan/distributed/utils.py): with TP or PP and no
    #: FSDP / HSDP / CP no mixed precision is applied at all, so the step runs in fp32.
    autocast_with_tp_or_pp: bool = True
    #: How the decoder layers are split over the ``pp * vpp`` pipeline stages when the job gives no
    #: split (``--stage-layers``, ``--first/last-stage-layers``). ``even-or-ceil``: an even split, and
    #: without interleaving ``ceil(L/pp)`` on all but the last stage when ``pp`` does not divide L
    #: (Megatron-LM asks for ``--decoder-first/last-pipeline-num-layers`` or a
    #: ``--pipeline-model-parallel-layout`` otherwise). ``embedding-output-weighted``: torchtitan's
    #: ``generate_llm_fqn_per_model_part`` (torchtitan/distributed/pipeline_parallel.py) with its
    #: defaults ``pipeline_parallel_first/last_stage_less_layers = 1``: the embedding and norm + output
    #: each count as one layer, ``L + 2`` is split as evenly as possible over the stages (the first
    #: ``(L + 2) % stages`` stages one more) and the first and last stage give up that one layer.
    pipeline_split: PipelineSplit = "even-or-ceil"
    #: dtype of PEFT adapters when ``--adapter-dtype auto``: ``fp32`` is peft's default
    #: (``get_peft_model(autocast_adapter_dtype=True)`` upcasts bf16/fp16 adapters to fp32,
    #: peft/tuners/tuners_utils.py ``_cast_adapter_dtype``). ``model``: the engine casts every parameter to the
    #: model's 16-bit dtype after peft (DeepSpeed's ``deepspeed.initialize`` -> ``_configure_distributed_model`` ->
    #: ``_cast_module_mixed_precision``, runtime/engine.py; measured: fp32 before, bf16 after), except a model built
    #: under ``zero.Init`` (ZeRO-3: the Hugging Face Trainer's ``from_pretrained``), whose parameters the engine does
    #: not cast (:func:`memplan.job.resolved_adapter_dtype`).
    adapter_dtype: Literal["fp32", "bf16", "fp16", "model"] = "fp32"
    #: What ``--compile`` compiles: ``blocks``, each transformer block on its own (torchtitan's
    #: ``apply_compile``, torchtune's ``compile_model``); ``model``, the whole model in one call (the Hugging Face
    #: Trainer's ``torch.compile(model)`` under ``torch_compile``, DeepSpeed's ``engine.compile()``); ``none``,
    #: the framework has no such option and ``--compile`` is refused.
    compile_scope: Literal["none", "blocks", "model"] = "none"
    #: ``--compile`` compiles the cross-entropy too (``--compile-loss auto``): torchtitan's ``[compile]
    #: components`` default ``["model", "loss"]`` (``build_cross_entropy_loss`` wraps the loss in
    #: ``torch.compile``); a Hugging Face causal LM computes its loss inside the forward the Trainer compiles.
    compiles_loss: bool = False
    #: Defaults the framework applies that memplan does not model: each rule reports one for a job
    #: (:mod:`memplan.profiles.defaults`), also when the job comes from flags.
    unmodelled_defaults: tuple[DefaultRule, ...] = ()

    # --- What the framework runs (issue 24: capabilities instead of framework-name if-chains) ---
    #: The framework-specific options it runs (names of :data:`memplan.profiles.rules.FEATURES`);
    #: a job that turns on another is refused with the option's flag and the frameworks that have it.
    features: frozenset[str] = frozenset()
    #: Why ``--fsdp`` cannot be combined with this framework (None: it runs PyTorch FSDP).
    fsdp_refusal: str | None = None
    #: Which full recomputes of only some layers per stage run here (:mod:`memplan.profiles.partial_recompute`):
    #: any count (Megatron), the counts of every N-th layer (torchtitan), none (the Hugging Face Trainer's and
    #: DeepSpeed's gradient checkpointing wraps every layer). ``memplan fit`` searches only these.
    partial_recompute: PartialRecompute = "none"
    #: The framework whose engine runs a ZeRO stage the user turns on here (None: this one). The Hugging Face
    #: Trainer hands ``--deepspeed`` to DeepSpeed's engine (its 16-bit weights, fp32 master and buckets), as
    #: memplan's TrainingArguments reader does; the doctor prices such a fix under that framework, and the estimator
    #: prices the job's own ``--zero`` under it (:mod:`memplan.profiles.zero_engine`).
    zero_framework: str | None = None
    #: Its own validity rules, run on every job of this framework (``Job.__post_init__``) and on every
    #: job with a model (:func:`memplan.jobcheck.validate_job_for_model`); each raises ``JobConfigError``.
    job_rules: tuple[JobRule, ...] = ()
    model_rules: tuple[ModelRule, ...] = ()
    #: Activation policies priced for full training only: a job with adapters, frozen or quantized
    #: base weights under one is refused.
    full_training_only_policies: tuple[str, ...] = ()
    #: The layouts ``memplan fit`` searches (what the framework's usual launcher runs): tensor and
    #: context parallelism, pipelines, interleaved (virtual) pipeline stages, expert parallelism,
    #: and the non-dominated shardings of model states, in the order they are tried.
    fit_tensor_parallel: bool = False
    fit_pipelines: bool = False
    fit_interleaved: bool = False
    fit_expert_parallel: bool = False
    fit_shardings: tuple[ShardingChoice, ...] = ("fsdp-full", "fsdp-hybrid")

    # --- Estimator capabilities (issue 24, the ledger): what the estimator prices for this framework,
    # --- named by the library that allocates it, so estimate/ never compares a framework's name.
    #: Megatron-core's ``GlobalMemoryBuffer`` ("mpu"): the all-gather MoE dispatcher's gathered tokens
    #: and, under ``--transformer-impl local``, the layers' gathers and unfused attention scores.
    global_memory_buffer: bool = False
    #: Transformer Engine's context-parallel attention buffers (``--cp-comm-type``) are priced.
    te_context_parallel: bool = False
    #: Transformer Engine's grouped GEMM keeps its per-stream cuBLAS workspaces (``--moe-grouped-gemm``).
    te_grouped_gemm_workspaces: bool = False
    #: The flex token dispatcher's communication buffers (DeepEP / HybridEP) are priced.
    flex_dispatch_buffers: bool = False
    #: The batch carries position ids, a loss mask and a full ``[b, 1, s, s]`` attention mask beside
    #: tokens and labels (Megatron-LM's ``get_batch``); otherwise tokens and labels only.
    full_batch_tensors: bool = False
    #: MoE router weights stay fp32 under a lower-precision model (transformers
    #: ``_keep_in_fp32_modules_strict``).
    fp32_router_weights: bool = False
    #: The model's forward keeps the embedding module's output bound until it returns (transformers'
    #: ``LlamaModel.forward``, ``Qwen2Model``, ``Gemma2Model``, ``GptOssModel``...: the local ``inputs_embeds``, read
    #: by the mask helpers, stays bound while ``hidden_states`` runs through the layers):
    #: :func:`memplan.estimate.input_leaf.bound_embedding_output`.
    binds_embedding_output: bool = False
    #: DeepSpeed activation checkpointing's ``partition_activations`` / ``cpu_checkpointing`` /
    #: contiguous buffers act on full recompute's kept inputs.
    deepspeed_checkpointing: bool = False

    @property
    def local_transformer_impl(self) -> bool:
        """``--transformer-impl local`` runs here (its feature): torch matmuls instead of Transformer
        Engine's layers, so no TE cuBLAS workspace, and the global buffer serves the layers (Megatron-LM)."""
        return "local-transformer-impl" in self.features


MEGATRON = FrameworkProfile(
    name="megatron",
    description=(
        "Megatron-LM (mcore, Transformer Engine): bf16/fp16 weights, fp32 main-grad buffer "
        "(accumulate_allreduce_grads_in_fp32), fp32 master weights and Adam moments in the "
        "(distributed) optimizer, vocab-parallel cross-entropy in fp32, fused kernels."
    ),
    mixed_weights="master-copy",
    mixed_grad_dtype="fp32",
    default_optimizer_impl="fused",
    default_loss="vocab-parallel",
    vocab_divisible_by=128,
    kernels="fused",
    own_hidden_dropout=True,
    workspace_bytes=TORCH_CUBLAS_WORKSPACE_THREADS * TORCH_CUBLAS_WORKSPACE_BYTES + TE_CUBLAS_WORKSPACE_BYTES,
    offload_moves_gradients=False,
    moe_probs_at="experts",
    features=frozenset({"tp-comm-overlap", "delay-wgrad", "early-attn-release",
                        "experts-wgrad-overlap", "shared-expert-overlap", "ep-a2a-overlap", "cuda-graphs",
                        "fine-offload", "local-transformer-impl", "distributed-optimizer", "zero-stages"}),
    job_rules=megatron_rules.JOB_RULES,
    model_rules=megatron_rules.MODEL_RULES,
    fit_tensor_parallel=True,
    fit_pipelines=True,
    fit_interleaved=True,
    fit_expert_parallel=True,
    fit_shardings=("dist-opt",),
    partial_recompute="layers",
    global_memory_buffer=True,
    te_context_parallel=True,
    te_grouped_gemm_workspaces=True,
    flex_dispatch_buffers=True,
    full_batch_tensors=True,
)

TORCHTITAN = FrameworkProfile(
    activation_offload="per-tensor",
    name="torchtitan",
    fsdp_at_one_rank=False,  # ParallelDims.fsdp_enabled: dp_shard > 1 or cp > 1
    # without FSDP, data parallelism is apply_ddp's replicate(model, bucket_cap_mb=100): DistributedDataParallel with
    # its default gradient_as_bucket_view=False (torch/distributed/_composable/replicate.py), a bucket copy per gradient
    ddp_bucket_copy=True,
    compile_scope="blocks",
    compiles_loss=True,
    description=(
        "torchtitan / FSDP2: fp32 sharded weights, bf16 all-gathered per block "
        "(MixedPrecisionPolicy param_dtype=bf16, reduce_dtype=fp32), fused AdamW, fp32 loss."
    ),
    mixed_weights="fsdp-cast",
    mixed_grad_dtype="fp32",
    default_optimizer_impl="fused",
    default_loss="fp32-logits",
    kernels="eager",
    frees_gradients=True,
    torch_optimizer=True,
    activation_policies=("none", "full", "torchtitan-sac", "memory-budget"),
    selective_policy="torchtitan-sac",
    autocast_with_tp_or_pp=False,
    pipeline_split="embedding-output-weighted",
    pipeline_fsdp_unsharded=True,
    fsdp_outer_units="embedding-and-head",
    trainer_loss="token-sum",
    dtensor_loss_parallel=True,
    fit_tensor_parallel=True,
    fit_pipelines=True,
    partial_recompute="every-nth",
    # the allocator simulator on the estimate's schedule where the trace witnesses torchtitan (the reserved
    # grid's torchtitan cell +0.3%, fixed +6.9%; its published FSDP runs -4.8..-5.3%, fixed -6.2..-9.6%);
    # with pipeline parallelism ``auto`` is fixed for every framework (estimate.engine.reserved_mode: on the
    # published 405B PP rows the simulator says +14.6% and +32.8%, fixed -10.9% and +4.1%)
    default_reserved="simulated",
)

DEEPSPEED = FrameworkProfile(
    name="deepspeed",
    compile_scope="model",
    description=(
        "DeepSpeed ZeRO: 16-bit weights and gradients, fp32 master weights and Adam moments "
        "in the optimizer (ZeRO paper's 2+2+12 bytes; ZeRO-3 keeps its gradient partitions in the "
        "model's dtype and makes one sub-group's fp32 gradient at the step), FusedAdam, reduce/all-gather buckets."
    ),
    mixed_weights="master-copy",
    mixed_grad_dtype=None,
    default_optimizer_impl="fused",
    default_loss="fp32-logits",
    kernels="eager",
    zero3_buffers=DEEPSPEED_ZERO3,
    allgather_bucket_elements=500_000_000,
    stage0_allreduce_elements=500_000_000,
    activation_policies=("none", "full", "attention-core"),
    selective_policy="attention-core",
    fsdp_refusal="is PyTorch FSDP; DeepSpeed shards parameters with ZeRO (use --zero 3 for full sharding)",
    frees_gradients_zero=(0, 1, 2),
    one_trained_dtype_zero=(3,),
    adapter_dtype="model",
    features=frozenset({"partition-activations", "cpu-checkpointing", "zero-stages"}),
    fit_shardings=("zero-1", "zero-2", "zero-3"),
    deepspeed_checkpointing=True,
)

HF = FrameworkProfile(
    activation_offload="per-tensor",
    name="hf",
    compile_scope="model",
    compiles_loss=True,
    description=(
        "Hugging Face Trainer / plain PyTorch AMP: fp32 weights and gradients, torch.autocast "
        "bf16 weight copies saved for backward, AdamW (fused), logits upcast to fp32, eager modules, "
        "DDP gradient buckets."
    ),
    mixed_weights="autocast",
    mixed_grad_dtype="fp32",
    default_optimizer_impl="fused",
    default_loss="fp32-logits",
    kernels="eager",
    ddp_bucket_copy=True,
    frees_gradients=True,
    torch_optimizer=True,
    vocab_parallel=False,
    activation_policies=("none", "full", "attention-module", "megatron-selective"),
    selective_policy="attention-module",
    full_training_only_policies=("megatron-selective",),
    fit_shardings=("ddp", "fsdp-full", "fsdp-hybrid"),
    fp32_router_weights=True,
    binds_embedding_output=True,
    features=frozenset({"zero-stages"}),
    zero_framework="deepspeed",
    zero3_buffers=DEEPSPEED_ZERO3,  # --zero runs DeepSpeed through the Trainer's integration
    # --fsdp: the Trainer's FSDP is accelerate's FSDP2 (transformers' TrainingArguments: fsdp_config "version"
    # defaults to 2), with MixedPrecisionPolicy(param_dtype=reduce_dtype=bf16) and the forward under autocast
    fsdp_reduce_dtype="compute",
    fsdp_autocast=True,
    # accelerate's fsdp2_prepare_model shards the input embedding as a unit and [final norm, head] as one kept
    # unsharded after its forward (reshard_after_forward=False); a tied head joins the embedding in that unit
    fsdp_outer_units="embedding-and-head",
    loss_in_model_forward=True,  # the Trainer passes labels; transformers' ForCausalLM computes the loss
    fsdp_at_one_rank=True,  # accelerate's launcher runs FSDP2 at --num_processes 1 too
    # accelerate's prepare_model wraps model.forward in convert_outputs_to_fp32 under native_amp (bf16 / fp16)
    fp32_outputs=True,
    autocast_16bit_weights=True,  # the same native_amp runs autocast over a bf16 / fp16 model (--bf16 + torch_dtype)
    # the allocator simulator on the estimate's schedule: the loops the trace runs (the reserved grid's 36
    # cells within 3%, the published PEFT runs' median 3.8%, fixed 4.2%); Megatron's and DeepSpeed's own
    # buffers have no such witness, and fit's default searches (megatron) stay on the fixed figure
    # (docs/benchmarks.md)
    default_reserved="simulated",
)

PROFILES: dict[str, FrameworkProfile] = {p.name: p for p in (MEGATRON, TORCHTITAN, DEEPSPEED, HF)}
#: The framework a fine-tuning job (adapters, a quantized base) runs under when none is named, and the
#: one ``memplan fit --methods`` compares under: the HF Trainer / TRL / PEFT loop fine-tuners use.
FINE_TUNING_FRAMEWORK = HF.name


def get_profile(name: str) -> FrameworkProfile:
    """The profile of a framework (``megatron``, ``torchtitan``, ``deepspeed``, ``hf``)."""
    try:
        return PROFILES[name]
    except KeyError:
        raise JobConfigError("--framework", f"must be one of {', '.join(PROFILES)}", name) from None


def vocab_split(profile: FrameworkProfile, tp: int) -> int:
    """How many ways the vocabulary-wide tensors (embedding rows, logits) are split under ``tp``."""
    return tp if profile.vocab_parallel else 1


def head_rows_split(profile: FrameworkProfile, tp: int, tied: bool) -> int:
    """How many ways the output head's weight is split: over TP, except a head tied to an embedding
    that TP does not split (Hugging Face's plan keeps the shared weight whole)."""
    return tp if profile.vocab_parallel or not tied else 1
