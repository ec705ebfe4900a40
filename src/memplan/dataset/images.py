"""Image tokens of vision-language examples (``--images-field``), by each processor's own rules.

A vision-language model's processor replaces each image placeholder the chat template writes with a
run of image tokens; the language model then sees those tokens like any other. Per image:

* **Qwen2-VL / Qwen2.5-VL** (``qwen2_vl``, ``qwen2_5_vl``): the image is resized so both sides are
  multiples of ``patch_size * merge_size`` (28) with its pixel count within ``min_pixels`` ..
  ``max_pixels`` (transformers' ``smart_resize`` rule: round each side to the factor; above the
  maximum, scale down by ``sqrt(h*w/max_pixels)`` and floor; below the minimum, scale up and ceil);
  tokens = ``(h/28) * (w/28)``, plus ``<|vision_start|>`` and ``<|vision_end|>``. ``min_pixels``,
  ``max_pixels``, ``patch_size``, ``merge_size`` come from ``preprocessor_config.json`` (defaults
  56*56, 28*28*1280, 14, 2).
* **LLaVA-1.5 style** (``llava``): a fixed ``(image_size / patch_size)**2`` tokens (576 for 336/14)
  from ``vision_config``; ``vision_feature_select_strategy: full`` keeps the CLS token (+1).
* **Gemma 3** (``gemma3``): ``mm_tokens_per_image`` (256), plus ``<start_of_image>``,
  ``<end_of_image>`` and the two ``"\\n\\n"`` tokens the processor wraps them in (pan-and-scan refused).

Placeholders already in the text (image items ``{"type": "image"}`` in a message's content, or the
family's placeholder string in plain text) were tokenized with the text, so each one found is
subtracted (Qwen: the three tokens ``<|vision_start|><|image_pad|><|vision_end|>``; LLaVA ``<image>``
and Gemma ``<start_of_image>``: one). Images are opened with Pillow only to read the size in their
header; pixels are never decoded. The counts are cached (:mod:`~memplan.dataset.imagecache`) until the
dataset or one of its image files changes.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan.errors import ConfigError

__all__ = ["FAMILIES", "ImageRule", "count_placeholders", "image_rule", "image_tokens", "images_note",
           "read_vision_config", "row_image_tokens", "smart_resize"]

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


def image_tokens(data: Any, path: str, field: str, rule: ImageRule, placeholders: list[int]
                 ) -> tuple[list[int], list[Path]]:
    """Tokens each row's images add to its tokenized text (``placeholders``: image placeholders the text
    already holds, per row), and the image files read (each once)."""
    if field not in data.column_names:
        raise ConfigError(FLAG, f"{path}: row 1 has no field {field!r} (fields: {', '.join(data.column_names)})")
    column = _undecoded(data, field)
    base = Path(path).expanduser()
    base = base if base.is_dir() else base.parent
    out = []
    sizes: dict[Path, tuple[int, int]] = {}
    for row, value in enumerate(column, start=1):
        images = _images(value, path, row, field)
        total = sum(_image_tokens(image, base, rule, (path, row, field), sizes) for image in images)
        out.append(total - min(placeholders[row - 1], len(images)) * rule.placeholder_tokens)
    return out, list(sizes)


def _undecoded(data: Any, field: str) -> list[Any]:
    """The column, with a ``datasets.Image`` feature left as ``{"bytes", "path"}`` (never decoded)."""
    import datasets

    feature = data.features.get(field)
    if isinstance(feature, datasets.Image):
        data = data.cast_column(field, datasets.Image(decode=False))
    elif isinstance(feature, (list, datasets.Sequence)) and isinstance(getattr(feature, "feature", None) or
                                                                       (feature[0] if isinstance(feature, list)
                                                                        else None), datasets.Image):
        data = data.cast_column(field, datasets.Sequence(datasets.Image(decode=False)))
    values = data[field]
    return values if isinstance(values, list) else list(values)


def _images(value: Any, path: str, row: int, field: str) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (str, dict)) or hasattr(value, "size"):
        return [value]
    if isinstance(value, list):
        return [v for v in value if v is not None]
    raise ConfigError(FLAG, f"{path}: row {row}, field {field!r}: must be an image path, a list of them or "
                      "{\"path\": ...}", type(value).__name__)


def _image_tokens(image: Any, base: Path, rule: ImageRule, where: tuple[str, int, str],
                  sizes: dict[Path, tuple[int, int]]) -> int:
    width, height = _size(image, base, where, sizes)
    try:
        return rule.tokens(width, height)
    except ValueError as exc:
        path, row, field = where
        raise ConfigError(FLAG, f"{path}: row {row}, field {field!r}: {_name(image)}: {exc}") from None


def _size(image: Any, base: Path, where: tuple[str, int, str], sizes: dict[Path, tuple[int, int]]
          ) -> tuple[int, int]:
    """(width, height) from the image's header (``sizes``: the files already read)."""
    from PIL import Image, UnidentifiedImageError

    path, row, field = where
    if hasattr(image, "size") and not isinstance(image, (str, dict)):
        return tuple(image.size)  # type: ignore[return-value]  # already a PIL image
    source: Any
    if isinstance(image, dict) and image.get("bytes"):
        source = io.BytesIO(image["bytes"])
    else:
        name = image.get("path") if isinstance(image, dict) else image
        if not isinstance(name, str) or not name:
            raise ConfigError(FLAG, f"{path}: row {row}, field {field!r}: an image must be a path or "
                              "{\"path\": ...}", repr(image)[:80])
        if "://" in name:
            raise ConfigError(FLAG, f"{path}: row {row}, field {field!r}: {name}: only local files are read "
                              "(memplan never downloads)")
        source = base / Path(name).expanduser()
        if source in sizes:
            return sizes[source]
    try:
        with Image.open(source) as opened:
            size: tuple[int, int] = opened.size
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        reason = "no such file" if isinstance(exc, FileNotFoundError) else f"cannot be opened as an image ({exc})"
        raise ConfigError(FLAG, f"{path}: row {row}, field {field!r}: {_name(image, source)}: {reason}") from None
    if isinstance(source, Path):
        sizes[source] = size
    return size


