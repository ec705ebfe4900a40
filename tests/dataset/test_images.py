"""--images-field: image tokens per example equal what the real transformers image processors produce."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from memplan.dataset.images import image_rule, row_image_tokens
from memplan.errors import ConfigError

PIL = pytest.importorskip("PIL.Image")

#: (width, height): tiny (scaled up to min_pixels), ordinary, wide, huge (scaled down to max_pixels), odd sizes.
SIZES = ((20, 30), (640, 480), (1000, 200), (3000, 2000), (333, 777), (57, 1401), (28, 28))
QWEN = {"model_type": "qwen2_vl", "vision_config": {"patch_size": 14, "spatial_merge_size": 2}}


@pytest.fixture(autouse=True)
def _own_cache(isolated_cache: Path) -> Path:
    return isolated_cache


def _pngs(folder: Path, sizes: tuple[tuple[int, int], ...] = SIZES) -> list[str]:
    names = []
    for i, (w, h) in enumerate(sizes):
        name = f"img{i}_{w}x{h}.png"
        PIL.new("RGB", (w, h), (i * 30 % 256, 90, 160)).save(folder / name)
        names.append(name)
    return names


def _qwen_reference(folder: Path, names: list[str], **kwargs: int) -> list[int]:
    """Tokens per image from transformers' own Qwen2-VL image processor (pixels processed for real)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(**kwargs)
    images = [PIL.open(folder / n).convert("RGB") for n in names]
    grids = np.asarray(processor(images=images)["image_grid_thw"])
    return [int(np.prod(g)) // processor.merge_size ** 2 for g in grids]


@pytest.mark.parametrize("pixels", [{}, {"min_pixels": 128 * 28 * 28, "max_pixels": 256 * 28 * 28}])
def test_qwen_tokens_equal_the_real_image_processor(tmp_path: Path, pixels: dict[str, int]) -> None:
    names = _pngs(tmp_path)
    rule = image_rule(QWEN, pixels)
    ours = [rule.tokens(w, h) - 2 for w, h in SIZES]  # less <|vision_start|>, <|vision_end|>
    assert ours == _qwen_reference(tmp_path, names, **pixels)
    assert len(set(ours)) > 4  # the sizes really exercise different grids


def test_qwen_torchvision_processor_agrees_when_installed(tmp_path: Path) -> None:
    # The only torchvision for torch 2.13.0 on PyPI (0.28.0) is built for CUDA: with the CPU torch its import
    # fails ("operator torchvision::nms does not exist"); the CPU build's index is not reachable here.
    pytest.importorskip("torchvision")
    from transformers import Qwen2VLImageProcessor

    names = _pngs(tmp_path)
    processor = Qwen2VLImageProcessor()
    grids = processor(images=[PIL.open(tmp_path / n).convert("RGB") for n in names])["image_grid_thw"]
    assert [int(np.prod(g)) // 4 + 2 for g in grids] == [image_rule(QWEN).tokens(w, h) for w, h in SIZES]


def test_llava_and_gemma3_fixed_counts() -> None:
    llava = image_rule({"model_type": "llava", "vision_feature_select_strategy": "default",
                        "vision_config": {"image_size": 336, "patch_size": 14}})
    assert llava.tokens(640, 480) == llava.tokens(20, 30) == 576
    assert image_rule({"model_type": "llava", "vision_feature_select_strategy": "full",
                       "vision_config": {"image_size": 224, "patch_size": 14}}).tokens(5, 5) == 257
    gemma = image_rule({"model_type": "gemma3", "mm_tokens_per_image": 256, "vision_config": {}})
    assert gemma.tokens(896, 896) == 256 + 4  # "\n\n" <start_of_image> ... <end_of_image> "\n\n"


def test_gemma3_count_equals_the_real_processor_expansion() -> None:
    """transformers' own Gemma3Processor (with its PIL image processor) on a tokenizer trained here, which, like
    Gemma's, has "\n\n" as one token: an image adds what memplan counts, wherever its placeholder sits."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3 import Gemma3ImageProcessorPil

    rng = random.Random(0)
    words = ("describe", "the", "a", "cat", "image", "of")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<bos>", "<eos>", "<unk>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    tok.train_from_iterator([" ".join(rng.choice(words) for _ in range(8)) for _ in range(100)],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", extra_special_tokens={
                                       "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                       "image_token": "<image_soft_token>"})
    fast.add_tokens(["\n\n"])
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(), tokenizer=fast, image_seq_length=256)
    rule = image_rule({"model_type": "gemma3", "mm_tokens_per_image": 256, "vision_config": {}})
    for text in ("<start_of_image>", "describe<start_of_image>", "a cat <start_of_image>\ndescribe"):
        ids = processor(text=[text], images=[[PIL.new("RGB", (640, 480))]])["input_ids"][0]
        # The placeholder was one token of the text: the image adds the rule's count less that one.
        assert len(ids) - len(fast(text)["input_ids"]) == rule.tokens(640, 480) - 1, text


def test_llava_count_equals_the_real_processor_expansion() -> None:
    """LlavaProcessor's own count for llava-1.5 (patch 14, one extra CLS token, the default strategy)."""
    from transformers.models.llava.processing_llava import LlavaProcessor

    fake = SimpleNamespace(image_processor=SimpleNamespace(crop_size={"height": 336, "width": 336}), patch_size=14,
                           num_additional_image_tokens=1, vision_feature_select_strategy="default",
                           image_token="<image>")
    expanded = LlavaProcessor.replace_image_token(fake, {"pixel_values": np.zeros((1, 3, 336, 336))}, 0)
    rule = image_rule({"model_type": "llava", "vision_config": {"image_size": 336, "patch_size": 14}})
    assert expanded.count("<image>") == rule.tokens(336, 336) == 576


def _vlm_folder(tmp_path: Path, config: dict, processor: dict | None = None) -> Path:
    folder = tmp_path / "vlm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if processor is not None:
        (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    return folder


def test_dataset_rows_add_their_images(tmp_path: Path, write_jsonl) -> None:
    names = _pngs(tmp_path)
    (tmp_path / "sub").mkdir()
    PIL.new("RGB", (500, 300)).save(tmp_path / "sub" / "x.png")
    rows = [{"text": "a", "images": names[0]},
            {"text": "b <|image_pad|>", "images": [names[1], names[2]]},
            {"text": "c", "images": {"path": "sub/x.png"}},
            {"text": "d", "images": []},
            {"text": "e", "images": [{"path": names[3]}, names[4]]}]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    vlm = _vlm_folder(tmp_path, QWEN, {"min_pixels": 3136, "max_pixels": 12845056})
    from memplan.dataset.lengths import Fields

    extra, rule = row_image_tokens(str(data), Fields(text="text"), "images", str(vlm))
    ref = _qwen_reference(tmp_path, names, min_pixels=3136, max_pixels=12845056)
    sub = _qwen_reference(tmp_path / "sub", ["x.png"], min_pixels=3136, max_pixels=12845056)[0]
    # row 2's text already holds one <|vision_start|><|image_pad|><|vision_end|> (3 tokens)
    assert extra.tolist() == [ref[0] + 2, ref[1] + ref[2] + 4 - 3, sub + 2, 0, ref[3] + ref[4] + 4]
    assert rule.max_pixels == 12845056


def test_messages_with_image_items_subtract_their_placeholders(tmp_path: Path, write_jsonl) -> None:
    names = _pngs(tmp_path, ((100, 100),))
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]}]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat, "images": names}])
    from memplan.dataset.lengths import Fields

    extra, _ = row_image_tokens(str(data), Fields(messages="messages"), "images",
                                str(_vlm_folder(tmp_path, {"model_type": "llava", "vision_config": {}})))
    assert extra.tolist() == [576 - 1]


