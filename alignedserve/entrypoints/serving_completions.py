"""``POST /v1/completions``: prompts in (text, token ids, or lists of either), completions out.

Choice ``index`` is ``prompt_index * n + i``, as in vLLM and the OpenAI API.
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
    completion_logprobs,
    final_text,
    respond,
    usage_of,
)
from alignedserve.entrypoints.openai_prepare import (
    ModelInfo,
    Prompt,
    check_prompt,
    completion_prompts,
    sampling_params,
)
from alignedserve.entrypoints.openai_protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from alignedserve.outputs import RequestOutput


async def create_completion(client: EngineClient, info: ModelInfo, model: str,
                            req: CompletionRequest, raw: Request) -> Response:
    prompts = await completion_prompts(req, info)
    params = sampling_params(req, req.max_tokens, req.logprobs, info)
    for prompt in prompts:
        check_prompt(prompt, params, info, "prompt")
    run = client.start(f"cmpl-{uuid.uuid4().hex}", [p.token_ids for p in prompts], params)
    stream = _stream(run, req, prompts, model, info) if req.stream else None
    return await respond(run, client, raw, stream,
                         lambda outputs: _response(run, req, prompts, outputs, model, info))


def _echo(prompt: Prompt, info: ModelInfo) -> str:
    if prompt.text is not None:
        return prompt.text
    return info.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)


def _response(run: EngineRun, req: CompletionRequest, prompts: list[Prompt],
              outputs: list[RequestOutput], model: str, info: ModelInfo) -> CompletionResponse:
    token_text = TokenText(info.tokenizer)
    choices = []
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        prefix = _echo(prompt, info) if req.echo else ""
        for c in out.outputs:
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(c.token_ids, c.logprobs or [], req.logprobs,
                                               token_text, len(prefix))
            text = prefix + final_text(c, req.include_stop_str_in_output)
            choices.append(CompletionChoice(index=i * req.n + c.index, text=text,
                                            logprobs=logprobs, finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason))
    return CompletionResponse(id=run.request_id, model=model, choices=choices,
                              usage=usage_of(outputs))


async def _stream(run: EngineRun, req: CompletionRequest, prompts: list[Prompt], model: str,
                  info: ModelInfo) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}
    tracker = DeltaTracker(req.include_stop_str_in_output)
    token_text = TokenText(info.tokenizer)
    echoed: set[int] = set()
    prompt_tokens = 0
    async for index, out in run.events():
        for c in out.outputs:
            key = index * req.n + c.index
            delta = tracker.update(key, c)
            if delta is None:
                continue
            text = delta.text
            if req.echo and key not in echoed:
                echoed.add(key)
                text = _echo(prompts[index], info) + text
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(delta.token_ids, delta.logprobs or [],
                                               req.logprobs, token_text, delta.text_offset)
            choice = CompletionChoice(index=key, text=text, logprobs=logprobs,
                                      finish_reason=delta.finish_reason,
                                      stop_reason=delta.stop_reason)
            yield CompletionChunk(id=run.request_id, created=created, model=model,
                                  choices=[choice]).model_dump_json(exclude=exclude)
        if out.finished:
            prompt_tokens += len(out.prompt_token_ids)
    if include_usage:
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=tracker.completion_tokens,
                      total_tokens=prompt_tokens + tracker.completion_tokens)
        yield CompletionChunk(id=run.request_id, created=created, model=model, choices=[],
                              usage=usage).model_dump_json()
