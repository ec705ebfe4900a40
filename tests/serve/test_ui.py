"""The web page of ``memplan serve`` in a real headless Chromium, against the real app on a socket.

Every number the page shows is compared with the API's answer for the same job (fetched here with
httpx), so the page cannot show numbers of its own. The page must load nothing from any other origin.
Skipped with the reason when Chromium, Playwright or the ``serve`` extra is missing.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (the page is tested in a real browser)")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (requirements-test.txt)")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-test.txt)")
uvicorn = pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install 'memplan[serve]')")

GiB = 2**30
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
#: The first line of a PyTorch 2.x OOM error (the figures of tests/doctor's fragmentation case).
OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 "
       "GiB of which 1.23 GiB is free. Including non-PyTorch memory, this process has 77.90 GiB memory in use. Of the "
       "allocated memory 60.12 GiB is allocated by PyTorch, and 16.20 GiB is reserved by PyTorch but unallocated.")
#: A small Llama-shaped config.json, pasted as text.
CONFIG = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
          "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048}
BASE = {"model": "llama-3.1-8b", "gpu": "h100-80gb", "gpus": 8}


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The real application (``create_app()``) served by uvicorn from a thread, on a free port."""
    from memplan.serve import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning",
                                        lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as play:
        chromium = play.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any, server: str) -> Iterator[Any]:
    """A fresh page that records every request it makes and every script error it raises."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = context.new_page()
    tab.set_default_timeout(15_000)
    tab.requests, tab.errors = [], []
    tab.on("request", lambda request: tab.requests.append(request.url))
    tab.on("pageerror", lambda error: tab.errors.append(str(error)))
    yield tab
    context.close()
    assert tab.errors == [], "the page raised script errors"


def api(server: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    return httpx.post(server + path, json=body, timeout=30).json()


def open_page(page: Any, server: str, query: str = "") -> None:
    page.goto(server + "/" + query)
    page.wait_for_selector("body[data-ready=true]", state="attached")


def settled(page: Any, **fields: Any) -> dict[str, Any]:
    """Wait for the estimate of a job holding ``fields``; the request the page sent."""
    page.wait_for_function("""want => {
        const out = document.querySelector('#estimate-out');
        if (!['done', 'error'].includes(out.dataset.state)) return false;
        const sent = JSON.parse(out.dataset.request || '{}');
        return Object.entries(want).every(([k, v]) => JSON.stringify(sent[k]) === JSON.stringify(v));
    }""", arg=fields)
    return json.loads(page.get_attribute("#estimate-out", "data-request"))


def shown(page: Any) -> dict[str, Any]:
    """The figures as the page shows them: bytes (data-bytes) and text."""
    out: dict[str, Any] = {}
    for name in ("peak-allocated", "peak-reserved", "gpu-usable", "headroom"):
        out[name] = (int(page.get_attribute(f"#{name}", "data-bytes")), page.inner_text(f"#{name}"))
    out["fits"] = page.get_attribute("#verdict", "data-fits")
    out["stages"] = page.locator("#breakdown thead th").count() - 1
    out["bars"] = page.locator("#chart svg g.bar").count()
    return out


def expected(doc: dict[str, Any]) -> dict[str, Any]:
    gpu = doc["gpu"]
    figures = {"peak-allocated": doc["peak_allocated_bytes"], "peak-reserved": doc["peak_reserved_bytes"],
               "gpu-usable": gpu["usable_bytes"], "headroom": gpu["headroom_bytes"]}
    out: dict[str, Any] = {k: (v, f"{v / GiB:.2f} GiB") for k, v in figures.items()}
    out.update(fits=str(gpu["fits"]).lower(), stages=len(doc["stages"]), bars=len(doc["stages"]))
    return out


def test_numbers_follow_the_knobs_and_equal_the_api(page: Any, server: str) -> None:
    open_page(page, server, "?model=gpt2&gpu=h100-80gb&gpus=8")
    settled(page, model="gpt2")
    page.select_option("#f-preset", "llama-3.1-8b")
    sent = settled(page, model="llama-3.1-8b")
    assert sent == BASE
    before = shown(page)
    assert before == expected(api(server, "/v1/estimate", BASE))

    page.fill("#f-tp", "2")
    settled(page, tp=2)
    page.fill("#f-mbs", "2")
    sent = settled(page, tp=2, mbs=2)
    job = {**BASE, "tp": 2, "mbs": 2}
    assert sent == job
    after = shown(page)
    doc = api(server, "/v1/estimate", job)
    assert after == expected(doc) and after["peak-allocated"] != before["peak-allocated"]
    for stage in doc["stages"]:  # the breakdown table: every category of every stage, in GiB
        column = page.locator(f"#breakdown tbody tr td:nth-child({stage['stage'] + 2})").all_text_contents()
        cells = [f"{v / GiB:.2f}" if v else "—" for v in stage["by_category"].values()]
        totals = [f"{stage[k] / GiB:.2f}" for k in ("peak_allocated_bytes", "peak_reserved_bytes")]
        assert column == [str(stage["layers"]) if not stage["layer_indices"] else
                          f"{stage['layer_indices'][0]}-{stage['layer_indices'][-1]}",
                          str(stage["inflight_microbatches"]), stage["peak_phase"], *cells, *totals]
    query = parse_qs(urlsplit(page.url).query)
    assert query["tp"] == ["2"] and query["mbs"] == ["2"] and query["model"] == ["llama-3.1-8b"]


def test_typing_is_debounced(page: Any, server: str) -> None:
    open_page(page, server, "?model=llama-3.1-8b&gpu=h100-80gb&gpus=8")
    settled(page, gpus=8)
    before = sum(url.endswith("/v1/estimate") for url in page.requests)
    page.locator("#f-seq").press_sequentially("8192")  # four input events, well inside 150 ms of each other
    settled(page, seq=8192)
    sent = sum(url.endswith("/v1/estimate") for url in page.requests) - before
    assert 1 <= sent < 4


def test_invalid_combination_shows_the_servers_message(page: Any, server: str) -> None:
    open_page(page, server, "?model=llama-3.1-8b&gpu=h100-80gb&gpus=8")
    settled(page, gpus=8)
    page.fill("#f-tp", "3")
    settled(page, tp=3)
    error = api(server, "/v1/estimate", {**BASE, "tp": 3})["error"]
    assert error["status"] == 400 and error["field"] == "gpus"
    assert page.is_visible("#estimate-error")
    assert error["message"] in page.inner_text("#estimate-error")
    assert page.get_attribute("#f-gpus", "aria-invalid") == "true"  # the field the server named
    page.fill("#f-tp", "4")
    settled(page, tp=4)
    assert page.is_hidden("#estimate-error") and page.get_attribute("#f-gpus", "aria-invalid") is None
    assert shown(page) == expected(api(server, "/v1/estimate", {**BASE, "tp": 4}))


def test_the_url_reproduces_the_view(page: Any, server: str) -> None:
    open_page(page, server)
    settled(page)
    page.select_option("#f-preset", "qwen2.5-7b")
    page.fill("#f-pp", "2")
    page.select_option("#f-recompute", "full")
    job = settled(page, model="qwen2.5-7b", pp=2, recompute="full")
    view = shown(page)
    assert view["stages"] == 2 == view["bars"]
    page.focus("#tab-estimate")
    page.keyboard.press("ArrowRight")  # the tabs are keyboard-usable
    assert page.get_attribute("#tab-fit", "aria-selected") == "true" and page.is_visible("#panel-fit")
    page.keyboard.press("ArrowRight")
    assert page.get_attribute("#tab-doctor", "aria-selected") == "true"
    link = page.url

    page.reload()
    page.wait_for_selector("body[data-ready=true]", state="attached")
    assert settled(page) == job
    assert shown(page) == view == expected(api(server, "/v1/estimate", job))
    assert page.input_value("#f-preset") == "qwen2.5-7b" and page.input_value("#f-pp") == "2"
    assert page.input_value("#f-recompute") == "full" and page.is_visible("#panel-doctor")
    assert page.url == link


def test_doctor_verdict_from_a_pasted_message(page: Any, server: str) -> None:
    open_page(page, server)
    page.click("#tab-doctor")
    page.fill("#d-message", OOM)
    page.click("#d-run")
    page.wait_for_selector("#panel-doctor[data-state=done]")
    doc = api(server, "/v1/doctor", {"message": OOM})
    assert page.get_attribute("#doctor-verdict", "data-verdict") == doc["verdict"] == "fragmentation"
    assert doc["verdict_text"] in page.inner_text("#doctor-verdict")
    fixes = page.locator("#doctor-fixes > li")
    assert fixes.count() == len(doc["fixes"]) >= 1
    assert fixes.first.locator(".setting").inner_text() == doc["fixes"][0]["setting"]
    assert page.locator("#doctor-out figure.oom svg rect").count() >= 3  # the GPU at the OOM, from the message
    page.reload()  # the message is in the link: the diagnosis comes back
    page.wait_for_selector("#panel-doctor[data-state=done]")
    assert page.get_attribute("#doctor-verdict", "data-verdict") == doc["verdict"]


def test_doctor_job_fixes_say_the_framework_s_own_settings(page: Any, server: str) -> None:
    """With the job on the left checked, each job fix shows its Megatron-LM arguments, as the API gives them."""
    open_page(page, server, "?model=llama-3.1-8b&gpu=h100-80gb&gpus=8&mbs=4&seq=8192&panel=doctor&d_job=1")
    page.fill("#d-message", OOM)
    page.click("#d-run")
    page.wait_for_selector("#panel-doctor[data-state=done]")
    items = page.locator("#doctor-fixes > li")
    natives = page.locator("#doctor-fixes > li .native")
    assert 1 <= natives.count() <= items.count()
    assert "Megatron-LM arguments: --" in natives.first.inner_text()
    assert natives.first.locator(".setting").inner_text().startswith("--")


def test_doctor_verdict_from_a_chosen_trace_file(page: Any, server: str, tmp_path: Any) -> None:
    from memplan.events import AllocEvent, Trace, write_trace

    rows, block = [], 0
    for iteration in range(5):  # 8 MiB kept at the end of every iteration: a leak
        for _ in range(4):
            rows += [("alloc", block, 64 * 2**20, iteration), ("free", block, 64 * 2**20, iteration)]
            block += 1
        rows.append(("alloc", block, 8 * 2**20, iteration))
        block += 1
    path = tmp_path / "leak.memplan-trace.gz"
    write_trace(Trace(events=tuple(AllocEvent(i, kind, b, size, "activation", "forward", it)
                                   for i, (kind, b, size, it) in enumerate(rows))), path)
    open_page(page, server, "?panel=doctor")
    page.set_input_files("#d-file", str(path))
    page.click("#d-run")
    page.wait_for_selector("#panel-doctor[data-state=done]")
    doc = httpx.post(server + "/v1/doctor", files={"file": path.read_bytes()}, timeout=30).json()
    assert page.get_attribute("#doctor-verdict", "data-verdict") == doc["verdict"] == "leak"
    assert page.locator("#doctor-out .finding").count() == len(doc["findings"])
    assert page.locator("#doctor-fixes > li").count() == len(doc["fixes"])
    # The live memory over the run: one line through the timeline's points, and the peak the API found.
    assert len(doc["timeline"]["points"]) == len(rows)
    label = page.get_attribute("#doctor-timeline", "aria-label")
    assert f"peak {doc['timeline']['peak_live_bytes'] / 2**30:.2f} GiB" in label
    assert page.locator("#doctor-timeline line.iteration").count() == 4  # five iterations


def _dataset_files(tmp_path: Any) -> tuple[Any, Any]:
    """A variable-length JSONL dataset and a byte-level BPE tokenizer trained on it, here."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = random.Random(7)
    words = ("memory", "step", "batch", "token", "the", "of", "peak", "layer")
    rows = [" ".join(rng.choice(words) for _ in range(int(rng.lognormvariate(3.5, 0.8)) + 1)) for _ in range(90)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(rows, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = tmp_path / "tokenizer.json"
    tok.save(str(tokenizer))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    return data, tokenizer


def test_dataset_panel_shows_every_step_as_the_api(page: Any, server: str, tmp_path: Any) -> None:
    data, tokenizer = _dataset_files(tmp_path)
    open_page(page, server, "?model=gpt2&gpu=rtx-4090&gpus=1&mbs=8&gbs=8&panel=dataset")
    page.set_input_files("#ds-file", str(data))
    page.set_input_files("#ds-tokenizer", [str(tokenizer)])
    page.select_option("#ds-batching", "hf")
    page.check("#ds-group")
    page.click("#ds-run")
    page.wait_for_selector("#panel-dataset[data-state=done]")
    job = {"model": "gpt2", "gpu": "rtx-4090", "gpus": 1, "mbs": 8, "gbs": 8}
    doc = httpx.post(server + "/v1/dataset", data={"job": json.dumps(job), "text_field": "text", "batching": "hf",
                                                   "seed": "42", "group_by_length": "true"},
                     files={"file": (data.name, data.read_bytes()), "tokenizer": ("tokenizer.json",
                                                                                 tokenizer.read_bytes())},
                     timeout=30).json()
    section = doc["dataset"]
    assert section["steps"] == 12 and section["batching"] == "hf"
    percentiles = section["step_peak_percentiles_bytes"]
    for name, value in (("worst", section["worst_step"]["peak_allocated_bytes"]), ("p50", percentiles["p50"]),
                        ("p90", percentiles["p90"]), ("p99", percentiles["p99"]),
                        ("usable", section["gpu_usable_bytes"])):
        assert int(page.get_attribute(f"#ds-{name}", "data-bytes")) == value
        assert page.inner_text(f"#ds-{name}") == f"{value / GiB:.2f} GiB"
    assert page.get_attribute("#dataset-verdict", "data-steps-over") == str(section["steps_over_gpu"])
    assert int(page.get_attribute("#ds-steps", "data-points")) == len(section["step_peaks"]["max_bytes"]) == 12
    assert int(page.get_attribute("#ds-usable-line", "data-bytes")) == section["gpu_usable_bytes"]
    counts = [int(c) for c in page.eval_on_selector_all("#ds-histogram rect", "bars => bars.map(b => b.dataset.count)")]
    assert counts == [b["count"] for b in section["length_histogram"]]
    worst = page.locator("#ds-worst-step td").all_inner_texts()
    assert worst[:3] == [str(section["worst_step"][k]) for k in ("index", "batch_size", "seq_length")]
    # Bad input: the server's one line, beside the panel.
    page.set_input_files("#ds-file", {"name": "train.txt", "mimeType": "text/plain", "buffer": b"hello"})
    page.click("#ds-run")
    page.wait_for_selector("#panel-dataset[data-state=error]")
    assert "file: must be a dataset file named with one of" in page.inner_text("#dataset-error")


def test_fit_table_and_using_a_layout(page: Any, server: str) -> None:
    open_page(page, server, "?model=llama-3.1-8b&gpu=h100-80gb&gpus=8&tp=2&panel=fit")
    page.wait_for_selector("#panel-fit[data-state=done]")  # a link to the fit panel runs the search
    doc = api(server, "/v1/fit", {**BASE, "top": 10})  # tp is the search's to choose: the page leaves it out
    assert "tp" in page.inner_text("#fit-status")
    rows = page.locator("#fit-table tbody tr")
    assert rows.count() == len(doc["candidates"]) >= 1
    assert rows.locator("td.l").all_inner_texts() == [c["label"] for c in doc["candidates"]]
    best = doc["candidates"][0]
    rows.first.get_by_role("button").click()
    settled(page, tp=best["tp"], pp=best["pp"], mbs=best["micro_batch_size"])
    assert page.is_visible("#panel-estimate")
    assert int(page.get_attribute("#peak-allocated", "data-bytes")) == best["allocated_bytes"]
    assert int(page.get_attribute("#peak-reserved", "data-bytes")) == best["reserved_bytes"]


def test_pasted_config_json(page: Any, server: str) -> None:
    open_page(page, server, "?gpu=a100-40gb&gpus=1")
    page.click("label:has(input[name=model_source][value=config])")
    page.fill("#f-config", json.dumps(CONFIG, indent=2))
    sent = settled(page, model_config=CONFIG)
    assert "model" not in sent
    assert shown(page) == expected(api(server, "/v1/estimate", {"model_config": CONFIG, "gpu": "a100-40gb",
                                                                "gpus": 1}))
    assert json.loads(parse_qs(urlsplit(page.url).query)["model_config"][0]) == CONFIG


def test_pasted_deepspeed_config_and_what_it_did_not_model(page: Any, server: str) -> None:
    ds = {"zero_optimization": {"stage": 2, "allgather_bucket_size": 200_000_000}, "train_micro_batch_size_per_gpu": 2,
          "bf16": {"enabled": True}}
    open_page(page, server, "?model=llama-3.1-8b&gpu=h100-80gb&gpus=8")
    settled(page, gpus=8)
    page.click("summary:has-text('Framework config files')")
    page.fill("#f-deepspeed_config", json.dumps(ds, indent=2))
    page.press("#f-deepspeed_config", "Tab")  # sent when the box is left
    settled(page, deepspeed_config=ds)
    doc = api(server, "/v1/estimate", {**BASE, "deepspeed_config": ds})
    assert shown(page) == expected(doc)
    assert page.locator("#input-settings tr").count() == len(doc["input_settings"]) + 1
    assert doc["unmodelled_settings"] and page.is_visible("#unmodelled")
    assert page.locator("#unmodelled li").all_inner_texts() == doc["unmodelled_settings"]


def test_nothing_is_loaded_from_another_origin(page: Any, server: str) -> None:
    open_page(page, server)
    settled(page)
    page.click("#tab-doctor")
    page.fill("#d-message", OOM)
    page.click("#d-run")
    page.wait_for_selector("#panel-doctor[data-state=done]")
    origins = {"{0.scheme}://{0.netloc}".format(urlsplit(url)) for url in page.requests}
    assert origins == {server}, page.requests
    paths = {urlsplit(url).path for url in page.requests}
    assert {"/", "/static/app.js", "/static/app.css", "/v1/openapi.json", "/v1/estimate", "/v1/doctor"} <= paths


def test_narrow_window_has_no_sideways_scroll(page: Any, server: str) -> None:
    page.set_viewport_size({"width": 400, "height": 800})
    open_page(page, server, "?model=llama-3.1-8b&gpu=h100-80gb&gpus=8&pp=4")
    settled(page, pp=4)
    assert page.evaluate("document.documentElement.scrollWidth") <= 400
    assert page.is_visible("#chart svg")


def test_every_job_field_of_the_schema_has_a_control(page: Any, server: str) -> None:
    open_page(page, server)
    fields = httpx.get(server + "/v1/openapi.json").json()["components"]["schemas"]["Job"]["properties"]
    controls = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#job [data-field]')]
        .filter(e => e.id.startsWith('f-'))
        .map(e => [e.dataset.field, e.tagName === 'SELECT' ? [...e.options].map(o => o.value) : e.type]))""")
    assert controls.pop("gpu") == [g["name"] for g in httpx.get(server + "/v1/gpus").json()]
    controls.pop("model"), controls.pop("model_config")  # the model box: preset, Hub id, config.json
    names = set(fields) - {"model", "model_config", "gpu"}
    assert names == set(controls)
    for name in names:
        prop = fields[name]
        if "enum" in prop:
            assert controls[name] == ["", *prop["enum"]], name
        elif prop["type"] == "boolean":
            assert controls[name] == ["", "true", "false"], name
        elif prop["type"] in ("integer", "number"):
            assert controls[name] == "number", name
        elif prop["type"] == "string" and not name.endswith("_config"):  # a TOML file's text is a text area
            assert controls[name] == "text", name
        else:  # a file's content: JSON or text
            assert controls[name] == "textarea", name