@pytest.mark.parametrize(("value", "message"), [
    ("missing.png", "row 2, field 'images': .*missing.png: no such file"),
    ("bad.png", "row 2, field 'images': .*bad.png: cannot be opened as an image"),
    (["http://x/y.png"], "only local files"),
    (7, "must be an image path")])
def test_bad_images_are_one_line(tmp_path: Path, write_jsonl, value: object, message: str) -> None:
    names = _pngs(tmp_path, ((50, 50),))
    (tmp_path / "bad.png").write_bytes(b"not a png")
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": "a", "images": names[0]}, {"text": "b", "images": value}])
    from memplan.dataset.lengths import Fields

    with pytest.raises(ConfigError, match=message) as err:
        row_image_tokens(str(data), Fields(text="text"), "images", str(_vlm_folder(tmp_path, QWEN)))
    assert "\n" not in str(err.value) and str(data) in str(err.value)


def test_unsupported_family_names_the_supported_ones() -> None:
    with pytest.raises(ConfigError, match="'idefics3' is an unsupported vision-language family; supported: "
                       "qwen2_vl, qwen2_5_vl, llava, gemma3"):
        image_rule({"model_type": "idefics3", "vision_config": {}})
    with pytest.raises(ConfigError, match="'llama' is an unsupported model without a vision encoder"):
        image_rule({"model_type": "llama"})
    with pytest.raises(ConfigError, match="pan-and-scan"):
        image_rule({"model_type": "gemma3"}, {"do_pan_and_scan": True})


