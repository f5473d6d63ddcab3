"""Request-length traces: find them by name or path, read them, select a slice.

Traces are read at run time from ``--trace-dir`` or ``$ALIGNEDSERVE_TRACE_DIR`` (a folder laid
out like ``../shared/workloads``: one sub-folder per trace), or from an explicit file path. The
project never depends on a fixed trace location; its tests use a small sample in
``tests/data``.

Recognised CSV layouts (by header): the Azure LLM inference 2023 traces
(``TIMESTAMP,ContextTokens,GeneratedTokens``), Vidur's processed traces
(``num_prefill_tokens,num_decode_tokens[,arrived_at]``), the derived ShareGPT lengths
(``prompt_tokens_dsv4,output_tokens_dsv4``) and a generic one
(``input_tokens|prompt_tokens|input_len|prompt_len``, ``output_tokens|output_len``, optional
``arrival_s`` in seconds).
"""

from __future__ import annotations

import csv
import hashlib
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from alignedserve.bench.workloads import RequestSpec, Workload

TRACE_DIR_ENV = "ALIGNEDSERVE_TRACE_DIR"


@dataclass(frozen=True, slots=True)
class KnownTrace:
    folder: str
    file: str
    aliases: tuple[str, ...]
    licence: str


KNOWN_TRACES: dict[str, KnownTrace] = {
    "azure_llm_2023_code": KnownTrace(
        "azure_llm_2023_code", "AzureLLMInferenceTrace_code.csv", ("azure-code", "azure_code"),
        "CC-BY 4.0, Azure/AzurePublicDataset (cite Splitwise, ISCA 2024)"),
    "azure_llm_2023_conv": KnownTrace(
        "azure_llm_2023_conv", "AzureLLMInferenceTrace_conv.csv", ("azure-conv", "azure_conv"),
        "CC-BY 4.0, Azure/AzurePublicDataset (cite Splitwise, ISCA 2024)"),
    "vidur_arxiv_summarization": KnownTrace(
        "vidur_arxiv_summarization",
        "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv", ("arxiv",),
        "MIT, microsoft/vidur"),
    "sharegpt_v3_partial_lengths": KnownTrace(
        "sharegpt_v3_partial_lengths", "sharegpt_v3_partial_first_turn_lengths.csv",
        ("sharegpt",), "derived lengths; ShareGPT upstream terms apply"),
}

# (input column, output column, time column or None, time kind) per layout, tried in order.
_LAYOUTS: tuple[tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...], str], ...] = (
    ("azure", ("ContextTokens",), ("GeneratedTokens",), ("TIMESTAMP",), "datetime"),
    ("vidur", ("num_prefill_tokens",), ("num_decode_tokens",), ("arrived_at",), "seconds"),
    ("sharegpt", ("prompt_tokens_dsv4",), ("output_tokens_dsv4",), (), "seconds"),
    ("generic", ("input_tokens", "prompt_tokens", "input_len", "prompt_len"),
     ("output_tokens", "output_len"), ("arrival_s", "arrival_time"), "seconds"),
)


@dataclass(frozen=True, slots=True)
class Selection:
    """Which rows to use: ``count`` rows (None/0 = all) from ``start``, either a contiguous
    ``window`` (keeps the trace's burst pattern) or a seeded ``random`` sample in trace order
    (keeps the length mix, thins the arrival rate)."""

    start: int = 0
    count: int | None = None
    sample: str = "window"
    seed: int = 0

    def indices(self, total: int) -> np.ndarray:
        if self.sample not in ("window", "random"):
            raise ValueError(f"trace sample must be 'window' or 'random', got {self.sample!r}")
        if not 0 <= self.start < total:
            raise ValueError(f"--trace-start {self.start} is outside the trace's {total} rows")
        pool = np.arange(self.start, total)
        count = min(self.count or len(pool), len(pool))
        if self.sample == "window":
            return pool[:count]
        rng = np.random.default_rng(self.seed)
        return np.sort(rng.choice(pool, size=count, replace=False))


