"""``POST /v1/chat/completions``: messages through the model's chat template, one reply per ``n``.

A stream opens with one ``{"role": "assistant", "content": ""}`` delta per choice (what the
OpenAI API sends), then content deltas, then a delta carrying each choice's finish reason.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from alignedserve.entrypoints.engine_client import EngineClient, EngineRun
from alignedserve.entrypoints.openai_format import (
    DeltaTracker,
    TokenText,
    chat_logprobs,
    final_text,
    respond,
    usage_of,
)
from alignedserve.entrypoints.openai_prepare import (
    ModelInfo,
    chat_prompt,
    check_prompt,
    sampling_params,
)
from alignedserve.entrypoints.openai_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
    Usage,
)
from alignedserve.outputs import RequestOutput


async def create_chat_completion(client: EngineClient, info: ModelInfo, model: str,
                                 req: ChatCompletionRequest, raw: Request) -> Response:
    prompt = await chat_prompt(req, info)
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, req.output_limit, top, info)
    check_prompt(prompt, params, info, "messages")
    run = client.start(f"chatcmpl-{uuid.uuid4().hex}", [prompt.token_ids], params)
    stream = _stream(run, req, model, info) if req.stream else None
    return await respond(run, client, raw, stream,
                         lambda outputs: _response(run, req, outputs[0], model, info))


def _response(run: EngineRun, req: ChatCompletionRequest, out: RequestOutput, model: str,
              info: ModelInfo) -> ChatCompletionResponse:
    token_text = TokenText(info.tokenizer)
    choices = []
    for c in out.outputs:
        logprobs = None
        if req.logprobs:
            logprobs = ChatLogprobs(content=chat_logprobs(
                c.token_ids, c.logprobs or [], req.top_logprobs or 0, token_text))
        message = AssistantMessage(content=final_text(c, req.include_stop_str_in_output))
        choices.append(ChatChoice(index=c.index, message=message, logprobs=logprobs,
                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    return ChatCompletionResponse(id=run.request_id, model=model, choices=choices,
                                  usage=usage_of([out]))


async def _stream(run: EngineRun, req: ChatCompletionRequest, model: str,
                  info: ModelInfo) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}

    def chunk(choice: ChatStreamChoice) -> str:
        return ChatCompletionChunk(id=run.request_id, created=created, model=model,
                                   choices=[choice]).model_dump_json(exclude=exclude)

    for i in range(req.n):
        yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
    tracker = DeltaTracker(req.include_stop_str_in_output)
    token_text = TokenText(info.tokenizer)
    prompt_tokens = 0
    async for _, out in run.events():
        for c in out.outputs:
            delta = tracker.update(c.index, c)
            if delta is None:
                continue
            logprobs = None
            if req.logprobs:
                logprobs = ChatLogprobs(content=chat_logprobs(
                    delta.token_ids, delta.logprobs or [], req.top_logprobs or 0, token_text))
            yield chunk(ChatStreamChoice(
                index=c.index, delta=DeltaMessage(content=delta.text or None), logprobs=logprobs,
                finish_reason=delta.finish_reason, stop_reason=delta.stop_reason))
        if out.finished:
            prompt_tokens = len(out.prompt_token_ids)
    if include_usage:
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=tracker.completion_tokens,
                      total_tokens=prompt_tokens + tracker.completion_tokens)
        yield ChatCompletionChunk(id=run.request_id, created=created, model=model, choices=[],
                                  usage=usage).model_dump_json()
