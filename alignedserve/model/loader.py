"""Load a Llama-family model + tokenizer from a Hugging Face directory or a GGUF file.

``load_model(None)`` loads the default model (see ``default_model.py``). Both formats
are turned into a stream of Hugging Face-named tensors that
`LlamaForCausalLM.load_weights` fuses into the model, so there is one weight-placement
path whatever the source. The model is built on the meta device and materialised
directly in the requested dtype/device, so no random initialisation is paid for.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from torch import Tensor

from alignedserve.model.config import ModelConfig
from alignedserve.model.default_model import cache_dir, default_model_path
from alignedserve.model.llama import LlamaForCausalLM
from alignedserve.huge_pages import move_to_huge_pages
from alignedserve.kernels import Kernels, kernels_for_path, select_kernels
from alignedserve.kernels.linear import pack_linears

# Chat-turn terminators that should stop generation even when the tokenizer's eos is
# something else; only honoured if the tokenizer has them as added (special) tokens.
_CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>")
_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# GGUF tensor name pieces -> Hugging Face names.
_GGUF_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(slots=True)
class LoadedModel:
    """A ready-to-run model (eval mode, no grads) with its tokenizer and stop tokens."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any  # transformers.PreTrainedTokenizerBase (kept lazy: importing is slow)
    eos_token_ids: frozenset[int]
    name: str


def load_model(
    model: str | os.PathLike[str] | None,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    kernels: Kernels | None = None,
) -> LoadedModel:
    """Load from a HF directory (config.json + *.safetensors), a ``.gguf`` file, or
    None for the default model. Weights are converted to ``dtype`` on ``device``; the model
    runs on ``kernels`` (default: ``select_kernels()`` on CPU, the reference elsewhere)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if kernels is None:
        kernels = select_kernels() if torch.device(device).type == "cpu" else (
            kernels_for_path("reference"))
    if path.is_file() and path.suffix == ".gguf":
        return _released(_load_gguf(path, dtype, device, kernels))
    if path.is_dir() and (path / "config.json").is_file():
        return _released(_load_hf_dir(path, dtype, device, kernels))
    if path.is_dir() and any(path.glob("*.gguf")):
        raise ValueError(f"{path} has no config.json; pass the .gguf file itself instead")
    raise FileNotFoundError(
        f"{path} is neither a .gguf file nor a Hugging Face model directory with config.json"
    )


def _released(loaded: LoadedModel) -> LoadedModel:
    """``loaded``, after handing the heap memory that loading freed back to the OS.

    Loading leaves copies behind: dequantized GGUF tensors, each weight before it was packed
    and before it moved to huge pages. glibc keeps freed blocks below the top of its heap for
    reuse and gives them back only when asked, so for a model of small tensors (the default
    one) the process would keep 150-300 MiB of resident memory it never touches again. Tensors
    above glibc's mmap threshold were unmapped when freed and are not affected. A no-op where
    the C library has no ``malloc_trim`` (not glibc)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):  # not glibc; no process handle (Windows)
        return loaded
    trim(0)
    return loaded


def _build_model(
    config: ModelConfig, weights: Iterable[tuple[str, Tensor]], dtype: torch.dtype, device: str,
    kernels: Kernels,
) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.load_weights(weights)
    model.eval().requires_grad_(False)
    model.kernels = kernels
    pack_linears(model, kernels)  # bf16 on CPU only; see kernels/linear.py
    if device == "cpu":
        move_to_huge_pages(model)  # weights stream from DRAM every step; see huge_pages.py
    return model


# ----------------------------------------------------------------- Hugging Face dirs


def _load_hf_dir(path: Path, dtype: torch.dtype, device: str, kernels: Kernels) -> LoadedModel:
    from transformers import AutoTokenizer

    hf_config = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_hf_config(hf_config)
    model = _build_model(config, _safetensors_weights(path), dtype, device, kernels)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    gen_path = path / "generation_config.json"
    gen_config = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    eos = _eos_token_ids(
        tokenizer, gen_config.get("eos_token_id"), hf_config.get("eos_token_id")
    )
    return LoadedModel(model, config, tokenizer, eos, path.resolve().name)


