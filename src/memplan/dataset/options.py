"""The ``--dataset`` options of ``memplan estimate`` and ``memplan fit``, and what they resolve to.

:func:`dataset_options` adds the options to a command (the command receives ``dataset_flags``, the
options the user gave); :func:`dataset_request` turns them, with the job and the ``--hf-args`` file's
batching fields (``seed``, ``data_seed``, ``dataloader_drop_last``, ``train_sampling_strategy`` /
``group_by_length``, ``max_length``, ``packing``, ``packing_strategy``, ``padding_free``,
``shuffle_dataset``, ``num_train_epochs``, ``pad_to_multiple_of``), into a
:class:`~memplan.dataset.DatasetRequest`. Flags typed on the command line win over the file.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import typer

from memplan.dataset.rules import RULES
from memplan.errors import ConfigError

__all__ = ["dataset_fields", "dataset_options", "dataset_request"]

PANEL = "Dataset (the user's own data)"
FLAG_IMAGES = "--images-field"

#: (parameter, flag, type, help, metavar)
_OPTIONS: tuple[tuple[str, str, Any, str, str | None], ...] = (
    ("dataset", "--dataset", str, "Training data: JSON/JSONL, Parquet, CSV, Arrow file, a save_to_disk folder or a "
     "cached Hub dataset id; prices every step of it.", "PATH"),
    ("text_field", "--text-field", str, "Column holding plain text. (default: text)", "NAME"),
    ("messages_field", "--messages-field", str, "Column holding chat messages (the tokenizer's chat template "
     "is applied).", "NAME"),
    ("prompt_field", "--prompt-field", str, "Column of prompts (with --completion-field).", "NAME"),
    ("completion_field", "--completion-field", str, "Column of completions (with --prompt-field).", "NAME"),
    ("images_field", "--images-field", str, "Column of each example's image(s): a path relative to the dataset, "
     "a list of them or {path: ...}; adds the image tokens of the VLM's processor.", "NAME"),
    ("vision_model", "--vision-model", str, "With --images-field: the vision-language model (folder, config.json or "
     "cached Hub id) whose processor counts image tokens. (default: the model)", "PATH"),
    ("tokenizer", "--tokenizer", str, "tokenizer.json, its folder or a cached Hub id. (default: the model's)",
     "PATH"),
    ("batching", "--batching", str, f"The trainer's batching rule: {', '.join(RULES)}. (default: hf)", "RULE"),
    ("max_length", "--max-length", int, "Truncation / packed row length in tokens (trl: 1024 by default).", "N"),
    ("seed", "--seed", int, "The trainer's seed (TrainingArguments.seed). (default: 42)", "N"),
    ("data_seed", "--data-seed", int, "TrainingArguments.data_seed (the sampler's seed).", "N"),
    ("epochs", "--epochs", int, "Epochs over the dataset. (default: 1)", "N"),
    ("group_by_length", "--group-by-length", bool, "HF Trainer's length-grouped sampler.", None),
    ("drop_last", "--drop-last", bool, "dataloader_drop_last: drop the last incomplete micro-batch.", None),
    ("pad_to_multiple_of", "--pad-to-multiple-of", int, "The collator's pad_to_multiple_of.", "N"),
    ("packing_strategy", "--packing-strategy", str, "trl-packing: bfd or wrapped. (default: bfd)", "NAME"),
    ("shuffle_dataset", "--shuffle-dataset", bool, "TRL SFTConfig.shuffle_dataset.", None),
)


def dataset_fields() -> dict[str, type]:
    """The ``--dataset`` options by parameter name, with their types (also the fields of ``POST /v1/dataset``)."""
    return {name: kind for name, _flag, kind, _help, _meta in _OPTIONS}


def dataset_options(*, plot: bool = False, emit: bool = False) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Add the dataset options (``--plot FILE`` when ``plot``, ``--emit KIND FILE`` when ``emit``) to a
    command receiving ``dataset_flags``."""
    rows = list(_OPTIONS)
    if plot:
        rows.append(("plot", "--plot", str, "With --dataset: write the per-step peak against the GPU as a PNG.",
                     "FILE"))
    if emit:
        rows.append(("emit", "--emit", tuple[str, str], "With --dataset: write the chosen setting as the "
                     "trainer's config: hf (TrainingArguments JSON), trl (SFTConfig JSON), torchtune or axolotl (YAML).",
                     "KIND FILE"))
    generated = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                   annotation=Annotated[kind | None, typer.Option(
                                       flag, help=text, rich_help_panel=PANEL, metavar=meta, show_default=False)])
                 for name, flag, kind, text, meta in rows]
    names = [p.name for p in generated]

    def decorate(func: Callable[..., None]) -> Callable[..., None]:
        own = [p for n, p in inspect.signature(func, eval_str=True).parameters.items() if n != "dataset_flags"]

        @functools.wraps(func)
        def command(**kwargs: Any) -> None:
            given = {name: kwargs.pop(name, None) for name in names}
            func(**kwargs, dataset_flags={k: v for k, v in given.items() if v is not None})

        del command.__wrapped__  # typer reads the signature below
        command.__signature__ = inspect.Signature(own + generated)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in own + generated}
        return command

    return decorate


