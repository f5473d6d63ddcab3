"""``alignedserve bench``: the command line of the benchmark tool.

Registers the subcommand with ``add_parser(subparsers)``; everything heavy (aiohttp, torch,
matplotlib, the engine) is imported only when a benchmark actually runs.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any

from alignedserve.bench.workloads import SYNTHETIC

DESCRIPTION = """\
Benchmark OpenAI-compatible servers (streaming, token-id prompts of exact lengths, exact
output lengths, checked) or this engine's scheduling policies in-process, on synthetic or
real-trace workloads; write raw per-request JSON, a markdown report and plots. The engine
flags apply to in-process targets (--policy, or policy names in --compare)."""

EXAMPLES = """\
examples:
  # a running server (ours, vLLM, llama-server, SGLang), 64 requests, 16 at a time
  alignedserve bench --url http://127.0.0.1:8000 --workload synthetic:varied \\
      --num-requests 64 --concurrency 16 --output-dir results/varied
  # scheduler policies in-process (no HTTP), ratios against fcfs
  alignedserve bench --compare aligned fcfs static --baseline fcfs \\
      --workload synthetic:fixed:in=512,out=256 --num-requests 64
  # engines side by side, one after another, on a scaled real trace replayed 20x faster
  alignedserve bench --compare ours=http://127.0.0.1:8000 vllm=http://127.0.0.1:8101 \\
      --baseline vllm --workload azure-conv --trace-dir ../shared/workloads \\
      --num-requests 100 --length-scale 0.5 --max-input-len 3500 --max-output-len 256 \\
      --time-scale 20
  # a rate sweep with Poisson arrivals and a goodput SLO
  alignedserve bench --url http://127.0.0.1:8000 --rate 0.5 1 2 4 inf \\
      --slo-ttft-ms 2000 --slo-tpot-ms 200

synthetic workloads (synthetic:NAME or synthetic:NAME:key=value,...):
""" + "\n".join(f"  {name:12s} {desc}" for name, (_, _, desc) in SYNTHETIC.items())


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a rate must be > 0 (or inf), got {text}")
    return value


def _add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("targets (what to benchmark)")
    g.add_argument("--url", help="base URL of an OpenAI-compatible server, e.g. "
                   "http://127.0.0.1:8000 (requests go to /v1/completions)")
    g.add_argument("--policy", help="run an in-process engine with this scheduling policy "
                   "(aligned, fcfs, static) instead of going over HTTP; the engine flags below "
                   "configure it")
    g.add_argument("--compare", nargs="+", metavar="TARGET", default=[],
                   help="more targets, run one after another on the same workload: a URL, a "
                   "policy name, or LABEL=URL / LABEL=POLICY")
    g.add_argument("--baseline", metavar="LABEL",
                   help="target label that ratios are computed against (default: the first)")
    g.add_argument("--model-name", help="'model' field sent to servers (default: the first id "
                   "from GET /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="Bearer token for servers that need one (default: $OPENAI_API_KEY)")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="streaming /v1/completions or /v1/chat/completions (chat needs "
                   "--prompt-format text)")
    g.add_argument("--request-timeout", type=float, default=3600.0, metavar="S",
                   help="seconds before a single HTTP request is given up")


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (what to send)")
    g.add_argument("--workload", default="synthetic:varied", metavar="SPEC",
                   help="synthetic:NAME[:k=v,...] (see below), a trace name (azure_llm_2023_code "
                   "/ azure-code, azure_llm_2023_conv / azure-conv, vidur_arxiv_summarization / "
                   "arxiv, sharegpt_v3_partial_lengths / sharegpt) or a CSV path")
    g.add_argument("--num-requests", type=int, default=None, metavar="N",
                   help="requests in the workload (default 64; 0 = the whole trace)")
    g.add_argument("--trace-dir", default=None, metavar="DIR",
                   help="folder holding the named traces (default: $ALIGNEDSERVE_TRACE_DIR)")
    g.add_argument("--trace-start", type=int, default=0, metavar="K",
                   help="skip the trace's first K rows")
    g.add_argument("--trace-sample", choices=["window", "random"], default="window",
                   help="take N consecutive rows (keeps bursts) or N random rows in trace order")
    g.add_argument("--output-len", type=int, default=None, metavar="N",
                   help="override every request's output length")
    g.add_argument("--length-scale", type=float, default=1.0, metavar="F",
                   help="multiply prompt and output lengths by F (keeps their spread)")
    g.add_argument("--max-input-len", type=int, default=None, metavar="N",
                   help="cap prompt lengths")
    g.add_argument("--max-output-len", type=int, default=None, metavar="N",
                   help="cap output lengths")
    g.add_argument("--max-total-len", type=int, default=None, metavar="N",
                   help="cap prompt + output (e.g. the model context) by shortening prompts")
    g.add_argument("--time-scale", type=float, default=1.0, metavar="F",
                   help="replay trace arrivals F times faster")


def _add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load (when to send)")
    g.add_argument("--rate", type=_rate, nargs="+", default=None, metavar="R",
                   help="request rate(s) in req/s with Poisson (or gamma) arrivals; several "
                   "values make a sweep; 'inf' sends everything at once. Without --rate a "
                   "timed trace is replayed, anything else is sent at once")
    g.add_argument("--burstiness", type=float, default=1.0, metavar="B",
                   help="gamma shape of inter-arrival gaps: 1 = Poisson, < 1 burstier")
    g.add_argument("--concurrency", type=int, default=None, metavar="N",
                   help="at most N requests in flight (a closed loop when sent at once)")
    g.add_argument("--duration", type=float, default=None, metavar="S",
                   help="stop sending new requests after S seconds (in-flight ones finish)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of lengths, prompts and arrivals (same seed = same workload)")
    g.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="small unrecorded requests sent to each target first")
    g.add_argument("--rounds", type=int, default=1, metavar="K",
                   help="repeat the comparison K times, alternating target order")


def _add_request_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("requests")
    g.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                   help="token-id prompts of exact length, or the same ids decoded to text")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer (HF dir or .gguf) for prompt ids (default: the engine's / "
                   "the default model's)")
    g.add_argument("--token-range", default=None, metavar="LO:HI",
                   help="draw prompt ids from [LO, HI) instead of asking a tokenizer")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature (0 = greedy)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the workload's output length (ignore_eos, min_tokens)")
    g.add_argument("--count-check", choices=["strict", "warn", "off"], default="strict",
                   help="a reply with a wrong output token count fails (strict) or is noted")
    g.add_argument("--extra-body", default=None, metavar="JSON",
                   help="extra JSON fields merged into every request body")
    g.add_argument("--slo-ttft-ms", type=float, default=None, metavar="MS",
                   help="TTFT objective for goodput (a request is good if it meets all given)")
    g.add_argument("--slo-tpot-ms", type=float, default=None, metavar="MS",
                   help="TPOT objective for goodput (a request is good if it meets all given)")
    g.add_argument("--slo-e2e-ms", type=float, default=None, metavar="MS",
                   help="E2E objective for goodput (a request is good if it meets all given)")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--output-dir", default=None, metavar="DIR",
                   help="where to write report.md, summary.json, runs/ and plots "
                   "(default: bench-results/DATE-TIME)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from alignedserve.entrypoints.args import add_engine_args

    p = subparsers.add_parser(
        "bench", help="benchmark servers or engine policies", description=DESCRIPTION,
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
        conflict_handler="resolve")
    add_engine_args(p)  # for in-process targets; --policy and --seed are redefined below
    _add_target_args(p)
    _add_workload_args(p)
    _add_load_args(p)
    _add_request_args(p)
    _add_output_args(p)
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    from alignedserve.bench.config import config_from_args
    from alignedserve.bench.runner import run_bench

    try:
        command = " ".join(["alignedserve", *map(shlex.quote, sys.argv[1:])])
        cfg = config_from_args(args, command)
        return run_bench(cfg)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
