"""``ModelRunner``: turns a StepPlan into one forward pass of the model and samples (the
simulator's stand-in for it is ``sim/executor.py``)."""

from __future__ import annotations

import time

import torch

from alignedserve.executor.attention import PrefillSegment, StepAttention
from alignedserve.executor.kv_pool import KVPool
from alignedserve.model.loader import LoadedModel
from alignedserve.model.sampler import Sampler, SamplingRow
from alignedserve.request import Request
from alignedserve.sched.plan import SampledToken, StepOutput, StepPlan


class ModelRunner:
    """Executes plans on a loaded model; owns the KV tensors and the per-request RNGs."""

    def __init__(self, loaded: LoadedModel, pool: KVPool, device: torch.device, seed: int | None):
        self.loaded = loaded
        self.model = loaded.model
        self.pool = pool
        self.device = device
        self.kernels = self.model.kernels
        self.sampler = Sampler(seed, self.kernels)
        self.scale = loaded.config.head_dim ** -0.5
        self._generators: dict[str, torch.Generator] = {}

    def execute(self, plan: StepPlan) -> StepOutput:
        waited, copied = self.pool.apply(plan.kv_ops)
        for request_id in plan.finished_request_ids:
            self._generators.pop(request_id, None)
        out = StepOutput(copy_wait_s=waited, copy_bytes=copied)
        if not plan.has_work:
            return out
        start = time.perf_counter()
        with torch.inference_mode():
            out.sampled = self._forward_and_sample(plan)
        out.compute_s = time.perf_counter() - start
        return out

    def _forward_and_sample(self, plan: StepPlan) -> dict[str, SampledToken]:
        ids: list[int] = []
        positions: list[int] = []
        sample_at: list[int] = []
        samplers: list[Request] = []
        segments: list[PrefillSegment] = []
        for chunk in plan.prefills:
            ids += chunk.token_ids
            positions += range(chunk.start, chunk.start + chunk.num_tokens)
            segments.append(PrefillSegment(self.pool.get(chunk.request.kv), chunk.start,
                                           chunk.num_tokens))
            if chunk.sample:
                sample_at.append(len(ids) - 1)
                samplers.append(chunk.request)
        decode = plan.decode_requests
        decode_positions = [r.num_tokens - 1 for r in decode]
        for request in decode:
            sample_at.append(len(ids))
            ids.append(request.output_token_ids[-1])
            samplers.append(request)
        positions += decode_positions
        attn = StepAttention(self.kernels, segments, [self.pool.get(r.kv) for r in decode],
                             torch.tensor(decode_positions, dtype=torch.int64), self.scale,
                             self.pool.tiled)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, pos, attn)
        if not samplers:
            return {}
        # sample_at is increasing, so as many entries as tokens means every row, in order (a
        # decode-only step): no gather.
        rows = hidden if len(sample_at) == len(ids) else hidden[sample_at]
        logits = self.model.compute_logits(rows, widen=False)
        result = self.sampler(logits, [self._row(r) for r in samplers])
        return {
            r.request_id: SampledToken(result.token_ids[i], result.logprobs[i],
                                       result.top_logprobs[i])
            for i, r in enumerate(samplers)
        }

    def _row(self, request: Request) -> SamplingRow:
        generator = None
        if request.params.seed is not None:
            generator = self._generators.get(request.request_id)
            if generator is None:
                generator = torch.Generator().manual_seed(request.params.seed)
                self._generators[request.request_id] = generator
        return SamplingRow(request.params, request.prompt_token_ids, request.output_token_ids,
                           generator, request.eos_token_ids)

    def close(self) -> None:
        self.pool.close()
