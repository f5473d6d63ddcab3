"""benchmarks/step_breakdown.py's per-part timer names each linear by its shape, whether or
not the packed layer still holds its unpacked weight (pack_linears drops it on the paths whose
own kernel takes every call)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from alignedserve.kernels import Kernels
from alignedserve.kernels.linear import PackedLinear

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import step_breakdown  # noqa: E402  (a script directory, not a package)


@pytest.fixture
def timer(monkeypatch: pytest.MonkeyPatch) -> step_breakdown.PartTimer:
    """PartTimer.installed(), its wrappers undone after the test."""
    wrap = step_breakdown.PartTimer.wrap

    def undone_after_the_test(self, owner, name, label) -> None:
        monkeypatch.setattr(owner, name, getattr(owner, name))
        wrap(self, owner, name, label)

    monkeypatch.setattr(step_breakdown.PartTimer, "wrap", undone_after_the_test)
    return step_breakdown.PartTimer.installed()


@pytest.mark.parametrize("release", [False, True])
def test_linears_are_timed_by_shape(compiled: Kernels, timer, release: bool) -> None:
    layer = PackedLinear(torch.randn(48, 32).bfloat16(), None, compiled)
    if release and not layer.release_weight():
        pytest.skip(f"the {compiled.path} path keeps the unpacked weight")
    layer(torch.randn(3, 32).bfloat16())
    timer.end_step("decode")
    assert list(timer.totals["decode"]) == ["linear 48x32"]
    assert timer.totals["decode"]["linear 48x32"] > 0
