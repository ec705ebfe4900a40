"""``memplan serve``'s JSON API over a real socket: every endpoint, the CLI's documents, every error path.

The app runs in uvicorn on a free port (a thread of this process, module scope); requests go through
httpx over TCP. Each error test ends by checking the server still answers.
"""

from __future__ import annotations

import json
import os
import pickle
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from typer.testing import CliRunner

from memplan.cli import app as cli
from memplan.serve import ServeLimits, create_app

ROOT = Path(__file__).resolve().parents[2]
CORPUS = json.loads((ROOT / "tests/data/oom_messages/corpus.json").read_text())["cases"]
MiB, GiB = 1 << 20, 1 << 30
runner = CliRunner()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Server:
    """uvicorn serving ``app`` in a thread on a socket bound here to a free port and handed to uvicorn (no port
    is chosen, released and bound again: a parallel test worker cannot take it in between)."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> httpx.Client:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)
        return self.client

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with _Server(create_app()) as http:
        yield http


@pytest.fixture(scope="module")
def strict() -> Iterator[httpx.Client]:
    """A server with small limits: 4 KiB bodies, 64 KiB uploads, 0.5 s per request, 600 MiB per child."""
    limits = ServeLimits(max_body_bytes=4096, max_upload_bytes=64 << 10, time_limit_s=0.5,
                         memory_limit_bytes=600 * MiB)
    with _Server(create_app(limits)) as http:
        yield http


def _cli(*args: str) -> Any:
    result = runner.invoke(cli, [*args, "--json"])
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.stdout)


def _error(response: httpx.Response, status: int, field: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text[:600]
    body = response.json()["error"]
    assert body["status"] == status and body["message"]
    if field is not None:
        assert body["field"] == field, body
    return body


def _alive(http: httpx.Client) -> None:
    assert http.get("/healthz").json() == {"status": "ok"}


# --- every endpoint answers what the command prints -------------------------------------------------

ESTIMATES = [
    (["llama-3.1-8b", "--gpus", "8", "--tp", "2", "--gpu", "h100-80gb"],
     {"model": "llama-3.1-8b", "gpus": 8, "tp": 2, "gpu": "h100-80gb"}),
    (["llama-3.1-70b", "--gpus", "64", "--tp", "8", "--pp", "4", "--vpp", "2", "--sequence-parallel",
      "--distributed-optimizer", "--recompute", "full", "--seq", "8192", "--gbs", "512"],
     {"model": "llama-3.1-70b", "gpus": 64, "tp": 8, "pp": 4, "vpp": 2, "sequence-parallel": True,
      "distributed_optimizer": True, "recompute": "full", "seq": 8192, "gbs": 512}),
    (["mixtral-8x7b", "--gpus", "16", "--ep", "8", "--framework", "torchtitan", "--fsdp", "full"],
     {"model": "mixtral-8x7b", "gpus": 16, "ep": 8, "framework": "torchtitan", "fsdp": "full"}),
    (["llama-3.2-1b", "--framework", "hf", "--peft", "lora", "--quantize-base", "nf4", "--fragmentation", "0.2"],
     {"model": "llama-3.2-1b", "framework": "hf", "peft": "lora", "quantize_base": "nf4", "fragmentation": 0.2}),
    (["llama-3.2-1b", "--framework", "hf", "--seq", "1024", "--reserved", "simulated"],
     {"model": "llama-3.2-1b", "framework": "hf", "seq": 1024, "reserved": "simulated"}),
]


@pytest.mark.parametrize(("args", "body"), ESTIMATES, ids=[a[0] for a, _ in ESTIMATES])
def test_estimate_is_the_cli_document(client: httpx.Client, args: list[str], body: dict[str, Any]) -> None:
    response = client.post("/v1/estimate", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json() == _cli("estimate", *args)


def test_estimate_with_dialect_contents_is_the_cli_document_of_the_files(client: httpx.Client, tmp_path: Path) -> None:
    deepspeed = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "offload_optimizer":
                 {"device": "cpu"}}, "bf16": {"enabled": True}, "steps_per_print": 10}
    peft = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"],
            "task_type": "CAUSAL_LM"}
    (tmp_path / "ds.json").write_text(json.dumps(deepspeed))
    (tmp_path / "adapter_config.json").write_text(json.dumps(peft))
    cli = _cli("estimate", "llama-3.1-8b", "--gpus", "8", "--deepspeed-config", str(tmp_path / "ds.json"))
    api = client.post("/v1/estimate", json={"model": "llama-3.1-8b", "gpus": 8, "deepspeed_config": deepspeed}).json()
    for doc in (cli, api):  # the file's path is named in the settings' sources; the rest is equal
        for item in doc["input_settings"]:
            item["source"] = "--deepspeed-config"
    assert api == cli and {s["key"] for s in api["input_settings"]} >= {"zero_optimization.stage", "steps_per_print"}
    cli = _cli("estimate", "llama-3.2-1b", "--framework", "hf", "--peft-config", str(tmp_path / "adapter_config.json"))
    api = client.post("/v1/estimate", json={"model": "llama-3.2-1b", "framework": "hf", "peft_config": peft}).json()
    assert api == cli
    megatron = "torchrun pretrain_gpt.py --num-layers 8 --hidden-size 1024 --num-attention-heads 16 " \
               "--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 64 " \
               "--tensor-model-parallel-size 2 --bf16 --use-distributed-optimizer --vocab-size 32000"
    (tmp_path / "megatron_args.txt").write_text(megatron)  # the model is named after the file, as the server's
    cli = _cli("estimate", "--megatron-args", str(tmp_path / "megatron_args.txt"), "--gpus", "8")
    api = client.post("/v1/estimate", json={"megatron_args": megatron, "gpus": 8}).json()
    assert api == cli and api["peak_allocated_bytes"] > 0


def test_estimate_of_a_pasted_config_is_the_cli_document_of_the_file(client: httpx.Client, tmp_path: Path) -> None:
    config = json.loads((ROOT / "src/memplan/model/presets/llama-3.2-1b.json").read_text())
    config.pop("_memplan", None)
    config["_name_or_path"] = "acme/tiny-llama"
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    api = client.post("/v1/estimate", json={"model_config": config, "gpus": 2, "seq": 1024})
    assert api.status_code == 200, api.text
    assert api.json() == _cli("estimate", str(folder), "--gpus", "2", "--seq", "1024")


def test_fit_search_limits_and_methods_are_the_cli_documents(client: httpx.Client) -> None:
    def same(api: dict[str, Any], cli: dict[str, Any]) -> None:
        for doc in (api, cli):
            doc.pop("seconds", None)  # the search's own wall time
        assert api == cli

    cases = [
        (["llama-3.1-8b", "--gpus", "8", "--top", "3"], {"model": "llama-3.1-8b", "gpus": 8, "top": 3}),
        (["llama-3.1-8b", "--gpus", "8", "--max-mbs", "--tp", "2", "--seq", "8192"],
         {"model": "llama-3.1-8b", "gpus": 8, "max_mbs": True, "tp": 2, "seq": 8192}),
        (["llama-3.1-8b", "--gpu", "rtx-4090", "--methods", "--seq", "2048"],
         {"model": "llama-3.1-8b", "gpu": "rtx-4090", "methods": True, "seq": 2048}),
    ]
    for args, body in cases:
        response = client.post("/v1/fit", json=body)
        assert response.status_code == 200, response.text
        same(response.json(), _cli("fit", *args))


def test_fit_where_nothing_fits_is_an_answer_not_an_error(client: httpx.Client) -> None:
    response = client.post("/v1/fit", json={"model": "llama-3.1-405b", "gpus": 1, "gpu": "rtx-4090"})
    assert response.status_code == 200, response.text
    doc = response.json()
    assert doc["fitting"] == 0 and doc["candidates"] == []
    assert "fits no layout" in doc["failure"] and "try --gpus" in doc["failure"]


def test_models_and_gpus_are_the_cli_catalogues(client: httpx.Client) -> None:
    assert client.get("/v1/models").json() == _cli("models")
    assert client.get("/v1/gpus").json() == _cli("gpus")


def test_openapi_lists_every_endpoint_and_every_job_field(client: httpx.Client) -> None:
    from memplan.jobflags import job_flags

    spec = client.get("/v1/openapi.json").json()
    assert spec["openapi"].startswith("3.1")
    assert {"/v1/estimate", "/v1/fit", "/v1/place", "/v1/doctor", "/v1/models", "/v1/gpus"} <= set(spec["paths"])
    job = spec["components"]["schemas"]["Job"]["properties"]
    for flag in job_flags():
        assert flag.name in job, flag.name
        if flag.choices:
            assert job[flag.name]["enum"] == list(flag.choices)
    assert {"model", "gpu", "model_config", "deepspeed_config"} <= set(job)


# --- placement ----------------------------------------------------------------------------------------

def test_place_agrees_with_colocate_and_ranks_by_headroom(client: httpx.Client, tmp_path: Path) -> None:
    small, other = {"model": "llama-3.2-1b", "gpus": 1, "seq": 2048}, {"model": "gpt2"}
    body = {"job": small, "gpus": [
        {"id": "busy", "gpu": "h100-80gb", "jobs": [other, other]},
        {"id": "empty", "gpu": "h100-80gb"},
        {"id": "slice", "gpu": "h100-80gb:1g.10gb"},
        {"id": "measured", "gpu": "a100-80gb", "free_bytes": 30 * GiB},
    ]}
    response = client.post("/v1/place", json=body)
    assert response.status_code == 200, response.text
    doc = response.json()
    by_id = {p["id"]: p for p in doc["placements"]}
    # No measurement: exactly memplan fit --colocate with the same jobs (the new one last).
    for index, path in enumerate(("a.yaml", "b.yaml", "new.yaml")):
        job = small if path == "new.yaml" else other
        (tmp_path / path).write_text("\n".join(f"{k}: {v}" for k, v in job.items()))
    shared = _cli("fit", "--colocate", str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml"), str(tmp_path / "new.yaml"),
                  "--gpu", "h100-80gb")
    assert by_id["busy"]["headroom_bytes"] == shared["headroom_bytes"]
    assert by_id["busy"]["fits"] == shared["fits"] and by_id["busy"]["bound"] == "predicted jobs"
    # A measured free memory below the prediction decides.
    measured = by_id["measured"]
    assert measured["bound"] == "measured free memory"
    assert measured["available_bytes"] == 30 * GiB - (measured["capacity_bytes"] - measured["limit_bytes"])
    assert not by_id["slice"]["fits"] and by_id["slice"]["headroom_bytes"] < 0
    fitting = [p for p in doc["placements"] if p["fits"]]
    assert doc["fitting"] == [p["id"] for p in sorted(fitting, key=lambda p: -p["headroom_bytes"])]
    assert doc["fitting"][0] == "empty"


@pytest.mark.parametrize(("body", "field"), [
    ({"gpus": [{"id": "a", "gpu": "h100-80gb"}]}, "job"),
    ({"job": {"model": "gpt2"}, "gpus": []}, "gpus"),
    ({"job": {"model": "gpt2"}, "gpus": [{"id": "a", "gpu": "h100-80gb"}, {"id": "a", "gpu": "h100-80gb"}]},
     "gpus[1].id"),
    ({"job": {"model": "gpt2"}, "gpus": [{"id": "a", "gpu": "h100-80gb", "free_bytes": 10**15}]},
     "gpus[0].free_bytes"),
    ({"job": {"model": "gpt2"}, "gpus": [{"id": "a", "gpu": "h100-80gb", "vram": 1}]}, "gpus[0].vram"),
    ({"job": {"model": "gpt2"}, "gpus": [{"id": "a", "gpu": "h100-80gb:9g.99gb"}]}, "gpu"),
    ({"job": {"model": "gpt2"}, "gpus": [{"id": "a", "gpu": "h100-80gb", "jobs": [{"model": "gpt2", "tp": 3}]}]},
     "gpus[0].jobs[0]: gpus"),
    ({"job": {"model": "gpt2"}, "gpus": [{"id": "a", "gpu": "h100-80gb"}], "margin": 1.5}, "margin"),
    ({"job": {"model": "gpt2"}, "gpus": [{"id": "a", "gpu": "h100-80gb"}], "priority": 1}, "priority"),
])
def test_place_bad_input(client: httpx.Client, body: dict[str, Any], field: str) -> None:
    _error(client.post("/v1/place", json=body), 400, field)
    _alive(client)


# --- doctor -------------------------------------------------------------------------------------------

def test_doctor_message_and_job_is_the_cli_document(client: httpx.Client, tmp_path: Path) -> None:
    case = next(c for c in CORPUS if c["id"] == "alpaca-189")
    log = tmp_path / "train.log"
    log.write_text(case["message"])
    config = json.loads((ROOT / case["job"]["model"]).read_text())
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    flags = case["job"]["flags"]
    args = ["doctor", str(log), "--model", str(folder), "--gpu", "a100-80gb"]
    for flag, value in flags.items():
        args += [f"--{flag.replace('_', '-')}", str(value)]
    body = {"message": case["message"], "gpu": "a100-80gb", "job": {"model_config": config, **flags}}
    response = client.post("/v1/doctor", json=body)
    assert response.status_code == 200, response.text
    assert response.json() == _cli(*args) and response.json()["verdict"] == "demand"


def test_doctor_uploads_a_snapshot_and_a_trace(client: httpx.Client, tmp_path: Path) -> None:
    from memplan.events import AllocEvent, Trace, write_trace

    snapshot = json.loads((ROOT / "tests/data/oom_snapshot.json").read_text())["snapshot"]
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(snapshot, protocol=4))
    response = client.post("/v1/doctor", files={"file": ("oom.pickle", path.read_bytes())})
    assert response.status_code == 200, response.text
    assert response.json() == _cli("doctor", str(path)) and response.json()["verdict"] == "fragmentation"
    rows = [("alloc", 1, 4 * GiB, "parameter"), ("alloc", 2, 3 * GiB, "workspace"), ("free", 2, 3 * GiB, "workspace")]
    trace = Trace(events=tuple(AllocEvent(i, k, b, s, c, "forward", 0) for i, (k, b, s, c) in enumerate(rows)))
    write_trace(trace, tmp_path / "step.mptrace")
    response = client.post("/v1/doctor", files={"file": ("step.mptrace", (tmp_path / "step.mptrace").read_bytes())},
                           data={"capacity": "6GiB"})
    assert response.status_code == 200, response.text
    assert response.json() == _cli("doctor", str(tmp_path / "step.mptrace"), "--capacity", "6GiB")


class _Hostile:
    """A pickle that, if loaded, writes ``canary`` (a path in the test's own tmp_path)."""

    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"echo pwned > {shlex.quote(str(self.canary))}",))


