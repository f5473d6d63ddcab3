"""The engine's CUDA path, end to end, on a tiny random Llama: a prepared check for a GPU machine.

Why: the CUDA code path (``EngineConfig.device``, the engine's device selection, and
``KVPool``'s host tier in pinned memory with host<->device moves on a CUDA copy stream
ordered by events) is not exercised by the CPU test suite. This script checks, on one device:

0. ``default_device``: ``EngineConfig(device=None)`` picks CUDA when torch sees it (CPU
   otherwise), with the device KV tier there and the host tier in CPU memory;
1. ``fp32_greedy_aligned`` / ``fp32_greedy_fcfs``: a batch of prompts of different lengths
   through ``LLM.generate`` (float32, greedy, every request in flight at once) gives the same
   token ids as transformers' greedy ``generate`` on the same weights and device, token for
   token up to the first step where transformers' own top-2 logits are a near-tie (rounding
   decides those; how many prompts have one is reported);
2. ``fp32_tier_moves``: the same with a device KV budget too small for the batch, so the
   aligned policy writes cohorts back to the host tier and prefetches them again; the
   outputs must still match, moves must have happened in both directions, nothing may leak,
   and on CUDA every move must have gone through the copy stream (a CUDA event) with the
   host caches pinned;
3. ``bf16``: the same batch in bfloat16 against transformers in bfloat16; the agreement is
   reported, not required (the two round differently);
4. ``rough_decode``: a run of many requests and many tokens (bfloat16) whose output tokens
   per second are reported as a rough figure only: one run, prefill included, a tiny model,
   and on CUDA the reference ops (the compiled kernels are CPU only).

The model is built with the test suite's ``tests.model_utils.tiny_hf_model`` (every weight
random, norms included) and saved as a Hugging Face directory with a word-level tokenizer.
With ``--device cpu`` the same checks run on CPU tiers (the CUDA-only parts are skipped and
say so), which is how the script is debugged before a GPU run. A compact JSON summary is
printed last and written to ``$OUT/gpu_check.json`` when ``$OUT`` is set; the exit status is
1 when a required check failed.

    python benchmarks/gpu_check.py [--device cuda|cpu] [--new-tokens 32]
        [--bench-requests 64] [--bench-tokens 128] [--threads N] [--kernel-path PATH]
        [--watchdog-s S]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing: alignedserve, tests
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from alignedserve import LLM, SamplingParams  # noqa: E402
from alignedserve.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from alignedserve.executor.kv_pool import KVPool  # noqa: E402
from alignedserve.kv.store import HOST, KVOp, KVOpKind  # noqa: E402

# hidden 256, 8 heads of 32, 2 KV heads (GQA 4:1), 4 layers; vocab = the tokenizer's 256 ids
MODEL = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
             bos_token_id=252, eos_token_id=253, tie_word_embeddings=False)
WORDS = 252  # ids 0..251 are words, 252..255 special
PROMPT_LENGTHS = [5, 17, 40, 96, 150, 230, 333, 411]
TIE = 1e-3  # transformers' top-2 logit gap under which a greedy step counts as a near-tie
# Tier-move run: ~730 fp32 tokens of device KV for ~1.5k tokens of prompts and outputs
TIER_DEVICE_KV_GB = 0.0014
TIER_HOST_KV_GB = 0.05


# ------------------------------------------------------------------ the model on disk

def save_tokenizer(path: Path) -> None:
    """A word-level tokenizer over ``w0``..``w251`` plus four special tokens (256 ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(WORDS)}
    vocab.update({"<s>": 252, "</s>": 253, "<unk>": 254, "<pad>": 255})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", pad_token="<pad>").save_pretrained(str(path))


def save_tiny_model(path: Path, seed: int) -> None:
    """The tiny random Llama as a Hugging Face directory (config, safetensors, tokenizer)."""
    from transformers.utils import logging as hf_logging

    from tests.model_utils import tiny_hf_model

    hf_logging.disable_progress_bar()
    tiny_hf_model("llama", seed=seed, **MODEL).save_pretrained(str(path))
    save_tokenizer(path)


def make_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, WORDS, (n,), generator=g).tolist() for n in lengths]


# ------------------------------------------------------------------ transformers' side

@dataclass(slots=True)
class Reference:
    tokens: list[list[int]]
    comparable: list[int]  # leading steps of each prompt that are not near-ties


def load_hf(path: Path, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = MODEL["vocab_size"] - 1
    return model


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int,
              device: str) -> Reference:
    """transformers' greedy ``generate``, one prompt at a time (no padding), with the raw
    logits of every step for the near-tie cut-off."""
    ref = Reference([], [])
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, output_logits=True,
                             return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        if len(tokens) != new_tokens:
            raise RuntimeError(f"transformers stopped after {len(tokens)} tokens")
        ref.tokens.append(tokens)
        ref.comparable.append(first_near_tie(out.logits, new_tokens))
    return ref


