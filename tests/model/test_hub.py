"""Hugging Face Hub model ids: a real cache layout, offline mode, and every error path without network."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants
import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import ModelConfigError
from memplan.model import load_model, total_params
from memplan.model.hub import hub_config_path, is_hub_id, looks_like_hub_id
from memplan.model.presets import preset_config

SHA = "0123456789abcdef0123456789abcdef01234567"
REPO = "meta-llama/Llama-3.2-1B"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An HF_HUB_CACHE holding models--meta-llama--Llama-3.2-1B (refs/main + snapshots/SHA/config.json),
    offline."""
    cache = tmp_path / "hub"
    repo = cache / "models--meta-llama--Llama-3.2-1B"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)
    snapshot = repo / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(preset_config("llama-3.2-1b")))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HOME", raising=False)
    return cache


def test_ids_paths_and_presets_are_told_apart() -> None:
    assert is_hub_id("meta-llama/Llama-3.2-3B") and is_hub_id("Qwen/Qwen3-8B@main")
    for ref in ("gpt2", "./org/name", "/abs/org", "configs/llama.json", "a/b/c", "~/x"):
        assert not is_hub_id(ref)
    assert looks_like_hub_id("meta--llama/x") and not is_hub_id("meta--llama/x")
    assert not is_hub_id("org/-bad") and not is_hub_id("org/na..me")


def test_cached_config_offline(hub_cache: Path) -> None:
    spec = load_model(REPO)
    assert spec.name == REPO
    assert total_params(spec) == total_params(load_model("llama-3.2-1b"))
    assert hub_config_path(f"{REPO}@{SHA}").parent.name == SHA  # a commit revision
    assert hub_config_path(f"{REPO}@main").is_file()


def test_a_preset_and_an_existing_path_win_over_the_hub(hub_cache: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    local = tmp_path / "meta-llama" / "Llama-3.2-1B"
    local.mkdir(parents=True)
    config = preset_config("llama-3.2-1b") | {"num_hidden_layers": 2}
    (local / "config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    assert load_model(REPO).num_layers == 2  # the folder, not the cache (16 layers)
    assert load_model("llama-3.2-1b").name == "llama-3.2-1b"


def test_not_cached_while_offline(hub_cache: Path) -> None:
    with pytest.raises(ModelConfigError, match="not in the local cache.*huggingface-cli download Org/Other"):
        load_model("Org/Other")


def test_malformed_id() -> None:
    with pytest.raises(ModelConfigError, match="well-formed Hugging Face Hub id"):
        load_model("meta--llama/Llama")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_unreachable_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        pytest.skip("huggingface_hub was imported with HF_HUB_OFFLINE set")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(ModelConfigError, match="is not reachable"):
        load_model("Org/Model")


class _FakeHub(http.server.BaseHTTPRequestHandler):
    """Answers like the Hub for a missing and a gated repository (status and X-Error-Code)."""

    def _reply(self) -> None:
        code, error = (401, "GatedRepo") if "gated" in self.path else (404, "RepoNotFound")
        self.send_response(code)
        self.send_header("X-Error-Code", error)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET = _reply

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        pytest.skip("huggingface_hub was imported with HF_HUB_OFFLINE set")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))
    yield
    server.shutdown()


def test_unknown_repository(fake_hub: None) -> None:
    with pytest.raises(ModelConfigError, match="is not a repository on the Hugging Face Hub"):
        load_model("someorg/missing")


def test_gated_repository_without_a_token(fake_hub: None) -> None:
    with pytest.raises(ModelConfigError, match="gated.*set HF_TOKEN or run `huggingface-cli login`"):
        load_model("someorg/gated-model")


def test_cli_estimate_and_errors(hub_cache: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["estimate", REPO, "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["unmodelled_settings"] == []
    for ref in ("meta--llama/x", "Org/Other"):
        bad = runner.invoke(app, ["estimate", ref])
        assert bad.exit_code == 2
        assert len(bad.output.strip().splitlines()) == 1, bad.output


def test_trace_resolves_hub_ids(hub_cache: Path) -> None:
    from memplan.trace.build import hf_config_dict

    name, config = hf_config_dict(REPO)
    assert name == REPO and config["num_hidden_layers"] == 16
