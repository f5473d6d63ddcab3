"""Model-free stand-ins for the benchmark tests: an engine and an OpenAI-style SSE server.

``StubEngine`` has the surface ``bench.inprocess`` uses (add_request with arrival_time,
step, has_unfinished, abort_request, stats, close): every step adds one token to every
request, after ``step_s`` seconds. ``FakeOpenAIServer`` streams ``/v1/completions`` like
vLLM (one token per chunk, a final usage chunk, ``[DONE]``) and serves ``/v1/models`` and
``/metrics``; ``short_by`` makes it return fewer tokens than asked, to test the count check,
and ``first_text`` sets the first chunk's text (e.g. one long line)
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from alignedserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from alignedserve.step_stats import BatchRecord, StepRecord, StepStats


@dataclass
class _Req:
    prompt: list[int]
    max_tokens: int
    arrival: float
    tokens: list[int] = field(default_factory=list)


class StubEngine:
    def __init__(self, step_s: float = 0.005, max_prompt: int = 1000,
                 interrupt_after_steps: int | None = None):
        self.step_s = step_s
        self.max_prompt = max_prompt
        self.interrupt_after_steps = interrupt_after_steps
        self.stats = StepStats()
        self.reqs: dict[str, _Req] = {}
        self.arrivals: dict[str, float] = {}
        self.aborted: list[str] = []
        self.max_inflight = 0

    def add_request(self, request_id: str, prompt: list[int], params: Any,
                    arrival_time: float | None = None) -> None:
        if len(prompt) > self.max_prompt:
            raise ValueError(f"prompt has {len(prompt)} tokens, more than {self.max_prompt}")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self.reqs[request_id] = _Req(list(prompt), params.max_tokens, arrival)
        self.arrivals[request_id] = arrival
        self.max_inflight = max(self.max_inflight, len(self.reqs))

    def has_unfinished(self) -> bool:
        return bool(self.reqs)

    def abort_request(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return self.reqs.pop(request_id, None) is not None

    def close(self) -> None:
        pass

    def step(self) -> list[RequestOutput]:
        limit = self.interrupt_after_steps
        if limit is not None and self.stats.steps >= limit:
            raise KeyboardInterrupt  # as if Ctrl-C hit during a step
        time.sleep(self.step_s)
        lengths = [len(r.prompt) + len(r.tokens) + 1 for r in self.reqs.values()]
        outs = []
        for rid, r in list(self.reqs.items()):
            r.tokens.append(7)
            done = len(r.tokens) >= r.max_tokens
            comp = CompletionOutput(0, "x" * len(r.tokens), list(r.tokens), None, None,
                                    "length" if done else None)
            outs.append(RequestOutput(rid, None, r.prompt, [comp], done,
                                      RequestMetrics(r.arrival)))
            if done:
                del self.reqs[rid]
        batch = (BatchRecord(len(lengths), min(lengths), max(lengths), sum(lengths)),)
        self.stats.add(StepRecord(self.stats.steps, 0, len(lengths), batch if lengths else (),
                                  self.step_s, 0.0, 0, 0.0))
        return outs


class _Handler(BaseHTTPRequestHandler):
    server: FakeOpenAIServer

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, code: int, data: Any) -> None:
        body = json.dumps(data).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake-model"}]})
        elif self.path == "/version":
            self._json(200, {"version": "fake-1.0", "kernel_path": "none"})
        elif self.path == "/metrics":
            s = self.server
            text = (f"alignedserve:decode_kv_tokens_total{{model_name=\"m\"}} {s.kv_tokens}\n"
                    f"alignedserve:decode_padded_tokens_total{{model_name=\"m\"}} {s.padded}\n")
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        fake = self.server
        fake.bodies.append(body)
        prompt, n = body["prompt"], body["max_tokens"]
        if len(prompt) > fake.max_prompt:
            return self._json(400, {"error": {"message": "prompt too long", "type": "invalid"}})
        with fake.lock:
            fake.inflight += 1
            fake.max_inflight = max(fake.max_inflight, fake.inflight)
        try:
            self._stream(body, max(1, n - fake.short_by))
        finally:
            with fake.lock:
                fake.inflight -= 1
                fake.kv_tokens += 3 * n
                fake.padded += 4 * n
        # Only now may the client see the end and send its next request: otherwise the
        # in-flight count could briefly exceed the client's cap (a race in the fake).
        self.wfile.write(b"data: [DONE]\n\n")

    def _stream(self, body: dict[str, Any], n: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(n):
            time.sleep(self.server.token_s)
            text = self.server.first_text if i == 0 and self.server.first_text else f"t{i} "
            chunk = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        if self.server.send_usage:
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())


class FakeOpenAIServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, token_s: float = 0.002, short_by: int = 0, max_prompt: int = 1000,
                 send_usage: bool = True, first_text: str = ""):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.first_text = first_text
        self.token_s, self.short_by, self.max_prompt = token_s, short_by, max_prompt
        self.send_usage = send_usage
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.inflight = self.max_inflight = 0
        self.kv_tokens = self.padded = 0
        # A short poll interval keeps shutdown() (once per test) from waiting 0.5 s.
        self._thread = threading.Thread(target=self.serve_forever, args=(0.02,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
        self.server_close()
