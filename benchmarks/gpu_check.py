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

Those are the ``offline`` group. Three more groups (``--checks`` picks groups; all by default):

* ``sampling`` (offline, float32): ``sampling`` runs seeded temperature / top-k / top-p /
  top-k+top-p+min-p / ``n=2`` requests: valid ids and lengths, the same seed repeats exactly,
  another seed differs somewhere, top-k draws lie in the top k (from 20 logprobs), the ``n``
  completions differ; ``sampling_penalties`` the same for repetition and presence/frequency
  penalties (and greedy with penalties); ``sampling_mixed_batch``: greedy and sampled rows in
  one batch give what each gives in a batch of its own kind; on CUDA, ``sampling_vs_cpu``
  reports how far a seeded case agrees with the same on CPU (not required).
* ``fp8``: ``fp8_kv`` runs the batch with ``kv_cache_dtype="fp8_e5m2"`` (float32 and bfloat16
  models): every KV tensor fp8, valid tokens, no leaks; agreement with the same model's
  own-dtype KV reported, not required. ``fp8_tier_moves``: the same under a device budget
  that forces write-backs and prefetches (on CUDA through the copy stream, pinned host
  caches); agreement with the fp8 run without moves reported.
* ``server``: the real ``alignedserve serve`` (the CLI module, this interpreter, this
  ``PYTHONPATH`` behind the checkout) on the model, float32, on a free 127.0.0.1 port, until
  ``/health`` answers: ``server_info`` (``/v1/models``, ``/version``, ``/engine/state``; on
  CUDA the ``reference`` kernel path); ``server_greedy``: a non-streaming ``/v1/completions``
  of three token-id prompts, greedy, whose tokens (read off ``logprobs: 0``) equal the offline
  engine's for the same prompts and transformers' greedy (to the near-tie cut-off);
  ``server_chat_stream``: a streaming ``/v1/chat/completions`` (the tokenizer carries a
  chat template) gives a role chunk, content, one finish reason, usage and ``[DONE]``, its
  content equal to the non-streaming answer; ``server_concurrent``: 16 streaming completions
  at once all complete, ``/health`` answering meanwhile; ``server_bad_body``: garbage bodies
  get 400 with an error object and the server answers afterwards; ``server_metrics``:
  ``/metrics`` names the kernel path (``engine_info``) and counted the tokens;
  ``server_stop``: SIGTERM, the app's shutdown completes and the process exits (0 or by the
  SIGTERM uvicorn raises again), no traceback in its log (``$OUT/gpu_check_server.log``).
  On the GPU machine fastapi, starlette, uvicorn and pydantic travel as wheels (see
  docs/results/2026-12-04-h200-cuda-path-check.md).

The model is built with the test suite's ``tests.model_utils.tiny_hf_model`` (every weight
random, norms included) and saved as a Hugging Face directory with a word-level tokenizer.
With ``--device cpu`` the same checks run on CPU tiers (the CUDA-only parts are skipped and
say so), which is how the script is debugged before a GPU run. A compact JSON summary is
printed last and written to ``$OUT/gpu_check.json`` when ``$OUT`` is set; the exit status is
1 when a required check failed.

    python benchmarks/gpu_check.py [--device cuda|cpu] [--checks offline server sampling fp8]
        [--new-tokens 32] [--bench-requests 64] [--bench-tokens 128] [--threads N]
        [--kernel-path PATH] [--server-start-s 180] [--request-timeout-s 120] [--watchdog-s S]
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import os
import platform
import re
import signal
import socket
import subprocess
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
CHECK_GROUPS = ("offline", "server", "sampling", "fp8")
# Each message's words, then "w0" as the generation prompt; every word is a vocabulary entry
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w0{% endif %}")


# ------------------------------------------------------------------ the model on disk

def vocabulary() -> dict[str, int]:
    """The tokenizer's 256 entries: ``w0``..``w251``, then ``<s> </s> <unk> <pad>``."""
    vocab = {f"w{i}": i for i in range(WORDS)}
    vocab.update({"<s>": 252, "</s>": 253, "<unk>": 254, "<pad>": 255})
    return vocab


