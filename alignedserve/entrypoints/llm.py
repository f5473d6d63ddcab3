"""The offline API, shaped like vLLM's: ``LLM(...).generate(prompts, params)`` and ``.chat``."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from alignedserve.config import CacheConfig, EngineConfig, SchedulerConfig
from alignedserve.engine import LLMEngine
from alignedserve.outputs import RequestOutput
from alignedserve.sampling_params import SamplingParams

PromptType = str | dict[str, Any]
_SCHED = SchedulerConfig()  # the defaults below come from here, so they cannot drift
Message = dict[str, str]


class LLM:
    """Generate from many prompts at once; all of them are batched by the engine's scheduler.

    ``model=None`` loads the default model (SmolLM2-135M-Instruct). ``model`` may be a Hugging
    Face model directory or a ``.gguf`` file.
    """

    def __init__(self, model: str | None = None, dtype: str = "bfloat16", device: str | None = None,
                 policy: str = "aligned", seed: int | None = None, max_model_len: int | None = None,
                 num_threads: int | None = None, device_kv_gb: float = 4.0,
                 host_kv_gb: float = 8.0, max_num_seqs: int = _SCHED.max_num_seqs,
                 max_num_batched_tokens: int = _SCHED.max_num_batched_tokens,
                 align_tolerance: int = _SCHED.align_tolerance,
                 kv_cache_dtype: str = "auto", kernel_path: str | None = None,
                 batch_invariant: bool = False, loaded=None):
        config = EngineConfig(
            model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, device=device,
            num_threads=num_threads, kernel_path=kernel_path, policy=policy,
            batch_invariant=batch_invariant,
            seed=seed, max_model_len=max_model_len,
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      align_tolerance=align_tolerance),
            cache=CacheConfig(device_kv_gb=device_kv_gb, host_kv_gb=host_kv_gb))
        self.engine = LLMEngine(config, loaded)
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig, loaded=None) -> LLM:
        """Build from a full EngineConfig (what the CLI parses)."""
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config, loaded)
        llm._ids = itertools.count()
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt is a string or ``{"prompt_token_ids": [...]}`` (or ``{"prompt": "..."}``).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params_list(sampling_params, len(prompts))
        ids = []
        for prompt, p in zip(prompts, params):
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, self._prompt_input(prompt), p)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then ``generate``."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = [{"prompt_token_ids": list(tokenizer.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt, tokenize=True,
            return_dict=True)["input_ids"])} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _prompt_input(prompt: PromptType) -> str | list[int]:
        if isinstance(prompt, str):
            return prompt
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError("a prompt dict needs 'prompt_token_ids' or 'prompt'")

    @staticmethod
    def _params_list(params, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
        return params

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
        return [done[i] for i in ids]
