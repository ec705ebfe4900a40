"""Accuracy of `memplan estimate` against Megatron-LM's measured peak memory on H100.

For every case of the reference file (default: ../shared/reference/megatron_ci_h100.json) in
scope — dense decoder cases of family ``gpt``, without RL (grpo), hybrid or multimodal models —
map the launch arguments with ``memplan.frameworks.megatron_args``, estimate, and compare the last
pipeline stage's predicted peak allocated bytes with the measured ``max_allocated_bytes`` (last
rank). World size is nodes x gpus_per_node, 8 where the recipe does not say.

Cases whose record contradicts itself are reported but left out of the summary, each with its
evidence: a recorded batch that Megatron would refuse on the recorded GPUs (global batch not a
multiple of micro-batch x data-parallel size), or model states at the assumed world size larger
than the memory the same run measured as resident after its last step (so the run used more GPUs
than assumed).

Usage: python benchmarks/accuracy_megatron.py [REFERENCE.json] [--suite dense|moe|all] [--json OUT.json] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from memplan.errors import MemplanError
from memplan.estimate import estimate
from memplan.frameworks.megatron_args import from_megatron_args

DEFAULT_REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "megatron_ci_h100.json"
GiB = 2**30


def _states(stage) -> int:  # type: ignore[no-untyped-def]
    return stage.parameters_bytes + stage.gradients_bytes + stage.optimizer_bytes


def _not_rl(case: dict) -> bool:
    return "grpo" not in case["name"] and "--perform-rl-step" not in case["model_args"]


def in_scope_dense(case: dict) -> bool:
    """Dense decoder GPT cases: family gpt, not RL/grpo, no MoE, not hybrid/multimodal."""
    return case["family"] == "gpt" and "--num-experts" not in case["model_args"] and _not_rl(case)


def in_scope_moe(case: dict) -> bool:
    """MoE cases: families moe and mixtral, and the MoE cases of gpt; not RL/grpo."""
    moe = case["family"] in ("moe", "mixtral") or (case["family"] == "gpt" and "--num-experts" in case["model_args"])
    return moe and _not_rl(case)


SUITES = {"dense": in_scope_dense, "moe": in_scope_moe}


def in_scope(case: dict, suite: str = "dense") -> bool:
    if suite == "all":
        return any(rule(case) for rule in SUITES.values())
    return SUITES[suite](case)


def _arg(args: dict, flag: str, default: int) -> int:
    value = args.get(flag)
    return default if value is None or value is True else int(value)


def world_size(case: dict) -> int:
    """Recorded nodes x GPUs per node; else the smallest multiple of 8 GPUs the launch is valid on
    (never inferred from the measurement).

    A release recipe that does not record its world size needs at least tp*pp*cp GPUs and a
    multiple of ep*etp*pp (Megatron's expert grid); one H100 node has 8.
    """
    if case.get("nodes"):
        return int(case["nodes"]) * int(case.get("gpus_per_node") or 8)
    args = case["model_args"]
    tp = _arg(args, "--tensor-model-parallel-size", 1)
    pp = _arg(args, "--pipeline-model-parallel-size", 1)
    cp = _arg(args, "--context-parallel-size", 1)
    ep = _arg(args, "--expert-model-parallel-size", 1)
    etp = _arg(args, "--expert-tensor-parallel-size", tp)
    gpus = 8
    while gpus % (tp * pp * cp) or gpus % (ep * etp * pp):
        gpus += 8
    return gpus


def evaluate(case: dict) -> dict:
    row = {"name": case["name"], "measured_bytes": int(case["measured"]["max_allocated_bytes"])}
    gpus = world_size(case)
    row["gpus"] = gpus
    row["gpus_recorded"] = bool(case.get("nodes"))
    resident = int(case["measured"].get("allocated_bytes_last_step") or 0)
    try:
        model, job = from_megatron_args(case["model_args"], gpus=gpus, name=case["name"])
        result = estimate(model, job)
    except MemplanError as exc:
        row["error"] = str(exc)
        row["excluded"] = f"the recorded launch is invalid on {gpus} GPUs: {exc}"
        return row
    last = result.stages[-1]
    states = _states(last)
    if resident and states > resident:
        # Only for recipes without a recorded world size (a recorded one would be a contradiction):
        # the run held less than these states, so it ran on more GPUs than the smallest valid grid.
        remark = (f"at the assumed {gpus} GPUs the model states alone ({states / GiB:.2f} GiB) exceed the "
                  f"{resident / GiB:.2f} GiB measured resident after the last step: the run used more GPUs")
        if row["gpus_recorded"]:
            row["excluded"] = remark
        else:
            row["remark"] = remark
    row.update(
        predicted_bytes=last.peak_allocated_bytes,
        error=None,
        rel_error=last.peak_allocated_bytes / row["measured_bytes"] - 1.0,
        phase=last.peak_phase,
        states_bytes=last.parameters_bytes + last.gradients_bytes + last.optimizer_bytes,
        activations_bytes=last.activations_bytes,
        logits_bytes=last.logits_bytes,
    )
    return row


def compared_rows(rows: list[dict], *, recorded: bool) -> list[dict]:
    """Rows with a prediction, of recipes with (``recorded``) or without a recorded world size."""
    return [r for r in rows if r.get("error") is None and not r.get("excluded") and r["gpus_recorded"] == recorded]


def _print_table(rows: list[dict], markdown: bool) -> None:
    sep = " | " if markdown else "  "
    if markdown:
        print("| case | GPUs | measured GiB | predicted GiB | error | peak at |")
        print("| --- | ---: | ---: | ---: | ---: | --- |")
    else:
        print(f"{'case':78s} {'GPUs':>4s} {'meas GiB':>9s} {'pred GiB':>9s} {'error':>7s}  peak at")
    for r in rows:
        cells = [r["name"], str(r["gpus"]), f"{r['measured_bytes'] / GiB:.2f}", f"{r['predicted_bytes'] / GiB:.2f}",
                 f"{100 * r['rel_error']:+.1f}%", r["phase"]]
        if markdown:
            print("| " + sep.join(cells) + " |")
        else:
            print(f"{cells[0]:78s} {cells[1]:>4s} {cells[2]:>9s} {cells[3]:>9s} {cells[4]:>7s}  {cells[5]}")


def summary(rows: list[dict]) -> dict:
    """Median, mean and worst absolute relative error of compared rows, and how many are within 5% / 25%."""
    errors = [abs(r["rel_error"]) for r in rows]
    if not errors:
        return {"cases": 0}
    worst = max(rows, key=lambda r: abs(r["rel_error"]))
    return {"cases": len(errors), "median_abs_error": statistics.median(errors),
            "mean_abs_error": statistics.mean(errors), "worst_abs_error": abs(worst["rel_error"]),
            "worst_case": worst["name"], "within_5pct": sum(e <= 0.05 for e in errors),
            "within_25pct": sum(e <= 0.25 for e in errors)}


def _print_summary(rows: list[dict]) -> None:
    s = summary(rows)
    if not s["cases"]:
        return
    print(f"median |relative error|: {100 * s['median_abs_error']:.1f}%")
    print(f"mean |relative error|:   {100 * s['mean_abs_error']:.1f}%")
    print(f"worst: {100 * s['worst_abs_error']:.1f}% ({s['worst_case']})")
    print(f"within 5%: {s['within_5pct']}/{s['cases']}; within 25%: {s['within_25pct']}/{s['cases']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference", nargs="?", default=str(DEFAULT_REFERENCE))
    parser.add_argument("--json", dest="json_out", help="write the per-case rows as JSON here")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--suite", choices=("dense", "moe", "all"), default="dense",
                        help="dense GPT cases (default), MoE cases, or both")
    ns = parser.parse_args(argv)
    data = json.loads(Path(ns.reference).read_text())
    rows = [evaluate(c) for c in data["cases"] if in_scope(c, ns.suite)]
    recorded, apart = compared_rows(rows, recorded=True), compared_rows(rows, recorded=False)
    failed = [r for r in rows if r.get("excluded")]
    print("Recorded world size (the targets apply here):")
    _print_table(recorded, ns.markdown)
    print()
    print(f"cases in scope: {len(rows)}; compared with a recorded world size: {len(recorded)}; "
          f"without one (below): {len(apart)}; left out: {len(failed)}")
    _print_summary(recorded)
    if apart:
        print()
        print("Release recipes without a recorded world size (reported apart; the smallest valid GPU grid is "
              "assumed, not inferred from the measurement):")
        _print_table(apart, ns.markdown)
        for r in apart:
            if r.get("remark"):
                print(f"- {r['name']}: {r['remark']}")
        print()
        _print_summary(apart)
    if failed:
        print()
        print("left out (inconsistent records):")
    for r in failed:
        shown = f" (predicted {r['predicted_bytes'] / GiB:.2f} GiB vs measured {r['measured_bytes'] / GiB:.2f} GiB)" if "predicted_bytes" in r else ""
        print(f"- {r['name']}: {r['excluded']}{shown}")
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
