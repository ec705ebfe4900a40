"""Every shipped model config records where it comes from, and the record is checked.

The record is each file's ``_memplan`` block (``source``, ``witnesses`` with the architecture
``fields`` each states, ``published_params``); ``benchmarks/config_sources.py`` renders it as
``docs/model-sources.md``. Checked here: every preset and benchmark config has a record; each
witness's fields equal the file's (or transformers' default for a field the file leaves out);
memplan's parameter count equals the published count at its printed precision; the page is current;
memplan's family defaults are transformers'. That memplan's count equals transformers' own build of
every one of these files is ``tests/model/test_hf_params.py``'s job.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from memplan.model.hf_dense import FAMILY_DEFAULTS
from memplan.model.presets import preset_names

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("config_sources", ROOT / "benchmarks" / "config_sources.py")
assert _SPEC is not None and _SPEC.loader is not None
sources = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("config_sources", sources)
_SPEC.loader.exec_module(sources)

SHIPPED = {f"{path.parent.name}/{path.stem}": path for path in sources.shipped_configs()}
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
#: Configs memplan made itself (benchmark models): their ``source`` names the memplan script.
OWN = {"configs/llama-100m", "configs/llama-ft-cpu"}


def _meta(key: str) -> dict[str, Any]:
    return sources.provenance(SHIPPED[key])


def test_every_preset_and_benchmark_config_is_covered() -> None:
    assert {key for key in SHIPPED if key.startswith("presets/")} == {f"presets/{n}" for n in preset_names()}
    assert len([key for key in SHIPPED if key.startswith("configs/")]) >= 16


@pytest.mark.parametrize("key", sorted(SHIPPED))
def test_config_records_its_sources(key: str) -> None:
    meta = _meta(key)
    assert meta.get("source"), f"{key}: no _memplan.source"
    witnesses, published = meta["witnesses"], meta["published_params"]
    for item in witnesses:
        assert item["kind"] and item["entry"] and item["agrees"], f"{key}: incomplete witness {item}"
        if item["kind"] != "unattributed":
            assert item["repo"].count("/") == 1 and item["path"], f"{key}: witness without repository/path"
            assert _COMMIT.match(item["commit"]), f"{key}: witness commit {item['commit']!r} is not a full hash"
    has_count = published.get("count") is not None or "billions" in published
    assert has_count or published.get("reason"), f"{key}: published_params has neither a count nor a reason"
    assert not has_count or published.get("source"), f"{key}: a published count without its source"
    if key in OWN:
        assert meta["source"].startswith("memplan ") and not witnesses
    else:
        assert witnesses or has_count, f"{key}: neither a witness nor a published count"


@pytest.mark.parametrize("key", sorted(SHIPPED))
def test_memplan_count_equals_the_published_count(key: str) -> None:
    published = _meta(key)["published_params"]
    total = sources.memplan_count(SHIPPED[key])
    verdict = sources.agrees_with_published(total, published)
    assert verdict is not False, f"{key}: memplan {total:,} vs published {published}"


def test_published_check_is_exact_or_to_the_printed_digit() -> None:
    assert sources.agrees_with_published(100, {"count": 100}) is True
    assert sources.agrees_with_published(101, {"count": 100}) is False
    assert sources.agrees_with_published(3_075_098_624, {"count": 3_075_100_928, "adjust": -2_304}) is False
    assert sources.agrees_with_published(3_075_100_928 - 2_304, {"count": 3_075_100_928, "adjust": 2_304}) is True
    assert sources.agrees_with_published(1_235_814_400, {"billions": "1.23"}) is True
    assert sources.agrees_with_published(1_245_814_400, {"billions": "1.23"}) is False
    assert sources.agrees_with_published(405_853_388_800, {"billions": "405"}) is True
    assert sources.agrees_with_published(10, {"count": None, "reason": "none"}) is None


def test_docs_page_is_the_record() -> None:
    assert (ROOT / "docs" / "model-sources.md").read_text(encoding="utf-8") == sources.render(), (
        "docs/model-sources.md is stale: run python benchmarks/config_sources.py --write")



def _resolved(config: dict[str, Any], key: str) -> Any:
    """The file's value, or the one transformers fills in when the file leaves the field out."""
    if key in config:
        return config[key]
    transformers = pytest.importorskip("transformers")
    body = {k: v for k, v in config.items() if k not in ("_memplan", "auto_map", "quantization_config")}
    return getattr(transformers.AutoConfig.for_model(**body), key)


@pytest.mark.parametrize("key", sorted(k for k in SHIPPED if any("fields" in w for w in _meta(k)["witnesses"])))
def test_witness_fields_equal_the_file(key: str) -> None:
    """Each witness's architecture fields, recorded as the witness states them, equal this file's; the
    fields a witness states differently are recorded under ``differs`` and must stay different."""
    config = json.loads(SHIPPED[key].read_text(encoding="utf-8"))
    for item in _meta(key)["witnesses"]:
        for field, value in item.get("fields", {}).items():
            assert _resolved(config, field) == value, f"{key}: {field} differs from {item['repo']} {item['entry']}"
        for field, value in item.get("differs", {}).items():
            assert config[field] != value, f"{key}: {field} now equals {item['repo']}'s; update the record"


@pytest.mark.parametrize("model_type", sorted(FAMILY_DEFAULTS))
def test_family_defaults_are_the_transformers_defaults(model_type: str) -> None:
    """The defaults memplan fills in for fields a published config leaves out (gemma-3-4b-text's
    text_config lists only six fields) are the ones transformers' config class fills in."""
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.AutoConfig.for_model(model_type)
    for field, value in FAMILY_DEFAULTS[model_type].items():
        assert getattr(hf_config, field) == value, f"{model_type}.{field}"