def find_trace(spec: str, trace_dir: str | None = None) -> tuple[Path, KnownTrace | None]:
    """Resolve a trace name (or alias) or a file path to an existing file."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path, None
    known = _known(spec)
    if known is None:
        names = sorted(KNOWN_TRACES) + sorted(a for k in KNOWN_TRACES.values() for a in k.aliases)
        raise ValueError(f"workload {spec!r} is not synthetic:NAME, a file, or a known trace "
                         f"({', '.join(names)})")
    root = trace_dir or os.environ.get(TRACE_DIR_ENV)
    if not root:
        raise ValueError(f"trace {spec!r} needs --trace-dir DIR or ${TRACE_DIR_ENV} (a folder "
                         f"holding {known.folder}/{known.file})")
    for candidate in (Path(root) / known.folder / known.file, Path(root) / known.file):
        if candidate.expanduser().is_file():
            return candidate.expanduser(), known
    raise FileNotFoundError(f"{known.folder}/{known.file} not found under {root}")


def _known(name: str) -> KnownTrace | None:
    if name in KNOWN_TRACES:
        return KNOWN_TRACES[name]
    return next((k for k in KNOWN_TRACES.values() if name in k.aliases), None)


def _column(header: list[str], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in header), None)


def _seconds(value: str, kind: str) -> float:
    if kind == "seconds":
        return float(value)
    # Azure stamps carry 7 fractional digits, more than datetime parses on every Python.
    main, _, frac = value.strip().partition(".")
    return datetime.fromisoformat(main).timestamp() + (float("0." + frac) if frac else 0.0)


def _detect_layout(path: Path, header: list[str]) -> tuple[str, str, str, str | None, str]:
    """(layout, input column, output column, time column or None, time kind)."""
    for layout, ins, outs, times, kind in _LAYOUTS:
        in_col, out_col = _column(header, ins), _column(header, outs)
        if in_col and out_col:
            return layout, in_col, out_col, _column(header, times), kind
    raise ValueError(f"{path}: unrecognised trace columns {header}")


def read_rows(path: Path) -> tuple[str, list[tuple[float | None, int, int]]]:
    """(layout name, [(arrival seconds or None, prompt tokens, output tokens)]) in file order.

    Lengths below 1 become 1: a request needs a prompt token and produces an output token.
    """
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        layout, in_col, out_col, t_col, kind = _detect_layout(path, header)
        rows = []
        for line, row in enumerate(reader, start=2):
            try:
                t = _seconds(row[t_col], kind) if t_col else None
                rows.append((t, max(1, int(float(row[in_col]))), max(1, int(float(row[out_col])))))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line}: bad row {row}: {exc}") from None
    if not rows:
        raise ValueError(f"{path}: the trace has no rows")
    return layout, rows


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_trace(spec: str, trace_dir: str | None, selection: Selection) -> Workload:
    """Load the selected rows of a trace, arrival times rebased so the first is at 0.

    Rows are sorted by arrival time when the trace has timestamps (the Azure files are
    already sorted; sorting makes replay robust to files that are not).
    """
    path, known = find_trace(spec, trace_dir)
    layout, rows = read_rows(path)
    timed = rows[0][0] is not None
    if timed:
        rows.sort(key=lambda r: r[0])
    picked = [rows[i] for i in selection.indices(len(rows))]
    t0 = picked[0][0] if timed else None
    specs = tuple(RequestSpec(i, p, o, None if t is None else t - t0)
                  for i, (t, p, o) in enumerate(picked))
    source = {"kind": "trace", "trace": spec, "path": str(path), "sha256": _sha256(path),
              "layout": layout, "rows_in_file": len(rows), "start": selection.start,
              "sample": selection.sample, "selected": len(specs), "timed": timed}
    if selection.sample == "random":
        source["sample_seed"] = selection.seed
    if known is not None:
        source["licence"] = known.licence
    name = next((n for n, k in KNOWN_TRACES.items() if k is known), path.name)
    return Workload(name, specs, source)
