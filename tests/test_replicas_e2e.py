"""End-to-end: ``alignedserve serve --replicas 2`` on a local Ray cluster, two engine replicas of
the default model with one thread each, driven over HTTP as users would.

One server for the module (Ray's start and two model loads take most of a minute here); the
tests that break a replica run after the ones that need both, and the last one stops it with
SIGTERM and checks that no Ray process is left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_process import get_or_none, serve_default_model, wait_until
from tests.test_server_e2e import BAD_INPUT, MAX_MODEL_LEN, sigterm_during_short_and_long
from tests.test_server_protocol import assert_error, sse_events

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.model
FAULT_TOKEN = 31337  # a prompt holding this token id makes its replica's next step fail
ARGS = ("--replicas", "2", "--num-threads", "1", "--max-model-len", str(MAX_MODEL_LEN),
        "--device-kv-gb", "0.5", "--host-kv-gb", "1", "--no-preallocate-kv",
        "--max-num-seqs", "32", "--max-queue", "32", "--shutdown-grace", "10",
        "--no-access-log", "--log-level", "warning")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The three primary colors are", "In 1969, astronauts", "A haiku about rain:"]


def _ray_pids() -> set[int]:
    """Processes whose command line names Ray (gcs_server, raylet, ray:: workers, ...)."""
    pids = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"ray" in cmd and (b"raylet" in cmd or b"gcs_server" in cmd or b"ray::" in cmd
                                  or b"ray/_private" in cmd or b"ray/dashboard" in cmd):
                pids.add(int(proc.name))
    return pids


@pytest.fixture(scope="module")
def server():
    """(base URL, process, model name, Ray processes that existed before it started)."""
    before = _ray_pids()
    with serve_default_model(*ARGS, env={"ALIGNEDSERVE_INJECT_STEP_FAILURE_TOKEN":
                                         str(FAULT_TOKEN)}) as (url, proc):
        yield url, proc, httpx.get(url + "/v1/models").json()["data"][0]["id"], before


def _state(url: str) -> dict:
    return httpx.get(url + "/engine/state", timeout=10).json()


def _per_replica(url: str, name: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"alignedserve:{name}{{") and 'replica="' in line:
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            values[replica] = float(line.rsplit(" ", 1)[1])
    return values


def _greedy(url: str, prompts: list[str], max_tokens: int = 24) -> list[str]:
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            rs = await asyncio.gather(*[client.post("/v1/completions", json={
                "prompt": p, "max_tokens": max_tokens, "temperature": 0}) for p in prompts])
        return [r.json()["choices"][0]["text"] for r in rs]
    return asyncio.run(run())


def test_greedy_outputs_equal_the_single_engine_servers(server):
    url, _, _, _ = server
    replicated = _greedy(url, PROMPTS)
    single_args = [a for a in ARGS if a not in ("--replicas", "2")]
    with serve_default_model(*single_args) as (single_url, _):
        single = _greedy(single_url, PROMPTS)
    assert replicated == single
    assert all(text.strip() for text in single)


def test_models_health_metrics_and_state(server):
    url, _, model, _ = server
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == model
    assert len(_per_replica(url, "engine_info")) == 2
    assert "alignedserve:replicas" in httpx.get(url + "/metrics").text
    state = _state(url)
    assert len(state["replicas"]) == 2 and state["kernel_path"]
    assert {tier.split("/")[0] for tier in state["kv"]} == {r["replica"] for r in state["replicas"]}


def test_100_concurrent_openai_streams_use_both_replicas(server):
    url, _, model, _ = server
    before = _per_replica(url, "decode_tokens_computed_total")
    clients, max_tokens = 100, 8

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, int]:
        stream = await client.completions.create(
            model=model, prompt=f"Request {i}: tell me about number {i}.", max_tokens=max_tokens,
            stream=True, stream_options={"include_usage": True}, temperature=0.7,
            extra_body={"ignore_eos": True})
        chunks, usage, reason = 0, 0, None
        async for chunk in stream:
            if chunk.choices:
                chunks += 1
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return reason, chunks, usage

    async def run():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*[one(client, i) for i in range(clients)])

    results = asyncio.run(run())
    assert all(reason == "length" and usage == max_tokens and chunks >= 1
               for reason, chunks, usage in results), results

    def both_used() -> bool:  # the counters reach /metrics on the replicas' next posts
        after = _per_replica(url, "decode_tokens_computed_total")
        return len([r for r in after if after[r] > before.get(r, 0)]) == 2
    assert wait_until(both_used, 10), (before, _per_replica(url, "decode_tokens_computed_total"))
    assert wait_until(lambda: _per_replica(url, "num_requests_running")
                       and sum(_per_replica(url, "num_requests_running").values()) == 0, 30)


@pytest.mark.parametrize("path,body,status,param", BAD_INPUT)
def test_bad_input_is_refused_as_by_one_engine(server, path, body, status, param):
    url, _, _, _ = server
    r = httpx.post(url + path, content=body, headers={"content-type": "application/json"},
                   timeout=60)
    error = assert_error(r, status, "*")
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error


def test_queue_full_on_every_replica_is_a_503_with_retry_after(server):
    url, _, _, _ = server
    limit = 2 * (32 + 32)  # replicas x (max-num-seqs + max-queue)

    async def run():
        limits = httpx.Limits(max_connections=limit + 40)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
            return await asyncio.gather(*[client.post("/v1/completions", json={
                "prompt": f"{i}", "max_tokens": 24, "ignore_eos": True})
                for i in range(limit + 30)])

    responses = asyncio.run(run())
    refused = [r for r in responses if r.status_code == 503]
    served = [r for r in responses if r.status_code == 200]
    assert len(refused) + len(served) == len(responses)
    assert refused, "past the queue bound some requests must be refused"
    assert all(r.headers.get("retry-after") for r in refused)
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in served)


def _replica_ids(url: str) -> set[str]:
    return {r["replica"] for r in _state(url)["replicas"]}


def test_a_failed_engine_step_errors_its_requests_and_the_replica_is_replaced(server):
    url, _, _, _ = server
    ids = _replica_ids(url)
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"prompt": [1, 2, FAULT_TOKEN], "max_tokens": 8})
    assert_error(r, 500)
    # the service keeps answering meanwhile: the router avoids the replica that reported it
    for _ in range(4):
        ok = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4},
                        timeout=120)
        assert ok.status_code == 200, ok.text
    # Ray's health check fails it and starts a fresh one
    assert wait_until(lambda: len(_replica_ids(url)) == 2 and len(_replica_ids(url) - ids) == 1,
                       180), _replica_ids(url)


def test_a_killed_replica_fails_only_its_started_streams_and_comes_back(server):
    url, _, _, _ = server
    victim = _state(url)["replicas"][0]
    results: list[tuple[int, int, str | None]] = []

    async def stream_all():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            return await asyncio.gather(*[_stream_tokens_or_error(client, i) for i in range(12)])

    def load():
        results.extend(asyncio.run(stream_all()))

    worker = threading.Thread(target=load)
    worker.start()
    assert wait_until(lambda: sum(r["running"] for r in _state(url)["replicas"]) >= 10, 60, 0.2)
    os.kill(victim["pid"], signal.SIGKILL)
    worker.join(300)
    assert not worker.is_alive(), "a stream hung after its replica was killed"
    assert len(results) == 12
    finished = [r for r in results if r[2] is None]
    failed = [r for r in results if r[2] is not None]
    assert all(tokens == 64 for _, tokens, _ in finished), results
    assert failed and all("replica" in error for _, _, error in failed), results
    assert finished, "the other replica's streams must finish"
    # new requests are served at once by the survivor, then by both once Ray restarted one
    ok = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=120)
    assert ok.status_code == 200, ok.text
    assert wait_until(lambda: len(_replica_ids(url)) == 2 and victim["replica"]
                       not in _replica_ids(url), 180), _replica_ids(url)
    before = _per_replica(url, "decode_tokens_computed_total")

    def both_used() -> bool:
        # A batch per poll: Ray's router may learn of the restarted replica a few seconds
        # after it reports itself (one full run sent every request to the survivor), and the
        # counters reach /metrics on the replicas' next posts.
        _greedy(url, PROMPTS * 3, max_tokens=4)
        after = _per_replica(url, "decode_tokens_computed_total")
        return len(after) == 2 and all(after[r] > before.get(r, 0) for r in after)
    assert wait_until(both_used, 60, 1.0), (before,
                                            _per_replica(url, "decode_tokens_computed_total"))


async def _stream_tokens_or_error(client: httpx.AsyncClient, i: int
                                  ) -> tuple[int, int, str | None]:
    """(status, tokens streamed, error message or None) of one 64-token stream."""
    payload = {"prompt": f"Story {i}:", "max_tokens": 64, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}}
    tokens, error = 0, None
    async with client.stream("POST", "/v1/completions", json=payload) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]["message"]
            elif chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return r.status_code, tokens, error


def test_zz_sigterm_drains_and_leaves_no_ray_process(server):
    url, proc, _, before = server
    results = sigterm_during_short_and_long(url, proc, 8, lambda: time.sleep(1.0) or True)
    assert proc.wait(90) in (0, -signal.SIGTERM)
    assert results["short"].status_code == 200
    events = sse_events(results["long"].text)
    assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"]
    assert get_or_none(url, "/health", 1) is None
    assert wait_until(lambda: not (_ray_pids() - before), 30), _ray_pids() - before
