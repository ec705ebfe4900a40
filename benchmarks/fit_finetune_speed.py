"""Speed of the fine-tuner's questions to ``memplan fit`` (target: < 1 s each, as a command).

Cases: ``--max-seq`` and ``--max-mbs`` of llama-3.1-8b on one RTX 4090 with QLoRA flags and with
full fine-tuning under 8-bit AdamW, and ``--methods`` (8 estimates). Each case is timed twice: the
library call (median of ``RUNS`` in this process, model loaded once) and the whole command as a new
process (``python -m memplan fit ...``, Python start-up and imports included; median of ``RUNS``).

Usage: python benchmarks/fit_finetune_speed.py [--json benchmarks/results/fit_finetune_speed.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from memplan import load_model
from memplan.fit import compare_methods, max_micro_batch, max_seq_length
from memplan.jobflags import build_job

RUNS = 5
QLORA = {"framework": "hf", "peft": "lora", "quantize_base": "nf4"}
FULL8 = {"framework": "hf", "optimizer": "adamw8bit", "recompute": "full"}
QLORA_FLAGS = ["--framework", "hf", "--peft", "lora", "--quantize-base", "nf4"]
FULL8_FLAGS = ["--framework", "hf", "--optimizer", "adamw8bit", "--recompute", "full"]
CASES = [
    ("--max-seq, QLoRA", lambda m: max_seq_length(m, build_job(QLORA), gpu="rtx-4090"), ["--max-seq", *QLORA_FLAGS]),
    ("--max-mbs, QLoRA, seq 2048", lambda m: max_micro_batch(m, build_job({**QLORA, "seq": 2048}), gpu="rtx-4090"),
     ["--max-mbs", "--seq", "2048", *QLORA_FLAGS]),
    ("--max-seq, full + adamw8bit", lambda m: max_seq_length(m, build_job(FULL8), gpu="rtx-4090"),
     ["--max-seq", *FULL8_FLAGS]),
    ("--methods, seq 2048", lambda m: compare_methods(m, gpu="rtx-4090", seq=2048), ["--methods", "--seq", "2048"]),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", dest="json_out")
    ns = parser.parse_args(argv)
    model = load_model("llama-3.1-8b")
    rows = []
    print("| question (llama-3.1-8b, 1 x rtx-4090) | library s | command s | target s |")
    print("| --- | ---: | ---: | ---: |")
    for name, call, flags in CASES:
        lib = []
        for _ in range(RUNS):
            start = time.perf_counter()
            call(model)
            lib.append(time.perf_counter() - start)
        proc = []
        for _ in range(RUNS):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "memplan", "fit", "llama-3.1-8b", "--gpu", "rtx-4090", *flags,
                            "--json"], capture_output=True, check=False)
            proc.append(time.perf_counter() - start)
        row = {"case": name, "library_s": statistics.median(lib), "command_s": statistics.median(proc), "target_s": 1.0}
        rows.append(row)
        print(f"| {name} | {row['library_s']:.3f} | {row['command_s']:.3f} | 1 |")
    print(f"\n{platform.machine()}, Python {platform.python_version()}")
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
