"""memplan doctor: the real OOM corpus, the real snapshots, synthetic leak/spike/fragmentation traces, bad input."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.doctor import diagnose, parse_oom_message
from memplan.errors import ConfigError
from memplan.events import AllocEvent, Trace
from memplan.inputs import JobRequest, load_job
from memplan.units import GiB, MiB

ROOT = Path(__file__).resolve().parents[2]
CORPUS = json.loads((ROOT / "tests/data/oom_messages/corpus.json").read_text())["cases"]
SNAPSHOTS = ROOT.parent / "shared" / "reference" / "snapshots"
if not SNAPSHOTS.is_dir():
    SNAPSHOTS = ROOT.parents[1] / "shared" / "reference" / "snapshots"


@pytest.mark.parametrize("case", CORPUS, ids=[c["id"] for c in CORPUS])
def test_corpus_verdict(case: dict) -> None:
    job = None
    if case["job"]:
        flags = case["job"]["flags"]
        job = load_job(JobRequest(model=str(ROOT / case["job"]["model"]), flags=flags, gpu=case["gpu"]))
    report = diagnose(case["message"], job=job, gpu=case["gpu"])
    assert report.verdict == case["label"]
    if case["label"] == "demand" and job is not None:
        fitting = [f for f in report.fixes if f.verified and f.kind == "job"]
        assert fitting and fitting[0].peak_bytes <= fitting[0].limit_bytes
    doc = json.loads(json.dumps(report.to_json()))
    assert doc["verdict"] == case["label"] and doc["evidence"]


def test_message_figures_both_layouts() -> None:
    old = parse_oom_message(CORPUS[1]["message"])
    assert old.layout == "torch<=2.0" and old.reserved.bytes == round(1.01 * GiB)
    new = parse_oom_message(CORPUS[9]["message"])
    assert new.layout == "torch>=2.1" and new.process_in_use is not None
    assert new.requested.bytes == 22 * MiB and new.unallocated.text == "194.87 MiB"


def _trace(events: list[tuple[str, int, int, str, int]]) -> Trace:
    return Trace(events=tuple(AllocEvent(i, k, b, s, c, "forward", it) for i, (k, b, s, c, it) in enumerate(events)))


def test_synthetic_leak_names_the_growing_site() -> None:
    rows, block = [], 0
    for it in range(5):
        for _ in range(4):
            rows += [("alloc", block, 64 * MiB, "activation", it), ("free", block, 64 * MiB, "activation", it)]
            block += 1
        rows.append(("alloc", block, 8 * MiB, "temporary", it))  # kept forever: the leak
        block += 1
    events = [AllocEvent(i, k, b, s, c, "forward", it, op="aten.mul", module="loss_history" if s == 8 * MiB else "")
              for i, (k, b, s, c, it) in enumerate(rows)]
    trace = Trace(events=tuple(events))
    report = diagnose(trace=trace)
    leak = next(f for f in report.findings if f.verdict == "leak")
    assert report.verdict == "leak" and leak.magnitude_bytes == 8 * MiB
    assert leak.sites[0][0] == "loss_history aten.mul"
    # At a capacity the leak outgrows, the fix (free what the site keeps) is verified by a replay.
    report = diagnose(trace=trace, capacity_bytes=100 * MiB)
    fix = next(f for f in report.fixes if f.kind == "code")
    assert report.verdict == "leak" and fix.verified and fix.verified_by == "simulation"
    assert "loss_history" in fix.action


def test_synthetic_spike() -> None:
    rows = [("alloc", 1, 4 * GiB, "parameter", 0), ("alloc", 2, 3 * GiB, "workspace", 0),
            ("free", 2, 3 * GiB, "workspace", 0)]
    report = diagnose(trace=_trace(rows))
    assert report.verdict == "spike" and report.findings[0].magnitude_bytes == 3 * GiB


def test_synthetic_fragmentation_fixed_by_a_replayed_setting() -> None:
    # A cached 1 GiB block is split by a 100 MiB request; the next 1 GiB request finds no block.
    rows = [("alloc", 0, GiB, "activation", 0), ("free", 0, GiB, "activation", 0),
            ("alloc", 1, 100 * MiB, "activation", 0), ("alloc", 2, GiB, "temporary", 0)]
    trace = _trace(rows)
    report = diagnose(trace=trace, capacity_bytes=1536 * MiB)
    assert report.verdict == "fragmentation"
    verified = [f for f in report.fixes if f.verified]
    assert verified and verified[0].kind == "allocator" and verified[0].verified_by == "simulation"
    assert verified[0].setting.startswith("PYTORCH_CUDA_ALLOC_CONF=")


@pytest.mark.skipif(not SNAPSHOTS.is_dir(), reason="../shared reference snapshots not present")
@pytest.mark.parametrize("name,label", [("01_", "fits"), ("02_", "fits"), ("03_", "fits"), ("04_", "fits"),
                                        ("10_", "demand")])
def test_real_snapshots(name: str, label: str) -> None:
    path = next(SNAPSHOTS.glob(f"{name}*.pickle"))
    report = diagnose(snapshot=path)
    assert report.verdict == label


@pytest.mark.skipif(not SNAPSHOTS.is_dir(), reason="../shared reference snapshots not present")
@pytest.mark.parametrize("name", ["01_", "02_", "03_", "04_"])
def test_real_snapshot_squeezed_is_fragmentation_with_a_replayed_fix(name: str) -> None:
    """Each real run at a capacity between its simulated peak allocated and peak reserved memory."""
    from memplan.alloc.simulator import simulate
    from memplan.doctor.inputs import read_snapshot

    path = next(SNAPSHOTS.glob(f"{name}*.pickle"))
    full = simulate(read_snapshot(path).trace)
    capacity = (full.peak_reserved_bytes + full.peak_allocated_bytes) // 2
    report = diagnose(snapshot=path, capacity_bytes=capacity)
    assert report.verdict == "fragmentation"
    best = report.fixes[0]
    assert best.verified and best.kind == "allocator" and best.verified_by == "simulation"
    assert best.peak_bytes <= capacity


runner = CliRunner()


def test_cli_message_on_stdin_json() -> None:
    result = runner.invoke(app, ["doctor", "-", "--json"], input=CORPUS[0]["message"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["verdict"] == "fragmentation"
    fix = doc["fixes"][0]
    assert {"action", "setting", "saves_bytes", "verified", "verified_by"} <= set(fix)


@pytest.mark.parametrize("text", [
    "RuntimeError: something went wrong",  # no figures
    ("CUDA out of memory. Tried to allocate 2.00 GB. GPU 0 has a total capacity of 79.15 GiB of which 1.23 GiB "
    "is free. Of the allocated memory 66.12 GiB is allocated by PyTorch, and 9.82 GiB is reserved by PyTorch "
    "but unallocated."),  # mixed units
])
def test_bad_message_is_one_line_exit_2(text: str) -> None:
    result = runner.invoke(app, ["doctor", "-"], input=text)
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and "OOM message" in result.output


def test_truncated_and_hostile_pickles_exit_2(tmp_path: Path) -> None:
    good = pickle.dumps({"segments": [], "device_traces": [[]]}, protocol=4)
    truncated = tmp_path / "cut.pickle"
    truncated.write_bytes(good[: len(good) // 2])
    hostile = tmp_path / "evil.pickle"
    hostile.write_bytes(b"\x80\x04cos\nsystem\n(S'echo hi'\ntR.")
    for path in (truncated, hostile):
        result = runner.invoke(app, ["doctor", str(path)])
        assert result.exit_code == 2, result.output
        assert len(result.output.strip().splitlines()) == 1 and "snapshot file" in result.output
    with pytest.raises(ConfigError):
        diagnose(snapshot=hostile)


def _snapshot_with_oom() -> dict:
    """A freed 1 GiB block split by a 100 MiB request; then 1 GiB fails with 400 MiB free on the device."""
    return json.loads((ROOT / "tests/data/oom_snapshot.json").read_text())["snapshot"]


def test_snapshot_dict_ending_in_an_oom_is_fragmentation_with_a_replayed_fix() -> None:
    report = diagnose(snapshot=_snapshot_with_oom())  # what memplan.watch passes: torch's dict
    assert report.verdict == "fragmentation"
    assert report.capacity_bytes == GiB + 400 * MiB and "snapshot" in report.capacity_source
    largest = {e.name: e.value for e in report.findings[0].evidence}["largest_free_block_bytes"]
    assert largest == 924 * MiB
    verified = [f for f in report.fixes if f.verified]
    assert verified and verified[0].setting.startswith("PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:")
    assert verified[0].verified_by == "simulation"


def test_cli_log_file_with_job_flags(tmp_path: Path) -> None:
    case = next(c for c in CORPUS if c["id"] == "alpaca-189")
    log = tmp_path / "train.log"
    log.write_text("Traceback (most recent call last):\n  ...\n" + case["message"] + "\n")
    args = ["doctor", str(log), "--model", str(ROOT / case["job"]["model"]), "--gpu", "a100-80gb", "--json"]
    for flag, value in case["job"]["flags"].items():
        args += [f"--{flag.replace('_', '-')}", str(value)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["verdict"] == "demand" and doc["inputs"] == ["message", "job"]
    assert any(f["verified"] and f["verified_by"] == "estimate" for f in doc["fixes"])
    assert "unmodelled_settings" in doc


@pytest.mark.parametrize("name", ["step.mptrace", "step.jsonl.gz"])  # the binary and the JSON-lines encodings
def test_cli_trace_file_and_two_messages(tmp_path: Path, name: str) -> None:
    from memplan.events import write_trace

    rows = [("alloc", 1, 4 * GiB, "parameter", 0), ("alloc", 2, 3 * GiB, "workspace", 0),
            ("free", 2, 3 * GiB, "workspace", 0)]
    path = tmp_path / name
    write_trace(_trace(rows), path)
    result = runner.invoke(app, ["doctor", str(path), "--capacity", "6GiB", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)  # 7 GiB live at the peak on 6 GiB, 3 GiB of it one workspace
    assert doc["verdict"] == "demand" and [f["verdict"] for f in doc["findings"]][:2] == ["demand", "spike"]
    assert doc["findings"][0]["evidence"][0]["name"] == "peak_live_bytes"  # the lower bound, then the replay
    assert doc["fixes"] == [] and "no allocator setting" in " ".join(doc["notes"])
    first, second = tmp_path / "a.log", tmp_path / "b.log"
    first.write_text(CORPUS[0]["message"])
    second.write_text(CORPUS[1]["message"])
    result = runner.invoke(app, ["doctor", str(first), str(second)])
    assert result.exit_code == 2 and "INPUT" in result.output


def test_report_text_and_public_names() -> None:
    from memplan import doctor

    assert [n for n in doctor.__all__ if not hasattr(doctor, n)] == []
    text = diagnose(CORPUS[0]["message"]).to_text()
    assert text.startswith("memplan doctor: fragmentation") and "PYTORCH_CUDA_ALLOC_CONF=" in text


@pytest.mark.parametrize("text,field,value", [
    (("CUDA out of memory. Tried to allocate 94.00 MiB. GPU 0 has a total capacity of 8.00 GiB of which 4.03 GiB "
     "is free. 2.94 GiB allowed; Of the allocated memory 2.81 GiB is allocated by PyTorch, and 20.00 MiB is "
     "reserved by PyTorch but unallocated."), "allowed", round(2.94 * GiB)),
    (("HIP out of memory. Tried to allocate 704.00 GiB. GPU 0 has a total capacity of 191.69 GiB of which 186.02 "
     "GiB is free. Of the allocated memory 4.89 GiB is allocated by PyTorch, and 2.25 MiB is reserved by "
     "PyTorch but unallocated."), "backend", "HIP"),
    (("CUDA out of memory. Tried to allocate 48.00 MiB. GPU 0 has a total capacity of 22.04 GiB of which 11.78 "
     "GiB is free. This process has 10.25 GiB memory in use. 10.00 GiB allowed; Of the allocated memory 9.90 GiB "
     "is allocated by PyTorch, and 100.00 MiB is reserved by PyTorch but unallocated."), "process_in_use",
     round(10.25 * GiB)),
    (("CUDA out of memory. Tried to allocate 14.00 MiB. GPU 0 has a total capacity of 22.30 GiB of which 4.69 MiB "
     "is free. Process 860120 has 22.29 GiB memory in use. Of the allocated memory 21.92 GiB is allocated by "
     "PyTorch, with 22.00 MiB allocated in private pools (e.g., CUDA Graphs), and 16.47 MiB is reserved by "
     "PyTorch but unallocated."), "private_pools", 22 * MiB),
    (("RuntimeError: CUDA out of memory. Tried to allocate 12.50 MiB (GPU 0; 10.92 GiB total capacity; 8.57 MiB "
     "already allocated; 9.28 GiB free; 4.68 MiB cached)"), "reserved", round(4.68 * MiB)),
])
def test_message_variants(text: str, field: str, value: object) -> None:
    m = parse_oom_message(text)
    got = getattr(m, field)
    assert (got.bytes if hasattr(got, "bytes") else got) == value


def test_message_in_a_log_wrapped_and_repeated() -> None:
    log = ("epoch 1\nCUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 23.65 GiB of "
           "which 0 bytes is free. Of the allocated memory 20.00 GiB is allocated by PyTorch, and 1.00 GiB is "
           "reserved by PyTorch but unallocated.\nretrying\n"
           "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity\n"
           "of 23.65 GiB of which 10.00 MiB is free. Of the allocated memory 21.00 GiB is allocated by PyTorch,\n"
           "and 500.00 MiB is reserved by PyTorch but unallocated.\nTraceback (most recent call last):\n  80GB\n")
    m = parse_oom_message(log)
    assert m.requested.bytes == 2 * GiB and m.free.bytes == 10 * MiB and m.unallocated.bytes == 500 * MiB


def test_cli_usage_errors_exit_2(tmp_path: Path) -> None:
    assert runner.invoke(app, ["doctor"]).exit_code == 2
    assert runner.invoke(app, ["doctor", str(tmp_path / "missing.log")]).exit_code == 2
    result = runner.invoke(app, ["doctor", "-", "--capacity", "lots"], input=CORPUS[0]["message"])
    assert result.exit_code == 2 and "--capacity" in result.output
    cut = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has"
    result = runner.invoke(app, ["doctor", "-"], input=cut)
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1


def test_snapshot_leak_found_by_optimizer_steps_and_frames() -> None:
    """Iterations come from torch's Optimizer.step annotations, sites from each alloc's first user frame."""
    base, entries, notes, t = 0x7F0000000000, [], [], 1000
    user = [{"filename": "/opt/torch/lib/python3.11/site-packages/torch/nn/modules/module.py", "name": "_call_impl",
             "line": 1}, {"filename": "/home/me/train.py", "name": "train_step", "line": 42}]
    for step in range(5):
        for k in range(3):  # activations freed within the step
            address = base + (step * 8 + k) * 64 * MiB
            entries.append({"action": "alloc", "addr": address, "size": 32 * MiB, "stream": 0, "time_us": t})
            entries.append({"action": "free_completed", "addr": address, "size": 32 * MiB, "stream": 0,
                            "time_us": t + 1})
            t += 10
        leaked = base + (step * 8 + 7) * 64 * MiB  # kept forever by train.py:42
        entries.append({"action": "alloc", "addr": leaked, "size": 4 * MiB, "stream": 0, "time_us": t,
                        "frames": user})
        t += 10
        notes.append({"stage": "END", "name": "Optimizer.step#AdamW.step", "device": 0, "time_us": t})
        t += 10
    raw = {"segments": [], "device_traces": [entries], "external_annotations": notes}
    report = diagnose(snapshot=raw)
    leak = report.findings[0]
    assert report.verdict == "leak" and leak.magnitude_bytes == 4 * MiB
    assert leak.sites[0][0] == "train.py:42 in train_step"


def test_message_with_rank_prefixes_on_every_line() -> None:
    log = ("[rank1]: Traceback (most recent call last):\n"
           "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.96 GiB. GPU 1 has a total\n"
           "[rank1]: capacity of 79.10 GiB of which 1.38 GiB is free. Including non-PyTorch memory, this process has\n"
           "[rank1]: 77.71 GiB memory in use. Of the allocated memory 74.20 GiB is allocated by PyTorch, and 2.98\n"
           "[rank1]: GiB is reserved by PyTorch but unallocated.\n")
    m = parse_oom_message(log)
    assert m.device == 1 and m.unallocated.text == "2.98 GiB" and m.process_in_use is not None


def test_other_out_of_memory_errors_say_what_they_are() -> None:
    result = runner.invoke(app, ["doctor", "-"], input="RuntimeError: CUDA error: out of memory\nCUDA kernel errors")
    assert result.exit_code == 2 and "driver" in result.output
    mps = "RuntimeError: MPS backend out of memory (MPS allocated: 6.79 GB, max allowed: 18.13 GB)."
    result = runner.invoke(app, ["doctor", "-"], input=mps)
    assert result.exit_code == 1 and "MPS" in result.output


def test_decimal_units_after_the_message_are_not_its_figures() -> None:
    log = ("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.56 GiB already "
           "allocated; 3.19 MiB free; 14.70 GiB reserved in total by PyTorch)\nloading the 7B model on an A100 80GB\n")
    assert parse_oom_message(log).reserved.text == "14.70 GiB"


def test_message_and_a_snapshot_without_its_oom_entry() -> None:
    """The message says what failed: its request is replayed at the end of the snapshot's trace."""
    raw = _snapshot_with_oom()
    raw["device_traces"][0].pop()  # no oom entry recorded
    message = ("CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 1.50 GiB of which "
               "400.00 MiB is free. Of the allocated memory 100.00 MiB is allocated by PyTorch, and 924.00 MiB is "
               "reserved by PyTorch but unallocated.")
    report = diagnose(message, snapshot=raw)
    assert report.verdict == "fragmentation" and report.inputs == ("message", "snapshot")
    assert any(f.verified and f.verified_by == "simulation" for f in report.fixes)


