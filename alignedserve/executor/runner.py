"""``ModelRunner``: turns a StepPlan into one forward pass of the model and samples (the
simulator's stand-in for it is ``sim/executor.py``). A step of at least ``SPLIT_MIN_ROWS``
decode rows and a small prompt part may run as two halves at once (``SplitForward``)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from alignedserve.executor.attention import PrefillSegment, StepAttention
from alignedserve.executor.kv_pool import KVPool
from alignedserve.executor.split_forward import SplitForward
from alignedserve.model.loader import LoadedModel
from alignedserve.model.sampler import SampleResult, Sampler, SamplingRow
from alignedserve.request import Request
from alignedserve.sched.plan import SampledToken, StepOutput, StepPlan


# Fewest decode rows a step splits at: each half's linears must stay bound by arithmetic (a
# dozen rows or more), since each half streams every weight matrix on its own.
SPLIT_MIN_ROWS = 32


class ModelRunner:
    """Executes plans on a loaded model; owns the KV tensors and the per-request RNGs.

    ``split``: run steps of many decode rows as two halves at once (see `SplitForward`), each
    on half of the intra-op threads; None runs every step as one batch.
    """

    def __init__(self, loaded: LoadedModel, pool: KVPool, device: torch.device, seed: int | None,
                 split: SplitForward | None = None):
        self.loaded = loaded
        self.model = loaded.model
        self.pool = pool
        self.device = device
        self.kernels = self.model.kernels
        self.sampler = Sampler(seed, self.kernels)
        self.scale = loaded.config.head_dim ** -0.5
        self._generators: dict[str, torch.Generator] = {}
        self.split = split

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
        if self.split is not None and self._splits(len(ids) - len(decode), len(decode)):
            hidden = self._split_hidden(segments, ids, positions, decode)
        else:
            hidden = self._hidden(segments, ids, positions, decode)
        if not samplers:
            return {}
        # sample_at is increasing, so as many entries as tokens means every row, in order (a
        # decode-only step): no gather.
        rows = hidden if len(sample_at) == len(ids) else hidden[sample_at]
        result = self._sample(rows, [self._row(r) for r in samplers])
        return {
            r.request_id: SampledToken(result.token_ids[i], result.logprobs[i],
                                       result.top_logprobs[i])
            for i, r in enumerate(samplers)
        }

    def _sample(self, rows: torch.Tensor, params: list[SamplingRow]) -> SampleResult:
        """One token per row of final hidden states. Where every row is plain greedy the LM
        head's greedy epilogue gives the tokens without storing the logits, if the head has
        one (the same index as the sampler's argmax over the logits); otherwise the logits
        go to the sampler."""
        if self.sampler.plain_greedy(params, self.model.config.vocab_size):
            tokens = self.model.greedy_tokens(rows)
            if tokens is not None:
                return self.sampler.greedy(tokens)
            # The rows are known plain greedy: the sampler need not check them again.
            return self.sampler.greedy_logits(self.model.compute_logits(rows, widen=False))
        return self.sampler(self.model.compute_logits(rows, widen=False), params)

    @staticmethod
    def _splits(prompt_tokens: int, decode_rows: int) -> bool:
        """Whether a step of this shape runs as two halves: enough decode rows, and a prompt
        part small enough (at most half the rows) that the halves can be balanced."""
        return decode_rows >= SPLIT_MIN_ROWS and 2 * prompt_tokens <= decode_rows

    def _hidden(self, segments: list[PrefillSegment], ids: list[int], positions: list[int],
                decode: list[Request]) -> torch.Tensor:
        """Final hidden states of the flattened tokens: prefill chunks, then decode rows
        (the last ``len(decode)`` of ``ids`` / ``positions``)."""
        decode_positions = positions[len(positions) - len(decode):]
        attn = StepAttention(self.kernels, segments, [self.pool.get(r.kv) for r in decode],
                             torch.tensor(decode_positions, dtype=torch.int64), self.scale,
                             self.pool.tiled)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        return self.model(input_ids, pos, attn)

    def _split_hidden(self, segments: list[PrefillSegment], ids: list[int],
                      positions: list[int], decode: list[Request]) -> torch.Tensor:
        """`_hidden` as two halves at once. The first half takes the prompt chunks (P tokens);
        of the decode rows, the first P go to the second half and the rest alternate, so both
        halves get about as many tokens and, rows being in any order, as many cached ones."""
        prompt = len(ids) - len(decode)  # at most half the decode rows (_splits)
        rows = list(range(len(decode)))
        halves = (rows[prompt::2], rows[:prompt] + rows[prompt + 1::2])

        def run(chunks: list[PrefillSegment], tokens: int,
                own: list[int]) -> Callable[[], torch.Tensor]:
            at = list(range(tokens)) + [prompt + r for r in own]  # indices into ids
            return lambda: self._hidden(chunks, [ids[j] for j in at], [positions[j] for j in at],
                                        [decode[r] for r in own])

        first, second = self.split.run(run(segments, prompt, halves[0]), run([], 0, halves[1]))
        hidden = first.new_empty((len(ids), first.shape[1]))
        hidden[:prompt] = first[:prompt]
        for half, out in zip(halves, (first[prompt:], second)):
            hidden[torch.tensor(half, dtype=torch.int64) + prompt] = out
        return hidden

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
        if self.split is not None:
            self.split.close()