def test_doctor_bad_uploads(client: httpx.Client, tmp_path: Path) -> None:
    canary = tmp_path / "memplan-serve-pwned"
    body = _error(client.post("/v1/doctor", files={"file": ("x.pickle", pickle.dumps(_Hostile(canary)))}), 400)
    assert "refused for safety" in body["message"] and not canary.exists()
    _error(client.post("/v1/doctor", files={"file": ("x.pickle", pickle.dumps({"segments": []})[:-5])}), 400)
    _error(client.post("/v1/doctor", files={"file": ("x.mptrace", b"\x1f\x8b\x08garbage")}), 400)
    _error(client.post("/v1/doctor", files={"file": ("x", b"")}), 400, "file")
    _error(client.post("/v1/doctor", files={"snapshot": ("x", b"\x80\x04N.")}), 400, "snapshot")
    _error(client.post("/v1/doctor", json={"message": "CUDA error: something else"}), 400)
    _error(client.post("/v1/doctor", json={}), 400, "body")
    _error(client.post("/v1/doctor", json={"message": "x", "verbose": True}), 400, "verbose")
    _error(client.post("/v1/doctor", json={"job": {"model": "gpt2", "zero": 7}}), 400, "zero")
    _error(client.post("/v1/doctor", data={"job": "{not json"}, files={"file": ("x", b"\x80\x04N.")}), 400, "job")
    _error(client.post("/v1/doctor", content=b"message=hi", headers={"content-type": "text/plain"}), 415)
    _alive(client)