def dataset_request(flags: Mapping[str, Any], loaded: Any) -> Any:
    """The :class:`~memplan.dataset.DatasetRequest` the flags, the job and ``--hf-args`` describe."""
    from memplan.dataset import Batching, DatasetRequest, Fields

    extra = {k for k in flags if k != "dataset"}
    if "dataset" not in flags:
        if extra:
            raise ConfigError(f"--{sorted(extra)[0].replace('_', '-')}", "needs --dataset")
        return None
    values = {**_hf_batching(getattr(loaded, "hf_args", None)), **flags}
    job = loaded.job
    batching = Batching(
        rule=values.get("batching", "hf"), micro_batch_size=job.batch.micro_batch_size,
        max_length=values.get("max_length"), seed=values.get("seed", 42), data_seed=values.get("data_seed"),
        drop_last=bool(values.get("drop_last", False)), group_by_length=bool(values.get("group_by_length", False)),
        pad_to_multiple_of=values.get("pad_to_multiple_of"),
        packing_strategy=_strategy(values.get("packing_strategy", "bfd")),
        shuffle_dataset=bool(values.get("shuffle_dataset", False)), epochs=int(values.get("epochs", 1)),
        gradient_accumulation_steps=job.num_microbatches)
    fields = Fields(text=values.get("text_field"), messages=values.get("messages_field"),
                    prompt=values.get("prompt_field"), completion=values.get("completion_field"))
    if fields.text is None and fields.messages is None and fields.prompt is None:
        fields = Fields(text="text")
    return DatasetRequest(path=str(flags["dataset"]), fields=fields, tokenizer=values.get("tokenizer"),
                          batching=batching, images=values.get("images_field"),
                          vision_model=values.get("vision_model"))


def _strategy(value: str) -> Any:
    if value not in ("bfd", "wrapped"):
        raise ConfigError("--packing-strategy", "must be bfd or wrapped", value)
    return value


def _hf_batching(path: str | None) -> dict[str, Any]:
    """The batching fields of ``--hf-args``: a TrainingArguments / SFTConfig JSON or a script's command line."""
    if path is None:
        return {}
    from memplan.frameworks.hf_args_file import read_hf_args

    args = read_hf_args(path)
    out: dict[str, Any] = {k: args[k] for k in ("seed", "data_seed", "pad_to_multiple_of", "max_length",
                                                "packing_strategy", "shuffle_dataset") if args.get(k) is not None}
    if args.get("max_seq_length") is not None and "max_length" not in out:
        out["max_length"] = args["max_seq_length"]
    if args.get("dataloader_drop_last"):
        out["drop_last"] = True
    if args.get("group_by_length") or args.get("train_sampling_strategy") == "group_by_length":
        out["group_by_length"] = True
    if args.get("num_train_epochs") is not None:
        out["epochs"] = max(1, int(float(args["num_train_epochs"])))
    sft = any(k in args for k in ("dataset_text_field", "packing", "padding_free", "completion_only_loss"))
    if sft:
        out["batching"] = ("trl-packing" if args.get("packing") else
                           "trl-padding-free" if args.get("padding_free") else "trl")
    return out


def estimate_with_dataset(loaded: Any, flags: Mapping[str, Any]) -> tuple[Any, dict[str, Any], Any]:
    """``memplan estimate --dataset``: the worst step's estimate, its JSON document with the ``dataset``
    section, and the :class:`~memplan.dataset.DatasetPeaks` (``--plot`` written when asked; the command
    checks its path first)."""
    require_packages()
    from dataclasses import replace

    from memplan.dataset import analyze
    from memplan.dataset.peaks import shape_job
    from memplan.documents import estimate_document

    request = dataset_request(flags, loaded)
    peaks = analyze(loaded, request)
    worst = peaks.worst
    at_worst = replace(loaded, job=shape_job(loaded.job, worst.batch_size, worst.seq_length, peaks.shapes.packed))
    result, document = estimate_document(at_worst)
    document["dataset"] = peaks.to_dict()
    images = images_section(request, loaded)
    if images is not None:
        document["dataset"]["images"] = images
        if isinstance(document.get("unmodelled_settings"), list):
            document["unmodelled_settings"].append(f"{FLAG_IMAGES}: the vision encoder's parameters and "
                                                   "activations (images are priced as their tokens only)")
    if flags.get("plot"):
        from memplan.dataset.plot import plot_steps

        plot_steps(peaks, str(flags["plot"]))
    return result, document, peaks


def images_section(request: Any, loaded: Any) -> dict[str, Any] | None:
    """The JSON ``dataset.images`` entry of an ``--images-field`` request (None without one)."""
    if request.images is None:
        return None
    from memplan.dataset.images import images_note

    return images_note(request.path, request.fields, request.images, request.vision_model or loaded.model_ref)


def require_packages() -> None:
    """Refuse in one line when a package ``--dataset`` needs is missing (the ``memplan[dataset]`` extra)."""
    from memplan.errors import MissingDependencyError

    for name in ("numpy", "datasets", "tokenizers"):
        try:
            __import__(name)
        except ImportError:
            raise MissingDependencyError(name, feature="--dataset", extra="dataset") from None


def report_dataset(model: str | None, job_file: str | None, gpu: str | None, job_flags: dict[str, Any],
                   flags: Mapping[str, Any], dialects: tuple[str | None, str | None, str | None]) -> tuple[Any, str]:
    """``memplan report --dataset``: the worst step's estimate and the report's per-step section."""
    require_packages()
    from memplan.dataset.html import dataset_section
    from memplan.inputs import JobRequest, load_job

    loaded = load_job(JobRequest(model=model, flags=job_flags, job_file=job_file, gpu=gpu or "h100-80gb",
                                 hf_args=dialects[0], peft_config=dialects[1], torchtitan_config=dialects[2]))
    result, _, peaks = estimate_with_dataset(loaded, flags)
    return result, dataset_section(peaks)
