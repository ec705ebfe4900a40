"""The classification of Megatron-LM's flags, grouped by what they do (read by megatron_flags.py).

``MODELLED``: the flags memplan's Megatron reader maps (megatron_args.py, megatron_model.py), with
what each becomes. ``GROUPS``: ``(effect, note, flags)`` for every other flag, grouped by subject.
``FAMILIES``: ``(prefix, effect, note)`` for whole families of flags that share one honest rule
(logging, checkpointing, data loading...); a flag in ``MODELLED`` or ``GROUPS`` wins over its family.
``OLDER_FLAGS``: flags of older Megatron-LM versions memplan still reads.
"""

from __future__ import annotations

from memplan.settings import Effect

__all__ = ["FAMILIES", "GROUPS", "MODELLED", "OLDER_FLAGS"]

_ARCH = "architecture: part of the model memplan builds"
_TOKENIZER = "decides the vocabulary size when --vocab-size is absent"
_PARALLEL = "parallelism: how memplan divides the model and its activations"
_PIPELINE = "pipeline stage split: which layers each stage holds"
_BATCH = "batch: activations per micro-batch and micro-batches in flight"
_PRECISION = "precision of parameters, gradients and optimizer states"
_SHARDING = "data-parallel sharding of parameters, gradients and optimizer states"
_RECOMPUTE = "activation recomputation"
_OFFLOAD = "CPU offload"

