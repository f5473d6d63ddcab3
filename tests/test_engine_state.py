"""The web console's server side, model-free: ``/engine/state``, ``/engine/events``, the page
at ``/`` and ``--no-ui``, the API key, and the decode groups the schedulers report.

The page itself runs in a real browser in tests/test_console_browser.py.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from alignedserve.config import SchedulerConfig
from alignedserve.entrypoints.engine_state import RecentLatencies
from alignedserve.kv.store import KVStore
from alignedserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from alignedserve.sched.registry import make_scheduler
from tests.fakes import FakeExecutor, make_request
from tests.server_fakes import fake_app, live_server

SNAPSHOT_KEYS = {"time", "model", "policy", "dtype", "kv_cache_dtype", "kernel_path", "running",
                 "waiting", "groups", "last_step", "kv", "bubble_recent", "output_tok_s",
                 "ttft_p50_s", "tpot_p50_s", "steps"}


@pytest.fixture(scope="module")
def server():
    app, engine, _ = fake_app(step_s=0.01)
    with live_server(app) as url:
        with httpx.Client(base_url=url, timeout=30) as client:
            yield client, engine


def _burst(client: httpx.Client, n: int, tokens: int) -> list[threading.Thread]:
    url = f"{client.base_url}/v1/completions"

    def one(i: int) -> None:  # one connection per thread
        httpx.post(url, json={"prompt": "p" * (5 + 20 * i), "max_tokens": tokens,
                              "ignore_eos": True}, timeout=30)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_state_while_busy_then_idle(server):
    client, _ = server
    idle = client.get("/engine/state").json()
    assert set(idle) == SNAPSHOT_KEYS
    assert idle["model"] == "fake-model" and idle["kernel_path"] == "reference"
    assert idle["kv"]["dev0"]["total_bytes"] > 0 and "host" in idle["kv"]
    threads = _burst(client, 6, 100)
    deadline = time.monotonic() + 5
    while (busy := client.get("/engine/state").json())["running"] < 6:
        assert time.monotonic() < deadline, busy
        time.sleep(0.05)
    assert busy["kv"]["dev0"]["used_bytes"] > 0
    assert busy["groups"] and sum(g["rows"] for g in busy["groups"]) == 6
    assert busy["last_step"] and busy["output_tok_s"] > 0
    for t in threads:
        t.join()
    time.sleep(2.2)  # past IDLE_S
    after = client.get("/engine/state").json()
    assert after["running"] == after["waiting"] == 0 and after["groups"] == []
    assert after["last_step"] == [] and after["kv"]["dev0"]["used_bytes"] == 0
    assert after["ttft_p50_s"] is not None and after["tpot_p50_s"] is not None
    assert after["steps"] > busy["steps"]


def test_state_holds_no_text(server):
    client, _ = server
    secret = "zebra-unicorn-42"
    threads = [threading.Thread(target=httpx.post, args=(f"{client.base_url}/v1/completions",),
                                kwargs={"json": {"prompt": secret, "max_tokens": 40,
                                                 "ignore_eos": True}, "timeout": 30})]
    threads[0].start()
    time.sleep(0.15)
    body = client.get("/engine/state").text
    threads[0].join()
    assert secret not in body and "quick brown" not in body


def test_events_stream_snapshots_and_reject_bad_intervals(server):
    client, _ = server
    received = []
    with client.stream("GET", "/engine/events", params={"interval": 0.1}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                received.append(json.loads(line[6:]))
            if len(received) == 3:
                break
    assert all(set(s) == SNAPSHOT_KEYS for s in received)
    assert received[0]["time"] < received[2]["time"]
    for bad in ["0", "abc", "61", "nan", "-1"]:
        r = client.get("/engine/events", params={"interval": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "interval"


def test_page_is_served_and_self_contained(server):
    client, _ = server
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "<title>AlignedServe console</title>" in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in page and "innerHTML" not in page


def test_no_ui_and_api_key():
    app, _, engine = fake_app({"ui": False})
    with live_server(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert client.get("/").status_code == 404
        assert client.get("/engine/state").status_code == 200
    engine.shutdown()
    app, _, engine = fake_app({"api_key": "sekrit"})
    with live_server(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert client.get("/").status_code == 200  # the page holds no data and asks for the key
        for path in ["/engine/state", "/engine/events"]:
            assert client.get(path).status_code == 401
        auth = {"Authorization": "Bearer sekrit"}
        assert client.get("/engine/state", headers=auth).status_code == 200
    engine.shutdown()


def test_recent_latencies_use_finished_requests_in_the_span():
    now = [100.0]
    recent = RecentLatencies(span_s=60, clock=lambda: now[0])

    def output(ttft: float, e2e: float, tokens: int, finished: bool = True) -> RequestOutput:
        metrics = RequestMetrics(0.0, ttft, e2e)
        return RequestOutput("r", "", [1], [CompletionOutput(0, "", list(range(tokens)), 0.0,
                                                              None, "length", None)],
                             finished, metrics)

    recent.observe(output(0.5, 2.5, 5))  # tpot 0.5
    recent.observe(None)
    now[0] = 130.0
    recent.observe(output(1.5, 2.5, 11))  # tpot 0.1
    assert recent.medians() == (1.0, pytest.approx(0.3))
    now[0] = 170.0  # the first one left the span
    assert recent.medians() == (1.5, pytest.approx(0.1))
    now[0] = 500.0
    assert recent.medians() == (None, None)


@pytest.mark.parametrize("policy", ["aligned", "fcfs", "static"])
def test_schedulers_report_decode_groups(policy):
    store = KVStore.for_devices([1 << 20], 1 << 22, bytes_per_token=16)
    sched = make_scheduler(policy, SchedulerConfig(max_num_seqs=8, align_tolerance=16), store)
    executor = FakeExecutor(store)
    for i, n in enumerate([30, 35, 200]):
        sched.add_request(make_request(f"r{i}", n, max_tokens=50))
    for _ in range(6):  # prefill everything, then a few decode steps
        plan = sched.schedule()
        sched.update(plan, executor.execute(plan))
    groups = sched.decode_groups()
    assert sum(g.rows for g in groups) == 3
    assert all(g.min_len <= g.max_len and g.tier == "dev0" for g in groups)
    if policy == "aligned":  # 30 and 35 within tolerance, 200 alone
        assert sorted(g.rows for g in groups) == [1, 2]

