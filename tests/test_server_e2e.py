"""End-to-end tests: a real ``alignedserve serve`` process on the default model, driven over HTTP
with the official ``openai`` client (and raw httpx where the client would hide the wire).

One server per module (started by the CLI exactly as a user would, on a free 127.0.0.1 port);
the last test sends it SIGTERM. Kept small enough to run in a few minutes on two CPU cores:
short prompts, a handful of tokens per request.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alignedserve.config import SchedulerConfig
from tests.server_process import get_or_none, serve_default_model, wait_until
from tests.test_server_protocol import HealthProbe, assert_error, sse_events

pytestmark = pytest.mark.model
MAX_MODEL_LEN = 2048
VOCAB = 49152


@pytest.fixture(scope="module")
def server():
    """(base URL, process, model name) of a server on the default model."""
    with serve_default_model("--max-model-len", str(MAX_MODEL_LEN), "--shutdown-grace", "10",
                             "--no-access-log", "--log-level", "warning") as (url, proc):
        yield url, proc, httpx.get(url + "/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    url, _, _ = server
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f"alignedserve:{name}{{") and all(
                f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _kv_used(url: str) -> tuple[float, float]:
    return (_metric(url, "kv_cache_used_bytes", tier="dev0"),
            _metric(url, "kv_cache_used_bytes", tier="host"))


# ---- the openai client: completions and chat -------------------------------------------------

def test_completion_usage_and_stream_match(server, oai):
    _, _, model = server
    prompt = "The capital of France is"
    full = oai.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    choice = full.choices[0]
    assert full.object == "text_completion" and full.model == model
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.completion_tokens == 8 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 8
    stream = oai.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                    stream=True, stream_options={"include_usage": True},
                                    extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_chat_stream_and_not(server, oai):
    _, _, model = server
    messages = [{"role": "user", "content": "Name a color."}]
    full = oai.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                       temperature=0)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content
    assert full.usage.completion_tokens <= 10 and full.usage.prompt_tokens > 5
    chunks = list(oai.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_stop_strings(server, oai):
    _, _, model = server
    prompt = "1, 2, 3, 4,"
    free = oai.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    stop = free[4:7]
    assert len(stop) == 3, free
    cut = oai.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                 stop=[stop, "never-appears"]).choices[0]
    assert cut.text == free[:free.index(stop)]
    assert cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == stop
    chat = oai.chat.completions.create(model=model, max_tokens=12, temperature=0,
                                       messages=[{"role": "user", "content": "Count to ten."}])
    text = chat.choices[0].message.content
    if len(text) >= 6:
        stop = text[3:6]
        again = oai.chat.completions.create(model=model, max_tokens=12, temperature=0, stop=stop,
                                            messages=[{"role": "user", "content": "Count to ten."}])
        assert again.choices[0].message.content == text[:text.index(stop)]
        assert again.choices[0].finish_reason == "stop"


def test_n_and_seed_reproducibility(server, oai):
    _, _, model = server
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                  extra_body={"ignore_eos": True})
    many = oai.completions.create(n=3, **kwargs)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.usage.completion_tokens == 24
    first = [c.text for c in oai.completions.create(n=2, seed=1234, **kwargs).choices]
    again = [c.text for c in oai.completions.create(n=2, seed=1234, **kwargs).choices]
    other = [c.text for c in oai.completions.create(n=2, seed=999, **kwargs).choices]
    assert first == again
    assert first != other, "different seeds gave the same samples"
    chat = dict(model=model, messages=[{"role": "user", "content": "Tell me a word."}],
                max_tokens=6, temperature=1.0, seed=77)
    assert oai.chat.completions.create(**chat).choices[0].message.content == \
        oai.chat.completions.create(**chat).choices[0].message.content


def test_logprobs_and_echo(server, oai):
    _, _, model = server
    r = oai.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0,
                               logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    echoed = oai.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0,
                                    echo=True)
    assert echoed.choices[0].text.startswith("Hello")
    chat = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in content)


# ---- bad input ---------------------------------------------------------------------------------

def _json(payload: object) -> bytes:
    return json.dumps(payload).encode()


BAD_INPUT = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ', 400, None),
    ("/v1/completions", _json({"prompt": "hi", "max_tokens": "many"}), 400, "max_tokens"),
    ("/v1/completions", _json({"prompt": {"text": "hi"}}), 400, "prompt"),
    ("/v1/completions", _json({"max_tokens": 3}), 400, "prompt"),
    ("/v1/chat/completions", _json({"max_tokens": 3}), 400, "messages"),
    ("/v1/completions", _json({"model": "gpt-5", "prompt": "hi"}), 404, "model"),
    ("/v1/completions", _json({"prompt": ""}), 400, "prompt"),
    ("/v1/completions", _json({"prompt": "hi", "max_tokens": 0}), 400, "max_tokens"),
    ("/v1/completions", _json({"prompt": "hi", "max_tokens": -1}), 400, "max_tokens"),
    ("/v1/completions", _json({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}), 400, "max_tokens"),
    ("/v1/completions", _json({"prompt": "hello " * (MAX_MODEL_LEN + 100), "max_tokens": 1}),
     400, "prompt"),
    ("/v1/completions", _json({"prompt": "x" * 3_000_000}), 400, "prompt"),
    ("/v1/chat/completions", _json({"messages": [{"role": "user", "content": "hi " * 3000}],
                                    "max_tokens": 1}), 400, "messages"),
    ("/v1/completions", _json({"prompt": "hi", "temperature": -0.5}), 400, "temperature"),
    ("/v1/completions", _json({"prompt": "hi", "temperature": 7}), 400, "temperature"),
    ("/v1/completions", _json({"prompt": "hi", "top_p": 0}), 400, "top_p"),
    ("/v1/completions", _json({"prompt": "hi", "top_p": 1.01}), 400, "top_p"),
    ("/v1/completions", _json({"prompt": "hi", "n": 1000}), 400, "n"),
    ("/v1/completions", _json({"prompt": [1, 2, VOCAB]}), 400, "prompt"),
    ("/v1/completions", _json({"prompt": [[5, 6], [-1]]}), 400, "prompt"),
    ("/v1/completions", b'{"prompt": "caf\xe9"}', 400, None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    ("/v1/completions", b'{"prompt": "' + b"a" * (5 << 20) + b'"}', 413, None),
    ("/v1/chat/completions", _json({"messages": []}), 400, "messages"),
    ("/v1/chat/completions", _json({"messages": [{"role": "robot", "content": "x"}]}), 400,
     "messages"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_INPUT)
def test_bad_input(server, path, body, status, param):
    url, _, _ = server
    r = httpx.post(url + path, content=body, headers={"content-type": "application/json"},
                   timeout=60)
    error = assert_error(r, status, "*")
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    ok = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200


def test_bad_input_through_the_client(server, oai):
    _, _, model = server
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(model=model, prompt="hi", max_tokens=10**6)
    assert exc.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_prompt_budget_is_served_within_its_bounds(server, oai):
    """The server holds prompt tokens per step to its step-time target: the budget /metrics
    shows lies between --min-prompt-tokens-per-step and --max-num-batched-tokens."""
    url, _, model = server
    oai.completions.create(model=model, prompt="word " * 600, max_tokens=2, temperature=0)
    config = SchedulerConfig()
    budget = _metric(url, "prompt_tokens_per_step_budget")
    assert config.min_prompt_tokens_per_step <= budget <= config.max_num_batched_tokens


# ---- disconnects, load, fuzz -------------------------------------------------------------------

def test_disconnect_frees_kv(server):
    url, _, _ = server
    assert wait_until(lambda: _metric(url, "num_requests_running") == 0, 60)
    idle = _kv_used(url)
    payload = {"prompt": "Write a long story.", "max_tokens": 1500, "ignore_eos": True,
               "stream": True}
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=payload) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: {")
                if seen >= 3:
                    assert _kv_used(url) != idle  # it really held KV
                    break
    assert wait_until(lambda: _kv_used(url) == idle, 30), (_kv_used(url), idle)
    assert _metric(url, "num_requests_running") == 0
    assert _metric(url, "num_sequences_admitted") == 0


async def _stream_tokens(client: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[int, int]:
    """(tokens streamed, completion_tokens in usage) for one streaming request."""
    payload = {"prompt": f"Item {i}:", "max_tokens": max_tokens, "ignore_eos": True,
               "temperature": 0.8, "stream": True, "logprobs": 0,
               "stream_options": {"include_usage": True}}
    streamed, usage = 0, -1
    async with client.stream("POST", "/v1/completions", json=payload) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                streamed += len(choice["logprobs"]["tokens"])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
    return streamed, usage


def test_200_concurrent_streams(server):
    url, _, _ = server
    clients, max_tokens = 200, 6

    async def run() -> list[tuple[int, int]]:
        limits = httpx.Limits(max_connections=clients + 20)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
            return await asyncio.gather(*[_stream_tokens(client, i, max_tokens)
                                          for i in range(clients)])

    with HealthProbe(url, period_s=0.1) as probe:
        results = asyncio.run(run())
    assert results == [(max_tokens, max_tokens)] * clients
    assert not probe.failures and len(probe.latencies) >= 3
    assert max(probe.latencies) < 3.0, sorted(probe.latencies)[-5:]
    assert wait_until(lambda: _metric(url, "num_sequences_admitted") == 0, 30)


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)
# Values of the wrong type or out of range for any field.
_junk = st.one_of(st.none(), st.booleans(), st.integers(-(10**20), 10**20), st.text(max_size=4),
                  st.floats(allow_nan=False, allow_infinity=False),
                  st.lists(st.integers(), max_size=2))


def _field(valid: st.SearchStrategy) -> st.SearchStrategy:
    # Mostly valid (1 in 8 junk), so that a fair share of requests get past validation and run.
    return st.integers(0, 7).flatmap(lambda i: _junk if i == 0 else valid)


_sampling = {
    "max_tokens": _field(st.integers(1, 3)), "temperature": _field(st.floats(0, 2)),
    "top_p": _field(st.floats(0.01, 1)), "top_k": _field(st.integers(-1, 100)),
    "min_p": _field(st.floats(0, 1)), "n": _field(st.integers(1, 3)),
    "seed": _field(st.integers(0, 2**32)), "stop": _field(st.lists(_text.filter(bool), max_size=3)),
    "stop_token_ids": _field(st.lists(st.integers(0, VOCAB - 1), max_size=3)),
    "ignore_eos": _field(st.booleans()), "repetition_penalty": _field(st.floats(0.5, 2)),
    "presence_penalty": _field(st.floats(-2, 2)), "frequency_penalty": _field(st.floats(-2, 2)),
    "min_tokens": _field(st.integers(0, 1)), "logprobs": _field(st.integers(0, 5)),
    "echo": _field(st.booleans()), "model": _field(st.none()),
}
_prompt = _field(st.one_of(_text.filter(bool), st.lists(_text.filter(bool), min_size=1, max_size=2),
                           st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4)))
_message = st.fixed_dictionaries({
    "role": _field(st.sampled_from(["user", "system", "assistant"])),
    "content": _field(_text)})


@st.composite
def _requests(draw) -> tuple[str, dict]:
    fields = draw(st.dictionaries(st.sampled_from(sorted(_sampling)), st.none(), max_size=6))
    body = {name: draw(_sampling[name]) for name in fields}
    body["max_tokens"] = body.get("max_tokens", 2)  # bounded work even when everything is valid
    if draw(st.booleans()):
        body["prompt"] = draw(_prompt)
        return "/v1/completions", body
    body["messages"] = draw(_field(st.lists(_message, min_size=1, max_size=2)))
    if isinstance(body.get("logprobs"), int) and not isinstance(body["logprobs"], bool):
        body["top_logprobs"] = body.pop("logprobs")
    return "/v1/chat/completions", body


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=_requests())
def test_schema_fuzz(server, request):
    url, _, _ = server
    path, body = request
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code in (200, 400, 404), (r.status_code, r.text, body)
    if r.status_code != 200:
        assert_error(r, r.status_code)
    else:
        assert r.json()["choices"]


def sigterm_during_short_and_long(url: str, proc, short_tokens: int,
                                  wait_admitted) -> dict[str, httpx.Response]:
    """Send a short request and a long stream, SIGTERM the server once ``wait_admitted()``
    says both are in, and return both responses ("short", "long") once they ended."""
    results: dict[str, httpx.Response] = {}

    def call(name: str, payload: dict) -> None:
        results[name] = httpx.post(url + "/v1/completions", json=payload, timeout=120)

    threads = [threading.Thread(target=call, args=args) for args in [
        ("short", {"prompt": "Hi", "max_tokens": short_tokens, "ignore_eos": True}),
        ("long", {"prompt": "Hi", "max_tokens": 1800, "ignore_eos": True, "stream": True})]]
    for t in threads:
        t.start()
    assert wait_admitted()
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    return results


def test_zz_sigterm_drains(server):
    """Runs last (it stops the module's server): short requests finish, long ones get an error."""
    url, proc, _ = server
    results = sigterm_during_short_and_long(
        url, proc, 12, lambda: wait_until(
            lambda: _metric(url, "num_sequences_admitted") == 2, 60, period=0.02))
    assert proc.wait(60) in (0, -signal.SIGTERM)
    assert results["short"].status_code == 200
    assert results["short"].json()["usage"]["completion_tokens"] == 12
    events = sse_events(results["long"].text)
    assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"]
    assert get_or_none(url, "/health", 1) is None  # the port is closed