# --- bad input: one clear 4xx, and the server keeps serving ------------------------------------------

@pytest.mark.parametrize(("body", "field"), [
    ({"model": "llama-3.1-8b", "tpp": 2}, "tpp"),                       # unknown field (did you mean tp?)
    ({"model": "llama-3.1-8b", "tp": "two"}, "tp"),                     # wrong type
    ({"model": "llama-3.1-8b", "tp": True}, "tp"),                      # a bool is not an int
    ({"model": "llama-3.1-8b", "gpus": -8}, "gpus"),                    # out of range
    ({"model": "llama-3.1-8b", "gpus": 8, "tp": 3}, None),              # sizes that do not divide
    ({"model": "llama-3.1-8b", "seq": 10**12}, None),                   # absurd
    ({"model": "llama-3.1-8b", "fragmentation": 1.5}, "fragmentation"),
    ({"model": "no-such-model"}, "model"),                              # unknown model
    ({"model": "llama-3.1-8b", "gpu": "h999"}, None),                   # unknown GPU
    ({"model": "/etc/passwd"}, "model"),                                # a server path
    ({"model": "llama-3.1-8b", "deepspeed_config": "/etc/ds.json"}, "deepspeed_config"),  # a path, not content
    ({"model": "llama-3.1-8b", "hf_args": {"deepspeed": "/etc/ds.json"}}, "hf_args: deepspeed"),
    ({"hf_args": {"model_name_or_path": "/etc"}}, "model"),
    ({"model": "llama-3.1-8b", "model_config": {"model_type": "llama"}}, "model_config"),
    ({"model_config": {"model_type": "no-such-type"}}, "model_type"),
    ({"model_config": [1, 2]}, "model_config"),
    ([1, 2, 3], "body"),
    ("llama", "body"),
])
def test_estimate_bad_input(client: httpx.Client, body: Any, field: str | None) -> None:
    error = _error(client.post("/v1/estimate", json=body), 400, field)
    assert "Traceback" not in error["message"] and "\n" not in error["message"]
    _alive(client)


