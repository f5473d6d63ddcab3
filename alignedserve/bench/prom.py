"""Read a server's Prometheus ``/metrics`` text and turn two scrapes into per-run engine stats.

Metric names differ between engines, so this looks for patterns rather than fixed names:
counters are differenced between the scrape before and after the run; the run's bubble
fraction comes from, in order of preference,

1. counter pairs ``*kv_tokens_total`` and ``*padded_tokens_total``:
   ``1 - d(kv) / d(padded)`` (exactly the engine's definition, over this run only);
2. a ``*bubble*`` histogram or summary: ``d(_sum) / d(_count)`` (mean per step, this run);
3. a ``*bubble*`` gauge: its value after the run (the engine's own window, which may
   include traffic from before the run; flagged as such).
"""

from __future__ import annotations

import math
import re
from typing import Any

Samples = dict[tuple[str, str], float]
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_KEEP = re.compile(r"bubble|kv_tokens|padded|alignedserve", re.IGNORECASE)


def parse_metrics(text: str) -> Samples:
    """``{(name, labels): value}`` for every sample line (comments skipped)."""
    out: Samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        try:
            out[(m.group(1), m.group(2) or "")] = float(m.group(3))
        except ValueError:
            continue
    return out


def _by_name(samples: Samples) -> dict[str, float]:
    """Sum over label sets: per-tier or per-device series add up to the engine total."""
    totals: dict[str, float] = {}
    for (name, _labels), value in samples.items():
        if not math.isnan(value):
            totals[name] = totals.get(name, 0.0) + value
    return totals


def _is_cumulative(name: str) -> bool:
    return name.endswith(("_total", "_sum", "_count", "_created")) or "_bucket" in name


def _find(names: dict[str, float], pattern: str) -> str | None:
    return next((n for n in sorted(names) if re.search(pattern, n)), None)


def _bubble(after: dict[str, float], delta: dict[str, float]) -> tuple[float | None, str | None]:
    kv, padded = _find(delta, r"kv_tokens_total$"), _find(delta, r"padded_tokens_total$")
    if kv and padded and delta[padded] > 0:
        return 1.0 - delta[kv] / delta[padded], f"1 - d({kv}) / d({padded})"
    s, c = _find(delta, r"bubble.*_sum$"), _find(delta, r"bubble.*_count$")
    if s and c and delta[c] > 0:
        return delta[s] / delta[c], f"d({s}) / d({c})"
    gauge = next((n for n in sorted(after) if "bubble" in n and not _is_cumulative(n)), None)
    if gauge:
        return after[gauge], f"{gauge} after the run (engine window, not this run only)"
    return None, None


def engine_stats_from_metrics(before: Samples | None,
                              after: Samples | None) -> dict[str, Any] | None:
    """Per-run stats from two scrapes; None when the server exposes nothing relevant."""
    if before is None or after is None:
        return None
    b, a = _by_name(before), _by_name(after)
    delta = {n: a[n] - b.get(n, 0.0) for n in a if _is_cumulative(n) and _KEEP.search(n)}
    bubble, how = _bubble(a, delta)
    gauges = {n: v for n, v in a.items() if not _is_cumulative(n) and _KEEP.search(n)}
    if bubble is None and not delta and not gauges:
        return None
    return {"source": "/metrics", "bubble_fraction": bubble, "bubble_from": how,
            "counter_deltas": delta, "gauges_after": gauges}