def test_doctor_needs_neither_torch_nor_numpy() -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['numpy'] = None; sys.modules['torch'] = None\n"
            "from memplan.doctor import diagnose\n"
            f"print(diagnose({CORPUS[0]['message']!r}).verdict)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.stdout.strip() == "fragmentation"


def test_job_alone_fits_or_gets_job_fixes() -> None:
    small = load_job(JobRequest(model="gpt2", flags={"gpus": 1, "framework": "hf", "seq": 512}))
    assert diagnose(job=small, gpu="h100-80gb").verdict == "fits"
    big = load_job(JobRequest(model="llama-3.1-8b", flags={"gpus": 1, "framework": "hf", "seq": 2048}))
    report = diagnose(job=big, gpu="rtx-4090")
    assert report.verdict == "demand" and report.fixes[0].verified and report.fixes[0].kind == "job"


def test_combined_fixes_keep_the_training_before_lora() -> None:
    """No single change fits llama-3.1-8b at mbs 4 x seq 8192 on 8 x 80 GB: a pair that keeps the training (a
    sharding with a smaller micro-batch or full recompute) is found and ranked before any LoRA pair."""
    from memplan.doctor.job_fixes import COMBINED_AT_MOST

    job = load_job(JobRequest(model="llama-3.1-8b", flags={"gpus": 8, "seq": 8192, "mbs": 4}))
    report = diagnose(job=job, gpu="h100-80gb")
    assert report.verdict == "demand"
    assert not any(f.verified for f in report.fixes if "+" not in f.action)  # no single change fits
    first = report.fixes[0]
    assert first.verified and not first.changes_training and first.action.count("+") == 1
    assert "FSDP full sharding" in first.action or "ZeRO stage 3" in first.action
    combined = [f for f in report.fixes if "+" in f.action]
    assert all(f.verified for f in combined) and all(f.action.count("+") < COMBINED_AT_MOST for f in combined)
    assert len({f.config_key for f in combined}) == len(combined)  # one per set of settings
    assert not any("zero" in f.config_key and "fsdp" in f.config_key for f in combined)
    for f in combined:  # one change per setting: no flag given twice
        flags = [w for w in f.setting.split() if w.startswith("--")]
        assert len(flags) == len(set(flags)), f.setting


