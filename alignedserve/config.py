"""Engine configuration: small dataclasses, one per concern."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

GiB = 1 << 30


# `serve`'s --step-time-target: under trace load a step that carries 2048 prompt tokens lasts
# seconds on a CPU, and every decode row in it waits (docs/results/, the Zen 3 and Zen 4 trace
# runs of 2026-12-02). Each step also pays a fixed cost (the weights read once, the step's
# Python), so a shorter target loses throughput to it in about the ratio fixed cost / target,
# on every machine alike; offline generation keeps the token budget alone.
SERVING_STEP_TIME_TARGET_S = 0.5


@dataclass(slots=True)
class SchedulerConfig:
    """Limits every policy honours.

    ``max_num_batched_tokens`` is the per-step token budget (decode rows count one token each);
    it is what keeps a long prompt from freezing decoding: prompts are prefilled in chunks.
    ``kv_reserve_tokens`` is how many output tokens of room a request's KV gets beyond what it
    holds, so that allocations grow rarely.
    """

    max_num_seqs: int = 256
    # 2048 rather than 1024: the projections' GEMMs run faster per row at 2048 rows on the CPU,
    # and so did whole workloads in-process (docs/results/, the fourth run).
    max_num_batched_tokens: int = 2048
    # Prompt tokens per step are also held to what this machine prefills in about this many
    # seconds beside the step's decode rows (alignedserve.sched.budget), never below
    # min_prompt_tokens_per_step; 0 (offline's default) turns the time target off. The server
    # defaults to SERVING_STEP_TIME_TARGET_S.
    step_time_target_s: float = 0.0
    min_prompt_tokens_per_step: int = 128
    kv_reserve_tokens: int = 256
    align_tolerance: int = 2
    max_queue: int = 100_000
    # aligned policy only:
    max_cohort_rows: int = 64  # cohorts above this are split
    # Hold a small cohort up to this many steps so a shorter one catches up and they merge.
    # That pays only where decode pads a batch to its longest row (the simulator's padded and
    # grouped kernels, where `alignedserve simulate` defaults to 8); this engine's decode
    # attention reads each row's exact length, so a hold only delays the held cohort's tokens
    # (measured on a served trace, docs/results/, the fifth run): 0 = never hold.
    catchup_window: int = 0
    max_wait_steps: int = 16  # a ready cohort waits at most this many steps before it has priority
    max_inflight: int = 4096  # requests admitted at once (their KV in device or host tiers)
    # Which waiting request is admitted next (alignedserve.sched.waiting): "shortest" prompt
    # first, a request that has waited max_admit_wait_steps steps before any younger one; or
    # "fcfs" (arrival order).
    admission: str = "shortest"
    max_admit_wait_steps: int = 64
    # KV tokens one host->device link can carry during one step (0: unlimited). With several
    # devices, prefetch that does not fit the compute device's link is staged on a peer device.
    # When set, it also caps the host-resident part of the pool (see AlignedScheduler).
    prefetch_link_tokens: int = 0


@dataclass(slots=True)
class CacheConfig:
    device_kv_gb: float = 4.0
    host_kv_gb: float = 8.0
    num_devices: int = 1
    granularity: int = 16
    # Lay bf16 caches out in bf16-pair blocks (alignedserve.kernels.kv_layout) on every
    # compiled kernel path where head_dim is 64; False keeps every cache token-major.
    tiled_layout: bool = True
    # Fault in the device tiers' KV budget at start-up where it is CPU memory (capped at half
    # the free RAM), as vLLM reserves its KV cache, so no request waits on page faults; the
    # server turns it on (alignedserve.huge_pages says why faults are slow here).
    preallocate_kv: bool = False

    def device_bytes(self) -> list[int]:
        return [int(self.device_kv_gb * GiB)] * self.num_devices

    def host_bytes(self) -> int:
        return int(self.host_kv_gb * GiB)


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None
    dtype: str = "bfloat16"
    # KV cache element type: "auto" (the model dtype) or "fp8_e5m2" (8-bit, half the KV bytes;
    # values rounded to e5m2, no scales: e5m2 keeps fp16's exponent range).
    kv_cache_dtype: str = "auto"
    device: str | None = None  # None: cuda when available, else cpu
    num_threads: int | None = None
    # Kernel instruction-set path (alignedserve.kernels.isa): amx, avx512_bf16, avx512,
    # avx2 or reference; None takes $ALIGNEDSERVE_ISA, else the best this CPU supports.
    kernel_path: str | None = None
    policy: str = "aligned"
    # Run steps of many decode rows as two halves at once, each on half the threads (bf16 on
    # a compiled CPU path, two threads or more; executor/split_forward.py), so one half's
    # attention may overlap the other's linears. Outputs are the same either way. Off by
    # default: it measured no faster than one batch (docs/architecture.md, "Split decode
    # steps").
    split_decode: bool = False
    # Give every row the same bits whatever shares its step, at any step size. Every kernel
    # path but amx is built that way; on amx this makes its own linear take steps of any size
    # instead of oneDNN above 1024 rows (whose rounding depends on the row count). Off by
    # default: on AMX hardware that costs more than the 5% a default may cost
    # (docs/results/2026-12-08-amx-first-run-since-the-kernel-layer.md;
    # alignedserve.kernels.dispatch.Kernels).
    batch_invariant: bool = False
    seed: int | None = None
    max_model_len: int | None = None  # None: the model's own context length
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)


def cache_root() -> Path:
    """Root of AlignedServe's per-machine cache: ``$ALIGNEDSERVE_CACHE``, or
    ``~/.cache/alignedserve`` where that is unset or empty. The default model, tokenizers and
    the compiled kernels live under it."""
    return Path(os.environ.get("ALIGNEDSERVE_CACHE") or "~/.cache/alignedserve").expanduser()
