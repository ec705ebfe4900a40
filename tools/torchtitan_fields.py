"""Extract torchtitan's TOML field list and model flavors into memplan's package data.

Reads, at one commit of a torchtitan git checkout, ``torchtitan/config/job_config.py`` (the
``JobConfig`` dataclass tree: every leaf field as ``section.key`` with its annotation and default)
and ``torchtitan/models/<name>/__init__.py`` (the flavor dicts of every supported model name), and
writes the JSON that :mod:`memplan.frameworks.torchtitan_fields` loads. Parsing only (``ast``):
nothing of torchtitan is imported. Re-run after a torchtitan update::

    python tools/torchtitan_fields.py /path/to/torchtitan 238fa9953e4aec2a62582121564273d7cbb1e9f1 \
        > src/memplan/data/torchtitan_fields.json

torchtitan replaced its TOML files with Python config registries after that commit (#2386);
it is the last one whose trainer reads ``--job.config_file FILE.toml``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from typing import Any

JOB_CONFIG = "torchtitan/config/job_config.py"
MODELS = "torchtitan/models/__init__.py"


def _show(repo: str, commit: str, path: str) -> str:
    return subprocess.run(["git", "-C", repo, "show", f"{commit}:{path}"], check=True, capture_output=True,
                          text=True).stdout


def _default(node: ast.expr | None) -> Any:
    """The field's default as JSON data (``field(default_factory=...)`` of a literal too), else None."""
    if node is None:
        return None
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "field":
        for kw in node.keywords:
            if kw.arg == "default":
                return _default(kw.value)
            if kw.arg == "default_factory":
                if isinstance(kw.value, ast.Name) and kw.value.id in ("list", "dict"):
                    return [] if kw.value.id == "list" else {}
                if isinstance(kw.value, ast.Lambda):
                    return _default(kw.value.body)
        return None
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def _classes(source: str) -> dict[str, list[tuple[str, str, Any]]]:
    """Every class of ``source``: its annotated fields as (name, annotation, default)."""
    out: dict[str, list[tuple[str, str, Any]]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = [(s.target.id, ast.unparse(s.annotation), _default(s.value)) for s in node.body
                              if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    return out


def _leaves(classes: dict[str, list[tuple[str, str, Any]]], name: str, prefix: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for field_name, annotation, default in classes[name]:
        key = f"{prefix}{field_name}"
        if annotation in classes:
            out += _leaves(classes, annotation, key + ".")
        else:
            out.append({"key": key, "type": annotation, "default": default})
    return out


def _flavors(source: str) -> list[str]:
    """Keys of the module-level dicts whose values are model-argument constructor calls."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and node.value.keys:
            keys, values = node.value.keys, node.value.values
            if all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in keys) \
                    and all(isinstance(v, ast.Call) for v in values):
                return [k.value for k in keys]  # type: ignore[union-attr]
    return []


def _supported(source: str) -> list[str]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "frozenset":
            return sorted(ast.literal_eval(node.args[0]))
    raise SystemExit(f"{MODELS}: no _supported_models frozenset")


def main(repo: str, commit: str) -> dict[str, Any]:
    full = subprocess.run(["git", "-C", repo, "rev-parse", commit], check=True, capture_output=True,
                          text=True).stdout.strip()
    fields = _leaves(_classes(_show(repo, full, JOB_CONFIG)), "JobConfig", "")
    flavors = {}
    for name in _supported(_show(repo, full, MODELS)):
        found = _flavors(_show(repo, full, f"torchtitan/models/{name}/__init__.py"))
        if found:
            flavors[name] = found
    return {"source": "https://github.com/pytorch/torchtitan", "commit": full, "job_config": JOB_CONFIG,
            "fields": fields, "flavors": flavors}


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python tools/torchtitan_fields.py TORCHTITAN_REPO COMMIT")
    print(json.dumps(main(sys.argv[1], sys.argv[2]), indent=1))
