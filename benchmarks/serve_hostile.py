"""``memplan serve`` under hostile requests: /healthz latency while a request runs past its limit, the
server's memory before and after the 503, a slow-loris client, and the status of each hostile body.

Runs ``python -m memplan serve`` on 127.0.0.1 (a free port) as a child process and measures it from
outside with httpx and psutil. Targets (issue 28, fixed before the run): /healthz within 2 s while
any request runs; after a 503 the server's resident memory within 10% of before; a header sent one
byte every 0.2 s cut off at the time limit; no 5xx but the 503s of the time limit.

    PYTHONPATH=src python benchmarks/serve_hostile.py -o benchmarks/results/serve_hostile.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

HERE = Path(__file__).resolve().parent
TIME_LIMIT = 5.0
REGEX = r"([\w.]|[\w.][\w.]|[\w.][\w.][\w.])*Z"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rss(proc: psutil.Process) -> int:
    return int(proc.memory_info().rss)


def _busy(child: psutil.Process) -> bool:
    """The child uses more than half a CPU (a finished child may exit while it is measured)."""
    try:
        return child.cpu_percent(0.5) > 50
    except psutil.NoSuchProcess:
        return False


def _slow_loris(port: int) -> dict[str, Any]:
    start = time.monotonic()
    sent = 0
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200:
            try:
                sock.sendall(bytes([byte]))
                sent += 1
            except OSError:
                break
            time.sleep(0.2)
            sock.settimeout(0.001)
            try:
                answer = sock.recv(200)
            except (TimeoutError, BlockingIOError):
                continue
            finally:
                sock.settimeout(30)
            break
    return {"bytes_sent": sent, "cut_off_after_s": round(time.monotonic() - start, 2),
            "answer": answer[:40].decode("latin-1")}


def _hostile(client: httpx.Client) -> list[dict[str, Any]]:
    llama = json.loads((HERE.parent / "src/memplan/model/presets/llama-3.2-1b.json").read_text())
    llama.pop("_memplan", None)
    adapter = {"peft_type": "LORA", "r": 8, "target_modules": REGEX}
    bodies = {
        "regex target_modules (estimate)": ("/v1/estimate", {"model": "llama-3.2-1b", "peft_config": adapter}),
        "regex target_modules (fit)": ("/v1/fit", {"model": "llama-3.2-1b", "gpus": 1, "peft_config": adapter}),
        "model_config 10^7 layers": ("/v1/estimate", {"model_config": {**llama, "num_hidden_layers": 10**7}}),
        "4000-digit gpus": ("/v1/estimate", {"model": "gpt2", "gpus": int("9" * 4000)}),
        "megatron --num-layers 23 digits": ("/v1/estimate", {"megatron_args": "pretrain_gpt.py --num-layers "
                                             "99999999999999999999999 --hidden-size 256 --num-attention-heads 8"}),
    }
    out = []
    for name, (path, body) in bodies.items():
        start = time.perf_counter()
        reply = client.post(path, json=body)
        out.append({"case": name, "status": reply.status_code, "seconds": round(time.perf_counter() - start, 3),
                    "message": reply.json()["error"]["message"][:160]})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", type=Path)
    args = parser.parse_args(argv)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    server = subprocess.Popen([sys.executable, "-m", "memplan", "serve", "--port", str(port), "--time-limit",
                               str(TIME_LIMIT), "--log-level", "warning"], env=env)
    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        for _ in range(300):
            try:
                client.get("/healthz")
                break
            except httpx.TransportError:
                time.sleep(0.1)
        proc = psutil.Process(server.pid)
        client.post("/v1/estimate", json={"model": "gpt2"})  # warm: the forkserver is started
        before = _rss(proc)
        replies: list[httpx.Response] = []
        body = {"model": "llama-3.1-405b", "gpus": 4096, "all": True}
        worker = threading.Thread(target=lambda: replies.append(client.post("/v1/fit", json=body)))
        start = time.perf_counter()
        worker.start()
        latencies = []
        while worker.is_alive():
            t = time.perf_counter()
            client.get("/healthz")
            latencies.append(time.perf_counter() - t)
            time.sleep(0.1)
        long_request = {"status": replies[0].status_code, "seconds": round(time.perf_counter() - start, 2)}
        time.sleep(1.0)
        after = _rss(proc)
        busy = [p.pid for p in proc.children(recursive=True) if _busy(p)]
        result = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.platform(),
            "cpus": os.cpu_count(), "load_average": os.getloadavg(), "time_limit_s": TIME_LIMIT,
            "long_request": long_request,
            "healthz_during": {"samples": len(latencies), "max_s": round(max(latencies), 3),
                               "median_s": round(sorted(latencies)[len(latencies) // 2], 4)},
            "server_rss_bytes": {"before": before, "after_503": after, "change": round(after / before - 1, 4)},
            "children_busy_after": busy,
            "slow_loris": _slow_loris(port),
            "hostile_bodies": _hostile(client),
        }
    finally:
        server.terminate()
        server.wait(10)
    text = json.dumps(result, indent=1)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
