"""memplan estimate against Megatron-LM's GB200 CI measurements (not shipped in ../shared/reference).

Megatron-LM's functional tests record ``torch.cuda.max_memory_allocated`` per step for each test case
and platform (``tests/functional_tests/test_cases/<family>/<case>/golden_values_dev_<platform>.json``,
key ``mem-max-allocated-bytes``). memplan's shipped reference holds a split of the H100 records; the
GB200 records are other measurements — another GPU, and GB200 nodes of 4 GPUs, so another
data-parallel size and often another world size — of those cases and of cases not shipped at all.

This script builds a reference file in the shipped format from a Megatron-LM checkout (the launch
arguments of ``model_config.yaml``; the world size from the GB200 recipe that runs the case,
``tests/test_utils/recipes/gb200/*.yaml`` ``spec.nodes`` x ``spec.gpus``; the measurement: the largest
``mem-max-allocated-bytes`` of the run, and the last step's ``mem-allocated-bytes``), then scores
it with ``benchmarks/accuracy_megatron.py``'s own rules (scope, world size, left-out records), so
nothing is chosen after seeing a result. Each row says whether the same case name is in the
shipped H100 split.

Usage: PYTHONPATH=src python benchmarks/megatron_unseen.py MEGATRON_CHECKOUT [--platform dgx_gb200]
           [--json OUT] [--reference-out REF.json]
(a checkout: ``git clone https://github.com/NVIDIA/Megatron-LM``; the run recorded in docs/benchmarks.md
used commit d98e8a64dd, the shipped reference's.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import accuracy_megatron as acc  # noqa: E402 - beside this file (sys.path above); the shipped-reference scorer: same rules

DEFAULT_OUT = HERE / "results" / "megatron_unseen_gb200.json"
GiB = 2**30


def _recipe_world(checkout: Path, platform: str) -> dict[str, tuple[int, int]]:
    """Test case -> (nodes, GPUs per node) from the platform's recipes."""
    folder = checkout / "tests" / "test_utils" / "recipes" / platform.removeprefix("dgx_")
    out: dict[str, tuple[int, int]] = {}
    for path in sorted(folder.glob("*.yaml")):
        recipe = yaml.safe_load(path.read_text())
        spec = recipe.get("spec") or {}
        nodes, gpus = spec.get("nodes"), spec.get("gpus")
        if not isinstance(nodes, int) or not isinstance(gpus, int):
            continue
        for product in recipe.get("products") or []:
            for case in product.get("test_case") or []:
                out.setdefault(case, (nodes, gpus))
    return out


def _values(golden: dict, key: str) -> list[float]:
    """A metric's per-step values in step order (two layouts: {step: value} or a list), NaN dropped."""
    entry = golden.get(key)
    values = entry.get("values") if isinstance(entry, dict) else None
    if isinstance(values, dict):
        ordered = [v for _, v in sorted(values.items(), key=lambda kv: int(kv[0]))]
    elif isinstance(values, list):
        ordered = values
    else:
        return []
    return [float(v) for v in ordered if isinstance(v, (int, float)) and not math.isnan(float(v))]


def build_reference(checkout: Path, platform: str) -> dict:
    """The platform's records in the shipped reference's format."""
    world = _recipe_world(checkout, platform)
    cases = []
    root = checkout / "tests" / "functional_tests" / "test_cases"
    for golden_path in sorted(root.glob(f"*/*/golden_values_dev_{platform}.json")):
        folder = golden_path.parent
        config_path = folder / "model_config.yaml"
        if not config_path.is_file():
            continue
        config = yaml.safe_load(config_path.read_text()) or {}
        golden = json.loads(golden_path.read_text())
        peaks, last = _values(golden, "mem-max-allocated-bytes"), _values(golden, "mem-allocated-bytes")
        if not peaks or not isinstance(config.get("MODEL_ARGS"), dict):
            continue
        nodes, gpus = world.get(folder.name, (None, None))
        cases.append({"name": folder.name, "family": folder.parent.name,
                      "path": str(folder.relative_to(checkout)), "nodes": nodes, "gpus_per_node": gpus,
                      "model_args": config["MODEL_ARGS"], "env": config.get("ENV_VARS") or {},
                      "measured": {"max_allocated_bytes": max(peaks),
                                   "allocated_bytes_last_step": last[-1] if last else None}})
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip() or None
    return {"source": f"github.com/NVIDIA/Megatron-LM tests/functional_tests/test_cases "
                      f"(golden_values_dev_{platform}.json)", "commit": commit,
            "measured_on": f"{platform}, torch.cuda.max_memory_allocated (largest of the run)", "cases": cases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a Megatron-LM checkout")
    parser.add_argument("--platform", default="dgx_gb200")
    parser.add_argument("--json", dest="json_out", default=str(DEFAULT_OUT))
    parser.add_argument("--reference-out", help="also write the built reference file here")
    ns = parser.parse_args(argv)
    reference = build_reference(ns.checkout, ns.platform)
    if ns.reference_out:
        Path(ns.reference_out).write_text(json.dumps(reference, indent=1) + "\n")
    shipped = json.loads(acc.DEFAULT_REFERENCE.read_text()) if acc.DEFAULT_REFERENCE.is_file() else {"cases": []}
    shipped_names = {c["name"] for c in shipped["cases"]}
    out: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                 "source": reference["source"], "commit": reference["commit"],
                 "measured_on": reference["measured_on"], "suites": {}}
    for suite in ("dense", "moe"):
        rows = [acc.evaluate(c) for c in reference["cases"] if acc.in_scope(c, suite)]
        for row in rows:
            row["in_shipped_h100_split"] = row["name"] in shipped_names
        recorded = acc.compared_rows(rows, recorded=True)
        apart = acc.compared_rows(rows, recorded=False)
        print(f"== {suite}: {ns.platform}, recorded world size")
        for r in recorded:
            mark = "" if r["in_shipped_h100_split"] else "  (case not shipped)"
            print(f"{r['name'][:70]:70s} {r['gpus']:4d} {r['measured_bytes'] / GiB:8.2f} "
                  f"{r['predicted_bytes'] / GiB:8.2f} {100 * r['rel_error']:+6.1f}%{mark}")
        summary = {"recorded": acc.summary(recorded), "without_recorded_world_size": acc.summary(apart),
                   "not_shipped": acc.summary([r for r in recorded if not r["in_shipped_h100_split"]]),
                   "left_out": [{"name": r["name"], "why": r["excluded"]} for r in rows if r.get("excluded")]}
        print(json.dumps(summary, indent=1))
        out["suites"][suite] = {"summary": summary, "rows": rows}
    Path(ns.json_out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