def save_tokenizer(path: Path) -> None:
    """A word-level tokenizer over ``w0``..``w251`` plus four special tokens (256 ids), with
    a chat template that joins the messages' words (so the server's chat endpoint runs)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocabulary(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


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
def hf_greedy(path: Path, dtype: torch.dtype, device: str, prompts: list[list[int]],
              new_tokens: int) -> Reference:
    """transformers' greedy ``generate`` of the model at ``path`` (loaded here, freed on
    return), one prompt at a time (no padding), with the raw logits of every step for the
    near-tie cut-off."""
    model = load_hf(path, dtype, device)
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
             device_kv_gb: float = 1.0, host_kv_gb: float = 1.0,
             kv_cache_dtype: str = "auto") -> LLM:
    return LLM.from_config(EngineConfig(
        model=str(path), dtype=dtype, kv_cache_dtype=kv_cache_dtype, device=device,
        policy=policy, seed=0,
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
    ref = hf_greedy(path, torch.bfloat16, device, prompts, args.new_tokens)
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


# ------------------------------------------------------------------ the HTTP server

SERVED_NAME = "tiny-llama"
SERVER_PROMPT_LENGTHS = [5, 40, 150]
CONCURRENT_STREAMS = 16
STREAM_TOKENS = 16
BAD_BODIES = {"truncated_json": b'{"prompt": [1, 2', "binary": b"\x00\xff garbage \xfe",
              "prompt_is_a_number": b'{"prompt": 7}'}


@dataclass(slots=True)
class Server:
    """One ``alignedserve serve`` subprocess, and the file its output goes to."""

    url: str
    proc: subprocess.Popen
    log_path: Path


@dataclass(slots=True)
class Expected:
    """What the server's greedy completions must give: transformers' greedy (to the near-tie
    cut-off) and the offline engine's tokens for the same prompts, config and batch."""

    hf: Reference
    engine: list[list[int]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(path: Path, device: str, port: int, args: argparse.Namespace) -> list[str]:
    """``alignedserve serve`` (the module the ``alignedserve`` script runs) in float32 with the
    offline checks' token budget and no step-time target, so that its batches are those of
    ``make_llm``; small KV budgets and no pre-faulting (the model is tiny)."""
    cmd = [sys.executable, "-m", "alignedserve.entrypoints.cli", "serve", str(path),
           "--host", "127.0.0.1", "--port", str(port), "--device", device,
           "--dtype", "float32", "--policy", "aligned", "--seed", "0",
           "--served-model-name", SERVED_NAME, "--max-num-batched-tokens", "256",
           "--step-time-target", "0", "--device-kv-gb", "0.25", "--host-kv-gb", "0.5",
           "--no-preallocate-kv", "--log-level", "info", "--no-access-log",
           "--shutdown-grace", "10"]
    if args.threads:
        cmd += ["--num-threads", str(args.threads)]
    if args.kernel_path:
        cmd += ["--kernel-path", args.kernel_path]
    return cmd


def log_tail(path: Path, lines: int = 30) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []


def start_server(path: Path, device: str, args: argparse.Namespace, log_path: Path) -> Server:
    """Start the server with this interpreter and this process's ``PYTHONPATH`` (carried
    wheels) behind the checkout, and wait until ``/health`` answers 200."""
    import httpx

    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    with log_path.open("w") as log:
        proc = subprocess.Popen(server_command(path, device, port, args), cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + args.server_start_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it answered: "
                               + " | ".join(log_tail(log_path, 12)))
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(server)
            raise TimeoutError(f"/health did not answer 200 within {args.server_start_s} s")
        time.sleep(0.25)


def stop_server(server: Server, timeout_s: float = 60.0) -> dict[str, Any]:
    """SIGTERM, as an operator stops it: within ``timeout_s`` (killed otherwise) uvicorn must
    log that the app's shutdown (the engine's stop) completed, and exit 0 or by the SIGTERM
    that uvicorn raises again once it is done; no traceback in the log."""
    start = time.perf_counter()
    killed = False
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
            killed = True
    text = server.log_path.read_text(errors="replace")
    tracebacks = text.count("Traceback (most recent call last)")
    result = {"returncode": server.proc.returncode, "exit_s": round(time.perf_counter() - start,
                                                                     2),
              "killed": killed, "log_tracebacks": tracebacks,
              "shutdown_complete": "Application shutdown complete" in text}
    result["ok"] = (server.proc.returncode in (0, -signal.SIGTERM) and not killed
                    and tracebacks == 0 and result["shutdown_complete"])
    if not result["ok"]:
        result["log_tail"] = log_tail(server.log_path)
    return result


def token_ids(pieces: list[str]) -> list[int]:
    """Token ids of the logprobs' token strings (-1 for a string that is no entry)."""
    vocab = vocabulary()
    return [vocab.get(p.strip(), -1) for p in pieces]


def sse_payloads(lines: list[str]) -> tuple[list[dict[str, Any]], bool]:
    """The JSON events of a server-sent-event stream and whether ``[DONE]`` ended it."""
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    done = bool(data) and data[-1] == "[DONE]"
    return [json.loads(d) for d in data if d != "[DONE]"], done


def server_expected(path: Path, device: str, prompts: list[list[int]],
                    args: argparse.Namespace, out: list[Expected]) -> dict[str, Any]:
    """transformers' fp32 greedy and the offline engine's (``make_llm``, fp32, aligned) for the
    server's prompts, computed in this process before the server starts."""
    ref = hf_greedy(path, torch.float32, device, prompts, args.new_tokens)
    llm = make_llm(path, device, "float32", "aligned", args)
    try:
        engine = engine_greedy(llm, prompts, args.new_tokens)
    finally:
        llm.engine.close()
    out.append(Expected(ref, engine))
    offline = compare(ref, engine)
    return {"ok": offline["ok"], "offline_equal_to_hf_cutoff": offline["equal_to_cutoff"],
            "near_tie_prompts": offline["near_tie_prompts"]}


def check_server_start(path: Path, device: str, args: argparse.Namespace, log_path: Path,
                       out: list[Server]) -> dict[str, Any]:
    start = time.perf_counter()
    out.append(start_server(path, device, args, log_path))
    return {"ok": True, "ready_s": round(time.perf_counter() - start, 2), "url": out[0].url,
            "command": " ".join(server_command(path, device, 0, args)[3:])}


def check_server_info(client: Any, device: str) -> dict[str, Any]:
    """``/health``, ``/v1/models``, ``/version`` and ``/engine/state`` answer as configured;
    on CUDA the kernel path is ``reference``."""
    models, version = client.get("/v1/models"), client.get("/version")
    state, health = client.get("/engine/state"), client.get("/health")
    cards = models.json().get("data", []) if models.status_code == 200 else []
    info = version.json() if version.status_code == 200 else {}
    snap = state.json() if state.status_code == 200 else {}
    result = {"status": [r.status_code for r in (models, version, state, health)],
              "models": [c.get("id") for c in cards],
              "max_model_len": cards[0].get("max_model_len") if cards else None,
              "version": info.get("version"), "kernel_path": info.get("kernel_path"),
              "engine_state": {k: snap.get(k) for k in ("dtype", "kv_cache_dtype", "policy",
                                                        "kernel_path")}}
    result["ok"] = (result["status"] == [200] * 4 and result["models"] == [SERVED_NAME]
                    and result["max_model_len"] == MODEL["max_position_embeddings"]
                    and bool(result["version"]) and snap.get("dtype") == "float32"
                    and snap.get("kernel_path") == result["kernel_path"]
                    and (device != "cuda" or result["kernel_path"] == "reference"))
    return result


def check_server_greedy(client: Any, prompts: list[list[int]], expected: Expected,
                        new_tokens: int) -> dict[str, Any]:
    """One non-streaming ``/v1/completions`` of token-id prompts, greedy, with ``logprobs: 0``
    (the chosen tokens' strings give their ids): equal to the offline engine's tokens and to
    transformers' greedy up to the near-tie cut-off."""
    body = {"model": SERVED_NAME, "prompt": prompts, "max_tokens": new_tokens,
            "temperature": 0.0, "ignore_eos": True, "logprobs": 0,
            "skip_special_tokens": False}
    r = client.post("/v1/completions", json=body)
    if r.status_code != 200:
        return {"ok": False, "status": r.status_code, "body": r.text[:500]}
    answer = r.json()
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    got = [token_ids(c["logprobs"]["tokens"]) for c in choices]
    result = compare(expected.hf, got)
    result["equal_offline_engine"] = sum(g == e for g, e in zip(got, expected.engine))
    result["finish_reasons"] = sorted({c["finish_reason"] for c in choices})
    result["text_is_the_tokens"] = all(c["text"].split() == c["logprobs"]["tokens"]
                                       for c in choices)
    logprobs = [lp for c in choices for lp in c["logprobs"]["token_logprobs"]]
    result["logprobs_in_range"] = all(-9999.0 <= lp <= 0.0 for lp in logprobs)
    result["completion_tokens"] = answer["usage"]["completion_tokens"]
    result["ok"] = (result["ok"] and result["equal_offline_engine"] == len(prompts)
                    and result["finish_reasons"] == ["length"] and result["logprobs_in_range"]
                    and result["completion_tokens"] == new_tokens * len(prompts))
    return result


def check_server_chat_stream(client: Any) -> dict[str, Any]:
    """A streaming ``/v1/chat/completions`` (greedy, the chat template of ``save_tokenizer``):
    a role chunk, content chunks, one finish reason, usage, then ``[DONE]``; its content equals
    the same request's non-streaming answer."""
    body = {"model": SERVED_NAME, "max_tokens": STREAM_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "skip_special_tokens": False,
            "messages": [{"role": "user", "content": "w1 w2 w3 w4 w5 w6 w7"}]}
    whole = client.post("/v1/chat/completions", json=body)
    if whole.status_code != 200:
        return {"ok": False, "status": whole.status_code, "body": whole.text[:500]}
    text = whole.json()["choices"][0]["message"]["content"]
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=stream_body) as r:
        status = r.status_code
        chunks, done = sse_payloads(list(r.iter_lines()))
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    content = "".join(c["delta"].get("content") or "" for c in choices)
    finishes = [c["finish_reason"] for c in choices if c.get("finish_reason")]
    usage = chunks[-1].get("usage") if chunks else None
    result = {"status": status, "chunks": len(chunks), "done": done,
              "errors": sum("error" in c for c in chunks),
              "first_delta_role": choices[0]["delta"].get("role") if choices else None,
              "finish_reasons": finishes, "words": len(content.split()),
              "equal_to_non_streaming": content == text,
              "completion_tokens": usage and usage.get("completion_tokens")}
    result["ok"] = (status == 200 and done and not result["errors"] and len(chunks) >= 3
                    and result["first_delta_role"] == "assistant" and finishes == ["length"]
                    and result["equal_to_non_streaming"] and result["words"] == STREAM_TOKENS
                    and result["completion_tokens"] == STREAM_TOKENS)
    return result