MODELLED: dict[str, str] = {
    **dict.fromkeys((
        "--num-layers", "--hidden-size", "--num-attention-heads", "--kv-channels", "--group-query-attention",
        "--num-query-groups", "--disable-bias-linear", "--swiglu", "--squared-relu", "--ffn-hidden-size",
        "--add-qkv-bias", "--qk-layernorm", "--normalization", "--untie-embeddings-and-output-weights",
        "--position-embedding-type", "--use-rotary-position-embeddings", "--max-position-embeddings",
        "--multi-latent-attention", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim", "--q-lora-rank",
        "--kv-lora-rank", "--num-experts", "--moe-ffn-hidden-size", "--moe-router-topk",
        "--moe-shared-expert-intermediate-size", "--moe-shared-expert-gate",
        "--moe-router-enable-expert-bias",
        "--moe-layer-freq", "--mtp-num-layers", "--vocab-size", "--make-vocab-size-divisible-by", "--spec",
    ), _ARCH),
    **dict.fromkeys(("--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file"), _TOKENIZER),
    **dict.fromkeys((
        "--tensor-model-parallel-size", "--context-parallel-size", "--expert-model-parallel-size",
        "--expert-tensor-parallel-size", "--sequence-parallel", "--pipeline-model-parallel-size",
    ), _PARALLEL),
    **dict.fromkeys((
        "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
        "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
        "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
        "--pipeline-model-parallel-layout", "--microbatch-group-size-per-virtual-pipeline-stage",
    ), _PIPELINE),
    **dict.fromkeys(("--micro-batch-size", "--global-batch-size", "--seq-length"), _BATCH),
    **dict.fromkeys((
        "--bf16", "--fp16", "--accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16", "--fp8-format",
        "--fp8-param-gather",
    ), _PRECISION),
    **dict.fromkeys((
        "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "--use-megatron-fsdp",
        "--use-torch-fsdp2", "--data-parallel-sharding-strategy",
    ), _SHARDING),
    **dict.fromkeys(("--optimizer", "--sgd-momentum", "--muon-scalar-optimizer"),
                    "optimizer and its states"),
    **dict.fromkeys(("--muon-tp-mode", "--muon-nesterov"), "Muon's Newton-Schulz step temporaries"),
    **dict.fromkeys((
        "--recompute-activations", "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
        "--recompute-modules",
    ), _RECOMPUTE),
    **dict.fromkeys(("--optimizer-cpu-offload",
                     "--optimizer-offload-fraction"), _OFFLOAD + " of optimizer states"),
    **dict.fromkeys(("--attention-backend", "--use-flash-attn"),
                    "attention kernel: flash/fused keeps no score matrix, unfused keeps it"),
    "--transformer-impl": ("attention kernel (local: Megatron's unfused attention unless flash); local layers "
                           "use Megatron's global memory buffer for their gathers and scores"),
    **dict.fromkeys(("--hidden-dropout", "--attention-dropout"), "dropout masks kept for backward"),
    "--cross-entropy-loss-fusion": "loss: fused cross-entropy keeps no fp32 logits copy",
    "--defer-embedding-wgrad-compute": "deferred embedding weight-gradient inputs kept across micro-batches",
    "--wgrad-deferral-limit": "how many micro-batches of deferred embedding inputs are kept",
    "--tp-comm-overlap": ("Transformer Engine userbuffers (outside PyTorch's allocator) and the overlapped "
                          "GEMMs' 3-stream cuBLAS workspace"),
    "--tp-comm-overlap-cfg": ("per-GEMM userbuffer methods and FP8 buffers (read when the YAML can be opened; "
                              "Transformer Engine's defaults otherwise, as the assumptions say)"),
    **dict.fromkeys(("--fine-grained-activation-offloading", "--offload-modules", "--min-offloaded-tensor-size",
                     "--activation-offload-fraction", "--delta-offload-bytes-across-pp-ranks"),
                    ("fine-grained activation offloading: the listed modules' saved inputs in CPU memory, group by "
                     "group, with Megatron's reload margin, fraction and pipeline-rank rules")),
    **dict.fromkeys(("--cuda-graph-impl", "--enable-cuda-graph", "--external-cuda-graph"),
                    ("CUDA graphs: the private pool kept for the run (the captured regions' most at once) and "
                     "the graphs' static inputs")),
    **dict.fromkeys(("--cuda-graph-modules", "--cuda-graph-scope"),
                    "what per-layer CUDA graphs capture (their saved tensors and backward move into the pool)"),
    "--cp-comm-type": ("context-parallel attention (Transformer Engine): same saved numel for every type; "
                       "the backward's ring / all-gather / all-to-all buffers per type"),
    "--moe-token-dispatcher-type": "MoE token dispatch buffers (allgather / alltoall; flex: DeepEP's buffer)",
    "--overlap-moe-expert-parallel-comm": ("combined 1F1B schedule: the next micro-batch's layer beside each "
                                           "backward layer at their worst moment, and its batch"),
    **dict.fromkeys(("--moe-enable-deepep", "--moe-flex-dispatcher-num-sms", "--moe-deepep-num-sms"),
                    "DeepEP's communication buffer (one channel per two SMs; outside PyTorch's allocator)"),
    "--delay-wgrad-compute": ("combined 1F1B: each delayed GEMM's input and output gradient kept until its "
                              "weight gradient runs (experts' across the next micro-batch's dispatch, the "
                              "attention's and shared expert's to the end of the layer pair)"),
    "--ep-overlap-early-attn-memory-release": ("combined 1F1B: the backward layer's attention activations freed "
                                               "before the next micro-batch's MLP forward"),
    "--overlap-dispatch-backward-with-experts-wgrad": ("routed experts' GEMM inputs and output gradients kept "
                                                       "through the dispatch backward"),
    "--moe-shared-expert-overlap": ("shared expert's first GEMM saves its gathered sequence-parallel input "
                                    "(side-stream allocations priced as allocated bytes)"),
    "--moe-flex-dispatcher-backend": "flex dispatcher backend: DeepEP's buffer priced",
    "--moe-expert-capacity-factor": "MoE expert capacity: tokens each expert receives",
    "--moe-pad-expert-input-to-capacity": "MoE: expert inputs padded to capacity",
    # Flags of older Megatron-LM versions memplan still reads (OLDER_FLAGS).
    "--cpu-offloading": _OFFLOAD + " of activations (older Megatron-LM)",
    "--cpu-offloading-activations": _OFFLOAD + " of activations (older Megatron-LM)",
    "--fp8": _PRECISION + " (older Megatron-LM spelling of --fp8-format)",
    "--fp8-param": _PRECISION + " (older Megatron-LM spelling of --fp8-param-gather)",
    "--no-accumulate-allreduce-grads-in-fp32": _PRECISION + " (older Megatron-LM)",
}

_REFUSED_T5 = "refused: T5 (encoder-decoder) models are not supported"
_REFUSED_HYBRID = "refused: hybrid Mamba models are not supported"
_REFUSED_MM = "refused: multimodal models are not supported"

#: Flags of older Megatron-LM versions (absent from the current list) that memplan reads.
OLDER_FLAGS: frozenset[str] = frozenset({
    "--cpu-offloading", "--cpu-offloading-activations", "--fp8", "--fp8-param",
    "--no-accumulate-allreduce-grads-in-fp32", "--bert-binary-head", "--language-model-type",
    "--vision-model-type", "--model-provider", "--total-seq-length",
})