def test_malformed_bodies(client: httpx.Client) -> None:
    def raw(data: bytes, kind: str = "application/json") -> httpx.Response:
        return client.post("/v1/estimate", content=data, headers={"content-type": kind})

    _error(raw(b'{"model": "gpt2",'), 400, "body")
    _error(raw(b'{"model": "gpt2", "model": "gpt2"}'), 400, "model")
    _error(raw(b'{"model": "gpt2", "fragmentation": NaN}'), 400, "body")
    _error(raw(b'\xff\xfe{}'), 400, "body")
    _error(raw(b"[" * 100_000 + b"]" * 100_000), 400, "body")  # nested too deeply for the parser
    _error(raw(b'{"model": "gpt2"}', "text/plain"), 415, "content-type")
    _error(client.get("/v1/nowhere"), 404)
    _error(client.get("/v1/estimate"), 405)
    _error(client.post("/v1/models"), 405)
    _alive(client)


def test_limits_body_time_and_memory(strict: httpx.Client) -> None:
    big = {"model": "gpt2", "model_config": {"pad": "x" * 8000}}
    _error(strict.post("/v1/estimate", json=big), 413, "body")

    def chunks() -> Iterator[bytes]:  # no Content-Length: refused as the bytes arrive
        yield b'{"model": "gpt2", "pad": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    _error(strict.post("/v1/estimate", content=chunks(), headers={"content-type": "application/json"}), 413)
    _error(strict.post("/v1/doctor", files={"file": ("x.pickle", b"\x80" + b"0" * (70 << 10))}), 413)
    error = _error(strict.post("/v1/fit", json={"model": "deepseek-v3", "gpus": 4096, "all": True}), 503)
    assert "time limit" in error["message"]
    _alive(strict)
    assert strict.post("/v1/estimate", json={"model": "gpt2"}).status_code == 200


