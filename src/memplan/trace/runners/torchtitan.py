"""``memplan trace --torchtitan FILE.toml``: trace torchtitan's own model, parallelize and optimizer code.

torchtitan 0.2.x (the releases that read a training TOML with ``ConfigManager``; 0.3 configures in
Python) is imported and run as its ``Trainer.__init__`` and ``forward_backward_step`` do, on
memplan's simulated ranks and fake tensors:

* the TOML is parsed by torchtitan's own ``ConfigManager`` (``--job.config_file FILE``);
* the model is ``train_spec.model_cls(model_args)`` of the file's ``[model] name`` / ``flavor``
  (``model_args.update_from_config``), built on ``meta`` under ``training.dtype`` as torchtitan
  builds it, then given fake storage (``to_empty``) inside the fake mode;
* ``train_spec.parallelize_fn`` (llama3: ``parallelize_llama`` — TP with sequence and loss
  parallelism, full or selective activation checkpointing with its per-op save list, FSDP2
  ``fully_shard`` with its ``MixedPrecisionPolicy`` and reshard policy) runs on a ``ParallelDims``
  mesh built over memplan's fake process group;
* the optimizer is ``train_spec.build_optimizers_fn`` over ``[optimizer]`` (torchtitan's
  ``OptimizersContainer``), the loss ``train_spec.build_loss_fn`` (a sum) divided by the batch's
  tokens, under torchtitan's train context (loss parallel) and ``maybe_enable_amp``.

memplan's own loop runs the iterations (forward, loss, backward, ``optimizer.step()``,
``zero_grad``), so the result is an ordinary trace: peaks, categories, and the simulated reserved
memory with FSDP's streams. The :class:`~memplan.job.Job` beside it is read from the same file by
:mod:`memplan.frameworks.torchtitan_config` (what ``memplan estimate --torchtitan-config`` prices),
and its classification of every field is the result's ``input_settings``.

What is refused before anything runs, and how the job and settings are read:
:mod:`memplan.trace.runners.torchtitan_setup`.

Known limitations: torchtitan's ``init_weights`` is not run (it only draws values, which fake
tensors have none of); the batch has no document masks (flex / varlen flavors are refused).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from memplan.errors import MissingDependencyError
from memplan.trace.run import StepJob
from memplan.trace.setup import TraceSetup

__all__ = ["FLAG", "TorchtitanTarget", "import_torchtitan"]

#: The command-line flag, as errors name it.
FLAG = "--torchtitan"


def import_torchtitan(module: str) -> Any:
    """A torchtitan module; a missing package (torchtitan or one it imports) is named, as every optional
    dependency is (:class:`~memplan.errors.MissingDependencyError`, exit 1)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise MissingDependencyError(exc.name or "torchtitan", feature=f"memplan trace {FLAG}",
                                     extra="torchtitan") from None


