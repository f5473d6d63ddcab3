"""Policy variants on the command line: ``POLICY`` or ``LABEL=POLICY:key=value:key=value``.

A variant runs a policy the simulator knows (the engine's ``aligned``, ``fcfs``, ``static``,
and ``vllm-plugin``, vLLM with our scheduler plug-in: ``plugin_policy.py``) with some settings
changed, so one comparison can pair, say, ``static`` on a padded kernel with ``fcfs`` on a
per-sequence kernel, or run ``aligned`` without its host pool. Keys are the fields of
``SchedulerConfig`` (``max_num_seqs``, ``max_wait_steps``, ...) and the per-run fields of
``SimConfig`` listed in ``SIM_KEYS`` (``plugin_admission`` takes 0/1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

from alignedserve.config import SchedulerConfig
from alignedserve.sim.config import SimConfig


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(f"expected 0 or 1, got {text!r}")
    return text == "1"


SIM_KEYS: Mapping[str, Callable[[str], Any]] = MappingProxyType({
    "kernel": str, "launch": str, "host_kv_gb": float, "device_kv_gb": float,
    "prefetch_link_tokens": int, "topology": str, "dispatch": str, "plugin_admission": _flag})
# SchedulerConfig fields parse as the type of their default (int, or str for ``admission``).
_SCHED_KEYS: Mapping[str, type] = MappingProxyType(
    {f.name: type(f.default) for f in dataclasses.fields(SchedulerConfig)})


@dataclass(frozen=True, slots=True)
class PolicyVariant:
    label: str
    policy: str
    overrides: tuple[tuple[str, str], ...] = ()

    def apply(self, cfg: SimConfig) -> SimConfig:
        """``cfg`` with this variant's overrides (``vllm-plugin`` launches ``grouped`` unless
        told otherwise: vLLM makes one attention call per step)."""
        sim, sched = {}, {}
        for key, text in self.overrides:
            if key in SIM_KEYS:
                sim[key] = SIM_KEYS[key](text)
            else:
                sched[key] = _SCHED_KEYS[key](text)
        if self.policy == "vllm-plugin":
            sim.setdefault("launch", "grouped")
        if sched:
            sim["scheduler"] = dataclasses.replace(cfg.scheduler, **sched)
        return dataclasses.replace(cfg, **sim)


def parse_variant(text: str) -> PolicyVariant:
    from alignedserve.sim.plugin_policy import SIM_POLICIES as POLICIES

    label, eq, rest = text.partition("=")
    if not eq:
        label, rest = "", text
    policy, *pairs = rest.split(":")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r} in {text!r}; choose one of {sorted(POLICIES)}")
    overrides = []
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not value:
            raise ValueError(f"bad setting {pair!r} in {text!r}: expected key=value")
        if key not in SIM_KEYS and key not in _SCHED_KEYS:
            raise ValueError(f"unknown setting {key!r} in {text!r}; settings: "
                             f"{sorted(SIM_KEYS) + sorted(_SCHED_KEYS)}")
        try:
            (SIM_KEYS.get(key) or _SCHED_KEYS[key])(value)
        except ValueError:
            raise ValueError(f"bad value for {key!r} in {text!r}: {value!r}") from None
        overrides.append((key, value))
    return PolicyVariant(label or policy, policy, tuple(overrides))


def parse_variants(texts: list[str]) -> list[PolicyVariant]:
    """Comma- or space-separated variants; labels must be unique."""
    variants = [parse_variant(t) for text in texts for t in text.split(",") if t.strip()]
    labels = [v.label for v in variants]
    if dupes := sorted({x for x in labels if labels.count(x) > 1}):
        raise ValueError(f"duplicate policy labels {dupes}: name variants LABEL=POLICY:...")
    if not variants:
        raise ValueError("--policies is empty")
    return variants
