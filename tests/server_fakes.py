"""A model-free stand-in for LLMEngine, for fast server tests (no torch work, no weights).

``FakeEngine`` honours the contract ``AsyncEngine`` and the server rely on: ``add_request``
validates like the real engine and raises ValueError; ``step`` emits *cumulative*
RequestOutputs (n sequences per request, text via the real ``IncrementalDetokenizer`` so stop
strings behave exactly as in the engine); ``abort_request`` frees KV; KV lives in a real
``KVStore``; ``stats`` is a real ``StepStats``. Each step adds one token to every running
sequence, after sleeping ``step_s`` to stand in for the forward pass.

Generation: greedy requests cycle through ``GREEDY_TEXT`` (EOS after ``eos_after`` tokens
unless ``ignore_eos``); sampled requests draw lowercase letters from ``random.Random(seed)``.
The tokenizer is byte-level: token ``b`` (< 256) is the byte ``b``; 256 is EOS.
"""

from __future__ import annotations

import argparse
import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from alignedserve.config import EngineConfig
from alignedserve.kernels import kernels_for_path
from alignedserve.kv.store import KVStore
from alignedserve.outputs import (
    CompletionOutput,
    IncrementalDetokenizer,
    RequestMetrics,
    RequestOutput,
)
from alignedserve.sampling_params import SamplingParams
from alignedserve.sched.budget import PromptBudget
from alignedserve.sched.interface import DecodeGroup
from alignedserve.step_stats import BatchRecord, StepRecord, StepStats

EOS = 256
VOCAB = 260
GREEDY_TEXT = "The quick brown fox jumps over the lazy dog. "


class ByteTokenizer:
    """Just enough of a Hugging Face tokenizer: __call__, decode, apply_chat_template."""

    chat_template = "fake"

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(0x100 + i) if i < 256 else "</s>" if i == EOS else "<unk>" for i in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if i < 256)
        text = data.decode("utf-8", errors="replace")
        if not skip_special_tokens and EOS in ids:
            text += "</s>"
        return text

    def apply_chat_template(self, conversation: list[dict[str, str]],
                            add_generation_prompt: bool = True, tokenize: bool = False) -> str:
        for message in conversation:
            if message["role"] == "tool" and message["content"] == "boom":
                raise ValueError("tool messages must follow a tool call")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in conversation)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class _Config:
    vocab_size: int = VOCAB


@dataclass
class _Loaded:
    config: _Config = field(default_factory=_Config)
    name: str = "fake-model"


@dataclass
class _Seq:
    seq_id: str
    params: SamplingParams
    detok: IncrementalDetokenizer
    rng: random.Random
    kv: object = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class _Group:
    request_id: str
    prompt: list[int]
    seqs: list[_Seq]
    arrival: float
    first_token: float | None = None


class _Scheduler:
    def __init__(self, engine: FakeEngine):
        self._engine = engine
        sched = engine.config.scheduler
        self.prompt_budget = PromptBudget(sched.max_num_batched_tokens, 0.0,
                                          sched.min_prompt_tokens_per_step)

    def num_running(self) -> int:
        return sum(1 for s in self._engine._active() if s.kv is not None)

    def num_waiting(self) -> int:
        return sum(1 for s in self._engine._active() if s.kv is None)

    def decode_groups(self) -> list[DecodeGroup]:
        """All running sequences as one group on dev0 (the fake has no cohorts)."""
        lengths = [len(g.prompt) + len(s.tokens) for g in list(self._engine.groups.values())
                   for s in g.seqs if s.kv is not None and s.finish_reason is None]
        return [DecodeGroup(len(lengths), min(lengths), max(lengths), "dev0")] if lengths else []


