"""Image tokens of ``--images-field``: agreement with transformers' Qwen2-VL image processor, and speed.

Fixed before any result was seen: N PNG files (default 4,000, one per row, sides drawn uniformly in
64..2000 px, seed 0, so most rows fall between Qwen2-VL's pixel bounds and some above them), a JSONL
dataset naming them, a Qwen2-VL config (default processor settings). The witness is transformers' own
``Qwen2VLImageProcessorPil`` run on 200 of those images decoded for real (every 20th): its
``image_grid_thw`` gives ``prod / merge_size**2`` tokens, plus the two vision markers; every one must
equal memplan's count. Speed: ``row_image_tokens`` from a cold cache (dataset read, every header read)
and again from the cache. The 2 cores are shared: the load average is recorded.

Usage: python benchmarks/dataset_images.py [--json benchmarks/results/dataset_images.json] [--images N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path


def _make(folder: Path, count: int) -> tuple[Path, Path, list[str]]:
    from PIL import Image

    rng = random.Random(0)
    names = [f"i{i}.png" for i in range(count)]
    for name in names:
        Image.new("RGB", (rng.randint(64, 2000), rng.randint(64, 2000))).save(folder / name, compress_level=1)
    data = folder / "train.jsonl"
    data.write_text("".join(json.dumps({"text": "x", "images": n}) + "\n" for n in names), encoding="utf-8")
    vlm = folder / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": {}}))
    return data, vlm, names


def _witness(folder: Path, names: list[str]) -> list[int]:
    import numpy as np
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil()
    out = []
    for name in names:
        with Image.open(folder / name) as image:
            grid = processor(images=[image.convert("RGB")])["image_grid_thw"][0]
        out.append(int(np.prod(grid)) // processor.merge_size ** 2 + 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--images", type=int, default=4000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        os.environ["MEMPLAN_CACHE"] = str(folder / "cache")
        from memplan.dataset.images import row_image_tokens
        from memplan.dataset.lengths import Fields

        data, vlm, names = _make(folder, args.images)
        start = time.perf_counter()
        tokens, _ = row_image_tokens(str(data), Fields(text="text"), "images", str(vlm))
        first = time.perf_counter() - start
        start = time.perf_counter()
        again, _ = row_image_tokens(str(data), Fields(text="text"), "images", str(vlm))
        cached = time.perf_counter() - start
        sample = list(range(0, len(names), 20))[:200]
        witness = _witness(folder, [names[i] for i in sample])
    ours = [int(tokens[i]) for i in sample]
    result = {"machine": platform.platform(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
              "images": args.images, "first_run_s": round(first, 3), "cached_run_s": round(cached, 3),
              "cached_equal": again.tolist() == tokens.tolist(), "witness_images": len(sample),
              "witness_equal": sum(a == b for a, b in zip(ours, witness)),
              "tokens_per_image": {"min": int(tokens.min()), "p50": int(sorted(tokens)[len(tokens) // 2]),
                                   "max": int(tokens.max())}}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