async def stream_completion(client: Any, prompt: list[int]) -> dict[str, Any]:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": STREAM_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "skip_special_tokens": False,
            "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        lines = [line async for line in r.aiter_lines()]
        status = r.status_code
    chunks, done = sse_payloads(lines)
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    usage = chunks[-1].get("usage") if chunks else None
    ok = (status == 200 and done and not any("error" in c for c in chunks) and len(chunks) >= 3
          and len(text.split()) == STREAM_TOKENS and bool(usage)
          and usage.get("completion_tokens") == STREAM_TOKENS)
    return {"ok": ok, "status": status, "chunks": len(chunks), "done": done, "words":
            len(text.split())}


def check_server_concurrent(url: str, prompts: list[list[int]],
                            timeout_s: float) -> dict[str, Any]:
    """``CONCURRENT_STREAMS`` streaming completions at once (greedy, different prompt lengths):
    every one yields its tokens and ``[DONE]``; ``/health`` answers while they run."""
    import httpx

    async def health_while_streaming(client: httpx.AsyncClient) -> int:
        await asyncio.sleep(0.2)
        return (await client.get("/health")).status_code

    async def run_all() -> tuple[list[dict[str, Any]], int]:
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
            *streams, health = await asyncio.gather(
                *(stream_completion(client, p) for p in prompts),
                health_while_streaming(client))
        return streams, health

    start = time.perf_counter()
    streams, health = asyncio.run(run_all())
    seconds = time.perf_counter() - start
    complete = sum(s["ok"] for s in streams)
    return {"ok": complete == len(prompts) and health == 200, "streams": len(prompts),
            "complete": complete, "health_during": health,
            "failed": [s for s in streams if not s["ok"]][:3],
            "chunks_min": min(s["chunks"] for s in streams), "seconds": round(seconds, 2),
            "out_tok_s": round(len(prompts) * STREAM_TOKENS / seconds, 1)}