def _safetensors_weights(path: Path) -> Iterator[tuple[str, Tensor]]:
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path} (other formats are not supported)")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _eos_token_ids(tokenizer: Any, *candidates: int | list[int] | None) -> frozenset[int]:
    """Union of config-declared eos ids, the tokenizer's eos, and chat-end tokens."""
    ids: set[int] = set()
    for cand in (*candidates, tokenizer.eos_token_id):
        if isinstance(cand, int):
            ids.add(cand)
        elif isinstance(cand, (list, tuple)):
            ids.update(int(c) for c in cand)
    added = tokenizer.get_added_vocab()
    ids.update(added[t] for t in _CHAT_END_TOKENS if t in added)
    return frozenset(ids)


# ----------------------------------------------------------------------------- GGUF


def _load_gguf(path: Path, dtype: torch.dtype, device: str, kernels: Kernels) -> LoadedModel:
    import gguf

    reader = gguf.GGUFReader(str(path))
    config = _gguf_config(reader)
    model = _build_model(config, _gguf_weights(reader, config), dtype, device, kernels)
    tokenizer = _gguf_tokenizer(path)
    extra = [_field(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    eos = _eos_token_ids(tokenizer, *extra)
    return LoadedModel(model, config, tokenizer, eos, path.name.removesuffix(".gguf"))


_REQUIRED = object()


def _field(reader: Any, key: str, default: Any = _REQUIRED) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"GGUF file lacks required metadata key {key!r}")
        return default
    return field.contents()


def read_gguf_config(path: Path) -> ModelConfig:
    """The ModelConfig of a GGUF file, from its metadata only (no weights are read)."""
    import gguf

    return _gguf_config(gguf.GGUFReader(str(path)))


def _gguf_config(reader: Any) -> ModelConfig:
    """Translate llama.cpp metadata (``{arch}.*`` keys) into a ModelConfig."""
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_GGUF_ARCHS)}")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF files with rope_freqs (Llama 3.1-style rope scaling) are not supported")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    rope_dims = _field(reader, f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ValueError(f"partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return ModelConfig(
        architecture=_GGUF_ARCHS[arch],
        vocab_size=int(_field(reader, f"{arch}.vocab_size", embed.data.shape[0])),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(reader, arch),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        attention_out_bias="blk.0.attn_output.bias" in tensor_names,
    )


def _gguf_rope_scaling(reader: Any, arch: str) -> dict[str, Any] | None:
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r}; supported: none, linear")


def _gguf_weights(reader: Any, config: ModelConfig) -> Iterator[tuple[str, Tensor]]:
    """Dequantized tensors under Hugging Face names, Q/K rows un-permuted (llama only)."""
    from gguf.quants import dequantize

    unpermute = config.architecture == "LlamaForCausalLM"
    for t in reader.tensors:
        name = _gguf_to_hf_name(t.name)
        array = dequantize(t.data, t.tensor_type)
        if not array.flags.writeable:  # F32 tensors are views of the read-only mmap
            array = np.array(array)
        weight = torch.from_numpy(array)
        if unpermute and ".attn_q." in t.name:
            weight = _unpermute_rope_rows(weight, config.num_heads)
        elif unpermute and ".attn_k." in t.name:
            weight = _unpermute_rope_rows(weight, config.num_kv_heads)
        yield name, weight


def _gguf_to_hf_name(name: str) -> str:
    base, _, kind = name.rpartition(".")  # kind: weight | bias
    if base in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_BLOCK:
        return f"model.layers.{parts[1]}.{_GGUF_BLOCK[parts[2]]}.{kind}"
    raise ValueError(f"unknown GGUF tensor {name!r}")


def _unpermute_rope_rows(w: Tensor, n_head: int) -> Tensor:
    """Undo llama.cpp's convert_hf_to_gguf permutation of attn_q / attn_k rows.

    The converter stores each head's rows interleaved as (dim/2, 2) so that its rope can
    rotate adjacent pairs; HF's rotate-half rope wants them as (2, dim/2). Works for
    weights [rows, in] and biases [rows] alike (the same transform transformers applies).
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_tokenizer(path: Path) -> Any:
    """HF tokenizer converted from GGUF metadata, cached on disk: the conversion takes
    seconds, reloading the saved fast tokenizer a fraction of one. The cache key covers
    the file's identity and the transformers version that did the conversion."""
    import transformers
    from transformers import AutoTokenizer

    stat = path.stat()
    ident = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    key = hashlib.sha1(ident.encode()).hexdigest()[:16]
    cached = cache_dir() / "tokenizers" / f"{path.name.removesuffix('.gguf')}-{key}"
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(str(cached))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like the GGUF is
    try:
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, cached)  # atomic; fails harmlessly if a concurrent load won
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer
