"""``alignedserve`` command line: generate, serve, bench, simulate, calibrate, env."""

from __future__ import annotations

import argparse
import importlib
import sys

from alignedserve.entrypoints.args import add_engine_args, engine_config_from_args


def _generate(args: argparse.Namespace) -> int:
    from alignedserve.entrypoints.llm import LLM
    from alignedserve.sampling_params import SamplingParams

    llm = LLM.from_config(engine_config_from_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    prompts = args.prompt or ["Write a haiku about the sea."]
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        for completion in out.outputs:
            print(completion.text, flush=True)
        m = out.metrics
        print(f"[{len(out.outputs[0].token_ids)} tokens, finish={out.outputs[0].finish_reason}, "
              f"ttft={m.ttft:.3f}s, e2e={m.e2e:.3f}s]", file=sys.stderr)
    return 0


# Each module exposes ``add_parser(subparsers)`` and imports its heavy dependencies lazily.
SUBCOMMAND_MODULES = [
    "alignedserve.entrypoints.server",  # serve
    "alignedserve.bench.cli",  # bench
    "alignedserve.sim.cli",  # simulate, calibrate
    "alignedserve.entrypoints.env",  # env
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alignedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts on the command line")
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    add_engine_args(gen)
    gen.set_defaults(func=_generate)
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
