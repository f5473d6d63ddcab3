"""What a run drives: an HTTP server (by URL) or an in-process engine policy (by name)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlparse


@dataclass(frozen=True, slots=True)
class Target:
    """Exactly one of ``url`` / ``policy`` is set; ``label`` names it in reports."""

    label: str
    url: str | None = None
    policy: str | None = None

    def __post_init__(self) -> None:
        if (self.url is None) == (self.policy is None):
            raise ValueError("a target is either a URL or a policy")
        if not self.label:
            raise ValueError("a target needs a label")

    @property
    def description(self) -> str:
        return self.url if self.url is not None else f"policy:{self.policy}"

    @property
    def in_process(self) -> bool:
        return self.policy is not None


def _url_label(url: str) -> str:
    parsed = urlparse(url)
    return f"{parsed.hostname}:{parsed.port}" if parsed.port else (parsed.hostname or url)


def parse_target(text: str) -> Target:
    """``URL``, ``POLICY``, ``LABEL=URL`` or ``LABEL=POLICY``."""
    text = text.strip()
    label, spec = None, text
    if not text.startswith(("http://", "https://")) and "=" in text:
        label, _, spec = text.partition("=")
        label, spec = label.strip(), spec.strip()
    if spec.startswith(("http://", "https://")):
        return Target(label or _url_label(spec), url=spec)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", spec):
        raise ValueError(f"target {text!r} is neither a URL (http://...) nor a policy name")
    return Target(label or spec, policy=spec)


def unique_labels(targets: list[Target]) -> list[Target]:
    """Suffix repeated labels (``fcfs``, ``fcfs-2``) so every run has its own folder."""
    seen: dict[str, int] = {}
    out = []
    for t in targets:
        seen[t.label] = seen.get(t.label, 0) + 1
        label = t.label if seen[t.label] == 1 else f"{t.label}-{seen[t.label]}"
        out.append(Target(label, t.url, t.policy))
    return out