class FakeEngine:
    def __init__(self, max_model_len: int = 256, max_num_seqs: int = 64, step_s: float = 0.002,
                 eos_after: int = 12):
        self.tokenizer = ByteTokenizer()
        self.loaded = _Loaded()
        self.config = EngineConfig(model="fake-model")
        self.kernels = kernels_for_path("reference")
        self.dtype = self.kv_dtype = torch.float32
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.step_s = step_s
        self.eos_after = eos_after
        self.store = KVStore.for_devices([1 << 22], 1 << 20, bytes_per_token=64)
        self.stats = StepStats()
        self.scheduler = _Scheduler(self)
        self.groups: dict[str, _Group] = {}
        self.aborted: list[str] = []
        self.fail_next_step = False
        self.closed = False

    # ---- the LLMEngine surface ------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt)["input_ids"]

    def validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        if any(not isinstance(t, int) or not 0 <= t < VOCAB for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {VOCAB})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but the model context is "
                             f"{self.max_model_len} tokens")
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} "
                             f"tokens, but {len(ids)} prompt tokens + max_tokens "
                             f"{params.max_tokens} were requested")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        if request_id in self.groups:
            raise ValueError(f"duplicate request id {request_id!r}")
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(ids, params)
        seqs = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            seqs.append(_Seq(f"{request_id}#{i}", params,
                             IncrementalDetokenizer(self.tokenizer, params.stop,
                                                    params.skip_special_tokens),
                             random.Random(seed)))
        self.groups[request_id] = _Group(request_id, ids, seqs, time.monotonic())

    def abort_request(self, request_id: str) -> bool:
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        self.aborted.append(request_id)
        for seq in group.seqs:
            self._free(seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    def close(self) -> None:
        self.closed = True

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        self._admit()
        lengths = []
        for group in list(self.groups.values()):
            for seq in group.seqs:
                if seq.kv is not None and seq.finish_reason is None:
                    lengths.append(len(group.prompt) + len(seq.tokens))
                    self._advance(group, seq)
        if lengths:
            batch = BatchRecord(len(lengths), min(lengths), max(lengths), sum(lengths))
            self.stats.add(StepRecord(self.stats.steps, 0, len(lengths), (batch,), self.step_s,
                                      0.0, 0, 0.0), time.monotonic())
        return [self._emit(g) for g in list(self.groups.values()) if self._progressed(g)]

    # ---- internals --------------------------------------------------------------------------
    def _active(self) -> list[_Seq]:
        return [s for g in list(self.groups.values()) for s in g.seqs if s.finish_reason is None]

    def _admit(self) -> None:
        running = sum(1 for s in self._active() if s.kv is not None)
        for group in self.groups.values():
            for seq in group.seqs:
                if seq.kv is None and seq.finish_reason is None and running < self.max_num_seqs:
                    seq.kv = self.store.allocate("dev0", len(group.prompt) + 16)
                    running += 1

    def _free(self, seq: _Seq) -> None:
        if seq.kv is not None and seq.kv in self.store:
            self.store.free_handle(seq.kv)
        self.store.drain_ops()

    def _next_token(self, group: _Group, seq: _Seq) -> int:
        p = seq.params
        if len(seq.tokens) >= self.eos_after and not p.ignore_eos:
            return EOS
        if p.temperature == 0:
            offset = sum(group.prompt) % len(GREEDY_TEXT)
            return ord(GREEDY_TEXT[(offset + len(seq.tokens)) % len(GREEDY_TEXT)])
        return ord(seq.rng.choice("abcdefghijklmnopqrstuvwxyz "))

    def _advance(self, group: _Group, seq: _Seq) -> None:
        token = self._next_token(group, seq)
        seq.tokens.append(token)
        if seq.params.logprobs is not None:
            top = {token: -0.25, **{t: -3.0 - t / 100 for t in range(97, 97 + seq.params.logprobs)
                                    if t != token}}
            seq.logprobs.append(top)
        group.first_token = group.first_token or time.monotonic()
        total = len(group.prompt) + len(seq.tokens)
        if seq.kv is not None and self.store.capacity_of(seq.kv) < total:
            self.store.grow(seq.kv, total + 16)
            self.store.drain_ops()
        if (matched := seq.detok.add([token])) is not None:
            seq.finish_reason, seq.stop_reason = "stop", matched
        elif token == EOS or token in seq.params.stop_token_ids:
            seq.finish_reason = "stop"
            seq.stop_reason = None if token == EOS else token
        elif (seq.params.max_tokens is not None and len(seq.tokens) >= seq.params.max_tokens) \
                or total >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            seq.detok.flush()
            self._free(seq)

    @staticmethod
    def _progressed(group: _Group) -> bool:
        return any(s.tokens for s in group.seqs)

    def _emit(self, group: _Group) -> RequestOutput:
        finished = all(s.finish_reason is not None for s in group.seqs)
        outputs = [CompletionOutput(i, s.detok.visible_text(s.finish_reason is not None),
                                    list(s.tokens), -0.25 * len(s.tokens),
                                    list(s.logprobs) if s.params.logprobs is not None else None,
                                    s.finish_reason, s.stop_reason)
                   for i, s in enumerate(group.seqs)]
        if finished:
            del self.groups[group.request_id]
        metrics = RequestMetrics(group.arrival, group.first_token,
                                 time.monotonic() if finished else None)
        return RequestOutput(group.request_id, None, list(group.prompt), outputs, finished, metrics)


def idle_kv_bytes(engine: FakeEngine) -> dict[str, int]:
    return {tier: used for tier, (used, _) in engine.store.usage_bytes().items()}



# ---- running the server on the fake engine -------------------------------------------------

def fake_app(settings_overrides: dict | None = None, **engine_kwargs):
    """(app, FakeEngine, AsyncEngine) with a server on a fresh FakeEngine."""
    from alignedserve.async_engine import AsyncEngine
    from alignedserve.entrypoints.server import build_app
    from alignedserve.entrypoints.server_state import ServerSettings

    engine = FakeEngine(**engine_kwargs)
    settings = ServerSettings(**{"model_names": ("fake-model",), "max_inflight": 512,
                                 **(settings_overrides or {})})
    async_engine = AsyncEngine(lambda: engine, max_pending=settings.max_inflight)
    return build_app(async_engine, settings), engine, async_engine


@contextmanager
def live_server(app) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free 127.0.0.1 port in a thread; yield its base URL.

    Runs the app's lifespan, so the engine is shut down on exit (when the app owns it).
    """
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.server_fakes --port P``: the real server (signals and all) on a fake."""
    from alignedserve.entrypoints.server import listen_socket, serve_app

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--grace", type=float, default=1.0)
    parser.add_argument("--step-s", type=float, default=0.01)
    args = parser.parse_args(argv)
    app, _, _ = fake_app({"shutdown_grace_s": args.grace}, step_s=args.step_s, max_model_len=4096)
    serve_app(app, listen_socket("127.0.0.1", args.port), "warning", access_log=False)


if __name__ == "__main__":
    main()
