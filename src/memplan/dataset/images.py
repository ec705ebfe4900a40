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
header; pixels are never decoded (the rules: :mod:`~memplan.dataset.imagerules`). The counts are cached (:mod:`~memplan.dataset.imagecache`) until the
dataset or one of its image files changes.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from memplan.dataset.imagerules import FAMILIES, FLAG, ImageRule, image_rule, read_vision_config, smart_resize
from memplan.errors import ConfigError, MissingDependencyError

__all__ = ["FAMILIES", "ImageRule", "count_placeholders", "image_rule", "image_tokens", "images_note",
           "read_vision_config", "row_image_tokens", "smart_resize"]


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

    try:
        import PIL  # noqa: F401  # only the size in each image's header is read
    except ImportError:
        raise MissingDependencyError("pillow", feature="--images-field", extra="dataset") from None
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
    return {"field": field, "vision_model": vision_ref, **rule.to_dict(),
            "rows_with_image_tokens": int((tokens > 0).sum()),
            "image_tokens": int(tokens.sum()),
            "not_modelled": "the vision encoder's parameters and activations (images are priced as their tokens)"}
