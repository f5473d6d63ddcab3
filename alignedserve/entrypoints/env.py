"""``alignedserve env``: what this machine is and what the engine will run on it, for bug
reports and benchmark records (as ``python -m torch.utils.collect_env`` does for torch).

It reads /proc/cpuinfo and the environment and builds nothing: the kernel path named is the
one the engine starts with unless its build fails (the server's log and ``/version`` then
name the lower path it fell to).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import alignedserve.kernels.isa as isa


def describe() -> list[str]:
    """The report's lines: CPU, kernel paths and per-CPU kernel choices, threads, versions.
    Raises ValueError where ``ALIGNEDSERVE_ISA`` names a path the engine would refuse."""
    import torch

    from alignedserve import __version__
    from alignedserve.config import cache_root

    paths = isa.cpu_paths()
    forced = isa.requested_path()
    path = forced or paths[0]
    lines = [f"AlignedServe {__version__}",
             f"CPU: {isa.cpu_info().summary()}",
             f"kernel paths this CPU runs: {', '.join(paths)}",
             f"kernel path in use: {path} ("
             + (f"forced by {isa.ENV_VAR}" if forced else f"the best; {isa.ENV_VAR} unset") + ")"]
    if isa.amx_emulated():
        lines.append(f"amx path: on emulated tiles ({isa.AMX_EMULATE_ENV}=1; for tests, slow)")
    if path == "avx512_bf16":
        items = "row units" if isa.decode_row_units() else "per-head items"
        ahead = isa.decode_read_ahead()
        lines.append(f"decode attention: {items}, "
                     + (f"{ahead} bytes read ahead" if ahead else "no read-ahead"))
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA")
    if not onednn and forced and forced != paths[0] and forced in isa.ONEDNN_CEILING:
        onednn = f"unset (the engine sets {isa.ONEDNN_CEILING[forced]} for the forced path)"
    lines += [f"ONEDNN_MAX_CPU_ISA: {onednn or 'unset'}",
              f"cores: {os.cpu_count()}; torch intra-op threads: {torch.get_num_threads()}",
              f"kernel cache: {cache_root()}",
              f"torch {torch.__version__}, Python {platform.python_version()}, "
              f"{platform.platform()}"]
    return lines


def _run(args: argparse.Namespace) -> int:
    try:
        print("\n".join(describe()))
    except ValueError as exc:  # a bad ALIGNEDSERVE_ISA: the engine would not start either
        print(f"CPU: {isa.cpu_info().summary()}\nerror: {exc}", file=sys.stderr)
        return 1
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("env", help="describe this machine's CPU and the kernel path "
                              "the engine runs on it (for bug reports and benchmark records)")
    p.set_defaults(func=_run)
