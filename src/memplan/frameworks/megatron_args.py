"""Map a Megatron-LM launch (its argument list) to a ModelSpec and a Job.

Accepts a command line or a bash launch script (``pretrain_gpt.py --num-layers 32 ...``, with
backslash-continued lines and the script's variables expanded), a YAML/JSON mapping of flags to
values (like a functional test's ``MODEL_ARGS``), a YAML/JSON list of tokens, or a mapping in Python
(read into ``{"--flag": value}`` by :mod:`memplan.frameworks.megatron_launch`). The flags memplan
models are mapped; every flag of the launch is reported with what memplan did with it
(:mod:`memplan.frameworks.megatron_flags`); architectures memplan does not model (T5, BERT, hybrid
Mamba, multimodal) are refused. Megatron's own defaults apply where
a flag is absent (megatron/training/arguments.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from memplan.errors import ModelConfigError, UnsupportedError
from memplan.frameworks.megatron_flags import megatron_settings
from memplan.frameworks.megatron_graphs import cuda_graphs
from memplan.frameworks.megatron_launch import parse_megatron_args, read_megatron_args_file
from memplan.frameworks.megatron_model import flag_is_set, megatron_model_spec, pipeline_layout_chunks
from memplan.frameworks.megatron_overlap import comm_overlap
from memplan.frameworks.shell_script import unresolved_hint
from memplan.job import (
    Batch,
    Job,
    MoEOptions,
    Offload,
    Optimizer,
    Parallelism,
    Precision,
    Recompute,
    Sharding,
)
from memplan.model.spec import ModelSpec
from memplan.optimizers import by_dialect
from memplan.settings import InputSetting

__all__ = ["dumps_args", "from_megatron_args", "load_megatron_args", "load_megatron_launch", "megatron_job",
           "parse_megatron_args", "read_megatron_args_file"]

#: Flags whose presence means an architecture memplan does not model, and its name.
_UNSUPPORTED = {
    "--encoder-num-layers": "T5 (encoder-decoder)",
    "--decoder-num-layers": "T5 (encoder-decoder)",
    "--encoder-seq-length": "T5 (encoder-decoder)",
    "--vocab-extra-ids": "T5 (encoder-decoder)",
    "--bert-no-binary-head": "BERT",
    "--bert-binary-head": "BERT",
    "--hybrid-layer-pattern": "hybrid Mamba",
    "--hybrid-override-pattern": "hybrid Mamba",
    "--is-hybrid-model": "hybrid Mamba",
    "--language-model-type": "multimodal",
    "--vision-model-type": "multimodal",
    "--model-provider": "multimodal (custom model provider)",
    "--total-seq-length": "multimodal",
}


def load_megatron_args(path: str | Path, *, gpus: int) -> tuple[ModelSpec, Job]:
    """ModelSpec and Job for a Megatron-LM launch described in the file ``path`` on ``gpus`` GPUs."""
    model, job, _ = load_megatron_launch(path, gpus=gpus)
    return model, job


def load_megatron_launch(path: str | Path, *, gpus: int) -> tuple[ModelSpec, Job, tuple[InputSetting, ...]]:
    """ModelSpec, Job and what memplan did with each flag of the launch in ``path``
    (:func:`memplan.frameworks.megatron_flags.megatron_settings`)."""
    args = read_megatron_args_file(path)
    model, job = from_megatron_args(args, gpus=gpus, name=Path(path).stem)
    return model, job, megatron_settings(args)


def from_megatron_args(
    source: str | Sequence[str] | Mapping[str, Any], *, gpus: int, name: str = "megatron-gpt"
) -> tuple[ModelSpec, Job]:
    """ModelSpec and Job for Megatron-LM arguments on ``gpus`` GPUs."""
    args = parse_megatron_args(source)
    for flag, arch in _UNSUPPORTED.items():
        if flag in args:
            raise UnsupportedError(
                f"{flag}: {arch} models are not supported by memplan's estimator "
                "(decoder-only GPT, Llama-style, MoE and MLA models are)"
            )
    spec = str(args.get("--spec", ""))
    if "mamba" in spec or "hybrid" in spec or "bert" in spec or "t5" in spec:
        raise UnsupportedError(f"--spec: the layer spec {spec!r} is not a GPT decoder; not supported")
    vocab_file = str(args.get("--vocab-file", ""))
    if vocab_file.endswith(".txt") and "--merge-file" not in args and "--tokenizer-type" not in args:
        raise UnsupportedError(
            "--vocab-file: a WordPiece vocabulary without --merge-file is BERT's tokenizer; "
            "BERT models are not supported"
        )
    model = megatron_model_spec(args, name=name)
    return model, megatron_job(args, model, gpus=gpus)


def _int(args: Mapping[str, Any], flag: str, default: int | None = None) -> int | None:
    value = args.get(flag, default)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ModelConfigError(flag, "must be an integer", value, hint=unresolved_hint(value)) from None


def _float(args: Mapping[str, Any], flag: str, default: float) -> float:
    value = args.get(flag, default)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ModelConfigError(flag, "must be a number", value, hint=unresolved_hint(value)) from None


_UNEVEN = ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers")
_ACCOUNT = ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")


def _check_pipeline_split(args: Mapping[str, Any], num_layers: int, pp: int) -> None:
    """Megatron's checks of the stage split (megatron/training/arguments.py, TransformerConfig.__post_init__): the
    layout excludes the other split flags, an uneven first/last stage excludes the account flags, and without
    either the stages divide the layers (one more for each account flag)."""
    uneven = [flag for flag in _UNEVEN if args.get(flag) is not None]
    account = [flag for flag in _ACCOUNT if flag_is_set(args, flag)]
    layout = "--pipeline-model-parallel-layout"
    if args.get(layout) and (uneven or account):
        raise ModelConfigError(layout, "cannot be combined with " + ", ".join(uneven + account) + " (Megatron "
                               "raises)", args.get(layout))
    if uneven and account:
        raise ModelConfigError(uneven[0], "cannot be combined with " + ", ".join(account) + " (Megatron raises)",
                               args.get(uneven[0]))
    total = num_layers + len(account)
    if pp > 1 and not uneven and not args.get(layout) and total % pp:
        counted = f"{num_layers} layers" + (f" + {len(account)} ({', '.join(account)})" if account else "")
        raise ModelConfigError("--pipeline-model-parallel-size", f"must divide the {counted} (Megatron asserts "
                               "it); give --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers or "
                               "--pipeline-model-parallel-layout for an uneven split", pp)


def megatron_job(args: Mapping[str, Any], model: ModelSpec, *, gpus: int) -> Job:
    """The Job part of Megatron arguments (parallelism, batch, precision, optimizer, recompute)."""
    tp = _int(args, "--tensor-model-parallel-size", 1) or 1
    pp = _int(args, "--pipeline-model-parallel-size", 1) or 1
    cp = _int(args, "--context-parallel-size", 1) or 1
    vpp = 1
    per_vstage = _int(args, "--num-layers-per-virtual-pipeline-stage")
    if per_vstage:
        vpp = max(1, model.num_layers // (pp * per_vstage))
    vpp = _int(args, "--num-virtual-stages-per-pipeline-rank", vpp) or vpp
    _check_pipeline_split(args, model.num_layers, pp)
    first = _int(args, "--decoder-first-pipeline-num-layers")
    last = _int(args, "--decoder-last-pipeline-num-layers")
    if flag_is_set(args, "--account-for-embedding-in-pipeline-split") or flag_is_set(args, "--account-for-loss-in-pipeline-split"):
        each = (model.num_layers + flag_is_set(args, "--account-for-embedding-in-pipeline-split")
                + flag_is_set(args, "--account-for-loss-in-pipeline-split")) // pp
        if flag_is_set(args, "--account-for-embedding-in-pipeline-split"):
            first = each - 1
        if flag_is_set(args, "--account-for-loss-in-pipeline-split"):
            last = each - 1
    chunk_layers = None
    layout = args.get("--pipeline-model-parallel-layout")
    if layout:
        chunk_layers, _ = pipeline_layout_chunks(str(layout))
        first = last = None
        vpp = 1
    parallel = Parallelism(
        world_size=gpus,
        tp=tp,
        pp=pp,
        vpp=vpp,
        chunk_layers=chunk_layers,
        cp=cp,
        ep=_int(args, "--expert-model-parallel-size", 1) or 1,
        etp=_int(args, "--expert-tensor-parallel-size", tp),  # Megatron: ETP defaults to TP
        sequence_parallel=flag_is_set(args, "--sequence-parallel"),
        first_stage_layers=first,
        last_stage_layers=last,
        microbatch_group_size=_int(args, "--microbatch-group-size-per-virtual-pipeline-stage"),
    )
    mbs = _int(args, "--micro-batch-size", 1) or 1
    gbs = _int(args, "--global-batch-size")
    batch = Batch(micro_batch_size=mbs, seq_length=_int(args, "--seq-length", 1024) or 1024, global_batch_size=gbs)
    return Job(
        parallel=parallel,
        sharding=_sharding(args),
        batch=batch,
        precision=_precision(args),
        optimizer=_optimizer(args),
        recompute=_recompute(args),
        attention=_attention(args),
        **_dropouts(args),
        loss="fused" if flag_is_set(args, "--cross-entropy-loss-fusion") else "vocab-parallel",
        defer_embedding_wgrad=flag_is_set(args, "--defer-embedding-wgrad-compute"),
        wgrad_deferral_limit=_int(args, "--wgrad-deferral-limit", 0) or 0,
        framework="megatron",
        vocab_divisible_by=_int(args, "--make-vocab-size-divisible-by", 128),
        mtp_layers=_int(args, "--mtp-num-layers", 0) or 0,
        moe=_moe_options(args),
        offload=_offload(args),
        overlap=comm_overlap(args),
        transformer_impl=_transformer_impl(args),
        cuda_graphs=cuda_graphs(args),
    )


def _dropouts(args: Mapping[str, Any]) -> dict[str, Any]:
    """``--hidden-dropout`` (embedding, residuals) and ``--attention-dropout`` (the probabilities), both 0.1 by
    default (TransformerConfig); the second is a field of its own only where they differ."""
    hidden, attention = _float(args, "--hidden-dropout", 0.1), _float(args, "--attention-dropout", 0.1)
    return {"dropout": hidden, "attention_dropout": None if attention == hidden else attention}


def _transformer_impl(args: Mapping[str, Any]) -> str:
    impl = str(args.get("--transformer-impl", "transformer_engine"))
    if impl not in ("transformer_engine", "local"):
        raise ModelConfigError("--transformer-impl", "must be transformer_engine or local", impl)
    return impl


def _moe_options(args: Mapping[str, Any]) -> MoEOptions:
    dispatcher = str(args.get("--moe-token-dispatcher-type", "allgather"))
    if dispatcher not in ("alltoall", "allgather", "flex"):
        raise ModelConfigError("--moe-token-dispatcher-type", "must be allgather, alltoall or flex", dispatcher)
    capacity = args.get("--moe-expert-capacity-factor")
    return MoEOptions(
        dispatcher=dispatcher,  # type: ignore[arg-type]
        capacity_factor=_float(args, "--moe-expert-capacity-factor", 1.0) if capacity is not None else None,
        pad_to_capacity=flag_is_set(args, "--moe-pad-expert-input-to-capacity") and capacity is not None,
        # the legacy GroupedMLP (--transformer-impl local) uses the grouped_gemm package, no TE workspaces
        grouped_gemm=flag_is_set(args, "--moe-grouped-gemm")
        and str(args.get("--transformer-impl", "transformer_engine")) != "local",
    )


def _offload(args: Mapping[str, Any]) -> Offload:
    fine = flag_is_set(args, "--fine-grained-activation-offloading")
    modules = args.get("--offload-modules") if fine else None
    names = [str(v) for v in modules] if isinstance(modules, list) else str(modules or "").split()
    if fine and not names:
        raise ModelConfigError("--offload-modules", "must name at least one module with "
                               "--fine-grained-activation-offloading (Megatron asserts it)", modules)
    return Offload(
        optimizer=flag_is_set(args, "--optimizer-cpu-offload"),
        optimizer_fraction=_float(args, "--optimizer-offload-fraction", 1.0),
        # --cpu-offloading moves activations unless --cpu-offloading-activations says otherwise.
        activations=flag_is_set(args, "--cpu-offloading")
        and ("--cpu-offloading-activations" not in args or flag_is_set(args, "--cpu-offloading-activations")),
        modules=",".join(names),
        min_tensor_numel=_int(args, "--min-offloaded-tensor-size", 1024 * 1024) or 0,
        group_fraction=_float(args, "--activation-offload-fraction", 1.0),
        pp_delta_bytes=_int(args, "--delta-offload-bytes-across-pp-ranks", 0) or 0,
    )


def _sharding(args: Mapping[str, Any]) -> Sharding:
    strategy = str(args.get("--data-parallel-sharding-strategy", ""))
    if flag_is_set(args, "--use-megatron-fsdp") or flag_is_set(args, "--use-torch-fsdp2"):
        zero = {"no_shard": 0, "optim": 1, "optim_grads": 2}.get(strategy, 3)
        return Sharding(zero=zero)
    return Sharding(
        # dist_muon: Megatron's layer-wise distributed optimizer (states sharded over data parallel).
        distributed_optimizer=flag_is_set(args, "--use-distributed-optimizer") or args.get("--optimizer") == "dist_muon",
        distributed_optimizer_instances=_int(args, "--num-distributed-optimizer-instances", 1) or 1,
    )


def _precision(args: Mapping[str, Any]) -> Precision:
    if flag_is_set(args, "--bf16"):
        name = "bf16-mixed"
    elif flag_is_set(args, "--fp16"):
        name = "fp16-mixed"
    else:
        return Precision(name="fp32")
    grad = None
    if flag_is_set(args, "--no-accumulate-allreduce-grads-in-fp32") or str(args.get("--grad-reduce-in-bf16", "")) in ("True", "true"):
        grad = name.removesuffix("-mixed")
    if name == "fp16-mixed" and not flag_is_set(args, "--accumulate-allreduce-grads-in-fp32"):
        grad = grad or "fp16"
    fp8 = args.get("--fp8-format") or (args.get("--fp8") if isinstance(args.get("--fp8"), str) else None)
    if fp8 is not None and str(fp8) not in ("hybrid", "e4m3"):
        raise UnsupportedError(f"--fp8-format: {fp8!r} is not modelled (hybrid and e4m3 are)")
    return Precision(
        name=name,  # type: ignore[arg-type]
        grad_dtype=grad,
        fp8=str(fp8) if fp8 is not None else None,  # type: ignore[arg-type]
        fp8_params=fp8 is not None and (flag_is_set(args, "--fp8-param-gather") or flag_is_set(args, "--fp8-param")),
    )


def _optimizer(args: Mapping[str, Any]) -> Optimizer:
    """``--optimizer`` and the arguments its registry entry reads (:mod:`memplan.optimizers`)."""
    name = str(args.get("--optimizer", "adam"))
    kinds = by_dialect("megatron")
    if name not in kinds:
        known = [kind.dialects.megatron[0] for kind in dict.fromkeys(kinds.values())]
        raise UnsupportedError(f"--optimizer: Megatron optimizer {name!r} is not modelled "
                               f"({', '.join(known[:-1])} and {known[-1]} are)")
    kind = kinds[name]
    values: dict[str, Any] = {}
    for spec in kind.dialects.megatron_flags:
        if spec.kind == "flag":
            value: Any = flag_is_set(args, spec.flag)
        elif spec.kind == "float":
            value = _float(args, spec.flag, float(spec.default))  # type: ignore[arg-type]
        else:
            value = str(args.get(spec.flag, spec.default))
        if spec.modelled and value not in spec.modelled:
            raise UnsupportedError(f"{spec.flag}: {value!r} is not modelled ({' and '.join(spec.modelled)} "
                                   f"{'is' if len(spec.modelled) == 1 else 'are'})")
        if spec.field:
            values[spec.field] = value
    return Optimizer(name=kind.name, **values)


def _recompute(args: Mapping[str, Any]) -> Recompute:
    granularity = args.get("--recompute-granularity")
    if flag_is_set(args, "--recompute-activations"):
        granularity = "selective"
    if flag_is_set(args, "--moe-layer-recompute"):
        # deprecated: Megatron turns it into selective recompute with "moe" added to the modules
        if granularity == "full":
            raise ModelConfigError("--moe-layer-recompute", "cannot be combined with --recompute-granularity "
                                   "full (Megatron refuses it too)", True)
        granularity = "selective"
    if not granularity or granularity is True:
        return Recompute()
    method = str(args.get("--recompute-method", "uniform"))
    return Recompute(
        mode=str(granularity),  # type: ignore[arg-type]
        method=method if method in ("uniform", "block") else "uniform",  # type: ignore[arg-type]
        num_layers=_int(args, "--recompute-num-layers"),
        modules=_recompute_modules(args) if granularity == "selective" else None,
    )


def _recompute_modules(args: Mapping[str, Any]) -> str | None:
    """Megatron ``--recompute-modules a b c`` (nargs list; default core_attn) as a comma list, with
    Megatron's refusals that need other arguments (transformer_config.py). Megatron reads the
    modules only under selective granularity, so the caller passes them only then."""
    value = args.get("--recompute-modules")
    moe_layer = flag_is_set(args, "--moe-layer-recompute")
    if value is None and not moe_layer:
        return None
    if value is None:
        names = ["core_attn"]
    elif isinstance(value, list):
        names = [str(v) for v in value]
    else:  # one name, or the flag with none (True): an empty list, which Megatron accepts
        names = [] if value is True else str(value).replace(",", " ").split()
    if moe_layer and "moe" not in names:
        names.append("moe")
    if "moe_act" in names and not flag_is_set(args, "--moe-grouped-gemm"):
        raise ModelConfigError("--recompute-modules", "moe_act needs --moe-grouped-gemm (Megatron refuses it "
                               "otherwise)", " ".join(names))
    if "shared_experts" in names and flag_is_set(args, "--moe-shared-expert-overlap"):
        raise ModelConfigError("--recompute-modules", "shared_experts cannot be recomputed with "
                               "--moe-shared-expert-overlap (Megatron refuses it)", " ".join(names))
    fp8 = args.get("--fp8-format") or isinstance(args.get("--fp8"), str)
    delayed = str(args.get("--fp8-recipe", "delayed")) == "delayed"  # TransformerConfig's default recipe
    if fp8 and delayed and {"moe_act", "layernorm"} & set(names):
        raise ModelConfigError("--recompute-modules", "moe_act and layernorm recompute need an FP8 recipe other "
                               "than delayed scaling (Megatron refuses them; set --fp8-recipe)", " ".join(names))
    return ",".join(names)


def _attention(args: Mapping[str, Any]) -> str:
    backend = str(args.get("--attention-backend", "auto"))
    if backend == "unfused":
        return "eager"
    if backend in ("flash", "fused", "auto") and str(args.get("--transformer-impl", "transformer_engine")) == "local":
        # The local (non-TE) layer spec uses Megatron's unfused DotProductAttention unless flash-attn is asked for.
        return "flash" if flag_is_set(args, "--use-flash-attn") or backend == "flash" else "eager"
    return "flash"


def dumps_args(args: Mapping[str, Any]) -> str:
    """The mapping as a JSON string (for reports)."""
    return json.dumps(dict(args), sort_keys=True, default=str)
