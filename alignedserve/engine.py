"""LLMEngine: the step loop (schedule -> execute -> update -> detokenize) and request intake.

Synchronous and single-threaded: callers (the offline ``LLM``, or ``AsyncEngine``'s engine
thread) call ``add_request`` / ``abort_request`` between ``step()`` calls. A request with
``n > 1`` fans out into ``n`` independent sequences (ids ``"{id}#{i}"``) whose outputs are
reported together under the caller's id.

``add_request`` raises ``QueueFull`` (re-exported here, so callers above the engine need not
reach into the scheduler) when the scheduler's bounded waiting queue is full.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import torch

from alignedserve.config import CacheConfig, EngineConfig, GiB
from alignedserve.kernels import kernels_for_path, select_kernels
from alignedserve.kernels.isa import cpu_info
from alignedserve.executor.kv_pool import KVPool
from alignedserve.executor.runner import ModelRunner
from alignedserve.executor.split_forward import SplitForward
from alignedserve.kv.store import HOST, KVStore
from alignedserve.model.config import ModelConfig
from alignedserve.model.loader import LoadedModel, load_model
from alignedserve.outputs import CompletionOutput, IncrementalDetokenizer, RequestMetrics, RequestOutput
from alignedserve.request import FinishReason, Request
from alignedserve.sampling_params import SamplingParams
from alignedserve.sched.interface import QueueFull  # noqa: F401  (part of the engine's API)
from alignedserve.sched.registry import make_scheduler
from alignedserve.step_stats import StepStats, record_step

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}


@dataclass(slots=True)
class _Sequence:
    request: Request
    detok: IncrementalDetokenizer
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None  # summed only when logprobs were requested


@dataclass(slots=True)
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[_Sequence]
    arrival_time: float


KV_CACHE_DTYPES = {"fp8_e5m2": torch.float8_e5m2, "fp8": torch.float8_e5m2}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: ``auto`` is the model dtype."""
    if name == "auto":
        return model_dtype
    try:
        return KV_CACHE_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose auto or one of "
                         f"{sorted(KV_CACHE_DTYPES)}") from None


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.dtype = resolve_dtype(config.dtype)
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        if loaded is None:
            kernels = (select_kernels(config.kernel_path, config.batch_invariant)
                       if self.device.type == "cpu"
                       else kernels_for_path("reference", config.batch_invariant))
            loaded = load_model(config.model, self.dtype, str(self.device), kernels)
        elif config.batch_invariant and not loaded.model.kernels.batch_invariant:
            raise ValueError("batch_invariant needs a model loaded with batch-invariant kernels "
                             "(load_model(..., kernels=select_kernels(path, "
                             "batch_invariant=True)))")
        self.loaded = loaded
        self.kernels = loaded.model.kernels
        mc = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.store, pool = self._build_kv(config.cache, mc)
        self.executor = ModelRunner(self.loaded, pool, self.device, config.seed,
                                    self._split_forward())
        self.scheduler = make_scheduler(config.policy, config.scheduler, self.store)
        self.stats = StepStats()
        self._groups: dict[str, _Group] = {}
        self._seq_group: dict[str, _Group] = {}

    def _split_forward(self) -> SplitForward | None:
        """Two half-thread workers for split decode steps (``EngineConfig.split_decode``), where
        they change no output: bf16 on a compiled CPU path, whose kernels give a row the same
        result in any batch and with any thread count (torch's float32 matmuls do not promise
        that, and float32 must match transformers token for token), with two threads or more."""
        threads = torch.get_num_threads()
        if (not self.config.split_decode or self.device.type != "cpu" or threads < 2
                or self.kernels.ext is None or self.dtype != torch.bfloat16):
            return None
        return SplitForward((threads // 2, threads - threads // 2), self.kernels.enter_thread)

    def _build_kv(self, cache: CacheConfig, mc: ModelConfig) -> tuple[KVStore, KVPool]:
        """The KV bookkeeping (scheduler side) and the tensors that mirror it (runner side):
        one tier per device plus the host, in the layout the kernel path reads fastest."""
        store = KVStore.for_devices(cache.device_bytes(), cache.host_bytes(),
                                    mc.kv_bytes_per_token(self.kv_dtype.itemsize),
                                    cache.granularity)
        tier_devices = {t: self._tier_device(i) for i, t in enumerate(store.device_tiers)}
        tier_devices[HOST] = torch.device("cpu")
        tiled = cache.tiled_layout and all(
            self.kernels.tiled_kv_applies(self.kv_dtype, mc.head_dim, cache.granularity, d)
            for d in tier_devices.values())
        pool = KVPool(tier_devices, mc.num_layers, mc.num_kv_heads, mc.head_dim, self.kv_dtype,
                      tiled)
        order = self.kernels.decode_read_order()
        if self.device.type == "cpu":
            log.info("CPU: %s", cpu_info().summary())
        log.info("kernels: %s path%s%s; KV cache: %s, %s layout", self.kernels.name,
                 f" (decode attention: {order})" if order else "",
                 ", batch-invariant at any step size" if self.kernels.batch_invariant else "",
                 str(self.kv_dtype).removeprefix("torch."), "tiled" if tiled else "token-major")
        if cache.preallocate_kv:
            self._preallocate(store, pool, tier_devices)
        return store, pool

    def _preallocate(self, store: KVStore, pool: KVPool,
                     tier_devices: dict[str, torch.device]) -> None:
        """Fault in the CPU device tiers' KV budget, at most half the free RAM."""
        budget = sum(store.total(t) for t in store.device_tiers
                     if tier_devices[t].type == "cpu") * store.bytes_per_token
        free_ram = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        start = time.perf_counter()
        reserved = pool.preallocate(min(budget, free_ram // 2))
        if reserved:
            log.info("KV cache: %.1f GiB preallocated in %.1f s", reserved / GiB,
                     time.perf_counter() - start)

    def _tier_device(self, index: int) -> torch.device:
        if self.device.type == "cuda":
            return torch.device("cuda", index % max(1, torch.cuda.device_count()))
        return self.device

    # ---- intake ---------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError with a clear message if the request cannot be served."""
        validate_prompt(prompt_token_ids, params, self.loaded.config.vocab_size,
                        self.max_model_len)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self._groups:
            raise ValueError(f"duplicate request id {request_id!r}")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = _Group(request_id, text, ids, [], arrival)
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            child = dataclasses.replace(params, n=1, seed=seed)
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            request = Request(seq_id, ids, child, eos_token_ids=self.loaded.eos_token_ids,
                              max_model_len=self.max_model_len, arrival_time=arrival)
            detok = IncrementalDetokenizer(self.tokenizer, child.stop, child.skip_special_tokens)
            group.seqs.append(_Sequence(request, detok))
            self._seq_group[seq_id] = group
        self._groups[request_id] = group
        try:
            for seq in group.seqs:
                self.scheduler.add_request(seq.request)
        except Exception:  # e.g. QueueFull part-way through n > 1: add all or nothing
            self.abort_request(request_id)
            raise

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request (all its sequences) and free its KV; False if unknown/finished."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for seq in group.seqs:
            self.scheduler.abort_request(seq.request.request_id)
            self._seq_group.pop(seq.request.request_id, None)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    @property
    def num_requests(self) -> int:
        return len(self._groups)

    # ---- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return outputs of requests that progressed or finished."""
        plan = self.scheduler.schedule()
        out = self.executor.execute(plan)
        touched = self.scheduler.update(plan, out)
        self.stats.add(record_step(plan, out, self.store), time.monotonic())
        affected = {id(g): g for g in self._finish_sequences(touched)}
        for seq_id in plan.finished_request_ids:  # failed or finished without a new token
            if (group := self._seq_group.get(seq_id)) is not None:
                affected[id(group)] = group
        return [self._emit(g) for g in affected.values()]

    def _finish_sequences(self, touched: list[Request]) -> list[_Group]:
        groups = []
        for request in touched:
            group = self._seq_group.get(request.request_id)
            if group is None:
                continue
            seq = next(s for s in group.seqs if s.request is request)
            new = request.output_token_ids[len(seq.detok.token_ids):]
            if request.params.logprobs is not None:
                start = len(seq.detok.token_ids)
                seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + sum(
                    request.output_logprobs[i].get(t, 0.0) for i, t in enumerate(new, start))
            matched = seq.detok.add(new)
            if matched is not None:
                seq.stop_reason = matched
                self.scheduler.finish_request(request, FinishReason.STOP)
            elif request.is_finished:
                seq.detok.flush()
                last = request.output_token_ids[-1]
                if request.finish_reason is FinishReason.STOP and last in request.params.stop_token_ids:
                    seq.stop_reason = last
            groups.append(group)
        return groups

    def _emit(self, group: _Group) -> RequestOutput:
        outputs = [self._completion(i, s) for i, s in enumerate(group.seqs)]
        finished = all(s.request.is_finished for s in group.seqs)
        reqs = [s.request for s in group.seqs]
        firsts = [r.first_token_time for r in reqs if r.first_token_time is not None]
        metrics = RequestMetrics(group.arrival_time, min(firsts) if firsts else None,
                                 max(r.finish_time or 0.0 for r in reqs) if finished else None)
        errors = [r.error for r in reqs if r.error]
        if finished:
            self._groups.pop(group.request_id, None)
            for s in group.seqs:
                self._seq_group.pop(s.request.request_id, None)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs,
                             finished, metrics, errors[0] if errors else None)

    @staticmethod
    def _completion(index: int, seq: _Sequence) -> CompletionOutput:
        r = seq.request
        finished = r.is_finished
        return CompletionOutput(
            index=index, text=seq.detok.visible_text(finished), token_ids=list(r.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=list(r.output_logprobs) if r.params.logprobs is not None else None,
            finish_reason=r.finish_reason.value if finished and r.finish_reason else None,
            stop_reason=seq.stop_reason)

    def close(self) -> None:
        self.executor.close()


def validate_prompt(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int,
                    max_model_len: int) -> None:
    """Raise ValueError with a clear message if a model of this vocabulary and context cannot
    serve the request (a pure function, so a front end without the model checks the same)."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}")
    n = len(prompt_token_ids)
    if n >= max_model_len:
        raise ValueError(f"prompt has {n} tokens but the model context is "
                         f"{max_model_len} tokens (room is needed for one output)")
    if params.max_tokens is not None and n + params.max_tokens > max_model_len:
        raise ValueError(f"this model's maximum context length is {max_model_len} "
                         f"tokens, but {n} prompt tokens + max_tokens {params.max_tokens} "
                         f"were requested")
    if params.n > 64:
        raise ValueError(f"n must be <= 64, got {params.n}")
