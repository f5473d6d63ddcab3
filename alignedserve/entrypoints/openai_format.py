"""Shared pieces of building API responses from engine outputs: stream deltas, logprobs, SSE.

Engine outputs are *cumulative* (each carries the whole text and token list so far, with any
text that could still become a stop string held back), so streaming means sending differences.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from alignedserve.entrypoints.engine_client import (
    ClientGone,
    EngineClient,
    EngineRun,
    final_outputs_unless_gone,
)
from alignedserve.entrypoints.openai_errors import APIError
from alignedserve.entrypoints.openai_protocol import (
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from alignedserve.outputs import CompletionOutput, RequestOutput

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = "data: [DONE]\n\n"
# JSON has no -Infinity; OpenAI-compatible servers send this instead.
_MIN_LOGPROB = -9999.0


# Line ends to str.splitlines, and so to httpx's line iterators, that JSON leaves unescaped
# inside strings (it escapes every other one, being control characters). A generated token
# holding one would cut its event in two for such clients; escaped, it is the same JSON.
_LINE_ENDS_IN_JSON = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028",
                                    "\u2029": "\\u2029"})


def sse(payload: str) -> str:
    """One server-sent event of the JSON ``payload``, on a single line for any client."""
    return f"data: {payload.translate(_LINE_ENDS_IN_JSON)}\n\n"


async def sse_frames(chunks: AsyncIterator[str], run: EngineRun,
                     to_error: Callable[[BaseException], APIError]) -> AsyncIterator[str]:
    """Frame JSON chunks as server-sent events, ending with ``[DONE]``.

    A failure after the stream started cannot change the HTTP status any more, so it is sent
    as an ``{"error": ...}`` event (the OpenAI client raises it) before ``[DONE]``. If the
    client goes away, Starlette cancels this generator and ``finally`` aborts the run.
    """
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except Exception as exc:
        yield sse(json.dumps(to_error(exc).body()))
    finally:
        run.close()
    yield SSE_DONE


async def respond(run: EngineRun, client: EngineClient, raw: Request,
                  stream: AsyncIterator[str] | None,
                  build: Callable[[list[RequestOutput]], BaseModel]) -> Response:
    """The HTTP answer to a started run, the same for every endpoint: the JSON chunks of
    ``stream`` as server-sent events, or (``stream`` None) the body ``build`` makes of the
    final outputs; 499 when the client left before them, an API error when the run failed."""
    if stream is not None:
        return StreamingResponse(sse_frames(stream, run, client.api_error),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        outputs = await final_outputs_unless_gone(run, raw.receive)
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    except Exception as exc:
        raise client.api_error(exc) from exc
    return JSONResponse(build(outputs).model_dump())


class TokenText:
    """Single-token strings for logprobs, cached per response (decoding is the costly part)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def _finite(logprob: float | None) -> float:
    if logprob is None or math.isnan(logprob):
        return _MIN_LOGPROB
    return max(logprob, _MIN_LOGPROB)


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]


def completion_logprobs(token_ids: list[int], entries: list[dict[int, float]], k: int,
                        text: TokenText, offset: int = 0) -> CompletionLogprobs:
    """The legacy shape; ``offset`` is where the first token's text starts in the choice."""
    result = CompletionLogprobs()
    for token, entry in zip(token_ids, entries):
        piece = text(token)
        result.tokens.append(piece)
        result.token_logprobs.append(_finite(entry.get(token)))
        top = {text(t): _finite(lp) for t, lp in _top(entry, k)} if k else None
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(piece)
    return result


def chat_logprobs(token_ids: list[int], entries: list[dict[int, float]], k: int,
                  text: TokenText) -> list[TokenLogprob]:
    items = []
    for token, entry in zip(token_ids, entries):
        piece = text(token)
        top = [TopLogprob(token=text(t), logprob=_finite(lp), bytes=list(text(t).encode()))
               for t, lp in _top(entry, k)]
        items.append(TokenLogprob(token=piece, logprob=_finite(entry.get(token)),
                                  bytes=list(piece.encode()), top_logprobs=top))
    return items


def final_text(out: CompletionOutput, include_stop: bool) -> str:
    """The choice's text; with ``include_stop_str_in_output``, plus the stop string matched."""
    if include_stop and out.finish_reason == "stop" and isinstance(out.stop_reason, str):
        return out.text + out.stop_reason
    return out.text


def usage_of(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion)


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: str | int | None
    text_offset: int  # where ``text`` starts in the choice's full text


class DeltaTracker:
    """Per-choice progress of a stream: what has been sent so far.

    Invariants (per choice key): the concatenated delta texts equal the final text; every
    generated token id appears in exactly one delta; the finish reason is sent exactly once.
    """

    def __init__(self, include_stop: bool):
        self.include_stop = include_stop
        self._chars: dict[int, int] = {}
        self._tokens: dict[int, int] = {}
        self._finished: set[int] = set()
        self.completion_tokens = 0

    def update(self, key: int, out: CompletionOutput) -> Delta | None:
        """The delta since the last update of ``key``, or None when there is nothing to send."""
        if key in self._finished:
            return None
        text = final_text(out, self.include_stop) if out.finished else out.text
        sent_chars, sent_tokens = self._chars.get(key, 0), self._tokens.get(key, 0)
        new_text, new_tokens = text[sent_chars:], out.token_ids[sent_tokens:]
        if not new_text and not new_tokens and not out.finished:
            return None
        self._chars[key] = max(sent_chars, len(text))
        self._tokens[key] = len(out.token_ids)
        self.completion_tokens += len(new_tokens)
        if out.finished:
            self._finished.add(key)
        logprobs = out.logprobs[sent_tokens:] if out.logprobs is not None else None
        return Delta(new_text, new_tokens, logprobs, out.finish_reason,
                     out.stop_reason if out.finished else None, sent_chars)