def first_near_tie(logits: tuple[torch.Tensor, ...], steps: int) -> int:
    for step, row in enumerate(logits):
        top2 = torch.topk(row[0].float(), 2).values
        if (top2[0] - top2[1]).item() < TIE:
            return step
    return steps


# ------------------------------------------------------------------ the engine's side

@dataclass(slots=True)
class MoveLog:
    """What the engine's KV pool did, read off the op log it replays."""

    moves: Counter = field(default_factory=Counter)  # "dev0->host", "host->dev0"
    stream_moves: int = 0  # moves whose completion is a CUDA event (the copy stream)
    thread_moves: int = 0  # moves done by the CPU copier thread
    host_allocs: int = 0
    host_unpinned: int = 0  # host-tier tensors that were not pinned (CUDA needs them pinned)


def watch_pool(pool: KVPool) -> MoveLog:
    """Count the pool's tier moves by direction (from the op log it replays, in order) and by
    mechanism (what each started move waits on), wrapping ``apply`` and ``_begin_move``."""
    log = MoveLog()
    tiers: dict[Any, str] = {}
    apply, begin_move = pool.apply, pool._begin_move

    def counting_apply(ops: list[KVOp]) -> tuple[float, int]:
        for op in ops:
            if op.kind is KVOpKind.MOVE_BEGIN:
                log.moves[f"{tiers[op.handle]}->{op.tier}"] += 1
            elif op.kind is KVOpKind.FREE:
                tiers.pop(op.handle, None)
            else:  # ALLOC, GROW, MOVE_END: the handle lives in op.tier
                tiers[op.handle] = op.tier
        return apply(ops)

    def noting_begin_move(op: KVOp) -> int:
        copied = begin_move(op)
        note_move(log, pool._moves[op.handle], op.tier)
        return copied

    pool.apply = counting_apply
    pool._begin_move = noting_begin_move
    return log


def note_move(log: MoveLog, move: Any, dst_tier: str) -> None:
    if isinstance(move.done, torch.cuda.Event):
        log.stream_moves += 1
    else:
        log.thread_moves += 1
    if dst_tier == HOST:
        log.host_allocs += 1
        on_stream = isinstance(move.done, torch.cuda.Event)
        log.host_unpinned += int(on_stream and not move.dst.is_pinned())


def make_llm(path: Path, device: str, dtype: str, policy: str, args: argparse.Namespace,
             device_kv_gb: float = 1.0, host_kv_gb: float = 1.0) -> LLM:
    return LLM.from_config(EngineConfig(
        model=str(path), dtype=dtype, device=device, policy=policy, seed=0,
        num_threads=args.threads, kernel_path=args.kernel_path,
        scheduler=SchedulerConfig(max_num_batched_tokens=256, kv_reserve_tokens=32),
        cache=CacheConfig(device_kv_gb=device_kv_gb, host_kv_gb=host_kv_gb)))


def engine_greedy(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def leaks(llm: LLM) -> dict[str, int]:
    """KV still held after every request finished: tokens per tier in the store, and pool
    tensors beyond those whose FREE is logged but not yet replayed (the pool replays the log
    at the next step, so the last request's cache is released then)."""
    engine = llm.engine
    held = {t: engine.store.used(t) for t in engine.store.tiers if engine.store.used(t)}
    pending_free = sum(op.kind is KVOpKind.FREE for op in engine.store._ops)
    if len(engine.executor.pool) != pending_free:
        held["pool_tensors"] = len(engine.executor.pool)
        held["pending_free"] = pending_free
    return held


def on_device(llm: LLM, device: str) -> bool:
    params = list(llm.engine.loaded.model.parameters())
    return all(p.device.type == device for p in params)


# ------------------------------------------------------------------ comparisons

def compare(ref: Reference, got: list[list[int]]) -> dict[str, Any]:
    """Per prompt: equal up to the near-tie cut-off (required), and whole-run equality."""
    prefix_ok = [g[:c] == r[:c] for g, r, c in zip(got, ref.tokens, ref.comparable)]
    return {"prompts": len(got), "equal_to_cutoff": sum(prefix_ok),
            "equal_whole": sum(g == r for g, r in zip(got, ref.tokens)),
            "near_tie_prompts": sum(c < len(r) for c, r in zip(ref.comparable, ref.tokens)),
            "mismatch_prompts": [i for i, ok in enumerate(prefix_ok) if not ok],
            "ok": all(prefix_ok) and all(len(g) == len(r) for g, r in zip(got, ref.tokens))}


def agreement(ref: Reference, got: list[list[int]]) -> dict[str, Any]:
    """How far each prompt's tokens agree before the first difference (bf16: reported)."""
    prefixes = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r))
                for g, r in zip(got, ref.tokens)]
    return {"prompts": len(got), "equal_whole": sum(p == len(r) for p, r in
                                                    zip(prefixes, ref.tokens)),
            "agreeing_prefix_tokens": prefixes, "tokens_per_prompt": len(ref.tokens[0])}