def check_server_bad_body(client: Any) -> dict[str, Any]:
    """Garbage bodies get 400 with an OpenAI error object; the server answers afterwards."""
    statuses, types = {}, {}
    for name, body in BAD_BODIES.items():
        r = client.post("/v1/completions", content=body,
                        headers={"content-type": "application/json"})
        statuses[name] = r.status_code
        try:
            types[name] = r.json()["error"]["type"]
        except (ValueError, KeyError, TypeError):
            types[name] = None
    after = client.post("/v1/completions", json={"model": SERVED_NAME, "prompt": [1, 2, 3],
                                                 "max_tokens": 2, "temperature": 0.0})
    health = client.get("/health").status_code
    return {"ok": set(statuses.values()) == {400} and all(types.values())
            and after.status_code == 200 and health == 200,
            "statuses": statuses, "error_types": types, "after_status": after.status_code,
            "health_after": health}


def check_server_metrics(client: Any, device: str) -> dict[str, Any]:
    """``/metrics`` scrapes; ``engine_info`` names the kernel path (``/version``'s; on CUDA
    ``reference``); generated tokens were counted; the device KV tier is there."""
    r, version = client.get("/metrics"), client.get("/version").json()
    text = r.text if r.status_code == 200 else ""
    info = re.search(r"^alignedserve:engine_info\{([^}]*)\} 1\.0$", text, re.M)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1))) if info else {}
    generated = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("alignedserve:generation_tokens_total{"))
    result = {"status": r.status_code, "engine_info": labels, "generation_tokens": generated,
              "dev0_tier": 'tier="dev0"' in text, "lines": len(text.splitlines())}
    result["ok"] = (r.status_code == 200 and labels.get("model_name") == SERVED_NAME
                    and labels.get("kernel_path") == version.get("kernel_path")
                    and (device != "cuda" or labels.get("kernel_path") == "reference")
                    and generated > 0 and result["dev0_tier"])
    return result