def test_concurrent_requests_all_answer(client: httpx.Client) -> None:
    from concurrent.futures import ThreadPoolExecutor

    base = str(client.base_url)

    def one(i: int) -> int:
        with httpx.Client(base_url=base, timeout=60) as http:
            path, body = ("/v1/fit", {"model": "gpt2", "gpus": 2, "top": 1}) if i % 4 == 0 else \
                ("/v1/estimate", {"model": "llama-3.1-8b", "gpus": 8, "mbs": 1 + i % 3})
            return http.post(path, json=body).status_code

    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(one, range(24))) == {200}


# --- the guard and the command ------------------------------------------------------------------------

def test_read_guard_refuses_files_outside_the_request(tmp_path: Path) -> None:
    from memplan.serve.guard import allowed_roots, read_guard

    inside = tmp_path / "inside.txt"
    inside.write_text("ok")
    secret = Path(__file__)  # a file of the repository, outside every allowed root
    with read_guard(allowed_roots(tmp_path)):
        assert inside.read_text() == "ok"
        with pytest.raises(PermissionError):
            secret.read_text()
        from memplan.model import load_model

        assert load_model("gpt2").name == "gpt2"  # presets ship in the package
    assert secret.read_text()  # outside the block nothing is refused


def test_memplan_serve_starts_and_answers() -> None:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "memplan", "serve", "--port", str(port), "--log-level", "warning",
                             "--workers", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                response = httpx.post(f"http://127.0.0.1:{port}/v1/estimate", json={"model": "gpt2"}, timeout=5)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode() \
                    if proc.stdout else ""
                time.sleep(0.05)
        assert response.status_code == 200 and response.json()["model"] == "gpt2"
    finally:
        proc.terminate()
        proc.wait(10)


