"""Drive the engine's real schedulers with SimulatedExecutors over a workload, in virtual time.

One *replica* is one engine: a ``KVStore``, a scheduler from the policy registry (the same
classes the engine runs, unchanged; or ``vllm-plugin``, vLLM with our plug-in, from
``plugin_policy.py``) whose clock is the executor's virtual clock, and a
``SimulatedExecutor``. The loop is the engine's: ``schedule -> execute -> update``, with
requests added between steps once their arrival time has passed — a request arriving while
a step runs is seen by the next one, as in the real engine.

With several replicas (topology ``dp``) the replica furthest behind in virtual time steps
next, so arrivals are dispatched in time order. An idle replica jumps to the next arrival.
Dispatch ``kv`` / ``kv+length`` runs the served replica router's own code
(``cluster/routing.py``) on exact replica state (the served one sees reports up to half a
second old, corrected by what it sent since).

Results are the benchmark tool's ``RequestRecord``s (times in virtual seconds from the first
arrival), so ``alignedserve.bench`` computes metrics and writes reports unchanged.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from alignedserve.bench.records import RequestRecord, StepSample
from alignedserve.bench.workloads import RequestSpec, Workload
from alignedserve.cluster.routing import ReplicaLoad, Router, group_lengths
from alignedserve.kv.store import KVStore
from alignedserve.request import FinishReason, Request
from alignedserve.sampling_params import SamplingParams
from alignedserve.sched.plan import StepOutput, StepPlan
from alignedserve.sim.config import SimConfig
from alignedserve.sim.costmodel import CostModel
from alignedserve.sim.executor import SimulatedExecutor
from alignedserve.sim.plugin_policy import check_launch, make_sim_scheduler
from alignedserve.step_stats import BatchRecord, StepRecord, StepStats

EOS_ID = 0  # the simulated sampler never emits it; outputs end by length (ignore_eos)
MAX_IDLE_STEPS = 10_000  # consecutive steps without compute before declaring a livelock


@dataclass(slots=True)
class _Live:
    spec: RequestSpec
    request: Request
    times: list[float] | None  # token timestamps when ITLs are recorded


@dataclass(slots=True)
class SimResult:
    """One policy simulated over one workload."""

    policy: str
    records: list[RequestRecord]
    steps: list[StepSample]
    engine_stats: dict[str, Any]
    wall_s: float
    notes: list[str] = field(default_factory=list)


class _StepSampler:
    """Keeps at most ~``limit`` evenly spaced steps of replica 0 for plots (deterministic)."""

    def __init__(self, limit: int):
        self.limit, self.stride, self.samples = max(2, limit), 1, []

    def offer(self, t: float, plan: StepPlan, stats: StepStats) -> None:
        if plan.step_id % self.stride:
            return
        rec = stats.window[-1]
        batches = tuple((b.rows, b.min_len, b.max_len, b.kv_tokens) for b in rec.batches)
        self.samples.append(StepSample(t, rec.step_id, rec.prefill_tokens, rec.decode_rows,
                                       batches, rec.bubble_fraction, rec.compute_s,
                                       rec.copy_wait_s))
        if len(self.samples) > self.limit:
            self.stride *= 2
            self.samples = [s for s in self.samples if s.step_id % self.stride == 0]


class _Replica:
    """One engine: a KV store, the policy's real scheduler on the executor's clock, and a
    SimulatedExecutor; ``live`` holds its unfinished requests."""

    def __init__(self, policy: str, cfg: SimConfig, cost: CostModel):
        bpt = cfg.model.kv_bytes_per_token
        self.store = KVStore.for_devices(cfg.device_kv_bytes(), cfg.host_kv_bytes(), bpt)
        self.executor = ex = SimulatedExecutor(cost, cfg.node, bpt)
        self.scheduler = make_sim_scheduler(policy, cfg.scheduler_config(), self.store,
                                            clock=lambda: ex.now,
                                            plugin_admission=cfg.plugin_admission)
        self.stats = StepStats()
        self.live: dict[str, _Live] = {}
        self.idle_steps = 0
        self._device_tiers = self.store.device_tiers
        self._device_total = sum(self.store.total(t) for t in self._device_tiers)

    def load(self, replica_id: str) -> ReplicaLoad:
        """What a served replica reports to the router (``cluster/replica.py``), exactly."""
        store = self.store
        queued = sum(live.spec.prompt_len for live in self.live.values()
                     if live.request.kv is None)
        groups = group_lengths(self.scheduler.decode_groups())
        return ReplicaLoad(replica_id, sum(store.used(t) for t in store.tiers) + queued,
                           max(1, self._device_total), self.scheduler.num_running(),
                           self.scheduler.num_waiting(), groups)

    def add(self, live: _Live) -> None:
        self.executor.advance_to(live.request.arrival_time)
        self.scheduler.add_request(live.request)
        self.live[live.request.request_id] = live

    def step(self, records: list[RequestRecord], sampler: _StepSampler | None) -> None:
        plan = self.scheduler.schedule()
        out = self.executor.execute(plan)
        touched = self.scheduler.update(plan, out)
        self.stats.add(self._step_record(plan, out))
        now = self.executor.now
        if sampler is not None:
            sampler.offer(now, plan, self.stats)
        live = self.live
        for request in touched:
            if live[request.request_id].times is not None:
                live[request.request_id].times.append(now)
            if request.is_finished:
                records.append(_record(live.pop(request.request_id)))
        for rid in plan.finished_request_ids:  # finished without a token (e.g. failed)
            if rid in live and live[rid].request.is_finished:
                records.append(_record(live.pop(rid)))
        self.idle_steps = 0 if plan.has_work else self.idle_steps + 1
        if self.idle_steps > MAX_IDLE_STEPS:
            raise RuntimeError(f"{self.scheduler.name}: no compute for {MAX_IDLE_STEPS} steps "
                               f"with {len(live)} requests in flight (livelock)")

    def _step_record(self, plan: StepPlan, out: StepOutput) -> StepRecord:
        """What ``stats.record_step`` returns, built from the per-batch aggregates the cost
        model already computed (one pass over the rows instead of two; a test checks that
        both agree)."""
        cost = self.executor.last_cost
        batches = tuple(BatchRecord(*b) for b in cost.batches)
        store = self.store
        used = sum(store.used(t) for t in self._device_tiers)
        return StepRecord(plan.step_id, cost.prefill_tokens, sum(b[0] for b in cost.batches),
                          batches, out.compute_s, out.copy_wait_s, out.copy_bytes,
                          used / self._device_total if self._device_total else 0.0,
                          sum(1 for c in plan.prefills if c.sample))


def _record(live: _Live) -> RequestRecord:
    r, spec = live.request, live.spec
    n_out = len(r.output_token_ids)
    ok = r.finish_reason is FinishReason.LENGTH and n_out == spec.output_len
    return RequestRecord(
        index=spec.index, prompt_len=spec.prompt_len, expected_output_len=spec.output_len,
        scheduled_s=r.arrival_time, sent_s=r.arrival_time, first_token_s=r.first_token_time,
        end_s=r.finish_time, output_len=n_out, chunk_times=live.times or [], ok=ok,
        error=r.error or (None if ok else f"finished {r.finish_reason} after {n_out} tokens"),
        count_source="simulator", count_mismatch=n_out != spec.output_len)


def _make_live(spec: RequestSpec, arrival: float, max_model_len: int, itl: bool) -> _Live:
    if spec.prompt_len + spec.output_len > max_model_len:
        raise ValueError(f"request {spec.index} needs {spec.prompt_len} + {spec.output_len} "
                         f"tokens, over the model context {max_model_len}: cap it with "
                         f"--max-total-len")
    params = SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)
    request = Request(str(spec.index), [1] * spec.prompt_len, params,
                      eos_token_ids=frozenset({EOS_ID}), max_model_len=max_model_len,
                      arrival_time=arrival)
    return _Live(spec, request, [] if itl else None)


def simulate(workload: Workload, offsets: Sequence[float], policy: str,
             cfg: SimConfig) -> SimResult:
    """Run every request of ``workload`` (due at ``offsets``) to completion under ``policy``."""
    if len(offsets) != len(workload.requests):
        raise ValueError("one arrival offset per request is needed")
    check_launch(policy, cfg.launch)
    wall = time.perf_counter()
    cost = cfg.cost_model()
    replicas = [_Replica(policy, cfg, cost) for _ in range(cfg.replicas)]
    order = sorted(range(len(offsets)), key=lambda i: (offsets[i], i))
    records: list[RequestRecord] = []
    sampler = _StepSampler(cfg.step_samples) if cfg.step_samples else None
    dispatch = _Dispatcher(cfg.dispatch)
    nxt = 0
    while True:
        current = _earliest_busy(replicas)
        if current is None and nxt == len(order):
            break
        horizon = current.executor.now if current else offsets[order[nxt]]
        while nxt < len(order) and offsets[order[nxt]] <= horizon:
            i = order[nxt]
            target = dispatch(replicas, workload.requests[i].prompt_len)
            target.add(_make_live(workload.requests[i], offsets[i], cfg.model.max_model_len,
                                  cfg.record_itl))
            nxt += 1
        if current is not None:
            current.step(records, sampler if current is replicas[0] else None)
    for r in replicas:  # conservation: every request left, and took its KV with it
        r.store.check_invariants()
        if leaked := {t: r.store.used(t) for t in r.store.tiers if r.store.used(t)}:
            raise RuntimeError(f"{policy}: KV still allocated after the run: {leaked}")
    return SimResult(policy, sorted(records, key=lambda r: r.index),
                     sampler.samples if sampler else [], _engine_stats(replicas, cfg),
                     time.perf_counter() - wall, _notes(cfg))


def _earliest_busy(replicas: list[_Replica]) -> _Replica | None:
    """The busy replica furthest behind in virtual time (None if all are idle)."""
    best = None
    for r in replicas:
        if r.scheduler.has_unfinished() and (best is None or r.executor.now < best.executor.now):
            best = r
    return best


class _Dispatcher:
    """Which replica gets the next arrival: round-robin, the fewest requests in flight, or the
    served router's ``Router.rank`` (``kv``, ``kv+length``) on each replica's exact state."""

    def __init__(self, rule: str):
        self.rule, self.turn = rule, 0
        self.router = Router(rule) if rule in ("kv", "kv+length") else None
        self.rng = random.Random(0)

    def __call__(self, replicas: list[_Replica], prompt_tokens: int) -> _Replica:
        self.turn += 1
        if self.rule == "least-loaded":
            return min(replicas, key=lambda r: len(r.live))
        if self.router is None:
            return replicas[(self.turn - 1) % len(replicas)]
        loads = [r.load(str(i)) for i, r in enumerate(replicas)]
        return replicas[int(self.router.rank(loads, prompt_tokens, self.rng)[0])]


def _engine_stats(replicas: list[_Replica], cfg: SimConfig) -> dict[str, Any]:
    """Totals over replicas: the engine's step statistics plus the executor's breakdown."""
    out: dict[str, Any] = {"replicas": len(replicas)}
    for key in ("steps", "prefill_tokens", "decode_tokens", "kv_tokens", "padded_tokens",
                "compute_s", "copy_wait_s", "copy_bytes"):
        out[key] = sum(getattr(r.stats, key) for r in replicas)
    out["bubble_fraction"] = (1 - out["kv_tokens"] / out["padded_tokens"]
                              if out["padded_tokens"] else 0.0)
    totals = [r.executor.totals for r in replicas]
    for key in ("host_s", "device_s", "linear_s", "prefill_attn_s", "decode_attn_s",
                "lm_head_sample_s", "grow_s"):
        out[key] = sum(getattr(t, key) for t in totals)
    kinds = {k for t in totals for k in t.copy_bytes}
    out["copy_bytes_by_route"] = {k: sum(t.copy_bytes.get(k, 0) for t in totals)
                                  for k in sorted(kinds)}
    out["virtual_end_s"] = max(r.executor.now for r in replicas)
    out["prefetch_link_tokens"] = cfg.scheduler_config().prefetch_link_tokens
    out["device_kv_tokens"] = [b // cfg.model.kv_bytes_per_token for b in cfg.device_kv_bytes()]
    out["host_kv_tokens"] = cfg.host_kv_bytes() // cfg.model.kv_bytes_per_token
    return out


def _notes(cfg: SimConfig) -> list[str]:
    node = cfg.node
    topo = (f"{cfg.replicas} data-parallel replicas ({cfg.nodes} node(s)), one device each, "
            f"dispatch {cfg.dispatch}"
            if cfg.topology == "dp" else
            f"one engine: dev0 computes, {node.num_devices - 1} peer device(s) stage KV")
    return [f"simulated: {cfg.model.name} on {node.name} ({topo}); decode attention kernel "
            f"model '{cfg.kernel.value}', launch '{cfg.launch.value}'; times are virtual seconds"]
