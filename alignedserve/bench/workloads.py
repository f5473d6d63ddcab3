"""Workloads: a list of (prompt length, output length, optional arrival time) per request.

A workload spec on the command line is one of

* ``synthetic:NAME`` or ``synthetic:NAME:key=value,...`` (see ``SYNTHETIC``);
* a trace name (``azure_llm_2023_conv``, alias ``azure-conv``, ...; see ``traces``);
* a path to a trace file (CSV).

Synthetic parameters: ``in`` / ``out`` are a length ``N`` or an inclusive range ``LO-HI``;
``bimodal`` also takes ``short=LO-HI``, ``long=LO-HI`` and ``long_frac=F``. Lengths are drawn
from ``numpy.random.default_rng(seed)``, so one seed gives one workload everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

SYNTHETIC_PREFIX = "synthetic:"


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send. ``arrival_s`` is the trace's arrival offset (None: not timed)."""

    index: int
    prompt_len: int
    output_len: int
    arrival_s: float | None = None


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests in arrival order (``arrival_s`` non-decreasing when present) plus provenance.

    ``source`` records where the lengths came from and every scaling applied to them; it is
    written into the report verbatim.
    """

    name: str
    requests: tuple[RequestSpec, ...]
    source: dict[str, Any] = field(default_factory=dict)

    @property
    def timed(self) -> bool:
        return bool(self.requests) and all(r.arrival_s is not None for r in self.requests)

    def __len__(self) -> int:
        return len(self.requests)


# ---- synthetic ----------------------------------------------------------------------------
Range = tuple[int, int]


def parse_range(text: str) -> Range:
    """``"512"`` -> (512, 512); ``"64-3072"`` -> (64, 3072). Lengths must be >= 1."""
    lo, _, hi = text.partition("-")
    try:
        r = (int(lo), int(hi or lo))
    except ValueError:
        raise ValueError(f"expected a length N or a range LO-HI, got {text!r}") from None
    if r[0] < 1 or r[1] < r[0]:
        raise ValueError(f"bad length range {text!r}: need 1 <= LO <= HI")
    return r


def _uniform(rng: np.random.Generator, r: Range, n: int) -> np.ndarray:
    return rng.integers(r[0], r[1] + 1, size=n)


def _log_uniform(rng: np.random.Generator, r: Range, n: int) -> np.ndarray:
    # Sample log(length) uniformly over [log LO, log(HI+1)) so each integer's share is
    # proportional to its log-width, then floor: the classic "varied" shape.
    x = np.exp(rng.uniform(math.log(r[0]), math.log(r[1] + 1), size=n))
    return np.clip(np.floor(x).astype(np.int64), r[0], r[1])


def _fixed(rng: np.random.Generator, p: dict[str, str], n: int) -> tuple[np.ndarray, np.ndarray]:
    i, o = parse_range(p.get("in", "512")), parse_range(p.get("out", "256"))
    if i[0] != i[1] or o[0] != o[1]:
        raise ValueError("synthetic:fixed takes single lengths (in=N,out=N), not ranges")
    return np.full(n, i[0]), np.full(n, o[0])


def _uniform_gen(rng: np.random.Generator, p: dict[str, str], n: int):
    return (_uniform(rng, parse_range(p.get("in", "64-3072")), n),
            _uniform(rng, parse_range(p.get("out", "256")), n))


def _log_uniform_gen(rng: np.random.Generator, p: dict[str, str], n: int):
    return (_log_uniform(rng, parse_range(p.get("in", "64-3072")), n),
            _log_uniform(rng, parse_range(p.get("out", "256")), n))


def _bimodal(rng: np.random.Generator, p: dict[str, str], n: int):
    short, long = parse_range(p.get("short", "64-256")), parse_range(p.get("long", "2048-3072"))
    frac = float(p.get("long_frac", "0.25"))
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"long_frac must be in [0, 1], got {frac}")
    is_long = rng.random(n) < frac
    prompts = np.where(is_long, _uniform(rng, long, n), _uniform(rng, short, n))
    return prompts, _uniform(rng, parse_range(p.get("out", "256")), n)


def _varied(rng: np.random.Generator, p: dict[str, str], n: int):
    o = parse_range(p.get("out", "256"))
    if o[0] != o[1]:
        raise ValueError("synthetic:varied has a fixed output length (out=N)")
    return _log_uniform(rng, parse_range(p.get("in", "64-3072")), n), np.full(n, o[0])


Generator = Callable[[np.random.Generator, dict[str, str], int], tuple[np.ndarray, np.ndarray]]
SYNTHETIC: dict[str, tuple[Generator, frozenset[str], str]] = {
    "fixed": (_fixed, frozenset({"in", "out"}), "every prompt in=512, every output out=256"),
    "uniform": (_uniform_gen, frozenset({"in", "out"}),
                "prompts uniform in in=64-3072, outputs uniform in out=256"),
    "log-uniform": (_log_uniform_gen, frozenset({"in", "out"}),
                    "prompts log-uniform in in=64-3072, outputs log-uniform in out=256"),
    "bimodal": (_bimodal, frozenset({"short", "long", "long_frac", "out"}),
                "short=64-256 or (share long_frac=0.25) long=2048-3072 prompts; out=256"),
    "varied": (_varied, frozenset({"in", "out"}),
               "prompts log-uniform in=64-3072, fixed outputs out=256"),
}


def parse_params(text: str) -> dict[str, str]:
    params: dict[str, str] = {}
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise ValueError(f"bad synthetic parameter {item!r}: expected key=value")
        params[key.strip()] = value.strip()
    return params


def synthetic(spec: str, num_requests: int, seed: int) -> Workload:
    """Build ``synthetic:NAME[:k=v,...]`` with ``num_requests`` requests (no arrival times)."""
    body = spec.removeprefix(SYNTHETIC_PREFIX)
    name, _, param_text = body.partition(":")
    if name not in SYNTHETIC:
        raise ValueError(f"unknown synthetic workload {name!r}; choose one of {sorted(SYNTHETIC)}")
    if num_requests < 1:
        raise ValueError("a synthetic workload needs --num-requests >= 1")
    gen, allowed, _ = SYNTHETIC[name]
    params = parse_params(param_text)
    if unknown := set(params) - allowed:
        raise ValueError(f"synthetic:{name} takes {sorted(allowed)}, not {sorted(unknown)}")
    prompts, outputs = gen(np.random.default_rng(seed), params, num_requests)
    specs = tuple(RequestSpec(i, int(p), int(o)) for i, (p, o) in enumerate(zip(prompts, outputs)))
    return Workload(f"synthetic:{name}" + (f":{param_text}" if param_text else ""), specs,
                    {"kind": "synthetic", "generator": name, "params": params, "seed": seed})


# ---- description --------------------------------------------------------------------------
def length_stats(values: list[int]) -> dict[str, float]:
    """Mean, percentiles and CV (population std / mean) of a list of lengths."""
    if not values:
        return {}
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "min": float(a.min()), "max": float(a.max()),
            "cv": float(a.std() / a.mean()) if a.mean() else 0.0}


def describe(workload: Workload) -> dict[str, Any]:
    """Length and arrival statistics of a workload, for the report."""
    reqs = workload.requests
    out: dict[str, Any] = {
        "name": workload.name, "requests": len(reqs),
        "input_tokens": length_stats([r.prompt_len for r in reqs]),
        "output_tokens": length_stats([r.output_len for r in reqs]),
    }
    if workload.timed and len(reqs) > 1:
        span = reqs[-1].arrival_s - reqs[0].arrival_s
        rate = (len(reqs) - 1) / span if span else math.inf
        out["arrivals"] = {"span_s": span, "mean_rate": rate}
    return out


# ---- scaling to a machine's capacity -------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Scaling:
    """How lengths and arrival times are adapted to the machine, applied in this order:

    1. ``output_len``: every output set to this length;
    2. ``length_scale``: prompt and output lengths multiplied, rounded, at least 1;
    3. ``max_input`` / ``max_output``: caps;
    4. ``max_total``: prompt + output capped (the model context) by shortening the *prompt*,
       keeping the decode work the workload asked for (output capped to ``max_total - 1``);
    5. ``time_scale``: arrival offsets divided by it (10 = replay ten times faster).
    """

    output_len: int | None = None
    length_scale: float = 1.0
    max_input: int | None = None
    max_output: int | None = None
    max_total: int | None = None
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.length_scale <= 0 or self.time_scale <= 0:
            raise ValueError("length and time scales must be > 0")
        for name in ("output_len", "max_input", "max_output"):
            if (v := getattr(self, name)) is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.max_total is not None and self.max_total < 2:
            raise ValueError("max_total must be >= 2 (one prompt and one output token)")

    @property
    def identity(self) -> bool:
        return self == Scaling()

    def _lengths(self, prompt: int, output: int, counts: dict[str, int]) -> tuple[int, int]:
        if self.output_len is not None:
            output = self.output_len
        if self.length_scale != 1.0:
            prompt = max(1, round(prompt * self.length_scale))
            output = max(1, round(output * self.length_scale))
        if self.max_input is not None and prompt > self.max_input:
            prompt, counts["input_capped"] = self.max_input, counts["input_capped"] + 1
        if self.max_output is not None and output > self.max_output:
            output, counts["output_capped"] = self.max_output, counts["output_capped"] + 1
        if self.max_total is not None and prompt + output > self.max_total:
            output = min(output, self.max_total - 1)
            prompt, counts["total_capped"] = self.max_total - output, counts["total_capped"] + 1
        return prompt, output

    def apply(self, workload: Workload) -> Workload:
        """Return the scaled workload; its ``source["scaling"]`` records what was done."""
        if self.identity:
            return workload
        counts = {"input_capped": 0, "output_capped": 0, "total_capped": 0}
        specs = []
        for r in workload.requests:
            p, o = self._lengths(r.prompt_len, r.output_len, counts)
            t = None if r.arrival_s is None else r.arrival_s / self.time_scale
            specs.append(RequestSpec(r.index, p, o, t))
        defaults = asdict(Scaling())
        record = {k: v for k, v in asdict(self).items() if v != defaults[k]}
        source = dict(workload.source, scaling={**record, **counts},
                      before_scaling=describe(workload))
        return Workload(workload.name, tuple(specs), source)