@pytest.mark.parametrize(("framework", "needs"), [("megatron", "--distributed-optimizer"), ("deepspeed", "--zero 1"),
                                                  ("hf", "--fsdp full")])
def test_optimizer_offload_comes_with_the_sharding_it_needs(framework: str, needs: str) -> None:
    """Full training of llama-3.1-8b on one 80 GB GPU: optimizer offload fits, with the sharding each framework's
    offload needs (a job without one is refused), and ranks before LoRA, which changes what trains."""
    job = load_job(JobRequest(model="llama-3.1-8b", flags={"gpus": 1, "framework": framework}))
    first = diagnose(job=job, gpu="h100-80gb").fixes[0]
    assert first.verified and not first.changes_training
    assert "--offload-optimizer" in first.setting and needs in first.setting


def test_no_optimizer_offload_where_torchtitan_cannot_shard() -> None:
    """torchtitan wraps FSDP2 only over two or more shard ranks (memplan.profiles.unwrapped_fsdp), so at one GPU its
    CPU offload cannot run: the doctor does not offer it (session 18; it offered --fsdp full --offload-optimizer)."""
    job = load_job(JobRequest(model="llama-3.1-8b", flags={"gpus": 1, "framework": "torchtitan"}))
    assert not any("--offload" in f.setting for f in diagnose(job=job, gpu="h100-80gb").fixes)


