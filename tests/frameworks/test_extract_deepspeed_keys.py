"""scripts/extract_deepspeed_keys.py: its readers on small DeepSpeed-shaped sources."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "extract_deepspeed_keys.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("extract_deepspeed_keys", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_MODELS = '''
class Offload(DeepSpeedConfigModel):
    device: str = "none"
    _private: int = 0


class Base(DeepSpeedConfigModel):
    stage: int = 0


class Zero(Base):
    model_config = {}
    prefetch_bucket_size: int = Field(5, ge=0, alias="stage3_prefetch_bucket_size")
    offload_param: Optional[Offload] = None
'''


def test_pydantic_fields_aliases_nesting_and_bases(script) -> None:
    classes = script._classes([ast.parse(_MODELS)])
    assert sorted(script._model_keys(classes["Zero"], classes)) == [
        "offload_param", "offload_param.device", "prefetch_bucket_size", "stage", "stage3_prefetch_bucket_size"]


def test_constants_with_a_default_are_keys(tmp_path: Path, script) -> None:
    (tmp_path / "c.py").write_text('AIO = "aio"\nAIO_BLOCK_SIZE = "block_size"\nAIO_BLOCK_SIZE_DEFAULT = 1\n'
                                   'AIO_MODE_FAST = "fast"\nOTHER_KEY = "x"\nOTHER_KEY_DEFAULT = 0\n')
    assert script._constant_keys(tmp_path, "c.py", "AIO_") == ["block_size"]


@pytest.mark.parametrize("source", ['get_scalar_param(param_dict, "k", 0)', 'param_dict.get("k")',
                                    'param_dict["k"]', '"k" in param_dict', '"k" in param_dict.keys()'])
def test_dict_reads(script, source: str) -> None:
    node = ast.parse(source, mode="eval").body
    found = script._dict_read(node, ("param_dict",))
    assert isinstance(found, ast.Constant) and found.value == "k"
    assert script._dict_read(node, ("other",)) is None


def test_a_missing_source_file_fails_loudly(tmp_path: Path, script) -> None:
    with pytest.raises(SystemExit, match="is missing"):
        script.extract(tmp_path)
