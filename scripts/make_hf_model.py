"""Dequantize the default model's GGUF into a Hugging Face directory (float32 safetensors,
config, tokenizer with its chat template), the format vLLM and other peers load.

    python scripts/make_hf_model.py OUT_DIR

Following ../shared/peers/README.md: transformers dequantizes the GGUF; ``save_pretrained``
refuses a GGUF-loaded model, so the state dict (without the tied ``lm_head.weight``) goes
through safetensors and the config is written without its ``quantization_config``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from alignedserve.model.default_model import default_model_path


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    gguf, out = default_model_path(), Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.update(architectures=["LlamaForCausalLM"], torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    print("wrote", out)


if __name__ == "__main__":
    main()