def _name(image: Any, source: Any = None) -> str:
    if isinstance(source, Path):
        return str(source)
    return str(image.get("path") or "embedded image") if isinstance(image, dict) else str(image)[:200]


def count_placeholders(value: Any, rule: ImageRule) -> int:
    """Image placeholders one row's text field already holds (image items of messages, or the family's
    placeholder string)."""
    if isinstance(value, str):
        return value.count(rule.placeholder)
    if isinstance(value, list):
        return sum(count_placeholders(v, rule) for v in value)
    if isinstance(value, dict):
        if value.get("type") == "image":
            return 1
        return sum(count_placeholders(value.get(k), rule) for k in ("content", "text") if k in value)
    return 0


def row_image_tokens(path: str, fields: Any, field: str, vision_ref: str | None) -> tuple[Any, ImageRule]:
    """Per row of the dataset at ``path``: the tokens its images add (numpy int64), and the rule used
    (``fields``: the request's :class:`~memplan.dataset.lengths.Fields`, where placeholders are looked for)."""
    import numpy as np

    from memplan.dataset.imagecache import cache_key, load_counts, save_counts
    from memplan.dataset.source import content_digest, open_dataset

    rule = image_rule(*read_vision_config(vision_ref))
    base = Path(path).expanduser().resolve()
    entry = cache_key(content_digest(path), str(base), repr(rule), field, repr((fields.text, fields.messages, fields.prompt,
                                                                     fields.completion)))
    cached = load_counts(entry)
    if cached is not None:
        return cached, rule
    data = open_dataset(path)
    texts = [name for name in (fields.messages, fields.prompt, fields.completion, fields.text)
             if name is not None and name in data.column_names] or [c for c in ("text",) if c in data.column_names]
    placeholders = [0] * len(data)
    for name in texts:
        placeholders = [have + count_placeholders(value, rule) for have, value in zip(placeholders, data[name])]
    counts, files = image_tokens(data, path, field, rule, placeholders)
    tokens = np.asarray(counts, dtype=np.int64)
    save_counts(entry, tokens, files)
    return tokens, rule


def images_note(path: str, fields: Any, field: str, vision_ref: str | None) -> dict[str, Any]:
    """The JSON ``dataset.images`` entry: the field, the rule, the image tokens counted (from the cache
    the run just filled), and what is not modelled."""
    tokens, rule = row_image_tokens(path, fields, field, vision_ref)
    return {"field": field, **rule.to_dict(), "rows_with_image_tokens": int((tokens > 0).sum()),
            "image_tokens": int(tokens.sum()),
            "not_modelled": "the vision encoder's parameters and activations (images are priced as their tokens)"}