def run_server_checks(path: Path, device: str, args: argparse.Namespace,
                      log_path: Path) -> dict[str, dict[str, Any]]:
    """The server group: each step guarded; the server is stopped whatever happened."""
    import httpx

    prompts = make_prompts(SERVER_PROMPT_LENGTHS, args.seed + 1)
    expected: list[Expected] = []
    servers: list[Server] = []
    checks = {"server_expected": guarded("server_expected", lambda: server_expected(
        path, device, prompts, args, expected))}
    checks["server_start"] = guarded("server_start", lambda: check_server_start(
        path, device, args, log_path, servers))
    if not servers:
        return checks
    server = servers[0]
    try:
        with httpx.Client(base_url=server.url, timeout=args.request_timeout_s) as client:
            checks["server_info"] = guarded("server_info",
                                            lambda: check_server_info(client, device))
            if expected:
                checks["server_greedy"] = guarded("server_greedy", lambda: check_server_greedy(
                    client, prompts, expected[0], args.new_tokens))
            checks["server_chat_stream"] = guarded("server_chat_stream",
                                                   lambda: check_server_chat_stream(client))
            streams = make_prompts([8 + 9 * i for i in range(CONCURRENT_STREAMS)], args.seed + 2)
            checks["server_concurrent"] = guarded("server_concurrent", lambda: (
                check_server_concurrent(server.url, streams, args.request_timeout_s)))
            checks["server_bad_body"] = guarded("server_bad_body",
                                                lambda: check_server_bad_body(client))
            checks["server_metrics"] = guarded("server_metrics",
                                               lambda: check_server_metrics(client, device))
    finally:
        checks["server_stop"] = guarded("server_stop", lambda: stop_server(server))
    return checks


# ------------------------------------------------------------------ sampling

SAMPLING_PROMPT_LENGTHS = [9, 33, 70, 120]
SAMPLING_TOKENS = 24
SEEDS = (11, 12)
# Each case runs with seed 11 twice and seed 12 once; "top_k" also asks for 20 logprobs, so
# that each step's entry shows whether the drawn token was among the 20 best.
SAMPLING_CASES: dict[str, dict[str, Any]] = {
    "temperature": dict(temperature=1.0),
    "top_k": dict(temperature=0.8, top_k=20, logprobs=20),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "top_k_top_p_min_p": dict(temperature=1.2, top_k=50, top_p=0.95, min_p=0.02),
    "n2": dict(temperature=1.0, top_p=0.95, n=2),
}
PENALTY_CASES: dict[str, dict[str, Any]] = {
    "repetition": dict(temperature=0.7, top_k=40, repetition_penalty=1.3),
    "presence_frequency": dict(temperature=0.7, top_k=40, presence_penalty=0.5,
                               frequency_penalty=0.3),
    "greedy_penalties": dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
}


def run_case(llm: LLM, prompts: list[list[int]], seed: int,
             case: dict[str, Any]) -> list[Any]:
    params = SamplingParams(max_tokens=SAMPLING_TOKENS, ignore_eos=True, seed=seed, **case)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def completions(outs: list[Any]) -> list[list[list[int]]]:
    """Token ids per prompt, per completion."""
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def sampling_case(llm: LLM, prompts: list[list[int]], case: dict[str, Any]) -> dict[str, Any]:
    """Valid ids and lengths; the same seed repeats exactly; another seed differs somewhere
    (sampled cases); top-k draws stay in the top k; ``n`` > 1 completions differ."""
    first = run_case(llm, prompts, SEEDS[0], case)
    again, other = (completions(run_case(llm, prompts, s, case)) for s in SEEDS)
    tokens = completions(first)
    flat = [t for per_prompt in tokens for c in per_prompt for t in c]
    sampled = case["temperature"] > 0
    result = {"valid": all(0 <= t < MODEL["vocab_size"] for t in flat) and all(
                  len(c) == SAMPLING_TOKENS for per_prompt in tokens for c in per_prompt),
              "seed_repeats": tokens == again, "distinct_tokens": len(set(flat))}
    result["ok"] = result["valid"] and result["seed_repeats"]
    if sampled:
        result["seeds_differ"] = tokens != other
        result["ok"] = result["ok"] and result["seeds_differ"]
    if case.get("top_k") and case.get("logprobs") == case["top_k"]:
        entries = [e for o in first for c in o.outputs for e in c.logprobs]
        result["within_top_k"] = all(len(e) == case["top_k"] for e in entries)
        result["ok"] = result["ok"] and result["within_top_k"] and len(entries) == len(flat)
    if case.get("n", 1) > 1:
        result["completions_differ"] = all(p[0] != p[1] for p in tokens)
        result["ok"] = result["ok"] and result["completions_differ"]
    return result


