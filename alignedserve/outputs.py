"""What callers receive: RequestOutput / CompletionOutput (vLLM's shapes), and detokenization."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence (of ``n``). ``text`` never contains a matched stop string."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        """Seconds from arrival to the last output token."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    prompt_logprobs: None = None
    num_cached_tokens: int = field(default=0)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, a few tokens at a time.

    Decodes only a short window (``prefix_offset``..end) per new token, and emits text only once
    it no longer ends in an incomplete UTF-8 sequence (U+FFFD), so multi-byte characters split
    across tokens come out whole. Stop strings are searched only in the new tail.
    """

    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self._backend_decode = _backend_decode(tokenizer)
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._holdback = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string matched (text truncated before it), or None."""
        for token in token_ids:
            self.token_ids.append(token)
            prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
            full = self._decode(self.token_ids[self._prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                before = len(self.text)
                self.text += full[len(prefix):]
                self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
                if matched := self._find_stop(before):
                    return matched
        return None

    def _find_stop(self, new_from: int) -> str | None:
        search_from = max(0, new_from - self._holdback)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self.text = self.text[:best[0]]
        return best[1]

    def flush(self) -> None:
        """At the end, include any trailing bytes that never formed a whole character."""
        tail = self._decode(self.token_ids[self._prefix_offset:])
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        if len(tail) > len(prefix):
            self.text += tail[len(prefix):]
            self._prefix_offset = self._read_offset = len(self.token_ids)

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: while running, hold back what could still start a stop string."""
        if finished or not self._holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self._holdback)]


def _backend_decode(tokenizer):
    """The Rust ``tokenizers`` decode behind a transformers fast tokenizer, where calling it
    directly gives the same text: the tokenizer does no clean-up of tokenization spaces (with
    clean-up on, or no backend, None: use ``tokenizer.decode``). Detokenizing runs twice per
    generated token, and transformers' per-call argument handling cost more than the decode
    itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend.decode
