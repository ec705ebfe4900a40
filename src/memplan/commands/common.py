"""What every ``memplan`` command shares: the typer app, error handling, output, and the job options.

The job options are generated from the Job's own field declarations (:mod:`memplan.jobflags`):
:func:`job_options` adds one option per job flag to a command and hands the values that were
given to the command as ``job_flags``. A command therefore never re-declares a job field.

Startup matters (``memplan estimate`` answers in well under a second): this module imports no
torch, numpy or matplotlib, and rich only when it renders.

Exit codes: 0 success; 1 a :class:`~memplan.errors.MemplanError` that is not a configuration
error (unsupported input, or a valid question whose answer is "no", e.g. nothing fits); 2 bad
input (a :class:`~memplan.errors.ConfigError` or a usage error reported by typer/click).
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, ClassVar

import typer

from memplan.errors import ConfigError, MemplanError

__all__ = [
    "EXIT_CONFIG",
    "EXIT_ERROR",
    "Command",
    "Group",
    "app",
    "check_output_path",
    "command_group",
    "handle_errors",
    "job_options",
    "option",
    "print_json",
    "print_rich",
    "print_unmodelled",
]

#: Exit code of bad input (the same code click uses for usage errors).
EXIT_CONFIG = 2
#: Exit code of any other deliberate memplan error.
EXIT_ERROR = 1


class _PlainCoercion:
    """Converts a command-line string to int/float/str/bool the way click does, without pydantic.

    typer >= 0.2x coerces every parameter, given or not, through a pydantic ``TypeAdapter`` built
    on first use: importing pydantic and building ~45 adapters costs ~0.2 s, which would double
    the start-up time of ``memplan estimate``. Our options are plain scalars, so they are
    converted here; any other parameter keeps typer's own path.
    """

    _NAMES: ClassVar[dict[type, str]] = {int: "integer", float: "float", str: "string", bool: "boolean"}
    _BOOLS: ClassVar[dict[str, bool]] = {
        "1": True, "true": True, "t": True, "yes": True, "y": True, "on": True,
        "0": False, "false": False, "f": False, "no": False, "n": False, "off": False,
    }

    def __init__(self, kind: type) -> None:
        self.kind = kind

    def coerce(self, value: Any, param: Any, ctx: Any) -> Any:
        if value is None or isinstance(value, self.kind):
            return value
        try:
            if self.kind is bool:
                return self._BOOLS[str(value).strip().lower()]
            return self.kind(value)
        except (KeyError, TypeError, ValueError):
            raise typer.BadParameter(f"{value!r} is not a valid {self._NAMES[self.kind]}.", ctx=ctx, param=param) from None

    @classmethod
    def install(cls, params: Iterable[Any]) -> None:
        """Give each plain scalar typer parameter this coercion (no-op on other typer versions)."""
        for param in params:
            descriptor = getattr(param, "type_descriptor", None)
            kind = getattr(descriptor, "annotation", None)
            info = getattr(descriptor, "parameter_info", None)
            plain = info is not None and all(getattr(info, a, None) is None for a in ("parser", "min", "max"))
            if kind in cls._NAMES and plain and getattr(param, "_runtime_param", 0) is None \
                    and param.nargs == 1 and not param.multiple:
                param._runtime_param = cls(kind)


class Command(typer.core.TyperCommand):
    """typer's command with the light scalar coercion of :class:`_PlainCoercion`, and help whose
    flag names stay whole at 80 columns."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        _PlainCoercion.install(params)
        return params

    def format_help(self, ctx: Any, formatter: Any) -> None:
        """typer's help, with each ``--no-X`` form named in the help text instead of its own column:
        that column squeezes long flag names (``--no-sequence-paral…``) in an 80-column terminal."""
        saved = [(p, p.secondary_opts, p.help) for p in self.get_params(ctx) if getattr(p, "secondary_opts", None)]
        for param, negative, text in saved:
            param.help = f"{text or ''} Turn off with {', '.join(negative)}.".strip()
            param.secondary_opts = []
        try:
            super().format_help(ctx, formatter)
        finally:
            for param, negative, text in saved:
                param.secondary_opts, param.help = negative, text


