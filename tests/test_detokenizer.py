"""IncrementalDetokenizer: the same text through the Rust backend's decode as through
transformers' ``tokenizer.decode``, token by token, on the default model's real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from alignedserve.outputs import IncrementalDetokenizer

TEXT = ("Hello  wörld — 你好, naïve café! 🤖🚀 <|im_start|>user\n"
        "  indented\tcode(x) -> [1, 2]\n\nÆØÅ ß ∑ ∞<|im_end|>\n")


class _WrapperOnly:
    """The tokenizer seen without its backend: IncrementalDetokenizer must use its decode."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer_ = tokenizer
        self.clean_up_tokenization_spaces = False

    def decode(self, ids, skip_special_tokens=False):
        return self._tokenizer_.decode(ids, skip_special_tokens=skip_special_tokens)


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    seen = []
    for token in ids:
        detok.add([token])
        seen.append(detok.text)
    detok.flush()
    return seen + [detok.text]


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path):
    from alignedserve.model.loader import _gguf_tokenizer

    return _gguf_tokenizer(default_model_path)


@pytest.mark.model
@pytest.mark.parametrize("skip_special", [True, False])
def test_backend_decode_streams_the_same_text(tokenizer, skip_special):
    ids = tokenizer(TEXT).input_ids
    fast = IncrementalDetokenizer(tokenizer, [], skip_special)
    assert fast._backend_decode is not None  # the default tokenizer does no clean-up
    slow = IncrementalDetokenizer(_WrapperOnly(tokenizer), [], skip_special)
    assert slow._backend_decode is None
    assert _stream(fast, ids) == _stream(slow, ids)
    assert fast.text == tokenizer.decode(ids, skip_special_tokens=skip_special)


@pytest.mark.model
def test_clean_up_keeps_the_wrapper(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert IncrementalDetokenizer(tokenizer, [])._backend_decode is None