def test_the_distributed_optimizer_is_a_fix_where_megatron_runs_it() -> None:
    """Megatron's own ZeRO-1 is tried for a Megatron job; under DeepSpeed the flag is refused, so not offered."""
    for framework, offered in (("megatron", True), ("deepspeed", False)):
        job = load_job(JobRequest(model="llama-3.1-8b", flags={"gpus": 8, "framework": framework}))
        fixes = diagnose(job=job, gpu="h100-80gb").fixes
        assert any(f.setting == "--distributed-optimizer" for f in fixes) is offered, framework


def test_timeline_keeps_every_peak_and_marks_the_oom() -> None:
    """At most TIMELINE_POINTS points, each the most live in its stretch: the trace's peak is a point."""
    from memplan.doctor.trace_facts import TIMELINE_POINTS

    rows = []
    for i in range(3000):  # a 1 GiB spike inside one stretch, on a sawtooth
        rows += [("alloc", 2 * i, (1 + i % 7) * MiB, "activation", i // 1000),
                 ("free", 2 * i, (1 + i % 7) * MiB, "activation", i // 1000)]
    rows.insert(3001, ("alloc", 10**6, GiB, "temporary", 1))
    rows.insert(3002, ("free", 10**6, GiB, "temporary", 1))
    doc = diagnose(trace=_trace(rows), capacity_bytes=512 * MiB).to_json()
    points = doc["timeline"]["points"]
    assert len(points) <= TIMELINE_POINTS + 1 and points[-1][0] == len(rows) - 1
    # the spike lands on block 1500's 3 MiB (1 + 1500 % 7): the peak, and the largest point
    assert max(p[1] for p in points) == doc["timeline"]["peak_live_bytes"] == GiB + 3 * MiB
    assert doc["timeline"]["oom_index"] is not None and doc["timeline"]["oom_index"] <= 3002
    assert diagnose(CORPUS[0]["message"]).to_json()["timeline"] is None  # a message has no events


@pytest.mark.parametrize(("framework", "dialect"), [("megatron", "Megatron-LM arguments"), ("deepspeed", "DeepSpeed config"),
                                                    ("hf", "TrainingArguments"), ("torchtitan", "torchtitan TOML")])
def test_every_job_fix_is_said_in_the_framework_s_own_settings(framework: str, dialect: str) -> None:
    """Each job fix carries its framework's settings (memplan.frameworks.native_fix), in the JSON and the text."""
    job = load_job(JobRequest(model="llama-3.1-8b", flags={"gpus": 8, "seq": 8192, "mbs": 4, "framework": framework}))
    report = diagnose(job=job, gpu="h100-80gb")
    fixes = [f for f in report.fixes if f.kind == "job"]
    assert fixes and all(f.native is not None and f.native["dialect"] == dialect for f in fixes)
    assert all(f.native["text"] or f.native["notes"] for f in fixes)
    assert report.to_json()["fixes"][0]["native"] == fixes[0].native
    assert f"{dialect}: " in report.to_text()


def test_megatron_fsdp_and_zero_3_are_one_run_offered_once() -> None:
    """Megatron-LM runs FSDP as Megatron-FSDP's optim_grads_params, which its arguments read back as ZeRO stage 3:
    the doctor offers that run once, priced as it reads back."""
    job = load_job(JobRequest(model="llama-3.1-8b", flags={"gpus": 8, "seq": 8192, "mbs": 4, "framework": "megatron"}))
    fixes = diagnose(job=job, gpu="h100-80gb").fixes
    assert not any("--fsdp" in f.setting for f in fixes)
    assert any("--zero 3" in f.setting and "optim_grads_params" in f.native["text"] for f in fixes)


def test_hf_zero_is_priced_as_the_trainer_runs_it() -> None:
    """A Hugging Face job's ZeRO fix is its ``--zero N``: DeepSpeed's engine (--deepspeed) under the Trainer, priced by
    the estimator's one rule (memplan.profiles.zero_engine: the engine's states and buffers, the HF model's code); FSDP's
    CPU offload moves the parameters with the optimizer states."""
    job = load_job(JobRequest(model="llama-3.1-8b", flags={"gpus": 8, "seq": 8192, "mbs": 4, "framework": "hf"}))
    fixes = diagnose(job=job, gpu="h100-80gb").fixes
    zero = [f for f in fixes if "--zero" in f.setting]
    assert zero and all(f.setting.startswith("--zero") and "--deepspeed" in f.native["text"] for f in zero)
    offload = [f for f in fixes if "--offload-optimizer" in f.setting and "--fsdp" in f.setting]
    assert all("--offload-params" in f.setting and "offload" in f.native["text"] for f in offload)
