"""One streaming OpenAI-style request: build the body, read server-sent events, fill a record.

Token counting: with ``stream_options.include_usage`` the server's final chunk carries
``usage.completion_tokens``, which is authoritative; servers that omit it are counted by
content-bearing chunks (exact for servers that stream one token per chunk, vLLM and ours;
an undercount for servers that merge tokens). ``count_source`` says which was used.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from alignedserve.bench.records import RequestRecord

COUNT_CHECKS = ("strict", "warn", "off")


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """Sampling fields every request carries. ``ignore_eos`` also sets ``min_tokens`` to
    ``max_tokens`` so every engine generates exactly the workload's output length."""

    endpoint: str = "completions"  # or "chat"
    temperature: float = 0.0
    ignore_eos: bool = True
    count_check: str = "strict"  # strict: a wrong count fails the request; warn: noted only
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")
        if self.count_check not in COUNT_CHECKS:
            raise ValueError(f"count check must be one of {COUNT_CHECKS}")

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


def request_body(model: str, prompt: list[int] | str, max_tokens: int,
                 opts: RequestOptions) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": True,
                            "temperature": opts.temperature,
                            "stream_options": {"include_usage": True}}
    if opts.endpoint == "chat":
        if not isinstance(prompt, str):
            raise ValueError("the chat endpoint needs text prompts (--prompt-format text)")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if opts.ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = max_tokens
    body.update(opts.extra_body)
    return body


def _chunk_text(obj: dict[str, Any]) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:
        return (c.get("delta") or {}).get("content") or ""
    return c.get("text") or ""


def _error_message(payload: bytes | str) -> str:
    text = payload.decode(errors="replace") if isinstance(payload, bytes) else payload
    try:
        err = json.loads(text).get("error", text)
        return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return text[:300]


async def stream_request(client: Any, url: str, body: dict[str, Any], rec: RequestRecord,
                         t0: float, opts: RequestOptions, headers: dict[str, str]) -> None:
    """POST ``body`` to ``url`` (through ``client``, an ``aiohttp.ClientSession``) and record
    timings into ``rec``.

    Sets ``rec.sent_s`` on entry; on return ``rec.ok`` tells whether the response was
    complete and (per ``opts.count_check``) had the expected number of tokens. Network and
    HTTP errors are recorded, not raised; cancellation propagates.
    """
    rec.sent_s = time.monotonic() - t0
    usage: dict[str, Any] | None = None
    chunks = 0
    async with client.post(url, json=body, headers=headers) as resp:
        if resp.status != 200:
            rec.end_s = time.monotonic() - t0
            rec.error = f"HTTP {resp.status}: {_error_message(await resp.read())}"
            return
        async for line in resp.content:  # one b"\n"-terminated line at a time
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            now = time.monotonic() - t0
            obj = json.loads(data)
            if "error" in obj:
                rec.end_s, rec.error = now, f"stream error: {_error_message(data)}"
                return
            usage = obj.get("usage") or usage
            if _chunk_text(obj):
                chunks += 1
                rec.chunk_times.append(now)
                if rec.first_token_s is None:
                    rec.first_token_s = now
    rec.end_s = time.monotonic() - t0
    _finish(rec, usage, chunks, opts)


def _finish(rec: RequestRecord, usage: dict[str, Any] | None, chunks: int,
            opts: RequestOptions) -> None:
    """Settle the output count and whether the request counts as successful."""
    if usage and usage.get("completion_tokens") is not None:
        rec.output_len, rec.count_source = int(usage["completion_tokens"]), "usage"
        if usage.get("prompt_tokens") is not None:
            rec.prompt_len_reported = int(usage["prompt_tokens"])
    else:
        rec.output_len, rec.count_source = chunks, "chunks"
    if rec.first_token_s is None:
        rec.error = "the response streamed no output text"
        return
    check_count(rec, opts)


def check_count(rec: RequestRecord, opts: RequestOptions) -> None:
    """Mark ``rec`` successful, unless (with ``ignore_eos``) the output count is wrong and the
    check is strict; a wrong count is always noted in ``rec.error`` / ``count_mismatch``."""
    rec.ok = True
    if opts.ignore_eos and opts.count_check != "off" and rec.output_len != rec.expected_output_len:
        rec.error = (f"expected {rec.expected_output_len} output tokens, got {rec.output_len} "
                     f"(counted from {rec.count_source})")
        rec.count_mismatch = True
        rec.ok = opts.count_check == "warn"