def test_cli_prices_image_tokens_and_refuses_bad_images(tmp_path: Path, write_jsonl, make_model_dir) -> None:
    from typer.testing import CliRunner

    from memplan.cli import app

    names = _pngs(tmp_path, ((1000, 1000), (64, 64)))
    vlm = _vlm_folder(tmp_path, QWEN)
    model = make_model_dir({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                            "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4,
                            "vocab_size": 300, "max_position_embeddings": 4096})
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": "a b", "images": names[0]},
                                                  {"text": "a", "images": names[1]}])
    common = ["estimate", str(model), "--dataset", str(data), "--mbs", "1", "--json"]
    plain = CliRunner().invoke(app, common)
    with_images = CliRunner().invoke(app, [*common, "--images-field", "images", "--vision-model", str(vlm)])
    assert plain.exit_code == 0 and with_images.exit_code == 0, with_images.output
    before, after = json.loads(plain.output)["dataset"], json.loads(with_images.output)["dataset"]
    assert after["worst_step"]["seq_length"] - before["worst_step"]["seq_length"] == \
        _qwen_reference(tmp_path, names[:1])[0] + 2
    assert after["images"]["family"] == "qwen2_vl"
    assert after["images"]["image_tokens"] == sum(_qwen_reference(tmp_path, names)) + 4
    assert after["images"]["rows_with_image_tokens"] == 2
    assert after["images"]["vision_model"] == str(vlm)
    text = CliRunner().invoke(app, [*common[:-1], "--images-field", "images", "--vision-model", str(vlm)],
                              env={"COLUMNS": "250"})
    assert text.exit_code == 0
    flat = " ".join(text.output.replace("│", " ").split())
    assert f"image tokens (images) {after['images']['image_tokens']:,} in 2 examples" in flat
    assert f"vision model {vlm} (qwen2_vl: patch 14, merge 2" in flat
    assert "Not modelled: the vision encoder's parameters and activations" in flat
    (tmp_path / names[1]).write_bytes(b"broken")
    out = tmp_path / "steps.png"
    bad = CliRunner().invoke(app, [*common, "--images-field", "images", "--vision-model", str(vlm),
                                   "--plot", str(out)])
    assert bad.exit_code == 2 and "row 2, field 'images'" in bad.output and not out.exists()
    assert len(bad.output.strip().splitlines()) == 1


def test_processor_config_json_nested_image_processor(tmp_path: Path) -> None:
    from memplan.dataset.images import read_vision_config

    folder = _vlm_folder(tmp_path, {"model_type": "qwen2_5_vl", "vision_config": {}})
    (folder / "processor_config.json").write_text(json.dumps({"image_processor": {
        "size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28}}}))
    rule = image_rule(*read_vision_config(str(folder)))
    assert (rule.min_pixels, rule.max_pixels) == (4 * 28 * 28, 64 * 28 * 28)
    assert rule.tokens(3000, 2000) - 2 == _qwen_reference(tmp_path, _pngs(tmp_path, ((3000, 2000),)),
                                                          min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28)[0]


def test_counts_are_cached_until_an_image_changes(tmp_path: Path, write_jsonl, isolated_cache: Path) -> None:
    from memplan.dataset.lengths import Fields

    names = _pngs(tmp_path, ((100, 100), (900, 700)))
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": "a", "images": names}])
    vlm = str(_vlm_folder(tmp_path, QWEN))
    first, _ = row_image_tokens(str(data), Fields(text="text"), "images", vlm)
    assert list((isolated_cache / "images").glob("*.npz"))
    again, _ = row_image_tokens(str(data), Fields(text="text"), "images", vlm)
    assert again.tolist() == first.tolist()
    PIL.new("RGB", (2000, 1500)).save(tmp_path / names[1])  # same name, new size: the entry is stale
    changed, _ = row_image_tokens(str(data), Fields(text="text"), "images", vlm)
    assert changed.tolist() == [sum(_qwen_reference(tmp_path, names)) + 4]
    assert changed.tolist() != first.tolist()


def test_fit_searches_with_the_image_tokens(tmp_path: Path, write_jsonl, make_model_dir) -> None:
    from typer.testing import CliRunner

    from memplan.cli import app

    names = _pngs(tmp_path, ((1200, 900),))
    model = make_model_dir({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                            "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4,
                            "vocab_size": 300, "max_position_embeddings": 8192})
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": "a b", "images": names[0]}, {"text": "a", "images": []}])
    common = ["fit", str(model), "--dataset", str(data), "--mbs", "1", "--gbs", "2", "--gpu", "rtx-4090",
              "--framework", "hf", "--json"]
    plain = CliRunner().invoke(app, common)
    vlm = str(_vlm_folder(tmp_path, QWEN))
    with_images = CliRunner().invoke(app, [*common, "--images-field", "images", "--vision-model", vlm])
    assert plain.exit_code == 0 and with_images.exit_code == 0, with_images.output
    before = json.loads(plain.stdout)["dataset"]["length_percentiles"]["p100"]
    after = json.loads(with_images.stdout)["dataset"]["length_percentiles"]["p100"]
    assert after - before == _qwen_reference(tmp_path, names)[0] + 2
    images = json.loads(with_images.stdout)["dataset"]["images"]
    assert images["image_tokens"] == _qwen_reference(tmp_path, names)[0] + 2
    text = CliRunner().invoke(app, [*common[:-1], "--images-field", "images", "--vision-model", vlm],
                              env={"COLUMNS": "250"})
    assert text.exit_code == 0
    flat = " ".join(text.output.replace("│", " ").split())
    assert f"image tokens (images) {images['image_tokens']:,} in 1 examples" in flat
    assert "Not modelled: the vision encoder's parameters and activations" in flat