def test_memplan_serve_bad_options() -> None:
    for args in (["--port", "70000"], ["--max-body", "lots"], ["--time-limit", "0"], ["--workers", "0"]):
        result = runner.invoke(cli, ["serve", *args])
        assert result.exit_code == 2, (args, result.output)


def test_isolated_work_is_stopped_past_its_memory_and_its_time() -> None:
    from memplan.serve.isolate import Refusal, run_isolated

    assert run_isolated(len, ((1, 2, 3),), seconds=30, memory_bytes=1 << 30) == 3
    with pytest.raises(Refusal) as memory:
        run_isolated(bytearray, (4 << 30,), seconds=30, memory_bytes=1 << 30)
    assert memory.value.status == 503 and "memory" in memory.value.message
    started = time.monotonic()
    with pytest.raises(Refusal) as slow:
        run_isolated(time.sleep, (30,), seconds=0.5, memory_bytes=None)
    assert slow.value.status == 503 and "time limit" in slow.value.message
    assert time.monotonic() - started < 10  # killed, not waited for


def _json_values() -> Any:
    from hypothesis import strategies as st

    leaves = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) \
        | st.text(max_size=12) | st.sampled_from(["gpt2", "llama-3.1-8b", "h100-80gb", "full", "selective", "lora",
                                                  "nf4", "hf", "megatron", "torchtitan", "bf16-mixed", "8GiB"])
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                            max_size=3), max_leaves=6)


def test_random_bodies_never_crash_the_server(client: httpx.Client) -> None:
    """Property: whatever JSON a client sends, the answer is 200 or a 4xx/503 JSON error — never a 500."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from memplan.jobfile import job_file_fields

    names = sorted(job_file_fields()) + ["model_config", "margin", "top", "max_mbs", "gpus", "job", "bogus"]
    bodies = st.dictionaries(st.sampled_from(names), _json_values(), max_size=5) | _json_values()
    paths = st.sampled_from(["/v1/estimate", "/v1/estimate", "/v1/place", "/v1/fit", "/v1/doctor"])

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    @given(path=paths, body=bodies)
    def check(path: str, body: Any) -> None:
        response = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        assert response.status_code in (200, 400, 413, 422, 503), (path, body, response.text[:400])
        if response.status_code != 200:
            assert set(response.json()["error"]) == {"status", "message", "field", "rule", "value"}

    check()
    _alive(client)


def test_workers_take_their_limits_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from starlette.testclient import TestClient

    from memplan.errors import ConfigError
    from memplan.serve.app import LIMITS_ENV, create_app_from_environment

    monkeypatch.setenv(LIMITS_ENV, json.dumps({"max_body_bytes": 20}))
    with TestClient(create_app_from_environment()) as local:
        _error(local.post("/v1/estimate", json={"model": "llama-3.1-8b", "gpus": 8, "tp": 2, "seq": 4096}), 413)
    for bad in ("{not json", json.dumps({"max_bodies": 1}), json.dumps({"time_limit_s": -1})):
        monkeypatch.setenv(LIMITS_ENV, bad)
        with pytest.raises(ConfigError):
            create_app_from_environment()


def test_serve_help_names_the_serve_extra() -> None:
    """rich markup would eat ``[serve]`` (a style tag) and leave pip install 'memplan'."""
    result = runner.invoke(cli, ["serve", "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0
    assert "pip install 'memplan[serve]'" in result.output


def test_estimate_refuses_what_deepspeed_zero3_refuses(client: httpx.Client) -> None:
    """fp32 adapters beside a bf16 ``modules_to_save`` copy under ZeRO-3 (``deepspeed.initialize`` asserts one dtype
    over the trained parameters): the server's error is the CLI's refusal (cell Z11, helper zero18b)."""
    body = {"model": "llama-3.2-1b", "framework": "deepspeed", "zero": 3, "precision": "bf16-mixed", "gpus": 2,
            "peft": "lora", "modules_to_save": "lm_head"}
    error = _error(client.post("/v1/estimate", json=body), 400)
    assert "--modules-to-save" in error["message"] and "one dtype" in error["message"], error
    body["adapter_dtype"] = "bf16"
    assert client.post("/v1/estimate", json=body).status_code == 200