# ------------------------------------------------------------------ the checks

def check_default_device(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``device=None`` resolves to CUDA when available; the tiers sit where they should."""
    want = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM.from_config(EngineConfig(model=str(path), dtype="float32",
                                       num_threads=args.threads, kernel_path=args.kernel_path))
    try:
        engine = llm.engine
        tiers = {t: str(d) for t, d in engine.executor.pool.tier_devices.items()}
        got = engine_greedy(llm, make_prompts([7], 3), 4)
    finally:
        llm.engine.close()
    copy_stream = engine.executor.pool._cuda_stream is not None
    ok = (engine.device.type == want and on_device(llm, want) and tiers[HOST] == "cpu"
          and torch.device(tiers["dev0"]).type == want and copy_stream == (want == "cuda")
          and len(got[0]) == 4)
    return {"ok": ok, "engine_device": str(engine.device), "tier_devices": tiers,
            "copy_stream": copy_stream}


def check_fp32(path: Path, device: str, prompts: list[list[int]], ref: Reference,
               args: argparse.Namespace, policy: str) -> dict[str, Any]:
    llm = make_llm(path, device, "float32", policy, args)
    try:
        result = compare(ref, engine_greedy(llm, prompts, args.new_tokens))
        result["weights_on_device"] = on_device(llm, device)
        result["leaks"] = leaks(llm)
        result["ok"] = result["ok"] and result["weights_on_device"] and not result["leaks"]
    finally:
        llm.engine.close()
    return result


def check_tier_moves(path: Path, device: str, prompts: list[list[int]], ref: Reference,
                     args: argparse.Namespace) -> dict[str, Any]:
    llm = make_llm(path, device, "float32", "aligned", args, TIER_DEVICE_KV_GB, TIER_HOST_KV_GB)
    log = watch_pool(llm.engine.executor.pool)
    try:
        result = compare(ref, engine_greedy(llm, prompts, args.new_tokens))
        stats = llm.engine.stats
        result.update(moves=dict(log.moves), stream_moves=log.stream_moves,
                      thread_moves=log.thread_moves, host_moves=log.host_allocs,
                      copy_bytes=stats.copy_bytes, copy_wait_s=round(stats.copy_wait_s, 4),
                      leaks=leaks(llm))
    finally:
        llm.engine.close()
    both_ways = log.moves["dev0->host"] > 0 and log.moves["host->dev0"] > 0
    result["ok"] = result["ok"] and both_ways and not result["leaks"]
    if device == "cuda":
        total = sum(log.moves.values())
        result["all_moves_on_stream"] = log.stream_moves == total
        result["host_caches_pinned"] = log.host_unpinned == 0
        result["ok"] = result["ok"] and log.stream_moves == total and log.host_unpinned == 0
    return result


def check_bf16(path: Path, device: str, prompts: list[list[int]],
               args: argparse.Namespace) -> dict[str, Any]:
    hf = load_hf(path, torch.bfloat16, device)
    ref = hf_greedy(hf, prompts, args.new_tokens, device)
    del hf
    llm = make_llm(path, device, "bfloat16", "aligned", args)
    try:
        got = engine_greedy(llm, prompts, args.new_tokens)
        result = agreement(ref, got)
        result["leaks"] = leaks(llm)
    finally:
        llm.engine.close()
    result["ok"] = all(len(g) == args.new_tokens for g in got) and not result["leaks"]
    result["hf_near_tie_prompts"] = sum(c < args.new_tokens for c in ref.comparable)
    return result


def rough_decode_rate(path: Path, device: str, args: argparse.Namespace) -> dict[str, Any]:
    """Output tok/s of one bf16 run of ``bench_requests`` x ``bench_tokens`` (prompts of 64
    tokens, all submitted at once, prefill included), after a small warm-up run."""
    llm = make_llm(path, device, "bfloat16", "aligned", args, 4.0, 8.0)
    try:
        engine_greedy(llm, make_prompts([16, 16], 5), 4)  # warm-up
        prompts = make_prompts([64] * args.bench_requests, 6)
        start = time.perf_counter()
        got = engine_greedy(llm, prompts, args.bench_tokens)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    finally:
        llm.engine.close()
    tokens = sum(len(g) for g in got)
    return {"label": "rough: one run, prefill included, tiny model",
            "kernel_path": llm.engine.kernels.path,
            "requests": args.bench_requests, "prompt_tokens": 64,
            "new_tokens": args.bench_tokens, "output_tokens": tokens,
            "seconds": round(seconds, 3), "out_tok_s": round(tokens / seconds, 1),
            "ok": tokens == args.bench_requests * args.bench_tokens}


# ------------------------------------------------------------------ driver

def environment(device: str) -> dict[str, Any]:
    import transformers

    env = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "cuda_available": torch.cuda.is_available()}
    if device == "cuda":
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    return env


def guarded(name: str, check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one check; an exception fails it (with the error's last lines) and the script goes
    on to the next, so one run on a borrowed machine reports every check."""
    start = time.perf_counter()
    print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
    try:
        result = check()
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc().splitlines()[-12:]}
    result["wall_s"] = round(time.perf_counter() - start, 2)
    print(f"gpu_check: {name}: {'ok' if result['ok'] else 'FAILED'}", file=sys.stderr,
          flush=True)
    return result


