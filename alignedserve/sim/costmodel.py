"""Prices the compute of one engine step on one device: a roofline per operation.

Per step, in order of the forward pass:

* **linear layers** (QKV, O, MLP) over all tokens of the step at once (prefill chunks and
  decode rows concatenated): ``max(FLOPs / achieved FLOP/s, (weights + activations) /
  achieved bandwidth)``, so the weights are read once per step whatever the batch;
* **prefill attention** (one varlen kernel per layer): roofline of the causal FLOPs and the
  KV bytes it reads;
* **decode attention**, one kernel call per decode batch and layer, priced by the chosen
  ``AttentionKernel`` (see its docstring) — this is where iteration-level bubbles live;
* **LM head and sampling** on the rows that sample only;
* **host overhead**: the CPU time of scheduling and launching, which is not overlapped.

Copies are priced by the executor (they depend on what else is in flight), not here.
Invariant: every cost is >= 0 and non-increasing in every FLOP/s and bandwidth figure.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from operator import attrgetter

from alignedserve.sched.plan import StepPlan
from alignedserve.sim.hardware import DeviceProfile, HostProfile
from alignedserve.sim.models import ModelProfile

_COMPUTED = attrgetter("num_computed_tokens")


class AttentionKernel(str, enum.Enum):
    """How a decode-attention kernel spends time on a batch of rows with KV lengths L_i.

    Work items are thread blocks, one per (sequence, KV head); ``U`` of them run at once and
    one alone pulls at most ``unit_burst * bandwidth / U``.

    * ``padded``: every row is padded to the longest, cost ∝ rows × max(L) (static-batching
      kernels such as FasterTransformer's, or dense SDPA with a mask);
    * ``per-seq``: one block per sequence reads exactly its L_i (vLLM's paged-attention v1);
      cost ∝ ΣL, but the longest block sets a tail that dominates when rows × heads are few
      relative to U;
    * ``split-kv``: flash-decoding; long rows are split into partitions so no block is
      longer than ``split_partition`` tokens; cost ∝ ΣL plus a small reduction. The kernel
      picks splitting only where it pays, so it is never slower than ``per-seq``.

    Hence, for any batch: padded >= per-seq >= split-kv.
    """

    PADDED = "padded"
    PER_SEQ = "per-seq"
    SPLIT_KV = "split-kv"


class AttentionLaunch(str, enum.Enum):
    """How the decode batches of one step reach the GPU.

    * ``per-batch``: one kernel call per decode batch and layer (DESIGN.md §4: a dense kernel
      per cohort); the calls run one after another, each paying its own launch and tail;
    * ``grouped``: one call per layer covering every batch of the step (a varlen / grouped
      launch), each batch still padded only to its own longest row.
    """

    PER_BATCH = "per-batch"
    GROUPED = "grouped"


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds per part of one step. ``device_s`` is the compute stream; ``host_s`` precedes it."""

    linear_s: float = 0.0
    prefill_attn_s: float = 0.0
    decode_attn_s: float = 0.0
    lm_head_s: float = 0.0
    sample_s: float = 0.0
    host_s: float = 0.0
    # per decode batch: (rows, min KV length, max KV length, Σ KV lengths), as stats.BatchRecord
    batches: tuple[tuple[int, int, int, int], ...] = ()
    prefill_tokens: int = 0

    @property
    def device_s(self) -> float:
        return (self.linear_s + self.prefill_attn_s + self.decode_attn_s + self.lm_head_s
                + self.sample_s)


class CostModel:
    """Prices steps of ``model`` on ``device`` with ``kernel`` decode attention.

    Stateless apart from constants derived once in ``__init__`` (the hot loop calls it per
    step, so per-call work is a handful of float operations per batch).
    """

    def __init__(self, model: ModelProfile, device: DeviceProfile, host: HostProfile,
                 kernel: AttentionKernel | str = AttentionKernel.SPLIT_KV,
                 launch: AttentionLaunch | str = AttentionLaunch.PER_BATCH,
                 split_partition: int = 512):
        self.model, self.device, self.host = model, device, host
        self.kernel = AttentionKernel(kernel)
        self.launch = AttentionLaunch(launch)
        self.split_partition = split_partition
        self._flops = device.flops
        self._attn_flops = device.attn_flops
        self._bw = device.bandwidth
        self._attn_bw = device.attn_bandwidth
        self._unit_bw = device.attn_bandwidth / device.parallel_units * device.unit_burst
        self._kv_layer = model.kv_bytes_per_token_layer
        self._item_bytes = model.kv_bytes_per_token_layer / model.num_kv_heads
        self._pair_flops = model.attn_flops_per_pair_layer
        self._layers = model.num_layers
        self._launch = device.kernel_launch_s

    # ---- parts -------------------------------------------------------------------------------
    def linear_s(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        m = self.model
        return max(tokens * m.linear_flops_per_token / self._flops,
                   (m.linear_weight_bytes + tokens * m.activation_bytes_per_token) / self._bw)

    def lm_head_s(self, rows: int) -> float:
        if rows <= 0:
            return 0.0
        m = self.model
        logits = rows * m.vocab_size * m.dtype_bytes
        return max(rows * m.lm_head_flops_per_row / self._flops,
                   (m.lm_head_bytes + logits) / self._bw)

    def sample_s(self, rows: int) -> float:
        """Softmax / top-k over fp32 logits: a few passes over rows x vocab, plus launches."""
        if rows <= 0:
            return 0.0
        return 3 * rows * self.model.vocab_size * 4 / self._bw + 4 * self._launch

    def prefill_attention_s(self, chunks: list[tuple[int, int]]) -> float:
        """Causal attention of chunks ``(start, num_tokens)`` over their own KV prefix."""
        if not chunks:
            return 0.0
        pairs = sum(n * s + n * (n + 1) // 2 for s, n in chunks)
        kv_tokens = sum(s + n for s, n in chunks)
        per_layer = max(pairs * self._pair_flops / self._attn_flops,
                        kv_tokens * self._kv_layer / self._bw)
        return self._layers * (per_layer + self._launch)

    def decode_attention_s(self, rows: int, total_len: int, max_len: int,
                           padded_len: int | None = None) -> float:
        """One kernel call per layer over ``rows`` rows, all layers.

        ``total_len`` = Σ L_i, ``max_len`` = max L_i; ``padded_len`` is what the padded kernel
        reads (default ``rows * max_len``; a grouped call passes Σ over batches of
        rows_b * max_b).
        """
        if rows <= 0:
            return 0.0
        kernel = self.kernel
        if kernel is AttentionKernel.PADDED:
            work = rows * max_len if padded_len is None else padded_len
        else:
            work = total_len
        per_layer = self._stream(work, max_len)
        if kernel is AttentionKernel.SPLIT_KV and max_len > self.split_partition:
            per_layer = min(per_layer, self._split(rows, total_len, max_len))
        return self._layers * (per_layer + self._launch)

    def _stream(self, work_tokens: float, longest: float) -> float:
        """Time of a kernel reading ``work_tokens`` of KV whose longest block has ``longest``."""
        throughput = max(work_tokens * self._kv_layer / self._attn_bw,
                         work_tokens * self._pair_flops / self._attn_flops)
        return max(throughput, longest * self._item_bytes / self._unit_bw)

    def _split(self, rows: int, total_len: int, max_len: int) -> float:
        splits = -(-max_len // self.split_partition)
        # partial outputs (fp32 value + max + sum per head) written then reduced: 2 passes
        partial = rows * self.model.num_heads * splits * (self.model.head_dim + 2) * 4 * 2
        return self._stream(total_len, self.split_partition) + partial / self._bw + self._launch

    def host_s(self, rows: int, batches: int) -> float:
        h = self.host
        return h.step_overhead_s + rows * h.per_row_overhead_s + batches * h.per_batch_overhead_s

    # ---- a whole plan -------------------------------------------------------------------------
    def price(self, plan: StepPlan) -> StepCost:
        """Cost of ``plan``'s compute (KV ops excluded). Call it before ``scheduler.update``.

        A decode row's KV length this step is ``num_computed_tokens + 1`` (the cache holds all
        but the newest token, which the step feeds: see ``Request``); reading the plain
        attribute instead of ``num_tokens`` keeps this hot loop cheap.
        """
        chunks = [(c.start, c.num_tokens) for c in plan.prefills]
        sampling = sum(1 for c in plan.prefills if c.sample)
        rows = total = longest = padded = 0
        decode_s = 0.0
        grouped = self.launch is AttentionLaunch.GROUPED
        batches = []
        for batch in plan.decode_batches:
            n = len(batch.requests)
            if not n:
                continue
            computed = list(map(_COMPUTED, batch.requests))
            b_total, b_max = sum(computed) + n, max(computed) + 1
            batches.append((n, min(computed) + 1, b_max, b_total))
            rows += n
            if grouped:
                total, padded = total + b_total, padded + n * b_max
                longest = max(longest, b_max)
            else:
                decode_s += self.decode_attention_s(n, b_total, b_max)
        if grouped:
            decode_s = self.decode_attention_s(rows, total, longest, padded)
        prefill_tokens = sum(n for _, n in chunks)
        return StepCost(linear_s=self.linear_s(prefill_tokens + rows),
                        prefill_attn_s=self.prefill_attention_s(chunks),
                        decode_attn_s=decode_s,
                        lm_head_s=self.lm_head_s(sampling + rows),
                        sample_s=self.sample_s(sampling + rows),
                        host_s=self.host_s(rows + len(chunks), len(plan.decode_batches)),
                        batches=tuple(batches), prefill_tokens=prefill_tokens)
