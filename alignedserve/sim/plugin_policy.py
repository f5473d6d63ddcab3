"""vLLM with the AlignedServe scheduler plug-in, as the simulator models it (``vllm-plugin``).

vLLM itself is modelled by the ``fcfs`` policy (continuous batching in arrival order, chunked
prefill under the token budget, the newest request preempted when KV runs out) on vLLM's
kernels (``split-kv`` or ``per-seq``). The plug-in (``alignedserve.integrations.vllm``)
changes three things per step, and this class makes the same changes with the plug-in's own
functions (``alignedserve.integrations.alignment``), not a copy of them:

* the running list is ordered in length groups (``ordered_groups``: decoding requests whose
  KV lengths lie within ``align_tolerance``, groups by their oldest member's arrival, members
  by arrival; requests still prefilling after them), so when the token budget or the KV binds,
  whole groups run together and the newest requests give way;
* nothing is held back: every decoding request that fits the budget runs (no catch-up holds,
  unlike the ``aligned`` policy);
* with the admission lever on (``plugin_admission``), waiting requests are offered in
  ``admission_order`` (preempted first, then aged after ``max_admit_wait_steps`` steps, then
  prompts within the tolerance of a running decode length, then the rest).

The step's decode rows go to the executor as one batch per length group. vLLM launches one
attention call over all of them; the cost model prices that with the ``grouped`` launch: on
``split-kv`` / ``per-seq`` the groups cost what one batch would (Σ L), and on ``padded`` each
group is padded only to its own longest row — what a padded kernel would cost if it were
given the plug-in's group boundaries (the groups are contiguous in vLLM's batch). The host
model charges its per-batch overhead per group, standing in for the plug-in's Python work.
"""

from __future__ import annotations

import itertools
from typing import Any

from alignedserve.config import SchedulerConfig
from alignedserve.integrations.alignment import (Candidate, WaitClock, admission_order,
                                                 ordered_groups)
from alignedserve.kv.store import KVStore
from alignedserve.request import Request
from alignedserve.sched.fcfs import FcfsScheduler
from alignedserve.sched.interface import BaseScheduler
from alignedserve.sched.plan import DecodeBatch, StepPlan
from alignedserve.sched.registry import POLICIES, make_scheduler
from alignedserve.sim.costmodel import AttentionLaunch


def _kv_length(request: Request) -> int:
    return request.num_computed_tokens


def _arrival(request: Request) -> float:
    return request.arrival_time


class VllmPluginScheduler(FcfsScheduler):
    """``fcfs`` with the vLLM plug-in's running order, optional admission lever, and one
    decode batch per length group (see the module docstring)."""

    name = "vllm-plugin"

    def __init__(self, config: SchedulerConfig, store: KVStore, *,
                 aligned_admission: bool = False, **kwargs: Any):
        super().__init__(config, store, **kwargs)
        self.aligned_admission = aligned_admission
        self._wait_clock = WaitClock()
        self._steps = 0
        # arrival order (requests come in time order; ties by index): vLLM's arrival times are
        # wall-clock and distinct, so a burst's requests are ordered there too
        self._arrivals = itertools.count()
        self._arrival: dict[str, int] = {}

    def _enqueue(self, request: Request) -> None:
        self._arrival[request.request_id] = next(self._arrivals)
        super()._enqueue(request)

    def _forget(self, request: Request) -> None:
        self._arrival.pop(request.request_id, None)
        super()._forget(request)

    def schedule(self) -> StepPlan:
        self._steps += 1
        decoding = [r for r in self.running if not r.in_prefill]
        groups = ordered_groups(decoding, _kv_length, _arrival, self.config.align_tolerance)
        self.running[:] = [r for g in groups for r in g] + \
            [r for r in self.running if r.in_prefill]
        self._wait_clock.observe((r.request_id for r in self.waiting), self._steps)
        if self.aligned_admission and len(self.waiting) > 1:
            self._order_waiting([r.num_tokens for r in decoding])
        plan = super().schedule()
        plan.decode_batches = self._group_batches(plan.decode_batches)
        return plan

    def _order_waiting(self, running_lengths: list[int]) -> None:
        queue = list(self.waiting)
        cands = [Candidate(self.prefill_target(r),
                           self._wait_clock.waited(r.request_id, self._steps),
                           self._arrival[r.request_id], r.num_preemptions > 0) for r in queue]
        order = admission_order(cands, running_lengths, self.config.align_tolerance,
                                self.config.max_admit_wait_steps)
        self.waiting.clear()
        self.waiting.extend(queue[i] for i in order)

    def _group_batches(self, batches: list[DecodeBatch]) -> list[DecodeBatch]:
        rows = [r for b in batches for r in b.requests]
        groups = ordered_groups(rows, _kv_length, _arrival, self.config.align_tolerance)
        return [DecodeBatch(g, batch_id=i) for i, g in enumerate(groups)]


SIM_POLICIES: dict[str, type[BaseScheduler]] = {**POLICIES,
                                               VllmPluginScheduler.name: VllmPluginScheduler}


def make_sim_scheduler(policy: str, config: SchedulerConfig, store: KVStore, *,
                       plugin_admission: bool = False, **kwargs: Any) -> BaseScheduler:
    """The scheduler of a simulated replica: an engine policy (``sched.registry``) or the
    vLLM plug-in's model; ``plugin_admission`` applies to the latter only."""
    if policy == VllmPluginScheduler.name:
        return VllmPluginScheduler(config, store, aligned_admission=plugin_admission, **kwargs)
    if plugin_admission:
        raise ValueError(f"plugin_admission is the vllm-plugin policy's, not {policy!r}'s")
    return make_scheduler(policy, config, store, **kwargs)


def check_launch(policy: str, launch: AttentionLaunch) -> None:
    """``vllm-plugin`` models vLLM's one attention call per step: its groups must be priced as
    one grouped call, not one call each."""
    if policy == VllmPluginScheduler.name and launch is not AttentionLaunch.GROUPED:
        raise ValueError("vllm-plugin needs launch=grouped (vLLM makes one attention call per "
                         f"step), got {launch.value!r}")
