"""Extract DeepSpeed's config keys (dotted) from a DeepSpeed source checkout, without importing it.

Usage::

    git clone https://github.com/deepspeedai/DeepSpeed /tmp/DeepSpeed
    python scripts/extract_deepspeed_keys.py /tmp/DeepSpeed > src/memplan/frameworks/deepspeed_key_list.txt

Reads the Python sources with :mod:`ast` (DeepSpeed itself is not installed). Four kinds of section:

* pydantic models (``DeepSpeedConfigModel`` subclasses): every annotated field, its ``alias`` too,
  nested models followed (``zero_optimization.offload_param.device``);
* constants files where a key ``NAME = "key"`` comes with ``NAME_DEFAULT`` (activation
  checkpointing, flops profiler, aio, elasticity...): the keys under the section's name prefix;
* the top level: the keys ``deepspeed/runtime/config.py`` reads from ``param_dict`` directly;
* open sections whose sub-keys are user-named or passed through (``optimizer.params``,
  ``compression_training``, ``data_efficiency``, ``autotuning``, ``amp``): listed as ``section.*``.

The first line records the DeepSpeed version and commit. A section whose class or constant is missing
in a newer DeepSpeed makes the script fail (exit 1) rather than drop keys silently.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

#: Top-level section → (file, model class). ``bfloat16`` is the old spelling of ``bf16``.
PYDANTIC = {
    "zero_optimization": ("deepspeed/runtime/zero/config.py", "DeepSpeedZeroConfig"),
    "fp16": ("deepspeed/runtime/precision_config.py", "DeepSpeedFP16Config"),
    "bf16": ("deepspeed/runtime/precision_config.py", "DeepSpeedBF16Config"),
    "bfloat16": ("deepspeed/runtime/precision_config.py", "DeepSpeedBF16Config"),
    "comms_logger": ("deepspeed/comm/config.py", "CommsLoggerConfig"),
    "tensorboard": ("deepspeed/monitor/config.py", "TensorBoardConfig"),
    "wandb": ("deepspeed/monitor/config.py", "WandbConfig"),
    "csv_monitor": ("deepspeed/monitor/config.py", "CSVConfig"),
    "comet": ("deepspeed/monitor/config.py", "CometConfig"),
    "compile": ("deepspeed/compile/config.py", "CompileConfig"),
    "hybrid_engine": ("deepspeed/runtime/config.py", "HybridEngineConfig"),
    "timers.throughput": ("deepspeed/utils/config.py", "DeepSpeedThroughputTimerConfig"),
    "tensor_parallel": ("deepspeed/runtime/tensor_parallel/config.py", "TPTrainingConfig"),
}
#: Files whose model classes nested fields may name (besides the section's own file).
MODEL_FILES = ("deepspeed/runtime/zero/offload_config.py", "deepspeed/runtime/zenflow/zenflow_config.py",
               "deepspeed/runtime/zero/leaf_module_config.py", "deepspeed/runtime/tensor_parallel/config.py")

#: Section → (constants file, name prefix): keys are the constants ``PREFIX_X = "..."`` that have a
#: ``PREFIX_X_DEFAULT``.
CONSTANTS = {
    "activation_checkpointing": ("deepspeed/runtime/activation_checkpointing/config.py", "ACT_CHKPT_"),
    "flops_profiler": ("deepspeed/profiling/constants.py", "FLOPS_PROFILER_"),
    "aio": ("deepspeed/runtime/swap_tensor/constants.py", "AIO_"),
    "elasticity": ("deepspeed/elasticity/constants.py", ""),
    "nebula": ("deepspeed/nebula/constants.py", "NEBULA_"),
    "checkpoint": ("deepspeed/runtime/model_checkpointing/constants.py", "CHECKPOINT_"),
    "eigenvalue": ("deepspeed/runtime/constants.py", "EIGENVALUE_"),
    "progressive_layer_drop": ("deepspeed/runtime/constants.py", "PLD_"),
    "sparse_attention": ("deepspeed/runtime/constants.py", "SPARSE_"),
    "torch_autocast": ("deepspeed/runtime/constants.py", "TORCH_AUTOCAST_"),
    "data_types": ("deepspeed/runtime/constants.py", ""),
}
#: Sub-keys of a constants section that its prefix rule misses or wrongly takes in (read from the
#: reading code by hand: ``checkpoint`` also takes runtime/constants.py's keys, ``data_types`` only
#: three of that file's keys).
EXTRA = {
    "checkpoint": ("load_universal", "use_node_local_storage", "parallel_write", "parallel_write.pipeline_stage",
                   "writer.type", "writer.io_buffer_size", "writer.io_buffer_double", "writer.io_multiplier",
                   "writer.show_statistics", "writer.data_parallel", "writer.decoupled"),
    "torch_autocast": ("enabled", "dtype", "lower_precision_safe_modules"),
}
ONLY = {"data_types": ("grad_accum_dtype", "param_dtype", "buffer_dtype"),
        "checkpoint": ("tag_validation", "checkpoint_serialization", "writer")}

#: Sections read with ``.get("literal", ...)`` in one function: section → (file, function).
LITERAL_GETS = {"expert_parallel": ("deepspeed/module_inject/auto_ep_config.py", "parse_autoep_config")}
#: Sections whose keys are the keys of one dict literal: section → (file, function, variable).
DICT_LITERALS = {"pipeline": ("deepspeed/runtime/config.py", "get_pipeline_config", "default_pipeline")}
#: Names ``runtime/config.py`` reads from a ``param_dict`` that is a section, not the top level
#: (``get_sparse_attention_mode(param_dict)`` is given the sparse_attention dict).
NOT_TOP_LEVEL = {"attention", "mode"}
#: Files that read the whole config, and the names its dict goes by there.
TOP_LEVEL_READERS = {"deepspeed/runtime/config.py": ("param_dict", "config"),
                     "deepspeed/__init__.py": ("config",)}
#: Top-level keys read through a function parameter's default (``get_communication_data_type``).
TOP_LEVEL_CONSTANTS = ("COMMUNICATION_DATA_TYPE", "SEQ_PARALLEL_COMMUNICATION_DATA_TYPE")
#: Constants a section's prefix rule takes in that belong elsewhere (``SPARSE_GRADIENTS`` is top level).
NOT_IN_SECTION = {"sparse_attention": ("sparse_gradients",)}
#: Sections whose sub-keys are free-form (optimizer/scheduler params, user-named groups, apex's
#: own amp options, the autotuner's search space).
OPEN = ("optimizer.params", "scheduler.params", "amp", "compression_training", "data_efficiency",
        "curriculum_learning", "autotuning", "quantize_training", "weight_quantization", "datastates_ckpt", "zero_optimization.zeropp_loco_param")


def _tree(root: Path, rel: str) -> ast.Module:
    path = root / rel
    if not path.is_file():
        sys.exit(f"extract_deepspeed_keys: {rel} is missing in {root}")
    return ast.parse(path.read_text(), filename=rel)


def _string_constants(tree: ast.Module) -> dict[str, object]:
    out: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value.value if isinstance(node.value, ast.Constant) else None
            out[node.targets[0].id] = value
    return out


def _classes(trees: list[ast.Module]) -> dict[str, ast.ClassDef]:
    return {n.name: n for t in trees for n in ast.walk(t) if isinstance(n, ast.ClassDef)}


def _model_keys(cls: ast.ClassDef, classes: dict[str, ast.ClassDef], seen: tuple[str, ...] = ()) -> list[str]:
    keys: list[str] = []
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        if name.startswith("_") or name == "model_config":
            continue
        names = [name]
        if isinstance(node.value, ast.Call):
            names += [k.value.value for k in node.value.keywords
                      if k.arg == "alias" and isinstance(k.value, ast.Constant)]
        nested = [n.id for n in ast.walk(node.annotation) if isinstance(n, ast.Name) and n.id in classes
                  and n.id not in seen]
        for key in names:
            keys.append(key)
            for sub in nested:
                keys += [f"{key}.{k}" for k in _model_keys(classes[sub], classes, (*seen, cls.name))]
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes and base.id != "DeepSpeedConfigModel":
            keys += _model_keys(classes[base.id], classes, seen)
    return keys


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    sys.exit(f"extract_deepspeed_keys: function {name} not found")


def _read_literals(fn: ast.FunctionDef) -> set[str]:
    """String keys ``fn`` reads from ``param_dict``."""
    args = (_dict_read(n, ("param_dict",)) for n in ast.walk(fn))
    return {a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)}


def _dict_read(node: ast.AST, names: tuple[str, ...]) -> ast.AST | None:
    """The key expression of a read from a dict variable in ``names``: ``get_scalar_param(d, K)``,
    ``d.get(K)``, ``d[K]``, ``K in d`` / ``K in d.keys()``; None for any other node."""
    def is_dict(n: ast.AST) -> bool:
        return isinstance(n, ast.Name) and n.id in names
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "get_scalar_param" \
            and len(node.args) > 1 and is_dict(node.args[0]):
        return node.args[1]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
            and is_dict(node.func.value) and node.args:
        return node.args[0]
    if isinstance(node, ast.Subscript) and is_dict(node.value):
        return node.slice
    if isinstance(node, ast.Compare) and len(node.comparators) == 1 and isinstance(node.ops[0], ast.In):
        target = node.comparators[0]
        if isinstance(target, ast.Call) and isinstance(target.func, ast.Attribute):
            target = target.func.value
        if is_dict(target):
            return node.left
    return None


def _top_level(root: Path) -> list[str]:
    """Keys read from the whole config dict (names resolved via constants), file by file."""
    consts = _string_constants(_tree(root, "deepspeed/runtime/constants.py"))
    keys: set[str] = set()
    for rel, names in TOP_LEVEL_READERS.items():
        for node in ast.walk(_tree(root, rel)):
            arg = _dict_read(node, names)
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                keys.add(arg.value)
            elif isinstance(arg, ast.Name) and isinstance(consts.get(arg.id), str):
                keys.add(str(consts[arg.id]))
    for name in TOP_LEVEL_CONSTANTS:
        if not isinstance(consts.get(name), str):
            sys.exit(f"extract_deepspeed_keys: constant {name} not found in deepspeed/runtime/constants.py")
        keys.add(str(consts[name]))
    return sorted(keys - NOT_TOP_LEVEL)


def _constant_keys(root: Path, rel: str, prefix: str) -> list[str]:
    consts = _string_constants(_tree(root, rel))
    return [str(v) for k, v in consts.items() if k.startswith(prefix) and isinstance(v, str)
            and f"{k}_DEFAULT" in consts and not k.endswith("_DEFAULT")]


def extract(root: Path) -> list[str]:
    keys: set[str] = set(_top_level(root))
    trees = {rel: _tree(root, rel) for rel in {f for f, _ in PYDANTIC.values()} | set(MODEL_FILES)}
    classes = _classes(list(trees.values()))
    for section, (rel, name) in PYDANTIC.items():
        if name not in classes:
            sys.exit(f"extract_deepspeed_keys: class {name} not found in {rel}")
        keys.add(section)
        keys |= {f"{section}.{k}" for k in _model_keys(classes[name], classes)}
    keys.add("timers")
    for section, (rel, prefix) in CONSTANTS.items():
        sub = set(_constant_keys(root, rel, prefix)) | set(EXTRA.get(section, ()))
        sub -= set(NOT_IN_SECTION.get(section, ()))
        if section in ONLY:
            sub &= set(ONLY[section]) | set(EXTRA.get(section, ()))
        if not sub:
            sys.exit(f"extract_deepspeed_keys: no keys found for {section} in {rel}")
        keys |= {section} | {f"{section}.{k}" for k in sub}
    for section, (rel, func) in LITERAL_GETS.items():
        keys |= {section} | {f"{section}.{k}" for k in _read_literals(_function(_tree(root, rel), func))}
    for section, (rel, func, var) in DICT_LITERALS.items():
        fn = _function(_tree(root, rel), func)
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id == var:
                keys |= {section} | {f"{section}.{k.value}" for k in node.value.keys if isinstance(k, ast.Constant)}
    keys |= {"optimizer", "optimizer.type", "optimizer.params", "optimizer.legacy_fusion", "scheduler",
             "scheduler.type", "scheduler.params", "amp.enabled"}
    keys |= {f"{section}.*" for section in OPEN} | {s.split(".")[0] for s in OPEN}
    return sorted(keys)


def _version(root: Path) -> str:
    version = (root / "version.txt").read_text().strip() if (root / "version.txt").is_file() else "unknown"
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return f"# DeepSpeed {version} commit {commit}"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[0])
    print(_version(root))
    print("# One dotted key per line; section.* = free-form sub-keys. Regenerate with "
          "scripts/extract_deepspeed_keys.py.")
    for key in extract(root):
        print(key)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
