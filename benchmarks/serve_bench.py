"""``memplan serve`` under load, measured from outside: start-up time, ``/v1/estimate`` latency and
throughput, errors and the server's memory over a sustained run.

The witness is independent of memplan: ``wrk`` (Debian's package; ``apt-get install wrk``) sends the
requests over TCP from its own process and counts latencies, requests per second and non-2xx
answers; the server's resident memory is read from ``/proc/PID/status`` once a second. The server is
one ``memplan serve`` process (one worker), started the way a user starts it.

Parameters (fixed before any result was seen; issue 16's targets):

- start-up: ``python -m memplan serve``, time from launch to the first 200 of ``GET /healthz``,
  5 launches, median (target < 2 s);
- latency: 1 connection, 20 s, median and p99 of ``POST /v1/estimate`` (target median < 20 ms);
- load: 50 connections over 2 wrk threads for 60 s, the four job bodies below in turn, warm-up
  included (target >= 200 requests/s, 0 errors, no memory growth: resident memory over the last
  10 s within 5% of the 10 s after warm-up).

Run: ``python benchmarks/serve_bench.py [--quick]`` (writes ``benchmarks/results/serve_bench.json``);
``--quick`` shortens every phase to a smoke test and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "serve_bench.json"

BODIES = [
    {"model": "llama-3.1-8b", "gpus": 8, "tp": 2, "gpu": "h100-80gb"},
    {"model": "llama-3.1-70b", "gpus": 64, "tp": 8, "pp": 4, "sequence_parallel": True, "distributed_optimizer": True,
     "recompute": "selective", "seq": 8192, "gbs": 512},
    {"model": "mixtral-8x7b", "gpus": 16, "ep": 8, "framework": "torchtitan", "fsdp": "full"},
    {"model": "llama-3.2-1b", "framework": "hf", "peft": "lora", "quantize_base": "nf4", "gpu": "rtx-4090"},
]
TARGETS = {"startup_s": 2.0, "median_latency_ms": 20.0, "requests_per_s": 200.0, "memory_growth": 0.05}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "memplan", "serve", "--port", str(port), "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _ready(port: int, proc: subprocess.Popen[bytes], limit: float = 30.0) -> float:
    """Seconds from now until GET /healthz answers 200 (plain sockets: no client library start-up)."""
    start = time.perf_counter()
    request = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode()
    while time.perf_counter() - start < limit:
        if proc.poll() is not None:
            raise RuntimeError(f"memplan serve exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(request)
                if sock.recv(64).startswith(b"HTTP/1.1 200"):
                    return time.perf_counter() - start
        except OSError:
            time.sleep(0.005)
    raise RuntimeError("memplan serve did not answer")


def startup(runs: int) -> dict[str, Any]:
    times = []
    for _ in range(runs):
        port = _free_port()
        launched = time.perf_counter()
        proc = _launch(port)
        try:
            _ready(port, proc)
            times.append(time.perf_counter() - launched)
        finally:
            proc.terminate()
            proc.wait(10)
    return {"runs": runs, "seconds": times, "median_s": statistics.median(times)}


_LUA = """
local bodies = {%s}
local i = 0
request = function()
  i = i + 1
  return wrk.format("POST", "/v1/estimate", {["Content-Type"] = "application/json"}, bodies[(i %% #bodies) + 1])
end
"""


def _wrk(port: int, connections: int, threads: int, seconds: int, script: Path) -> dict[str, Any]:
    out = subprocess.run(["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--latency", "--timeout", "10s",
                          "-s", str(script), f"http://127.0.0.1:{port}"], capture_output=True, text=True, check=True)
    text = out.stdout

    def ms(label: str) -> float:
        match = re.search(rf"^\s*{label}\s+([\d.]+)(us|ms|s)\s*$", text, re.MULTILINE)
        assert match, text
        value, unit = float(match.group(1)), match.group(2)
        return value * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]

    requests = int(re.search(r"(\d+) requests in", text).group(1))  # type: ignore[union-attr]
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    socket_errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    return {"connections": connections, "threads": threads, "seconds": seconds, "requests": requests,
            "requests_per_s": float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1)),  # type: ignore[union-attr]
            "median_ms": ms("50%"), "p90_ms": ms("90%"), "p99_ms": ms("99%"),
            "non_2xx": int(non_2xx.group(1)) if non_2xx else 0,
            "socket_errors": sum(map(int, socket_errors.groups())) if socket_errors else 0,
            "wrk_output": text}


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _check_bodies(port: int) -> None:
    """Each body is answered 200 before timing starts (a benchmark of 4xx answers measures nothing)."""
    import urllib.request

    for body in BODIES:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/estimate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
            json.loads(response.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test: short phases, not the targets' setting")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is needed (apt-get install wrk)")
    latency_s, load_s, startups = (3, 6, 2) if args.quick else (20, 60, 5)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "smoke_test": args.quick,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "load_average_at_start": os.getloadavg()},
        "targets": TARGETS, "bodies": BODIES,
    }
    result["startup"] = startup(startups)
    port = _free_port()
    proc = _launch(port)
    try:
        _ready(port, proc)
        _check_bodies(port)
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "bodies.lua"
            script.write_text(_LUA % ", ".join(json.dumps(json.dumps(b)) for b in BODIES))
            result["latency"] = _wrk(port, 1, 1, latency_s, script)
            samples: list[tuple[float, int]] = []
            done = threading.Event()

            def sample() -> None:
                start = time.perf_counter()
                while not done.wait(1.0):
                    samples.append((time.perf_counter() - start, _rss_kib(proc.pid)))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            result["load"] = _wrk(port, 50, 2, load_s, script)
            done.set()
            sampler.join()
        window = max(1, min(10, len(samples) // 3))
        early = statistics.mean(kib for _, kib in samples[:window])
        late = statistics.mean(kib for _, kib in samples[-window:])
        result["memory"] = {"rss_kib_samples": samples, "early_mean_kib": early, "late_mean_kib": late,
                            "growth": (late - early) / early}
    finally:
        proc.terminate()
        proc.wait(10)
    result["machine"]["load_average_at_end"] = os.getloadavg()
    load, latency = result["load"], result["latency"]
    result["met"] = {
        "startup": result["startup"]["median_s"] < TARGETS["startup_s"],
        "median_latency": latency["median_ms"] < TARGETS["median_latency_ms"],
        "throughput": load["requests_per_s"] >= TARGETS["requests_per_s"],
        "no_errors": load["non_2xx"] == 0 and load["socket_errors"] == 0,
        "no_memory_growth": result["memory"]["growth"] <= TARGETS["memory_growth"],
    }
    out = RESULTS.with_name("serve_bench_quick.json") if args.quick else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'SMOKE TEST (not the targets setting) ' if args.quick else ''}start-up median "
          f"{result['startup']['median_s']:.2f} s; latency median {latency['median_ms']:.2f} ms p99 "
          f"{latency['p99_ms']:.2f} ms; load {load['requests_per_s']:.0f} req/s, median {load['median_ms']:.1f} ms, "
          f"non-2xx {load['non_2xx']}, socket errors {load['socket_errors']}; RSS {result['memory']['early_mean_kib']:.0f}"
          f" → {result['memory']['late_mean_kib']:.0f} KiB ({100 * result['memory']['growth']:+.1f}%); met: "
          f"{result['met']}")


if __name__ == "__main__":
    main()
