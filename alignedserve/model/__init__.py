"""The one Llama-family model definition, its loader (Hugging Face, GGUF) and the sampler."""