_NM: Effect = "not-modelled"
_NONE: Effect = "no-memory-effect"

GROUPS: tuple[tuple[Effect, str, tuple[str, ...]], ...] = (
    # Architectures memplan refuses (the launch is an error; listed so that none is silent).
    (_NM, _REFUSED_T5, ("--encoder-num-layers", "--decoder-num-layers", "--encoder-seq-length",
                        "--vocab-extra-ids")),
    (_NM, "T5 (encoder-decoder) option; encoder-decoder models are not modelled",
     ("--decoder-seq-length", "--relative-attention-num-buckets", "--relative-attention-max-distance")),
    (_NM, "refused: BERT models are not supported", ("--bert-no-binary-head", "--bert-binary-head")),
    (_NM, _REFUSED_HYBRID, ("--hybrid-layer-pattern", "--hybrid-override-pattern", "--is-hybrid-model")),
    (_NM, "hybrid Mamba layers are not modelled", ("--disable-mamba-mem-eff-path",)),
    (_NM, _REFUSED_MM, ("--language-model-type", "--vision-model-type", "--model-provider",
                        "--total-seq-length")),
    # CUDA graphs (the modelled ones are in MODELLED).
    (_NM, "the optimizer step's CUDA graph (its captured temporaries) is not priced", ("--optimizer-cuda-graph",)),
    (_NONE, ("CUDA-graph warm-up steps run eagerly before the capture; the RNG tracker's states are a few bytes "
            "per generator"), ("--cuda-graph-warmup-steps", "--te-rng-tracker")),
    # Activation offloading (fine-grained offloading's sizes are in MODELLED).
    (_NONE, ("fine-grained offloading's scheduling: when D2H copies are launched or joined, not what is "
             "offloaded"), ("--fine-grained-offloading-max-inflight-offloads", "--delay-offload-until-cuda-graph")),
    (_NM, "layer-wise activation offloading (Transformer Engine) is not priced in this form",
     ("--cpu-offloading-num-layers", "--cpu-offloading-retain-pinned-cpu-buffers")),
    (_NM, "MoE paged stash (routed-expert activations kept in paged GPU/CPU buffers) is not priced",
     ("--moe-paged-stash", "--moe-paged-stash-page-size", "--moe-paged-stash-buffer-size-factor-cuda",
      "--moe-paged-stash-buffer-size-factor-cpu")),
    # Optimizers and their states.
    (_NM, ("Muon options that change its step temporaries (unsplit QKV, the Triton SYRK Gram kernel, fp32 "
          "instead of bf16 Newton-Schulz iterates) are not priced; memplan prices split QKV and bf16 iterates"),
     ("--muon-no-split-qkv", "--muon-use-syrk", "--muon-fp32-matmul-prec")),
    (_NONE, "Muon update rule (scaling, coefficients, iterations reuse the same buffers)",
     ("--muon-momentum", "--muon-scale-mode", "--muon-coefficient-type", "--muon-num-ns-steps", "--muon-extra-scale-factor")),
    (_NONE, "optimizer hyper-parameter", ("--adam-beta1", "--adam-beta2", "--adam-eps", "--lion-beta1",
                                          "--lion-beta2", "--weight-decay", "--start-weight-decay",
                                          "--end-weight-decay", "--weight-decay-incr-style", "--clip-grad",
                                          "--apply-wd-to-qk-layernorm", "--no-weight-decay-cond-type",
                                          "--head-lr-mult", "--decoupled-lr", "--decoupled-min-lr",
                                          "--min-lr", "--warmup")),
    (_NM, ("precision-aware optimizer: reduced-precision main parameters, gradients and Adam moments are "
          "not priced (memplan keeps them fp32)"),
     ("--use-precision-aware-optimizer", "--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype",
      "--exp-avg-sq-dtype")),
    (_NM, "CPU optimizer variants (pinned buffers, torch optimizer, overlapped copies) are not priced",
     ("--use-torch-optimizer-for-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--no-pin-cpu-grads",
      "--no-pin-cpu-params")),
    (_NM, "frozen layers keep no gradients or optimizer states; memplan trains every parameter",
     ("--freeze-all-layers",)),
    # Tensor / context / expert parallel communication.
    (_NONE, ("TP communication overlap switch: Transformer Engine's initialize_ub allocates every GEMM's "
            "userbuffer whatever it says (it picks which GEMMs use them); the bootstrap backend only exchanges "
            "handles"),
     ("--tp-comm-overlap-rs-dgrad", "--no-tp-comm-bulk-wgrad",
      "--disable-tp-comm-bulk-wgrad", "--no-tp-comm-bulk-dgrad", "--disable-tp-comm-bulk-dgrad",
      "--no-tp-comm-overlap-ag", "--disable-tp-comm-overlap-ag", "--no-tp-comm-overlap-rs",
      "--disable-tp-comm-overlap-rs", "--no-tp-comm-split-ag", "--disable-tp-comm-split-ag",
      "--no-tp-comm-split-rs", "--disable-tp-comm-split-rs", "--tp-comm-bootstrap-backend")),
    (_NONE, ("hierarchical context-parallel group sizes: the a2a+p2p buffers keep the local numel whatever "
            "the split"), ("--hierarchical-context-parallel-sizes",)),
    (_NM, "hybrid (per-sequence) context parallelism and its sequence packing are not modelled",
     ("--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank")),
    (_NONE, ("HybridEP's SM and block counts size no NVLink buffer (the preprocessing scratch is blocks x "
            "(ranks + local experts) x 8 bytes: kilobytes, priced at 108 blocks)"),
     ("--moe-hybridep-num-sms", "--moe-hybridep-num-blocks-permute", "--moe-hybridep-num-blocks-unpermute",
      "--moe-hybridep-num-sms-preprocessing")),
    (_NM, ("HybridEP's fused permute and uneven-input padding, NCCL-EP's buffers and the dispatch/combine "
          "dtypes are not priced"),
     ("--moe-permute-fusion-into-hybridep", "--moe-hybridep-pad-uneven-dispatch-inputs",
      "--moe-ncclep-zero-copy", "--moe-dispatch-fwd-dtype", "--moe-combine-bwd-dtype")),
    (_NONE, ("combined 1F1B communication stream priority: the same stream and tensors, only the GPU's "
            "scheduling order changes (megatron/core/pipeline_parallel/utils.py set_streams)"),
     ("--high-priority-a2a-comm-stream",)),
    (_NM, "generalized tensor parallelism (GTP weight sharding and rematerialisation) is not modelled",
     ("--tensor-parallel-num-weight-shards", "--expert-tensor-parallel-num-weight-shards",
      "--gtp-remat-opt-in-modules", "--gtp-remat-nccl-ub", "--gtp-expert-remat-nccl-ub",
      "--gtp-remat-reduce-scatter-with-fp32-accumulation")),
    # Data-parallel buffers and sharding details.
    (_NM, ("gradient / parameter bucket layout and communication buffers are not priced separately "
          "(memplan prices whole-model gradient buffers)"),
     ("--ddp-num-buckets", "--ddp-bucket-size", "--ddp-pad-buckets-for-high-nccl-busbw",
      "--ddp-reduce-scatter-with-fp32-accumulation", "--ddp-param-name-patterns-for-fp32-local-accumulation",
      "--use-nccl-ub", "--disable-symmetric-registration", "--fsdp-manual-registration",
      "--no-use-layer-wise-param-layout", "--reuse-grad-buf-for-mxfp8-param-ag",
      "--create-all-gather-group")),
    (_NONE, "communication scheduling (when collectives start), not what is allocated",
     ("--overlap-grad-reduce", "--overlap-param-gather", "--overlap-param-gather-with-optimizer-step",
      "--no-align-grad-reduce", "--disable-align-grad-reduce", "--no-align-param-gather",
      "--ddp-average-in-collective", "--no-gradient-reduce-div-fusion", "--no-overlap-p2p-communication",
      "--overlap-p2p-communication-warmup-flush", "--use-ring-exchange-p2p",
      "--pipeline-model-parallel-comm-backend", "--use-sharp", "--sharp-enabled-group",
      "--high-priority-stream-groups", "--use-tp-pp-dp-mapping", "--nccl-communicator-config-path",
      "--disable-gloo-process-groups", "--distributed-backend", "--distributed-timeout-minutes",
      "--distributed-timeout-seconds-after-init", "--local-rank", "--lazy-mpu-init", "--fake-process-group",
      "--symmetric-ar-type", "--nccl-all-reduce-for-prefill")),
    (_NM, ("Megatron-FSDP / HSDP buffer options (double buffering, main-weight and gradient dtypes, "
          "outer sharding) are not priced"),
     ("--megatron-fsdp-main-params-dtype", "--megatron-fsdp-main-grads-dtype",
      "--megatron-fsdp-grad-comm-dtype",
      "--megatron-fsdp-enable-fine-grained-param-gather", "--megatron-fsdp-max-pool-double-buffer",
      "--fsdp-db-use-persist-buf-on-alloc-fail", "--fsdp-double-buffer",
      "--suggested-communication-unit-size",
      "--keep-fp8-transpose-cache", "--enable-full-sharding-in-hsdp", "--outer-dp-sharding-strategy",
      "--torch-fsdp2-no-reshard-after-forward", "--megatron-fsdp-version")),
    # Precision details.
    (_NM, "FP8/FP4 options beyond the format (recipe, per-layer precision, FP4) are not priced",
     ("--fp8-recipe", "--fp8-quantizer-factory", "--fp8-amax-history-len", "--no-fp8-wgrad",
      "--disable-fp8-wgrad", "--fp8-output-proj", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16",
      "--num-layers-at-end-in-bf16", "--fp4-format", "--fp4-recipe", "--fp4-quantizer-factory",
      "--fp4-param-gather", "--te-precision-config-file", "--moe-router-padding-for-quantization",
      "--moe-router-padding-for-fp8", "--kitchen-config-file", "--kitchen-recipe-number",
      "--use-kitchen-attention", "--kitchen-attention-backend")),
    (_NONE, "FP8 scaling arithmetic", ("--fp8-margin", "--fp8-interval", "--fp8-amax-compute-algo")),
    (_NM, ("dtype of kept tensors (fp32 residual stream, fp32 softmax, logits dtype, router dtype) "
          "is not priced; memplan keeps them in the training dtype"),
     ("--fp32-residual-connection", "--attention-softmax-in-fp32", "--fp16-lm-cross-entropy",
      "--output-logit-dtype", "--moe-router-dtype", "--apply-query-key-layer-scaling")),
    (_NONE, "loss scaling arithmetic", ("--loss-scale", "--initial-loss-scale", "--min-loss-scale",
                                        "--loss-scale-window", "--hysteresis")),
    (_NONE, "numerics of matmuls and kernels", ("--disable-bf16-reduced-precision-matmul",
                                                "--deterministic-mode",
                                                "--batch-invariant-mode", "--batch-invariant-backend")),
    # Model details memplan does not model.
    (_NM, "architecture variant memplan does not model (its extra weights or activations are not priced)",
     ("--attention-output-gate", "--qk-l2-norm", "--softmax-type", "--window-size", "--window-attn-skip-freq",
      "--experimental-attention-variant", "--linear-attention-freq", "--linear-conv-kernel-dim",
      "--linear-key-head-dim", "--linear-value-head-dim", "--linear-num-key-heads",
      "--linear-num-value-heads",
      "--moe-latent-size", "--moe-apply-probs-on-input", "--moe-use-grouped-tensor",
      "--moe-single-grouped-weight",
      "--moe-single-grouped-bias", "--moe-expert-rank-capacity-factor", "--mtp-use-repeated-layer",
      "--mtp-detach-heads", "--mtp-hsm", "--mtp-standalone", "--mtp-hybrid-override-pattern",
      "--heterogeneous-layers-config-path", "--heterogeneous-layers-config-encoded-json",
      "--padded-vocab-size",
      "--no-pad-vocab-size", "--disable-pad-vocab-size", "--apply-residual-connection-post-layernorm",
      "--quick-geglu", "--openai-gelu", "--glu-linear-offset", "--activation-func-clamp-value",
      "--use-te-activation-func", "--use-fused-weighted-squared-relu", "--no-position-embedding",
      "--mrope-section",
      "--mla-down-proj-fusion", "--cache-mla-latents")),
    (_NM, ("MoE routing variant: router temporaries (tokens x experts) are not priced separately and routing "
          "is assumed balanced"),
     ("--moe-router-num-groups", "--moe-router-group-topk", "--moe-router-score-function",
      "--moe-router-load-balancing-type", "--moe-z-loss-coeff", "--moe-input-jitter-eps",
      "--moe-token-drop-policy", "--moe-enable-routing-replay", "--moe-router-force-load-balancing",
      "--moe-router-force-biased", "--moe-router-topk-scaling-factor", "--moe-router-pre-softmax",
      "--moe-router-quantile-balancing-ema")),
    (_NM, ("activation-saving execution variant not priced (MoE-layer recompute, activations distributed "
          "over TP ranks, MLP computed in sequence chunks)"),
     ("--moe-layer-recompute", "--distribute-saved-activations", "--mlp-chunks-for-training")),
    (_NM, ("attention-mask tensors built for the batch (s x s per sample with --reset-attention-mask) are "
          "not priced"), ("--reset-attention-mask", "--no-create-attention-mask-in-dataloader")),
    (_NM, "upcycling converts a dense checkpoint to MoE at load time (both models held then); not priced",
     ("--moe-use-upcycling", "--moe-upcycling-granularity")),
    (_NM, ("kernel fusion switch: it changes which intermediates are kept, and memplan prices one kernel "
           "choice per layer whatever the switch says"),
     ("--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
      "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
      "--no-persist-layer-norm", "--moe-permute-fusion", "--moe-router-fusion", "--fused-residual-rmsnorm",
      "--use-transformer-engine-op-fuser", "--cross-entropy-fusion-impl", "--disable-jit-fuser",
      "--flash-attention-version", "--no-clone-scatter-output-in-embedding",
      "--disable-clone-scatter-output-in-embedding", "--moe-mlp-glu-interleave-size",
      "--moe-shared-expert-glu-interleave-size")),
    (_NM, ("grouped GEMM or per-expert GEMMs: memplan prices the same kept expert inputs for both; the "
           "grouped path's workspace and any padding are not priced separately"),
     ("--moe-grouped-gemm", "--use-grouped-gemm-for-shared-expert", "--use-grouped-gemm-for-dense-mlp")),
    (_NONE, ("values inside the same tensors (initialisation, scaling constants, RoPE frequencies, "
            "loss weights)"),
     ("--init-method-std", "--embedding-init-method-std", "--init-method-xavier-uniform", "--norm-epsilon",
      "--apply-layernorm-1p", "--rotary-interleaved", "--rotary-base", "--rotary-percent",
      "--rotary-seq-len-interpolation-factor", "--rotary-scaling-factor", "--use-rope-scaling",
      "--rope-scaling-factor", "--rope-type", "--mscale", "--mscale-all-dim", "--qk-clip", "--qk-clip-alpha",
      "--qk-clip-threshold", "--mtp-loss-scaling-factor", "--moe-aux-loss-coeff",
      "--moe-router-bias-update-rate",
      "--moe-per-layer-logging", "--onnx-safe", "--use-mcore-models", "--no-initialization",
      "--calculate-per-token-loss", "--no-rope-freq", "--data-parallel-random-init")),
    (_NM, ("model weights created on the CPU or the meta device first: initialisation peaks are not priced "
          "(memplan prices the training step)"), ("--use-cpu-initialization",
                                                  "--init-model-with-meta-device")),
    # Batch schedule.
    (_NM, ("batch-size ramp-up or schedules change the micro-batches per step during training; memplan "
          "prices the given --global-batch-size"),
     ("--rampup-batch-size", "--step-batch-size-schedule", "--decrease-batch-size-if-needed",
      "--phase-transition-iterations")),
    (_NONE, "old spelling Megatron refuses or ignores (use the newer flag)",
     ("--batch-size", "--model-parallel-size", "--checkpoint-activations")),
    (_NM, "allocator cache emptying between steps changes fragmentation, not the live peak memplan prices",
     ("--empty-unused-memory-level",)),
    (_NM, ("evaluation forward passes at their own micro-batch size are not priced (memplan prices the "
          "training step)"), ("--eval-micro-batch-size", "--eval-global-batch-size")),
    (_NM, "inference text generation at training time (its KV cache) is not priced",
     ("--max-tokens-to-oom", "--mlp-chunks-for-prefill", "--flash-decode", "--enable-chunked-prefill",
      "--num-speculative-tokens", "--use-legacy-static-engine", "--decode-only-cuda-graphs",
      "--use-same-sampling-seed-across-dp-ranks", "--moe-pad-experts-for-cuda-graph-inference")),
    (_NM, "RL (GRPO) training co-locates an inference engine and its rollouts; not priced",
     ("--perform-rl-step", "--langrl-env-config", "--refit-method")),
    (_NM, "Megatron's vision / BERT / retrieval models are not modelled (memplan prices a GPT decoder)",
     ("--img-h", "--img-w", "--num-channels", "--patch-dim", "--num-classes", "--classes-fraction",
      "--data-per-class-fraction", "--vision-pretraining", "--vision-pretraining-type",
      "--vision-backbone-type",
      "--swin-backbone-type", "--mask-type", "--mask-factor", "--iter-per-epoch", "--mask-prob",
      "--short-seq-prob", "--bert-load", "--bert-embedder-type", "--output-bert-embeddings",
      "--titles-data-path",
      "--query-in-block-prob", "--use-one-sent-docs", "--evidence-data-path", "--block-data-path",
      "--embedding-path", "--indexer-batch-size", "--indexer-log-interval")),
    (_NM, "debug dumps copy activations / gradients / parameters during the step; not priced",
     ("--save-activations-interval", "--save-dgrads-interval",
      "--save-wgrads-interval", "--save-params-interval", "--save-tokens-per-expert-interval")),
    # Run control, seeds, schedules: nothing allocated on the GPU.
    (_NONE, "run control (iterations, seeds, schedules, checks, garbage collection)",
     ("--train-iters", "--train-samples", "--seed", "--skip-train", "--test-mode", "--manual-gc",
      "--manual-gc-interval", "--no-manual-gc-eval", "--disable-manual-gc-eval", "--iterations-to-skip",
      "--no-check-for-nan-in-loss-and-grad", "--check-for-large-grads", "--check-for-spiky-loss",
      "--check-weight-hash-across-dp-replicas-interval", "--gpu-sniff-test-interval", "--train-sync-interval",
      "--rerun-mode", "--result-rejected-tracker-filename", "--error-injection-rate",
      "--error-injection-type",
      "--start-eval-at-iter", "--full-validation", "--multiple-validation-sets", "--validation-set-names",
      "--enable-experimental", "--yaml-cfg", "--sft", "--sft-tokenizer-prompt-format", "--adlr-autoresume",
      "--adlr-autoresume-interval", "--enable-msc", "--disable-msc", "--run-workload-inspector-server",
      "--enable-ft-package", "--calc-ft-timeouts", "--ft-num-warmup-iters", "--app-tag-run-name",
      "--app-tag-run-version", "--config-logger-dir", "--timing-log-level", "--timing-log-option",
      "--no-barrier-with-level-1-timing", "--nvtx-ranges", "--memory-snapshot-path", "--record-shapes",
      "--dump-param-to-param-group-map", "--replication", "--replication-jump", "--replication-factor",
      "--verify-integrity", "--finetune", "--pretrained-checkpoint", "--use-checkpoint-args",
      "--use-mp-args-from-checkpoint-args", "--auto-detect-ckpt-format", "--use-dist-ckpt",
      "--persistent-save-interval", "--use-persistent-ckpt-worker",
      "--distrib-optim-fully-reshardable-mem-efficient",
      "--override-ckpt-iteration", "--override-opt-param-scheduler", "--override-opt_param-scheduler",
      "--use-checkpoint-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler", "--help",
      "--disable-straggler-on-startup", "--mock-data", "--split", "--sample-rate", "--num-workers",
      "--reset-position-ids", "--eod-mask-loss",
      "--num-dataset-builder-threads", "--object-storage-cache-path", "--mid-level-dataset-surplus",
      "--allow-ambiguous-pad-tokens", "--per-split-data-args-path", "--per-dataset-sequences-path",
      "--no-mmap-bin-files", "--train-data-path", "--valid-data-path", "--test-data-path",
      "--no-data-sharding",
      "--trust-remote-code", "--chat-template", "--use-gigatoken", "--no-one-logger",
      "--no-use-tokenizer-model-from-checkpoint-args", "--disable-use-tokenizer-model-from-checkpoint-args",
      "--no-strict-fsdp-dtensor-load", "--disable-strict-fsdp-dtensor-load",
      "--no-ckpt-load-validate-sharding-integrity", "--disable-ckpt-load-validate-sharding-integrity",
      "--no-ckpt-fully-parallel-save", "--no-save-tokenizer-assets", "--disable-save-tokenizer-assets",
      "--no-save-optim", "--no-save-rng", "--no-load-optim", "--no-load-rng", "--record-memory-history",
      "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces", "--no-log-loss-scale-to-tensorboard",
      "--disable-log-loss-scale-to-tensorboard", "--no-yarn-correction-range-round-to-int",
      "--disable-flight-recorder-dump-on-timeout", "--disable-flight-recorder-extra-dump-on-exec",
      "--disable-flight-recorder-include-only-active",
      "--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
      "--no-dsa-indexer-rotate-activation", "--disable-dsa-indexer-rotate-activation",
      "--no-dsa-indexer-scoring-relu", "--disable-dsa-indexer-scoring-relu")),
)

