"""Command-line flags shared by every subcommand that builds an engine."""

from __future__ import annotations

import argparse

from alignedserve.config import (SERVING_STEP_TIME_TARGET_S, CacheConfig, EngineConfig,
                                 SchedulerConfig)
from alignedserve.kernels.isa import PATHS


def add_engine_args(parser: argparse.ArgumentParser, serving: bool = False) -> None:
    """Engine options. ``serving`` picks the server's defaults where they differ from offline
    use (as vLLM's defaults depend on its usage context): --preallocate-kv on (a server runs
    for long, and no request should wait on page faults) and --step-time-target on (requests
    arrive while others decode, and each decode row waits on the step's prompt chunk)."""
    sched = SchedulerConfig()  # scheduler defaults come from the config, so they cannot drift
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e5m2", "fp8"],
                   help="KV cache element type: auto (= --dtype) or fp8_e5m2 (8-bit: half the "
                        "KV memory and decode-attention traffic, small accuracy cost)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    g.add_argument("--kernel-path", default=None, choices=list(PATHS),
                   help="kernel instruction set (default: $ALIGNEDSERVE_ISA, else the best "
                        "this CPU supports); a lower one tests or measures that path")
    g.add_argument("--policy", default="aligned", choices=["aligned", "fcfs", "static"],
                   help="scheduling policy: aligned (length-aligned cohorts, default), fcfs "
                        "(vLLM-like continuous batching), static (FasterTransformer-like)")
    g.add_argument("--split-decode", action=argparse.BooleanOptionalAction, default=False,
                   help="run steps of 32+ decode rows as two halves at once, each on half the "
                        "threads, so one half's attention may overlap the other's linears "
                        "(bf16 on a compiled CPU path; outputs unchanged; off by default: it "
                        "measured no faster than one batch)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="give every request the same bits whatever shares its steps, at any "
                        "step size (every kernel path but amx is that way already; on amx its "
                        "own linear then takes steps above 1024 rows too, instead of oneDNN)")
    g.add_argument("--seed", type=int, default=None, help="seed for requests without their own")
    g.add_argument("--max-model-len", type=int, default=None, help="context length cap")
    g.add_argument("--device-kv-gb", type=float, default=4.0, help="KV budget per device (GiB)")
    g.add_argument("--host-kv-gb", type=float, default=8.0, help="KV budget in host RAM (GiB)")
    g.add_argument("--max-num-seqs", type=int, default=sched.max_num_seqs,
                   help="max requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=sched.max_num_batched_tokens,
                   help="per-step token budget (prefills are chunked to fit)")
    g.add_argument("--step-time-target", type=float,
                   default=SERVING_STEP_TIME_TARGET_S if serving else sched.step_time_target_s,
                   help="seconds: prompt tokens per step are also held to what this machine "
                        "prefills in about this long beside the step's decode rows, so decode "
                        "rows do not wait on long prompt chunks (0: the token budget only; "
                        f"default {SERVING_STEP_TIME_TARGET_S} for serve, 0 offline)")
    g.add_argument("--min-prompt-tokens-per-step", type=int,
                   default=sched.min_prompt_tokens_per_step,
                   help="the step-time target never holds a step below this many prompt tokens")
    g.add_argument("--align-tolerance", type=int, default=sched.align_tolerance,
                   help="max KV-length difference inside an aligned decode batch")
    g.add_argument("--max-cohort-rows", type=int, default=64,
                   help="aligned: cohorts larger than this are split")
    g.add_argument("--max-wait-steps", type=int, default=16,
                   help="aligned: steps a ready cohort may wait before it gets priority")
    g.add_argument("--catchup-window", type=int, default=sched.catchup_window,
                   help="aligned: hold a small cohort up to this many steps so a shorter one "
                        "catches up and merges (0: never hold)")
    g.add_argument("--admission", default=sched.admission, choices=["shortest", "fcfs"],
                   help="aligned: which waiting request is prefilled next: shortest prompt "
                        "first (with aging, default) or arrival order")
    g.add_argument("--max-admit-wait-steps", type=int, default=sched.max_admit_wait_steps,
                   help="aligned, shortest: steps after which a waiting request goes before "
                        "every younger one")
    g.add_argument("--max-inflight", type=int, default=4096,
                   help="aligned: requests in flight at once (KV in device or host tier)")
    g.add_argument("--no-tiled-kv", dest="tiled_kv", action="store_false",
                   help="keep bf16 KV caches token-major (default: bf16-pair blocks where a "
                        "compiled kernel path runs and head_dim is 64)")
    g.add_argument("--preallocate-kv", action=argparse.BooleanOptionalAction,
                   default=serving,
                   help="fault in the device KV budget at start-up (CPU; at most half the free "
                        "RAM)")
    g.add_argument("--num-devices", type=int, default=1,
                   help="device KV tiers; devices beyond the first stage KV for it")
    g.add_argument("--prefetch-link-tokens", type=int, default=0,
                   help="aligned: KV tokens one host link moves per step (0: unlimited)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        device=args.device, num_threads=args.num_threads, kernel_path=args.kernel_path,
        policy=args.policy, split_decode=args.split_decode,
        batch_invariant=args.batch_invariant, seed=args.seed,
        max_model_len=args.max_model_len,
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  step_time_target_s=args.step_time_target,
                                  min_prompt_tokens_per_step=args.min_prompt_tokens_per_step,
                                  align_tolerance=args.align_tolerance,
                                  max_cohort_rows=args.max_cohort_rows,
                                  max_wait_steps=args.max_wait_steps,
                                  catchup_window=args.catchup_window,
                                  max_inflight=args.max_inflight,
                                  admission=args.admission,
                                  max_admit_wait_steps=args.max_admit_wait_steps,
                                  prefetch_link_tokens=args.prefetch_link_tokens),
        cache=CacheConfig(device_kv_gb=args.device_kv_gb, host_kv_gb=args.host_kv_gb,
                          num_devices=args.num_devices, tiled_layout=args.tiled_kv,
                          preallocate_kv=args.preallocate_kv))
