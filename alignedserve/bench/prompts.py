"""Prompts of exact token lengths: random token ids from a seeded RNG, or their text.

Token-id prompts are what makes engines comparable: every engine sees the same ids, of the
length the workload asked for, with no tokenizer round trip. Ids are drawn uniformly from the
vocabulary minus special/added tokens (a stray ``<|im_end|>`` or BOS would change behaviour).
Request ``i`` under seed ``s`` always gets the same prompt, whatever the run order, and two
requests never share a long prefix, so prefix caches do not flatter anyone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class TokenSpace:
    """Ids ``[0, vocab_size)`` minus ``excluded``."""

    vocab_size: int
    excluded: frozenset[int] = frozenset()
    _allowed: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        allowed = np.setdiff1d(np.arange(self.vocab_size), np.fromiter(self.excluded, int))
        if allowed.size == 0:
            raise ValueError("no token ids left to sample prompts from")
        object.__setattr__(self, "_allowed", allowed)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TokenSpace:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        added = set((tokenizer.get_added_vocab() or {}).values()) if hasattr(
            tokenizer, "get_added_vocab") else set()
        return cls(len(tokenizer), frozenset(special | added))

    @classmethod
    def parse(cls, text: str) -> TokenSpace:
        """``"LO:HI"`` -> ids in ``[LO, HI)`` (for servers whose tokenizer is not at hand)."""
        lo, _, hi = text.partition(":")
        try:
            low, high = int(lo), int(hi)
        except ValueError:
            raise ValueError(f"--token-range wants LO:HI, got {text!r}") from None
        if not 0 <= low < high:
            raise ValueError(f"--token-range needs 0 <= LO < HI, got {text!r}")
        return cls(high, frozenset(range(low)))

    def prompt_ids(self, seed: int, index: int, length: int, stream: int = 0) -> list[int]:
        """Ids for request ``index``; ``stream`` separates families (1 = warm-up prompts)."""
        rng = np.random.default_rng([seed, stream, index])
        return self._allowed[rng.integers(0, self._allowed.size, size=length)].tolist()


@dataclass(frozen=True, slots=True)
class PromptFactory:
    """Builds request ``i``'s prompt: token ids, or (``text=True``) those ids decoded.

    Text prompts re-tokenize to roughly, not exactly, the requested length; the server's
    reported ``usage.prompt_tokens`` is used for input-token metrics then.
    """

    space: TokenSpace
    seed: int
    tokenizer: Any = None
    text: bool = False

    def __post_init__(self) -> None:
        if self.text and self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer (--tokenizer)")

    def build(self, index: int, length: int, stream: int = 0) -> list[int] | str:
        ids = self.space.prompt_ids(self.seed, index, length, stream)
        return self.tokenizer.decode(ids) if self.text else ids


def load_tokenizer(spec: str | None) -> Any:
    """A Hugging Face tokenizer from a model directory, a ``.gguf`` file, or (None) the default
    model's GGUF, which is fetched on first use like the engine does."""
    from transformers import AutoTokenizer

    if spec is None:
        from alignedserve.model import loader
        from alignedserve.model.default_model import default_model_path

        path = default_model_path()
        # The loader caches the (slow) GGUF -> fast-tokenizer conversion; reuse it if present.
        cached = getattr(loader, "_gguf_tokenizer", None)
        if cached is not None:
            return cached(path)
    else:
        path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))