_LOGGING = "logging / profiling / monitoring: host-side, no GPU memory in the step"
_CKPT = "checkpoint save/load runs outside the training step memplan prices"
_DATA = "data loading and tokenizer options run on the host"

#: ``(prefix, effect, note)``: whole families of flags; ``MODELLED`` and ``GROUPS`` win over them.
FAMILIES: tuple[tuple[str, Effect, str], ...] = (
    ("--log-", _NONE, _LOGGING), ("--tensorboard", _NONE, _LOGGING), ("--wandb-", _NONE, _LOGGING),
    ("--one-logger", _NONE, _LOGGING), ("--otel-", _NONE, _LOGGING), ("--logging-level", _NONE, _LOGGING),
    ("--profile", _NONE, _LOGGING), ("--pytorch-profiler", _NONE, _LOGGING),
    ("--use-pytorch-profiler", _NONE, _LOGGING), ("--straggler-", _NONE, _LOGGING),
    ("--log-straggler", _NONE, _LOGGING), ("--flight-recorder", _NONE, _LOGGING),
    ("--no-flight-recorder", _NONE, _LOGGING), ("--moe-routing-trace", _NONE, _LOGGING),
    ("--save", _NONE, _CKPT), ("--load", _NONE, _CKPT), ("--ckpt-", _NONE, _CKPT),
    ("--dist-ckpt-", _NONE, _CKPT), ("--async-", _NONE, _CKPT), ("--non-persistent-", _NONE, _CKPT),
    ("--exit-", _NONE, "exit conditions of the run"), ("--eval-", _NONE, "evaluation schedule"),
    ("--lr", _NONE, "learning-rate schedule"),
    ("--data-", _NONE, _DATA), ("--dataloader-", _NONE, _DATA), ("--fim-", _NONE, _DATA),
    ("--tokenizer-", _NONE, _DATA), ("--tiktoken-", _NONE, _DATA), ("--null-tokenizer-", _NONE, _DATA),
    ("--inprocess-", _NONE, "in-process restart (fault tolerance) control"),
    ("--fault-injector-", _NONE, "fault injection for testing resilience"),
    ("--inference-", _NONE, ("Megatron's inference engine (text generation server, RL rollouts), not used "
                            "by the training step")),
    ("--no-inference-", _NONE, "Megatron's inference engine, not used by the training step"),
    ("--logits-", _NONE, "logit distillation data written or read on the host"),
    ("--rl-", _NM, "RL (GRPO) training co-locates an inference engine and its rollouts; not priced"),
    ("--no-rl-", _NM, "RL (GRPO) training co-locates an inference engine and its rollouts; not priced"),
    ("--grpo-", _NM, "RL (GRPO) training co-locates an inference engine and its rollouts; not priced"),
    ("--dino-", _NM, "Megatron's DINO vision model is not modelled"),
    ("--biencoder-", _NM, "Megatron's biencoder (retrieval) models are not modelled"),
    ("--ict-", _NM, "Megatron's ICT (retrieval) models are not modelled"),
    ("--retriever-", _NM, "Megatron's retrieval models are not modelled"),
    ("--mamba-", _NM, "hybrid Mamba layers are not modelled"),
    ("--gdp-", _NM, "Gated Delta Product (linear attention) layers are not modelled"),
    ("--dsa-", _NM, "DeepSeek sparse attention (its indexer and top-k selection) is not modelled"),
    ("--mhc-", _NM, "manifold hyper-connections (several residual streams) are not modelled"),
    ("--enable-mhc-", _NM, "manifold hyper-connections (several residual streams) are not modelled"),
    ("--mup-", _NONE, "muP: initialisation and learning-rate multipliers only"),
    ("--use-mup", _NONE, "muP: initialisation and learning-rate multipliers only"),
    ("--yarn-", _NONE, "YaRN RoPE constants"),
)