class Group(typer.core.TyperGroup):
    """typer's group with the light scalar coercion of :class:`_PlainCoercion`."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        _PlainCoercion.install(params)
        return params


app = typer.Typer(
    name="memplan",
    cls=Group,
    help="How much GPU memory a training job needs, where it goes, and how to make it fit.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def command_group(name: str, help: str) -> typer.Typer:
    """A group of subcommands (``memplan alloc ...``) registered on :data:`app`."""
    group = typer.Typer(name=name, cls=Group, help=help, no_args_is_help=True, add_completion=False,
                        context_settings={"help_option_names": ["-h", "--help"]})
    app.add_typer(group, name=name)
    return group


@contextmanager
def handle_errors() -> Iterator[None]:
    """Turn memplan's own errors into one red ``error:`` line on stderr and an exit code.

    :class:`ConfigError` (bad input) exits 2, any other :class:`MemplanError` exits 1. Other
    exceptions are bugs and keep their traceback.
    """
    try:
        yield
    except ConfigError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(EXIT_CONFIG) from None
    except MemplanError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(EXIT_ERROR) from None


def print_json(data: object) -> None:
    """``data`` as indented JSON on stdout (nothing else is printed with ``--json``)."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def print_rich(*renderables: Any) -> None:
    """Render rich objects (tables, panels, objects with ``__rich__``) on stdout."""
    from rich.console import Console

    Console(highlight=False).print(*renderables)


def print_unmodelled(settings: Iterable[Any]) -> None:
    """The input settings memplan does not model, as one yellow line on stdout (none: nothing); the
    reasons are in ``--json`` (``unmodelled_settings``)."""
    from memplan.settings import unmodelled

    missing = unmodelled(settings)
    if not missing:
        return
    names = ", ".join(f"{item.source} {item.key}" for item in missing)
    typer.secho(f"Not modelled ({len(missing)} input setting{'s' if len(missing) > 1 else ''}; the estimate "
                f"assumes otherwise; why: --json unmodelled_settings): {names}", fg="yellow")


#: The dialect-file options every job command takes (``--hf-args``, ``--peft-config``).
HF_ARGS_HELP = ("Hugging Face TrainingArguments: the JSON to_json_string() writes, or a text file with the script's "
                "command line (python train.py --per_device_train_batch_size 4 ...). Sets framework hf.")
PEFT_CONFIG_HELP = "PEFT adapter_config.json (LoRA/DoRA) applied to the job."
TORCHTITAN_CONFIG_HELP = ("torchtitan training TOML (--job.config_file): its [model] name/flavor names the preset "
                          "when MODEL is not given; parallelism, batch, precision, checkpointing. Sets framework "
                          "torchtitan.")


def option(*names: str, help: str, panel: str, metavar: str | None = None) -> Any:
    """A typer option shown in help panel ``panel``, without typer's own default text."""
    return typer.Option(*names, help=help, rich_help_panel=panel, metavar=metavar, show_default=False)


def check_output_path(flag: str, path: str | None) -> None:
    """Refuse, before any work starts, an output path that is a folder or whose folder is missing."""
    if path is None:
        return
    target = Path(path).expanduser()
    if target.is_dir():
        raise ConfigError(flag, "must be a file path, not a folder", path)
    parent = target.parent
    if not parent.is_dir():
        raise ConfigError(flag, f"must be in an existing folder ({parent} does not exist)", path)


def _job_parameters(skip: frozenset[str]) -> list[inspect.Parameter]:
    from memplan.jobflags import job_flags

    out = []
    for flag in job_flags():
        if flag.name in skip:
            continue
        decl = f"{flag.flag}/--no-{flag.flag[2:]}" if flag.kind is bool else flag.flag
        info = option(decl, help=flag.help_text, panel=flag.panel, metavar=flag.metavar)
        annotation = Annotated[flag.kind | None, info]  # type: ignore[operator]
        out.append(inspect.Parameter(flag.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation))
    return out


def job_options(*, skip: Iterable[str] = ()) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Add every job flag (except ``skip``) to a command; the command receives ``job_flags``.

    ``job_flags`` is ``{flag name: value}`` of the flags the user gave (see
    :func:`memplan.jobflags.build_job`). The command declares ``job_flags`` as its last
    parameter; the job options appear after its own ones.
    """
    skipped = frozenset(skip)

    def decorate(func: Callable[..., None]) -> Callable[..., None]:
        own = [p for name, p in inspect.signature(func, eval_str=True).parameters.items() if name != "job_flags"]
        generated = _job_parameters(skipped)
        names = [p.name for p in generated]

        @functools.wraps(func)
        def command(**kwargs: Any) -> None:
            given = {name: kwargs.pop(name, None) for name in names}
            func(**kwargs, job_flags={name: value for name, value in given.items() if value is not None})

        del command.__wrapped__  # typer must read the signature below, not the original's
        command.__signature__ = inspect.Signature(own + generated)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in own + generated}
        return command

    return decorate