def contained(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()``, an exception failing this part of a check only (reported with its last
    lines), so that the check's other parts still report."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc().splitlines()[-8:]}


def penalties_change_greedy(llm: LLM, prompts: list[list[int]],
                            case: dict[str, Any]) -> dict[str, Any]:
    """Reported: whether greedy with penalties gives other tokens than plain greedy."""
    plain = engine_greedy(llm, prompts, SAMPLING_TOKENS)
    penalized = [p[0] for p in completions(run_case(llm, prompts, SEEDS[0], case))]
    return {"ok": True, "changed": plain != penalized}


def check_sampling(path: Path, device: str, cases: dict[str, dict[str, Any]],
                   args: argparse.Namespace) -> dict[str, Any]:
    """Every case of ``cases`` on one fp32 engine (seeded requests; the engine's own seed is
    fixed too), each contained."""
    prompts = make_prompts(SAMPLING_PROMPT_LENGTHS, args.seed + 3)
    llm = make_llm(path, device, "float32", "aligned", args)
    try:
        result: dict[str, Any] = {name: contained(lambda: sampling_case(llm, prompts, case))
                                  for name, case in cases.items()}
        if "greedy_penalties" in cases:
            result["greedy_penalties_change_output"] = contained(
                lambda: penalties_change_greedy(llm, prompts, cases["greedy_penalties"]))
        result["leaks"] = leaks(llm)
    finally:
        llm.engine.close()
    parts = [r for r in result.values() if isinstance(r, dict) and "ok" in r]
    result["ok"] = all(r["ok"] for r in parts) and not result["leaks"]
    return result


def check_mixed_batch(path: Path, device: str, args: argparse.Namespace) -> dict[str, Any]:
    """Greedy and seeded sampled requests in one batch: each row gives what it gives in a batch
    of its own kind (same prompts, so the same shapes), i.e. rows do not disturb each other."""
    prompts = make_prompts(SAMPLING_PROMPT_LENGTHS, args.seed + 3)
    case = SAMPLING_CASES["top_k_top_p_min_p"]
    greedy = SamplingParams(temperature=0.0, max_tokens=SAMPLING_TOKENS, ignore_eos=True)
    sampled = SamplingParams(max_tokens=SAMPLING_TOKENS, ignore_eos=True, seed=SEEDS[0], **case)
    llm = make_llm(path, device, "float32", "aligned", args)
    try:
        mixed = llm.generate([{"prompt_token_ids": p} for p in prompts],
                             [greedy, sampled] * (len(prompts) // 2), use_tqdm=False)
        all_greedy = engine_greedy(llm, prompts, SAMPLING_TOKENS)
        all_sampled = [p[0] for p in completions(run_case(llm, prompts, SEEDS[0], case))]
    finally:
        llm.engine.close()
    rows = [list(o.outputs[0].token_ids) for o in mixed]
    greedy_ok = all(rows[i] == all_greedy[i] for i in range(0, len(rows), 2))
    sampled_ok = all(rows[i] == all_sampled[i] for i in range(1, len(rows), 2))
    return {"ok": greedy_ok and sampled_ok, "greedy_rows_equal": greedy_ok,
            "sampled_rows_equal": sampled_ok}


def check_sampling_vs_cpu(path: Path, device: str, args: argparse.Namespace) -> dict[str, Any]:
    """Reported only: a seeded case on ``device`` against the same on CPU (the draws come from the
    same CPU generators, so only rounding near a cut or a draw can part them). The CPU engine
    runs the reference ops too, so no kernels are compiled on the GPU machine."""
    prompts = make_prompts(SAMPLING_PROMPT_LENGTHS, args.seed + 3)
    case = SAMPLING_CASES["top_k_top_p_min_p"]
    on_cpu = argparse.Namespace(**{**vars(args), "kernel_path": "reference"})
    runs = []
    for where, run_args in ((device, args), ("cpu", on_cpu)):
        llm = make_llm(path, where, "float32", "aligned", run_args)
        try:
            runs.append([p[0] for p in completions(run_case(llm, prompts, SEEDS[0], case))])
        finally:
            llm.engine.close()
    result = agreement(Reference(runs[1], []), runs[0])
    result["ok"] = True
    return result


# ------------------------------------------------------------------ fp8 KV cache

FP8 = "fp8_e5m2"


def watch_kv_dtypes(pool: KVPool) -> set[str]:
    """The dtypes of every KV tensor the pool makes from now on."""
    seen: set[str] = set()
    empty = pool._empty

    def noting_empty(tier: str, capacity: int) -> torch.Tensor:
        tensor = empty(tier, capacity)
        seen.add(str(tensor.dtype).removeprefix("torch."))
        return tensor

    pool._empty = noting_empty
    return seen


def fp8_run(path: Path, device: str, dtype: str, prompts: list[list[int]],
            args: argparse.Namespace, device_kv_gb: float = 1.0,
            host_kv_gb: float = 1.0) -> tuple[list[list[int]], dict[str, Any], MoveLog]:
    """Greedy with an fp8_e5m2 KV cache: the tokens, facts about the run, and its moves."""
    llm = make_llm(path, device, dtype, "aligned", args, device_kv_gb, host_kv_gb, FP8)
    try:
        dtypes = watch_kv_dtypes(llm.engine.executor.pool)
        log = watch_pool(llm.engine.executor.pool)
        got = engine_greedy(llm, prompts, args.new_tokens)
        facts = {"kv_dtype": str(llm.engine.kv_dtype).removeprefix("torch."),
                 "kv_tensor_dtypes": sorted(dtypes), "leaks": leaks(llm)}
    finally:
        llm.engine.close()
    facts["valid"] = (all(0 <= t < MODEL["vocab_size"] for g in got for t in g)
                      and all(len(g) == args.new_tokens for g in got))
    facts["ok"] = (facts["valid"] and facts["kv_tensor_dtypes"] == ["float8_e5m2"]
                   and facts["kv_dtype"] == "float8_e5m2" and not facts["leaks"])
    return got, facts, log


def check_fp8(path: Path, device: str, prompts: list[list[int]], args: argparse.Namespace,
              out: list[list[list[int]]]) -> dict[str, Any]:
    """fp8_e5m2 KV with float32 and bfloat16 models: runs, caches are fp8, no leaks; agreement
    with the same engine's own-dtype KV reported, not required (e5m2 keeps 2 mantissa bits)."""
    result: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        llm = make_llm(path, device, dtype, "aligned", args)
        try:
            base = engine_greedy(llm, prompts, args.new_tokens)
        finally:
            llm.engine.close()
        got, facts, _ = fp8_run(path, device, dtype, prompts, args)
        if dtype == "float32":
            out.append(got)
        result[dtype] = {**facts, **agreement(Reference(base, []), got)}
    result["ok"] = all(result[d]["ok"] for d in ("float32", "bfloat16"))
    return result


def check_fp8_tier_moves(path: Path, device: str, prompts: list[list[int]],
                         args: argparse.Namespace, fp8_ref: list[list[int]] | None
                         ) -> dict[str, Any]:
    """fp8 caches written back to the host tier and prefetched (a quarter of the fp32 tier
    check's device budget, so about as many tokens fit): moves both ways, no leaks, on CUDA
    through the copy stream into pinned memory; agreement with the fp8 run without moves
    reported (the batches differ, and so may float32 rounding before the fp8 cast)."""
    got, result, log = fp8_run(path, device, "float32", prompts, args, TIER_DEVICE_KV_GB / 4,
                               TIER_HOST_KV_GB)
    total = sum(log.moves.values())
    result.update(moves=dict(log.moves), stream_moves=log.stream_moves,
                  thread_moves=log.thread_moves)
    result["ok"] = (result["ok"] and log.moves["dev0->host"] > 0
                    and log.moves["host->dev0"] > 0)
    if device == "cuda":
        result["all_moves_on_stream"] = log.stream_moves == total
        result["host_caches_pinned"] = log.host_unpinned == 0
        result["ok"] = result["ok"] and log.stream_moves == total and log.host_unpinned == 0
    if fp8_ref:
        result["vs_fp8_without_moves"] = agreement(Reference(fp8_ref, []), got)
    return result


# ------------------------------------------------------------------ driver

SERVER_PACKAGES = ("fastapi", "starlette", "uvicorn", "pydantic", "pydantic_core", "anyio",
                   "h11", "uvloop", "httpx", "prometheus_client")


def environment(device: str, groups: list[str]) -> dict[str, Any]:
    import transformers

    env = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "cuda_available": torch.cuda.is_available()}
    if device == "cuda":
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    if "server" in groups:
        env["server_packages"] = {name: package_version(name) for name in SERVER_PACKAGES}
    return env


def package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


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


def run_offline_checks(path: Path, device: str,
                       args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The ``offline`` group: the checks 0-4 of the module docstring."""
    prompts = make_prompts(PROMPT_LENGTHS, args.seed)
    refs: list[Reference] = []

    def reference() -> dict[str, Any]:
        refs.append(hf_greedy(path, torch.float32, device, prompts, args.new_tokens))
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


def run_sampling_checks(path: Path, device: str,
                        args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The ``sampling`` group: seeded sampling cases, penalties, a mixed batch, and on CUDA
    the agreement with CPU (reported)."""
    checks = {"sampling": guarded("sampling", lambda: check_sampling(path, device,
                                                                     SAMPLING_CASES, args)),
              "sampling_penalties": guarded("sampling_penalties", lambda: check_sampling(
                  path, device, PENALTY_CASES, args)),
              "sampling_mixed_batch": guarded("sampling_mixed_batch",
                                              lambda: check_mixed_batch(path, device, args))}
    if device == "cuda":
        checks["sampling_vs_cpu"] = guarded("sampling_vs_cpu",
                                            lambda: check_sampling_vs_cpu(path, device, args))
    return checks


def run_fp8_checks(path: Path, device: str, args: argparse.Namespace
                   ) -> dict[str, dict[str, Any]]:
    """The ``fp8`` group: fp8_e5m2 KV caches, without and with tier moves."""
    prompts = make_prompts(PROMPT_LENGTHS, args.seed)
    fp8_ref: list[list[list[int]]] = []
    checks = {"fp8_kv": guarded("fp8_kv", lambda: check_fp8(path, device, prompts, args,
                                                            fp8_ref))}
    checks["fp8_tier_moves"] = guarded("fp8_tier_moves", lambda: check_fp8_tier_moves(
        path, device, prompts, args, fp8_ref[0] if fp8_ref else None))
    return checks


def run_checks(path: Path, device: str, args: argparse.Namespace,
               server_log: Path) -> dict[str, dict[str, Any]]:
    checks: dict[str, dict[str, Any]] = {}
    if "offline" in args.checks:
        checks.update(run_offline_checks(path, device, args))
    if "sampling" in args.checks:
        checks.update(run_sampling_checks(path, device, args))
    if "fp8" in args.checks:
        checks.update(run_fp8_checks(path, device, args))
    if "server" in args.checks:
        checks.update(run_server_checks(path, device, args, server_log))
    return checks


def summarize(env: dict[str, Any], checks: dict[str, dict[str, Any]], skipped: list[str],
              args: argparse.Namespace) -> dict[str, Any]:
    failed = [name for name, c in checks.items() if not c["ok"]]
    tier = checks.get("fp32_tier_moves", {})
    if torch.cuda.is_available() and env["device"] == "cuda":
        env["max_memory_allocated_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return {"ok": not failed, "groups": args.checks,
            "passed": [n for n in checks if n not in failed],
            "failed": failed, "skipped": skipped, **env,
            "model": {k: MODEL[k] for k in ("hidden_size", "num_hidden_layers",
                                            "num_attention_heads", "num_key_value_heads",
                                            "vocab_size")},
            "prompt_lengths": PROMPT_LENGTHS, "new_tokens": args.new_tokens,
            "tier_moves": tier.get("moves"), "stream_moves": tier.get("stream_moves"),
            "rough_decode_tok_s": checks.get("rough_decode", {}).get("out_tok_s"),
            "checks": checks}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda when available, else cpu")
    parser.add_argument("--checks", nargs="+", choices=CHECK_GROUPS, default=list(CHECK_GROUPS),
                        help="check groups to run (default: all, in the order "
                             f"{' '.join(CHECK_GROUPS)})")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--bench-requests", type=int, default=None, help="default 64 (cpu: 8)")
    parser.add_argument("--bench-tokens", type=int, default=None, help="default 128 (cpu: 16)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kernel-path", default=None, help="CPU kernel path (cpu only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-start-s", type=float, default=180.0,
                        help="seconds the server may take to answer /health")
    parser.add_argument("--request-timeout-s", type=float, default=120.0,
                        help="HTTP client timeout per request")
    parser.add_argument("--watchdog-s", type=float, default=0.0,
                        help="after this many seconds, print every thread's stack and exit "
                             "(a hang on a borrowed machine still says where); 0: off")
    args = parser.parse_args()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.checks = [g for g in CHECK_GROUPS if g in args.checks]
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
    # (the server subprocess never turns TF32 on: torch's default is off for matmuls)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    skipped = []
    if args.device != "cuda":
        skipped.append("CUDA-only parts skipped on cpu: the copy stream and its events, pinned "
                       "host caches, the GPU name, sampling against CPU; tier moves ran "
                       "through the CPU copier thread")
        print("gpu_check: " + skipped[0], file=sys.stderr)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        path = Path(tmp) / "tiny-llama"
        save_tiny_model(path, args.seed)
        server_log = (out or Path(tmp)) / "gpu_check_server.log"
        checks = run_checks(path, args.device, args, server_log)
    summary = summarize(environment(args.device, args.checks), checks, skipped, args)
    text = json.dumps(summary)
    print(text)
    if out:
        (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
