"""Hostile and mistaken inputs: every one gets one clear line and exit code 2, in bounded time and memory.

The command-line cases run in one child process whose address space is capped (``RLIMIT_AS``,
:data:`MEMORY_CAP`): the child builds each case's files and runs the command in-process (typer's
``CliRunner``), timing it. A case that tried to read ``/dev/zero`` whole, or build a list of 10^12
layers, would die there, not in the test process. Each case must exit 2 with exactly one line
(``error: ...``) within :data:`TIME_CAP` seconds.

The server cases run against ``memplan serve``'s app on 127.0.0.1 (a uvicorn thread, as in
tests/serve): no 500, one JSON error, ``/healthz`` answering while a request runs past its limit,
a header sent one byte at a time cut off.

A hypothesis property mutates real job files and ``config.json`` files at random: the answer is an
estimate or one line with exit 2, never a traceback, within :data:`TIME_CAP` seconds.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Seconds one case may take (the slowest honest refusal takes well under 1 s).
TIME_CAP = 5.0
#: Address space of the child running the command-line cases.
MEMORY_CAP = 2 << 30
PRESETS = ROOT / "src/memplan/model/presets"


def _preset(name: str) -> dict[str, Any]:
    config = json.loads((PRESETS / f"{name}.json").read_text())
    config.pop("_memplan", None)
    return config


def _config_dir(tmp: Path, name: str, **changes: Any) -> str:
    folder = tmp / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**_preset("llama-3.2-1b"), **changes}))
    return str(folder)


def _write(tmp: Path, name: str, text: str | bytes) -> str:
    path = tmp / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


_LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))


def _big_trace(tmp: Path) -> str:
    """A real binary trace whose header claims 200,000,000 events."""
    from memplan.events import AllocEvent, Trace, TraceMeta, write_trace

    path = tmp / "small.mptrace"
    events = (AllocEvent(0, "alloc", 1, 512, "activation", "forward", 0, "", "", 0),
              AllocEvent(1, "free", 1, 512, "activation", "forward", 0, "", "", 0))
    write_trace(Trace(events=events, meta=TraceMeta()), path)
    data = bytearray(path.read_bytes())
    header = struct.unpack_from("<I", data, 12)[0]
    struct.pack_into("<Q", data, 16 + header, 200_000_000)
    return _write(tmp, "claims-200M.mptrace", bytes(data))


def _small_trace(tmp: Path) -> str:
    from memplan.events import AllocEvent, Trace, TraceMeta, write_trace

    path = tmp / "one.mptrace"
    events = (AllocEvent(0, "alloc", 1, 1 << 30, "activation", "forward", 0, "", "", 0),
              AllocEvent(1, "free", 1, 1 << 30, "activation", "forward", 0, "", "", 0))
    write_trace(Trace(events=events, meta=TraceMeta()), path)
    return str(path)


def _deep_trace(tmp: Path) -> str:
    header = json.dumps({"format": "memplan-trace", "version": 1, "meta": {}})
    return _write(tmp, "deep.jsonl.gz", gzip.compress((header + "\n" + "[" * 200_000 + "]" * 200_000 + "\n").encode()))


def _megatron(tmp: Path, extra: str, layers: str = "4") -> str:
    return _write(tmp, "megatron.sh", f"pretrain_gpt.py --num-layers {layers} --hidden-size 256 "
                  "--num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 --micro-batch-size 1 "
                  "--global-batch-size 8 --bf16 --tokenizer-type NullTokenizer --vocab-size 1000 " + extra)


def _oom(free: str) -> str:
    return ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            f"79.10 GiB of which {free} is free. Including non-PyTorch memory, this process has 77.88 GiB memory in "
            "use. Of the allocated memory 66.00 GiB is allocated by PyTorch, and 9.80 GiB is reserved by PyTorch but "
            "unallocated.")


_DS_BOTH = json.dumps({"bf16": {"enabled": True}, "fp16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1})
_REGEX = r"([\w.]|[\w.][\w.]|[\w.][\w.][\w.])*Z"

#: (case id, arguments given the case's folder). Every one must exit 2 with one line.
CLI_CASES: list[tuple[str, Callable[[Path], list[str]]]] = [
    ("model name of 300 characters", lambda t: ["estimate", "a" * 300]),
    ("model path of 5000 characters", lambda t: ["estimate", "/x" * 2500]),
    ("config with 10^12 layers", lambda t: ["estimate", _config_dir(t, "l12", num_hidden_layers=10**12)]),
    ("config with 10^7 layers", lambda t: ["estimate", _config_dir(t, "l7", num_hidden_layers=10**7)]),
    ("config with 10^9 heads", lambda t: ["estimate", _config_dir(t, "h9", num_attention_heads=10**9)]),
    ("config with a 10^20 hidden size", lambda t: ["estimate", _config_dir(t, "big", hidden_size=10**20)]),
    ("config nested 200k deep", lambda t: ["estimate", _write(t, "deep.json", '{"a":' + "[" * 200_000)]),
    ("config with a 5000-digit integer", lambda t: ["estimate", _write(t, "digits.json", '{"model_type": "llama", '
                                                                       '"hidden_size": ' + "9" * 5000 + "}")]),
    ("job file JSON nested 200k deep", lambda t: ["estimate", "--job", _write(t, "job.json", "[" * 200_000)]),
    ("job file YAML nested 200k deep", lambda t: ["estimate", "--job", _write(t, "job.yaml", "[" * 200_000)]),
    ("job file YAML block nesting", lambda t: ["estimate", "--job", _write(
        t, "block.yaml", "".join(" " * i + f"k{i}:\n" for i in range(2000)))]),
    ("job file with a 5000-digit integer (YAML)", lambda t: ["estimate", "--job", _write(
        t, "digits.yaml", "model: gpt2\ngpus: " + "9" * 5000 + "\n")]),
    ("job file with a 5000-digit integer (JSON)", lambda t: ["estimate", "--job", _write(
        t, "digits.json", '{"model": "gpt2", "gpus": ' + "9" * 5000 + "}")]),
    ("job file YAML billion laughs in a list field", lambda t: ["estimate", "--job", _write(
        t, "laughs.yaml", "model: gpt2\n" + _LAUGHS + "lora-targets: *i\n")]),
    ("job file YAML recursive alias", lambda t: ["estimate", "--job", _write(t, "self.yaml", "model: &m [*m]\n")]),
    ("job file /dev/zero", lambda t: ["estimate", "--job", "/dev/zero"]),
    ("--deepspeed-config /dev/zero", lambda t: ["estimate", "gpt2", "--deepspeed-config", "/dev/zero"]),
    ("--hf-args /dev/urandom", lambda t: ["estimate", "gpt2", "--hf-args", "/dev/urandom"]),
    ("--hf-args an endless text stream", lambda t: ["estimate", "gpt2", "--hf-args", _write(t, "big.txt", "a" * (17 << 20))]),
    ("--peft-config /dev/zero", lambda t: ["estimate", "gpt2", "--peft-config", "/dev/zero"]),
    ("--peft-config with a backtracking regex", lambda t: ["estimate", "llama-3.2-1b", "--peft-config", _write(
        t, "adapter_config.json", json.dumps({"peft_type": "LORA", "r": 8, "target_modules": _REGEX}))]),
    ("--peft-config regex with a back-reference", lambda t: ["estimate", "llama-3.2-1b", "--peft-config", _write(
        t, "adapter_backref.json", json.dumps({"peft_type": "LORA", "r": 8,
                                               "target_modules": r"(\w)\1*(\w+\.)*\w*Z"}))]),
    ("--megatron-args --num-layers of 23 digits", lambda t: ["estimate", "--megatron-args", _megatron(
        t, "", layers="99999999999999999999999")]),
    ("--megatron-args --num-layers 10^8", lambda t: ["estimate", "--megatron-args", _megatron(
        t, "", layers="100000000")]),
    ("--megatron-args --moe-layer-freq list of 10^10", lambda t: ["estimate", "--megatron-args", _megatron(
        t, "--num-experts 8 --moe-layer-freq '[1]*100000*100000'")]),
    ("--megatron-args YAML billion laughs", lambda t: ["estimate", "--megatron-args", _write(
        t, "args.yaml", _LAUGHS + "num-layers: *i\n")]),
    ("--torchtitan-config nested arrays", lambda t: ["estimate", "--torchtitan-config", _write(
        t, "deep.toml", "[model]\nname = 'llama3'\nx = " + "[" * 100_000 + "]" * 100_000 + "\n")]),
    ("--gpus of 5000 digits in a job file", lambda t: ["estimate", "--job", _write(
        t, "gpus.yaml", "model: gpt2\ngpus: " + "1" * 5000 + "\n")]),
    ("--gpus 10^11", lambda t: ["estimate", "gpt2", "--gpus", "100000000000"]),
    ("trace claiming 200M events: doctor", lambda t: ["doctor", _big_trace(t), "--gpu", "h100-80gb"]),
    ("trace claiming 200M events: alloc simulate", lambda t: ["alloc", "simulate", _big_trace(t)]),
    ("trace claiming 200M events: diff", lambda t: ["diff", _big_trace(t), _big_trace(t)]),
    ("trace line nested 200k deep: doctor", lambda t: ["doctor", _deep_trace(t), "--gpu", "h100-80gb"]),
    ("trace line nested 200k deep: diff", lambda t: ["diff", _deep_trace(t), _deep_trace(t)]),
    ("trace /dev/zero", lambda t: ["alloc", "simulate", "/dev/zero"]),
    ("snapshot /dev/zero", lambda t: ["doctor", "/dev/zero"]),
    ("snapshot as a protocol-0 pickle", lambda t: ["doctor", _write(
        t, "old.pickle", pickle.dumps({"segments": []}, protocol=0))]),
    ("--deepspeed-config nested 200k deep", lambda t: ["estimate", "gpt2", "--deepspeed-config", _write(
        t, "ds_deep.json", '{"a": ' + "[" * 200_000)]),
    ("--peft-config nested 200k deep", lambda t: ["estimate", "gpt2", "--peft-config", _write(
        t, "adapter_deep.json", '{"a": ' + "[" * 200_000)]),
    ("--hf-args with a 5000-digit integer", lambda t: ["estimate", "gpt2", "--hf-args", _write(
        t, "args.json", '{"per_device_train_batch_size": ' + "7" * 5000 + "}")]),
    ("--megatron-args pipeline layout of 10^10 symbols", lambda t: ["estimate", "--megatron-args", _megatron(
        t, "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout '((t*100000)*100000)'")]),
    ("config.json that is a list", lambda t: ["estimate", _write(t, "list.json", "[1, 2, 3]")]),
    ("config with 10^8 experts", lambda t: ["estimate", _config_dir(t, "moe", model_type="mixtral",
                                                                    num_local_experts=10**8,
                                                                    num_experts_per_tok=2)]),
    ("job file that is a directory", lambda t: ["estimate", "--job", str(t)]),
    ("gzip trace of 10M+ empty lines", lambda t: ["alloc", "simulate", _write(t, "lines.jsonl.gz", gzip.compress(
        (json.dumps({"format": "memplan-trace", "version": 1, "meta": {}}) + "\n" * 10_000_003).encode()))]),
    ("OOM message with a 5000-digit size", lambda t: ["doctor", _write(t, "oom_digits.log", _oom("1.20 GiB").replace(
        "2.00 GiB", "9" * 5000 + " GiB"))]),
    ("--capacity of 5000 digits", lambda t: ["doctor", _write(t, "oom_ok.log", _oom("1.20 GiB")), "--capacity",
                                             "9" * 5000]),
    ("--fragmentation nan", lambda t: ["estimate", "gpt2", "--fragmentation", "nan"]),
    # contradictions
    ("--ep 8 on a dense model", lambda t: ["estimate", "llama-3.1-8b", "--gpus", "8", "--ep", "8"]),
    ("--zero 3 with --distributed-optimizer", lambda t: ["estimate", "gpt2", "--gpus", "8", "--zero", "3",
                                                         "--distributed-optimizer"]),
    ("--fsdp full with --framework deepspeed", lambda t: ["estimate", "gpt2", "--gpus", "8", "--fsdp", "full",
                                                          "--framework", "deepspeed"]),
    ("DeepSpeed config enabling bf16 and fp16", lambda t: ["estimate", "gpt2", "--deepspeed-config", _write(
        t, "ds.json", _DS_BOTH)]),
    ("DeepSpeed enabled: maybe", lambda t: ["estimate", "gpt2", "--deepspeed-config", _write(
        t, "ds_maybe.json", json.dumps({"bf16": {"enabled": "maybe"}}))]),
    ("--recompute-layers 1000 on 32 layers", lambda t: ["estimate", "llama-3.1-8b", "--recompute", "full",
                                                        "--recompute-layers", "1000"]),
    ("--recompute-layers 0 uniform", lambda t: ["estimate", "llama-3.1-8b", "--recompute", "full",
                                                "--recompute-layers", "0"]),
    ("gpt2 --seq 8192 past 1,024 positions", lambda t: ["estimate", "gpt2", "--seq", "8192"]),
    ("empty snapshot", lambda t: ["doctor", _write(t, "empty.pickle", pickle.dumps(
        {"segments": [], "device_traces": [[]]}, protocol=4)), "--gpu", "h100-80gb"]),
    ("trace alone without --gpu", lambda t: ["doctor", _small_trace(t)]),
    ("OOM message with free memory over the total", lambda t: ["doctor", _write(t, "oom.log", _oom("196.60 GiB"))]),
]


def _run_cases(folder: Path) -> None:
    """The child: run every case in-process and print one JSON line per case."""
    from typer.testing import CliRunner

    from memplan.cli import app

    runner = CliRunner()
    for index, (name, build) in enumerate(CLI_CASES):
        case_dir = folder / f"case{index}"
        case_dir.mkdir()
        args = build(case_dir)
        start = time.perf_counter()
        result = runner.invoke(app, args)
        seconds = time.perf_counter() - start
        text = (result.stderr if result.stderr_bytes is not None else result.output).strip()
        print(json.dumps({"case": name, "exit": result.exit_code, "seconds": round(seconds, 3), "output": text,
                          "exception": None if result.exception is None or isinstance(result.exception, SystemExit)
                          else f"{type(result.exception).__name__}: {str(result.exception)[:200]}"}), flush=True)


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("hostile")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap})); "
            "sys.path.insert(0, {tests!r}); import test_hostile_inputs as t; t._run_cases(__import__('pathlib')"
            ".Path({folder!r}))").format(cap=MEMORY_CAP, tests=str(ROOT / "tests"), folder=str(folder))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=TIME_CAP * len(CLI_CASES) + 60)
    results = {row["case"]: row for row in map(json.loads, proc.stdout.splitlines())}
    assert len(results) == len(CLI_CASES), f"the child stopped after {len(results)} cases:\n{proc.stderr[-3000:]}"
    return results


@pytest.mark.parametrize("name", [name for name, _ in CLI_CASES])
def test_cli_case_is_one_line_exit_2(cli_results: dict[str, dict[str, Any]], name: str) -> None:
    row = cli_results[name]
    assert row["exception"] is None, row
    assert row["exit"] == 2, row
    lines = row["output"].splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), row
    assert row["seconds"] < TIME_CAP, row


# ----------------------------------------------------------------------------------------------
# The server (127.0.0.1 only)

def _server_cases() -> list[tuple[str, str, dict[str, Any]]]:
    """(case id, endpoint, JSON body): each must be a 4xx with one JSON error, fast."""
    llama = _preset("llama-3.2-1b")
    adapter = {"peft_type": "LORA", "r": 8, "target_modules": _REGEX, "base_model_name_or_path": "llama-3.2-1b"}
    return [
        ("regex target_modules on /v1/estimate", "/v1/estimate", {"model": "llama-3.2-1b", "peft_config": adapter}),
        ("regex target_modules on /v1/fit", "/v1/fit", {"model": "llama-3.2-1b", "gpus": 1, "peft_config": adapter}),
        ("model_config of 10^7 layers", "/v1/estimate", {"model_config": {**llama, "num_hidden_layers": 10**7}}),
        ("5000-digit gpus", "/v1/estimate", {"model": "gpt2", "gpus": int("9" * 4000)}),
        ("megatron_args --num-layers of 23 digits", "/v1/estimate", {"megatron_args": (
            "pretrain_gpt.py --num-layers 99999999999999999999999 --hidden-size 256 --num-attention-heads 8 "
            "--seq-length 512 --max-position-embeddings 512 --tokenizer-type NullTokenizer --vocab-size 1000")}),
        ("body nested 200k deep", "/v1/estimate", {"model": "gpt2", "deepspeed_config": "NESTED"}),
        ("--ep 8 on a dense model", "/v1/estimate", {"model": "gpt2", "gpus": 8, "ep": 8}),
    ]


@pytest.fixture(scope="module")
def server() -> Any:
    pytest.importorskip("starlette")
    uvicorn = pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    import socket
    import threading

    from memplan.serve import ServeLimits, create_app
    from memplan.serve.protocol import guarded_protocol

    sock = socket.socket()  # bound here and handed to uvicorn: a parallel test worker cannot take the port
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    limits = ServeLimits(time_limit_s=3.0, memory_limit_bytes=2 << 30, max_concurrent=2)
    config = uvicorn.Config(create_app(limits), host="127.0.0.1", port=port, log_level="critical",
                            http=guarded_protocol(limits.time_limit_s))
    instance = uvicorn.Server(config)
    thread = threading.Thread(target=instance.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not instance.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        yield client, port
    instance.should_exit = True
    thread.join(10)
    sock.close()


def _body(raw: dict[str, Any]) -> bytes:
    text = json.dumps(raw)
    return text.replace('"NESTED"', "[" * 200_000 + "]" * 200_000).encode()


@pytest.mark.parametrize("case", _server_cases(), ids=lambda c: c[0])
def test_server_case_is_a_4xx(server: Any, case: tuple[str, str, dict[str, Any]]) -> None:
    client, _port = server
    _name, path, body = case
    start = time.perf_counter()
    reply = client.post(path, content=_body(body), headers={"content-type": "application/json"})
    seconds = time.perf_counter() - start
    assert 400 <= reply.status_code < 500, reply.text
    error = reply.json()["error"]
    assert "\n" not in error["message"] and "/tmp" not in error["message"], error
    assert seconds < TIME_CAP, (seconds, error)
    assert client.get("/healthz").json() == {"status": "ok"}


def _multipart(client: Any, name: str, data: bytes) -> Any:
    return client.post("/v1/doctor", files={"file": (name, data)}, data={"gpu": "h100-80gb"})


def test_server_upload_deep_trace_and_old_pickle(server: Any, tmp_path: Path) -> None:
    client, _port = server
    deep = Path(_deep_trace(tmp_path)).read_bytes()
    reply = _multipart(client, "deep.jsonl.gz", deep)
    assert reply.status_code == 400 and "/tmp" not in reply.text, reply.text
    reply = _multipart(client, "old.pickle", pickle.dumps({"segments": [], "device_traces": []}, protocol=0))
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert "pickle" in message and "/tmp" not in message, message
    big = Path(_big_trace(tmp_path)).read_bytes()
    reply = _multipart(client, "big.mptrace", big)
    assert reply.status_code == 400 and "MAX_EVENTS" in reply.text and "/tmp" not in reply.text, reply.text


def test_server_slow_headers_are_cut_off(server: Any) -> None:
    """A client sending its headers one byte at a time is answered 408 and closed at the time limit (3 s)."""
    import socket

    _client, port = server
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        received = b""
        for byte in request:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.1)
            sock.setblocking(False)
            try:
                received += sock.recv(4096)
            except BlockingIOError:
                pass
            finally:
                sock.setblocking(True)
            if received:
                break
        assert time.monotonic() - start < 3.0 + 1.5, "the connection was not cut off at the time limit"
    assert received.startswith(b"HTTP/1.1 408"), received[:80]


def test_server_healthz_answers_while_a_request_runs_past_its_limit(server: Any) -> None:
    """A fit of a 405B model over 4096 GPUs runs past the 3 s limit in its child process: /healthz answers
    meanwhile, the request gets a 503, and no child process is left running."""
    import threading

    psutil = pytest.importorskip("psutil")
    client, _port = server
    me = psutil.Process()
    replies: list[Any] = []
    body = {"model": "llama-3.1-405b", "gpus": 4096, "all": True, "max_mbs": True, "max_seq": True}
    worker = threading.Thread(target=lambda: replies.append(client.post("/v1/fit", json=body)))
    worker.start()
    latencies = []
    while worker.is_alive():
        start = time.perf_counter()
        assert client.get("/healthz").status_code == 200
        latencies.append(time.perf_counter() - start)
        time.sleep(0.2)
    worker.join()
    assert max(latencies) < 2.0, latencies
    if replies[0].status_code == 503:  # ran past the limit: its child must be gone
        time.sleep(0.5)

        def busy(child: Any) -> bool:
            try:
                return child.status() != psutil.STATUS_ZOMBIE and child.cpu_percent(0.2) > 50
            except psutil.NoSuchProcess:
                return False

        assert not [p for p in me.children(recursive=True) if busy(p)]


# ----------------------------------------------------------------------------------------------
# Random mutations of real inputs: an estimate or one ConfigError/UnsupportedError, never a traceback

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_JOB = {"model": "llama-3.2-1b", "gpus": 8, "tp": 2, "pp": 2, "seq": 2048, "mbs": 2, "gbs": 64,
        "recompute": "selective", "zero": 1, "precision": "bf16-mixed", "gpu": "h100-80gb"}
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70_000), st.sampled_from([0, -1, 10**9, 2**40 + 1, 10**29]),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
    st.sampled_from(["full", "selective", "none", "auto", "lora", "llama-3.1-8b", "h100-80gb", "fp16-mixed"]))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                       max_leaves=12)


def _mutate(base: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    out = dict(base)
    for _ in range(data.draw(st.integers(1, 3))):
        action = data.draw(st.sampled_from(["set", "drop", "add"]))
        key = data.draw(st.sampled_from(sorted(out))) if out else "x"
        if action == "drop":
            out.pop(key, None)
        elif action == "set":
            out[key] = data.draw(_VALUES)
        else:
            out[data.draw(st.text(min_size=1, max_size=12))] = data.draw(_VALUES)
    return out


def _answer_or_refusal(request: Any) -> None:
    from memplan.documents import estimate_document
    from memplan.errors import ConfigError, UnsupportedError
    from memplan.inputs import load_job

    start = time.perf_counter()
    try:
        estimate_document(load_job(request))
    except (ConfigError, UnsupportedError) as exc:
        assert "\n" not in str(exc)
    assert time.perf_counter() - start < TIME_CAP


_PROPERTY = settings(max_examples=40, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@_PROPERTY
@given(data=st.data(), suffix=st.sampled_from([".yaml", ".json"]))
def test_mutated_job_files_never_raise_a_traceback(tmp_path: Path, data: st.DataObject, suffix: str) -> None:
    from memplan.inputs import JobRequest

    job = _mutate(_JOB, data)
    path = tmp_path / f"job{suffix}"
    text = json.dumps(job, default=str)  # JSON is YAML too
    path.write_text(text)
    _answer_or_refusal(JobRequest(job_file=str(path)))


@_PROPERTY
@given(data=st.data())
def test_mutated_config_json_never_raises_a_traceback(tmp_path: Path, data: st.DataObject) -> None:
    from memplan.inputs import JobRequest

    config = _mutate(_preset(data.draw(st.sampled_from(["llama-3.2-1b", "qwen3-30b-a3b", "gpt2"]))), data)
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, default=str))
    _answer_or_refusal(JobRequest(model=str(folder), flags={"gpus": 2}))
