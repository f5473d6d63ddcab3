"""Turning a validated API request into what the engine takes: token-id prompts and SamplingParams.

Every check that needs the model (vocabulary, context length, chat template) happens here,
before the request is admitted, so that a bad request is refused with a 400 and never reaches
the engine thread.

Tokenizing costs about a microsecond per byte, so a multi-megabyte prompt would stall the
event loop (and /health) for seconds. Two guards: a text that cannot fit in the context even
at the tokenizer's densest (``max_token_chars`` characters per token) is refused without being
tokenized, and long texts are tokenized in a worker thread. Encoding off the loop is safe
alongside the engine thread's decoding: both only *read* the Rust tokenizer (transformers
mutates it only when truncation/padding settings change, which the server never asks for).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from alignedserve.entrypoints.openai_errors import bad_request
from alignedserve.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from alignedserve.sampling_params import SamplingParams

# Below this, logits / temperature can overflow float32; vLLM uses the same cut-off for greedy.
GREEDY_BELOW = 1e-5
# Texts shorter than this are tokenized on the loop: a thread hop would cost more than it saves.
_INLINE_CHARS = 16_384


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the server needs to know about the served model (read-only, thread-safe)."""

    tokenizer: Any
    vocab_size: int
    max_model_len: int
    validate: Callable[[list[int], SamplingParams], None]  # raises ValueError
    max_token_chars: int | None  # length of the longest vocabulary entry; None: unknown
    kernel_path: str  # the engine's kernel instruction-set path (alignedserve.kernels.isa)

    @classmethod
    def of(cls, engine: Any) -> ModelInfo:
        """From an ``LLMEngine`` (or anything shaped like one)."""
        vocab = engine.loaded.config.vocab_size
        return cls(engine.tokenizer, vocab, engine.max_model_len, engine.validate_prompt,
                   _max_token_chars(engine.tokenizer, vocab), engine.kernels.name)

    @classmethod
    def from_facts(cls, tokenizer: Any, vocab_size: int, max_model_len: int,
                   kernel_path: str) -> ModelInfo:
        """For a front end without the model (replicas elsewhere): the engine's own checks,
        run on the facts they depend on."""
        from functools import partial

        from alignedserve.engine import validate_prompt

        check = partial(validate_prompt, vocab_size=vocab_size, max_model_len=max_model_len)
        return cls(tokenizer, vocab_size, max_model_len, check,
                   _max_token_chars(tokenizer, vocab_size), kernel_path)

    async def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Token ids of ``text``; 400 for invalid Unicode or a text that cannot fit the context."""
        _utf8_len(text, param)
        if self.max_token_chars and len(text) > self.max_model_len * self.max_token_chars:
            raise bad_request(f"the text ({len(text)} characters) cannot fit in the model context "
                              f"({self.max_model_len} tokens)", param)
        if len(text) < _INLINE_CHARS:
            return self._encode(text, add_special_tokens)
        return await asyncio.to_thread(self._encode, text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _max_token_chars(tokenizer: Any, vocab_size: int) -> int | None:
    # A byte-level BPE token string has one character per byte it covers (a SentencePiece one,
    # one per character), and a text has at least as many bytes as characters: so no text has
    # fewer than len(text) / max_token_chars tokens.
    to_tokens = getattr(tokenizer, "convert_ids_to_tokens", None)
    if to_tokens is None:
        return None
    try:
        tokens = to_tokens(list(range(vocab_size)))
    except Exception:  # ids past the tokenizer's own vocabulary, etc.: no bound, no harm
        return None
    return max((len(t) for t in tokens if t), default=None)


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # as the client sent it, for echo; None for token-id prompts


def _utf8_len(text: str, param: str) -> int:
    # JSON escapes can smuggle lone surrogates ("\ud800") that cannot be UTF-8 encoded.
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise bad_request("text contains invalid Unicode (a lone surrogate)", param) from None


async def completion_prompts(req: CompletionRequest, info: ModelInfo) -> list[Prompt]:
    raw = req.prompt
    if isinstance(raw, str):
        raw = [raw]
    if not raw:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(raw[0], int):
        return [Prompt(list(raw), None)]
    prompts = []
    for item in raw:
        if isinstance(item, str):
            prompts.append(Prompt(await info.encode(item, True, "prompt"), item))
        else:
            prompts.append(Prompt(list(item), None))
    return prompts


async def chat_prompt(req: ChatCompletionRequest, info: ModelInfo) -> Prompt:
    if not getattr(info.tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    conversation = []
    for i, message in enumerate(req.messages):
        entry = {"role": message.role, "content": message.text()}
        if message.name is not None:
            entry["name"] = message.name
        for value in entry.values():
            _utf8_len(value, f"messages[{i}]")
        conversation.append(entry)
    try:
        text = info.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=req.add_generation_prompt, tokenize=False)
    except Exception as exc:  # template errors are the conversation's fault (e.g. role order)
        raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from None
    # The template already wrote the special tokens; adding them again would double the BOS.
    return Prompt(await info.encode(text, False, "messages"), None)


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    info: ModelInfo) -> SamplingParams:
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature < GREEDY_BELOW:
        temperature = 0.0
    top_k = 0 if req.top_k in (None, -1) else min(req.top_k, info.vocab_size)
    stop_ids = list(req.stop_token_ids or [])
    if any(t >= info.vocab_size for t in stop_ids):
        raise bad_request(f"stop_token_ids must be below the vocabulary size {info.vocab_size}",
                          "stop_token_ids")
    try:
        return SamplingParams(
            n=req.n, temperature=temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k,
            min_p=req.min_p or 0.0, seed=req.seed, max_tokens=max_tokens,
            min_tokens=req.min_tokens, stop=req.stop_list, stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logprobs=logprobs, skip_special_tokens=req.skip_special_tokens)
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def check_prompt(prompt: Prompt, params: SamplingParams, info: ModelInfo, param: str) -> None:
    """The engine's own admission checks (empty, vocabulary, context length), as a 400."""
    try:
        info.validate(prompt.token_ids, params)
    except ValueError as exc:
        message = str(exc)
        raise bad_request(message, "max_tokens" if "max_tokens" in message else param) from None
    if len(prompt.token_ids) + params.min_tokens > info.max_model_len:
        raise bad_request(f"min_tokens {params.min_tokens} does not fit in the model context "
                          f"({info.max_model_len} tokens) after the prompt", "min_tokens")
