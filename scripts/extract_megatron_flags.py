"""Write the complete list of Megatron-LM's command-line flags (memplan's megatron_flag_list.txt).

Usage::

    python scripts/extract_megatron_flags.py MEGATRON/megatron/training/arguments.py \
        [--commit SHA] [-o src/memplan/frameworks/megatron_flag_list.txt]

Megatron builds its parser partly from literal ``add_argument`` calls and partly from dataclasses
(``ArgumentGroupFactory`` turns each field of TransformerConfig, TrainingConfig... into a flag, a
default-True bool into ``--no-X`` and ``--disable-X``), so reading the file's text is not enough:
this script builds the real parser (``add_megatron_arguments``) and lists every option string of
every action. Megatron's optional dependencies (Transformer Engine, triton, ...) are usually absent
on the machine running it; imports of missing third-party modules made by Megatron's own files are
answered with inert stand-ins, which is enough to build the parser (no kernel runs). The literal
``'--flag'`` strings of ``add_argument`` calls in arguments.py are added too, so flags Megatron adds
only when an optional package is present (``--kitchen-*``) are listed as well.
"""

from __future__ import annotations

import argparse
import ast
import importlib.abc
import importlib.machinery
import subprocess
import sys
import types
import typing
from pathlib import Path


class _AnyMeta(type):
    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _any_class(name)

    def __or__(cls, other: object) -> type:
        return cls

    __ror__ = __or__

    def __getitem__(cls, key: object) -> type:
        return cls


class _Anything(metaclass=_AnyMeta):
    """Stands for any object of a missing module: callable, subclassable, decorates as identity."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> object:
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else _Anything()

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _any_class(name)

    def __iter__(self) -> typing.Iterator[object]:
        return iter(())

    def __bool__(self) -> bool:
        return False

    def __getitem__(self, key: object) -> _Anything:
        return _Anything()


def _any_class(name: str) -> type:
    return type(name, (_Anything,), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _any_class(name)


class _MissingModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answer imports of missing third-party modules made from Megatron's files with stand-ins."""

    def __init__(self, root: Path) -> None:
        self.root = str(root)

    def find_spec(self, name: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        top = name.split(".")[0]
        if top == "megatron" or top in sys.stdlib_module_names or top.startswith("_"):
            return None
        stubbed_parent = isinstance(sys.modules.get(top), _StubModule)
        if not stubbed_parent and ("." in name or not self._from_megatron()):
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            try:
                if finder.find_spec(name, path, target) is not None:  # type: ignore[call-arg]
                    return None
            except (ImportError, AttributeError, ValueError):
                continue
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def _from_megatron(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            filename = frame.f_code.co_filename
            if not filename.startswith("<frozen"):
                return filename.startswith(self.root)
            frame = frame.f_back  # type: ignore[assignment]
        return False

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def parser_flags(root: Path) -> set[str]:
    """Every ``--flag`` of the parser ``add_megatron_arguments`` builds from the checkout ``root``."""
    # torch looks for triton lazily; load those parts first so that they see no stand-in.
    import torch
    import torch._dynamo
    import torch._inductor.compile_fx
    import torch._inductor.ir
    import torch.distributed
    import torch.utils.flop_counter  # noqa: F401

    if not hasattr(typing, "override"):  # Megatron uses Python 3.12's typing.override
        typing.override = lambda function: function  # type: ignore[attr-defined]
    sys.meta_path.append(_MissingModules(root))
    sys.path.insert(0, str(root))
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return {option for action in parser._actions for option in action.option_strings if option.startswith("--")}


def literal_flags(arguments_py: Path) -> set[str]:
    """The ``'--flag'`` string literals passed to ``add_argument`` calls in arguments.py."""
    tree = ast.parse(arguments_py.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--"):
                    found.add(arg.value)
    return found


def _commit(root: Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("arguments_py", type=Path, help="megatron/training/arguments.py of a Megatron-LM checkout")
    cli.add_argument("--commit", help="the checkout's commit (default: git rev-parse HEAD in the checkout)")
    cli.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    opts = cli.parse_args()
    arguments_py = opts.arguments_py.resolve()
    root = arguments_py.parents[2]
    built, literal = parser_flags(root), literal_flags(arguments_py)
    flags = sorted(built | literal)
    header = [
        "# Every command-line flag of Megatron-LM's argument parser (add_megatron_arguments),",
        f"# Megatron-LM commit {opts.commit or _commit(root)}, megatron/training/arguments.py.",
        (f"# {len(flags)} flags ({len(built)} from the parser built here, {len(literal - built)} more only "
        "added when an optional package is present)."),
        "# Written by scripts/extract_megatron_flags.py; classified in memplan/frameworks/megatron_flags.py.",
    ]
    text = "\n".join(header + flags) + "\n"
    if opts.output is None:
        sys.stdout.write(text)
    else:
        opts.output.write_text(text)
        print(f"{len(flags)} flags -> {opts.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