@dataclass(frozen=True)
class TorchtitanTarget:
    """What ``memplan trace --torchtitan FILE`` traces: torchtitan's code for the job in ``path``."""

    #: The training TOML.
    path: str
    #: torchtitan's parsed ``JobConfig`` of ``path``.
    job_config: Any
    #: The flavor's model arguments as torchtitan updates them from the file.
    model_args: Any
    #: memplan's description of the same model (what the estimator prices, ``--compare-estimate``).
    model_spec: Any = None

    @property
    def __memplan_source__(self) -> str:  # read by memplan.trace.errors for its messages
        return self.path

    @property
    def name(self) -> str:
        model = self.job_config.model
        return f"torchtitan {model.name} {model.flavor}"

    def step_job(self, options: TraceSetup) -> StepJob:
        """Build model, parallelisms, optimizer and loss as torchtitan's trainer does (inside the fake mode)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        jc = self.job_config
        spec = import_torchtitan("torchtitan.protocols.train_spec").get_train_spec(jc.model.name)
        args = self.model_args
        dims = _parallel_dims(jc, options.world_size)
        dtypes = import_torchtitan("torchtitan.config").TORCH_DTYPE_MAP

        def built(apply: Any) -> Any:
            """``apply`` (torchtitan's parallelize or pipelining function) on the model built on ``meta``."""
            with torch.device("meta"), _default_dtype(dtypes[jc.training.dtype]):
                model = spec.model_cls(args)
            with _cpu_meshes():  # meshes are small real tensors, as in memplan's ranks
                if dims.world_size > 1:
                    dims.build_mesh()
                return apply(model)

        if dims.pp_enabled:
            from memplan.trace.runners.torchtitan_pipeline import pipeline_step_job

            return pipeline_step_job(jc, spec, args, dims, built=built, amp=_amp_dtype(jc, dims),
                                     cuda_autocast=options.device == "cuda", context=_train_context(jc, dims),
                                     dtypes=dtypes)
        with unset_fake_temporarily():
            model = built(lambda model: spec.parallelize_fn(model, dims, jc))
        # Storage for every parameter and buffer, as torchtitan's to_empty gives it. Its
        # init_weights only draws values (and reassigns freqs_cis with the same shape and dtype);
        # fake tensors have no values, and trunc_normal_ reads a scalar they cannot answer.
        model.to_empty(device="cpu")
        model.train()
        optimizer = spec.build_optimizers_fn([model], jc.optimizer, dims)
        loss_sum = spec.build_loss_fn(jc, parallel_dims=dims)
        shape = (jc.training.local_batch_size, jc.training.seq_len)
        batch = {"tokens": torch.randint(0, args.vocab_size, shape), "labels": torch.randint(0, args.vocab_size, shape)}
        tokens = shape[0] * shape[1]  # torchtitan divides the summed loss by the step's valid tokens

        def loss_fn(output: Any, batch: Any) -> torch.Tensor:
            return loss_sum(output, batch["labels"]) / tokens

        return StepJob(model, batch, optimizer, loss_fn, _amp_dtype(jc, dims), cuda_autocast=options.device == "cuda",
                       call=lambda tokens, labels: model(tokens), context=_train_context(jc, dims))

    @staticmethod
    def head_modules(model: torch.nn.Module) -> frozenset[str]:
        """The output projection (``output``) and the root: what produces the logits."""
        return frozenset({"", "output"} if hasattr(model, "output") else {""})


def _parallel_dims(jc: Any, world_size: int) -> Any:
    p = jc.parallelism
    module = import_torchtitan("torchtitan.distributed.parallel_dims")
    return module.ParallelDims(dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
                               cp=p.context_parallel_degree, tp=p.tensor_parallel_degree,
                               pp=p.pipeline_parallel_degree, ep=p.expert_parallel_degree,
                               etp=p.expert_tensor_parallel_degree, world_size=world_size)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def _cpu_meshes() -> Iterator[None]:
    """torchtitan builds its meshes on ``torchtitan.tools.utils.device_type`` ("cuda" when no
    accelerator is found); memplan's simulated ranks live on the CPU, so the mesh is built there
    (the same ranks and dimension names; fake tensors stand for the GPU's memory)."""
    module = import_torchtitan("torchtitan.distributed.parallel_dims")
    before = module.device_type
    module.device_type = "cpu"
    try:
        yield
    finally:
        module.device_type = before


def _amp_dtype(jc: Any, dims: Any) -> torch.dtype | None:
    """torchtitan's ``maybe_enable_amp``: autocast to ``mixed_precision_param`` only without FSDP
    (FSDP's MixedPrecisionPolicy casts instead) and without TP/PP."""
    if dims.fsdp_enabled or dims.tp_enabled or dims.pp_enabled:
        return None
    if jc.training.mixed_precision_param == "float32":
        return None
    dtypes = import_torchtitan("torchtitan.config").TORCH_DTYPE_MAP
    return dtypes[jc.training.mixed_precision_param]  # type: ignore[no-any-return]


def _train_context(jc: Any, dims: Any) -> Any:
    """torchtitan's train context: ``loss_parallel`` under TP unless ``disable_loss_parallel``."""
    utils = import_torchtitan("torchtitan.distributed.utils")
    return utils.get_train_context(dims.tp_enabled and not jc.parallelism.disable_loss_parallel)
