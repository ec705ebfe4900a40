"""The image-token rules of the vision-language families ``--images-field`` knows, one entry each.

:data:`FAMILIES` maps a ``config.json`` ``model_type`` to a builder reading that family's settings
(``config.json`` and ``preprocessor_config.json``) into an :class:`ImageRule`; the rules themselves are
described in :mod:`memplan.dataset.images`. An unknown family is one line naming it and the supported ones.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan.errors import ConfigError

__all__ = ["FAMILIES", "ImageRule", "image_rule", "read_vision_config", "smart_resize"]

FLAG = "--images-field"


@dataclass(frozen=True, kw_only=True)
class ImageRule:
    """How one model turns an image into tokens."""

    family: str
    #: The text the chat template writes per image (what the processor expands).
    placeholder: str
    #: Tokens that placeholder costs in the text as tokenized.
    placeholder_tokens: int
    #: Tokens around the image's own tokens (start/end markers).
    wrapper_tokens: int = 0
    #: Tokens per image when the count does not depend on its size.
    fixed: int | None = None
    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    def tokens(self, width: int, height: int) -> int:
        """Tokens one ``width`` x ``height`` image becomes, markers included."""
        if self.fixed is not None:
            return self.fixed + self.wrapper_tokens
        h, w = smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size ** 2 + self.wrapper_tokens

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"family": self.family, "placeholder": self.placeholder}
        if self.fixed is not None:
            return {**out, "tokens_per_image": self.fixed + self.wrapper_tokens}
        return {**out, "patch_size": self.patch_size, "merge_size": self.merge_size, "min_pixels": self.min_pixels,
                "max_pixels": self.max_pixels, "marker_tokens": self.wrapper_tokens}


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize target: sides multiples of ``factor``, pixels within [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.1f} is above Qwen2-VL's 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * scale / factor) * factor, math.ceil(width * scale / factor) * factor
    return h, w


def _qwen(config: Mapping[str, Any], processor: Mapping[str, Any]) -> ImageRule:
    vision = config.get("vision_config") or {}
    size = processor.get("size") or {}
    patch = int(processor.get("patch_size") or vision.get("patch_size") or 14)
    merge = int(processor.get("merge_size") or vision.get("spatial_merge_size") or 2)
    return ImageRule(family="qwen2_vl", placeholder="<|image_pad|>", placeholder_tokens=3, wrapper_tokens=2,
                     patch_size=patch, merge_size=merge,
                     min_pixels=int(processor.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
                     max_pixels=int(processor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280))


def _llava(config: Mapping[str, Any], processor: Mapping[str, Any]) -> ImageRule:
    vision = config.get("vision_config") or {}
    side = int(vision.get("image_size") or 336) // int(vision.get("patch_size") or 14)
    keep_cls = config.get("vision_feature_select_strategy", "default") == "full"
    return ImageRule(family="llava", placeholder="<image>", placeholder_tokens=1, fixed=side * side + keep_cls)


def _gemma3(config: Mapping[str, Any], processor: Mapping[str, Any]) -> ImageRule:
    if processor.get("do_pan_and_scan"):
        raise ConfigError(FLAG, "Gemma 3's pan-and-scan (do_pan_and_scan: true in preprocessor_config.json) is not "
                          "modelled: its crop count depends on each image")
    return ImageRule(family="gemma3", placeholder="<start_of_image>", placeholder_tokens=1, wrapper_tokens=4,
                     fixed=int(config.get("mm_tokens_per_image") or 256))


#: model_type -> the rule builder (config.json, preprocessor_config.json).
FAMILIES: dict[str, Callable[[Mapping[str, Any], Mapping[str, Any]], ImageRule]] = {
    "qwen2_vl": _qwen, "qwen2_5_vl": _qwen, "llava": _llava, "gemma3": _gemma3}


def image_rule(config: Mapping[str, Any], processor: Mapping[str, Any] | None = None) -> ImageRule:
    """The rule of the model whose ``config.json`` is ``config``."""
    model_type = config.get("model_type")
    builder = FAMILIES.get(str(model_type))
    if builder is None:
        kind = "vision-language family" if "vision_config" in config else "model without a vision encoder"
        raise ConfigError(FLAG, f"model_type {model_type!r} is an unsupported {kind}; supported: "
                          f"{', '.join(FAMILIES)} (--vision-model names the vision-language model)")
    return builder(config, processor or {})


def read_vision_config(ref: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``config.json`` and ``preprocessor_config.json`` (``{}`` when absent) of a folder, a config.json or
    a cached Hub id."""
    if ref is None:
        raise ConfigError("--vision-model", "--images-field needs the vision-language model's config.json: name "
                          "its folder or cached Hub id")
    given = Path(ref).expanduser()
    if given.is_dir() or given.is_file():
        folder = given if given.is_dir() else given.parent
        config_path = given if given.is_file() else folder / "config.json"
    else:
        from memplan.model.hub import hub_config_path

        config_path = hub_config_path(ref)
        folder = config_path.parent
    return _read_json(config_path, required=True), _processor_config(folder)


def _processor_config(folder: Path) -> dict[str, Any]:
    """``preprocessor_config.json``, else the ``image_processor`` entry of ``processor_config.json``."""
    own = _read_json(folder / "preprocessor_config.json")
    if own:
        return own
    nested = _read_json(folder / "processor_config.json").get("image_processor")
    return nested if isinstance(nested, dict) else {}


def _read_json(path: Path, *, required: bool = False) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ConfigError("--vision-model", f"{path}: no such file")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError("--vision-model", f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError("--vision-model", f"{path}: must be a JSON object", type(data).__name__)
    return data