def run_checks(path: Path, device: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    prompts = make_prompts(PROMPT_LENGTHS, args.seed)
    refs: list[Reference] = []

    def reference() -> dict[str, Any]:
        hf = load_hf(path, torch.float32, device)
        refs.append(hf_greedy(hf, prompts, args.new_tokens, device))
        return {"ok": True, "near_tie_prompts": sum(c < args.new_tokens
                                                    for c in refs[0].comparable)}

    checks = {"default_device": guarded("default_device",
                                        lambda: check_default_device(path, args)),
              "hf_fp32_reference": guarded("hf_fp32_reference", reference)}
    if refs:
        for policy in ("aligned", "fcfs"):
            checks[f"fp32_greedy_{policy}"] = guarded(
                f"fp32_greedy_{policy}",
                lambda: check_fp32(path, device, prompts, refs[0], args, policy))
        checks["fp32_tier_moves"] = guarded(
            "fp32_tier_moves", lambda: check_tier_moves(path, device, prompts, refs[0], args))
    checks["bf16"] = guarded("bf16", lambda: check_bf16(path, device, prompts, args))
    checks["rough_decode"] = guarded("rough_decode", lambda: rough_decode_rate(path, device,
                                                                               args))
    return checks


def summarize(env: dict[str, Any], checks: dict[str, dict[str, Any]],
              skipped: list[str]) -> dict[str, Any]:
    failed = [name for name, c in checks.items() if not c["ok"]]
    tier = checks.get("fp32_tier_moves", {})
    if torch.cuda.is_available() and env["device"] == "cuda":
        env["max_memory_allocated_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return {"ok": not failed, "passed": [n for n in checks if n not in failed],
            "failed": failed, "skipped": skipped, **env,
            "model": {k: MODEL[k] for k in ("hidden_size", "num_hidden_layers",
                                            "num_attention_heads", "num_key_value_heads",
                                            "vocab_size")},
            "prompt_lengths": PROMPT_LENGTHS, "new_tokens": checks.get("bf16", {}).get(
                "tokens_per_prompt"),
            "tier_moves": tier.get("moves"), "stream_moves": tier.get("stream_moves"),
            "rough_decode_tok_s": checks["rough_decode"].get("out_tok_s"), "checks": checks}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda when available, else cpu")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--bench-requests", type=int, default=None, help="default 64 (cpu: 8)")
    parser.add_argument("--bench-tokens", type=int, default=None, help="default 128 (cpu: 16)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kernel-path", default=None, help="CPU kernel path (cpu only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--watchdog-s", type=float, default=0.0,
                        help="after this many seconds, print every thread's stack and exit "
                             "(a hang on a borrowed machine still says where); 0: off")
    args = parser.parse_args()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cpu = args.device == "cpu"
    args.bench_requests = args.bench_requests or (8 if cpu else 64)
    args.bench_tokens = args.bench_tokens or (16 if cpu else 128)
    return args


def main() -> int:
    args = parse_args()
    if args.watchdog_s > 0:
        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda asked for, but torch sees no CUDA device", file=sys.stderr)
        return 2
    # float32 must be IEEE float32 on both sides (no TF32) for a token-for-token comparison
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    skipped = []
    if args.device != "cuda":
        skipped.append("CUDA-only parts skipped on cpu: the copy stream and its events, pinned "
                       "host caches, the GPU name; tier moves ran through the CPU copier thread")
        print("gpu_check: " + skipped[0], file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        path = Path(tmp) / "tiny-llama"
        save_tiny_model(path, args.seed)
        checks = run_checks(path, args.device, args)
    summary = summarize(environment(args.device), checks, skipped)
    text = json.dumps(summary)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
