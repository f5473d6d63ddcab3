"""The simulator's model of vLLM with our scheduler plug-in (``vllm-plugin``,
``alignedserve.sim.plugin_policy``): what it schedules, and the prediction's shape on a GPU
profile — about 1.0x of vLLM-like ``fcfs`` on unpadded kernels, a gain only against padded
batching. No model, no GPU, no vLLM; seconds.
"""

from __future__ import annotations

import dataclasses

import pytest

from alignedserve.bench.workloads import synthetic
from alignedserve.kv.store import KVStore
from alignedserve.sim.config import SimConfig
from alignedserve.sim.costmodel import AttentionLaunch
from alignedserve.sim.executor import SimulatedExecutor
from alignedserve.sim.plugin_policy import VllmPluginScheduler, make_sim_scheduler
from alignedserve.sim.runner import simulate
from alignedserve.sim.variants import parse_variants
from tests.fakes import make_request
from tests.test_sim import LLAMA, all_at_once, poisson, small_config, varied

TOLERANCE = 64


def plugin_config(**kw) -> SimConfig:
    cfg = small_config(launch="grouped", **kw)
    return dataclasses.replace(cfg, scheduler=dataclasses.replace(
        cfg.scheduler, align_tolerance=TOLERANCE, max_admit_wait_steps=16))


@pytest.mark.parametrize("timed", [False, True])
@pytest.mark.parametrize("admission", [False, True])
def test_every_request_finishes_with_exact_token_counts(timed, admission):
    w = varied(40)
    res = simulate(w, poisson(w) if timed else all_at_once(w), "vllm-plugin",
                   plugin_config(plugin_admission=admission))
    assert [(r.ok, r.output_len) for r in res.records] == \
        [(True, s.output_len) for s in w.requests]


def _run_plans(admission: bool, n: int = 30):
    """(plan, the running list as the plan left it) per step, run directly."""
    cfg = plugin_config()
    store = KVStore.for_devices(cfg.device_kv_bytes(), cfg.host_kv_bytes(),
                                LLAMA.kv_bytes_per_token)
    sim = SimulatedExecutor(cfg.cost_model(), cfg.node, LLAMA.kv_bytes_per_token)
    sched = make_sim_scheduler("vllm-plugin", cfg.scheduler_config(), store,
                               clock=lambda: sim.now, plugin_admission=admission)
    for i, spec in enumerate(varied(n, seed=5).requests):
        sched.add_request(make_request(str(i), spec.prompt_len, spec.output_len))
    while sched.has_unfinished():
        plan = sched.schedule()
        yield plan, list(sched.running)
        sched.update(plan, sim.execute(plan))


def test_decode_rows_go_in_length_groups_within_the_tolerance():
    multi = 0
    for plan, _ in _run_plans(admission=False):
        lengths = [b.kv_lengths() for b in plan.decode_batches]
        assert all(max(g) - min(g) <= TOLERANCE for g in lengths)
        multi += len(lengths) > 1
    assert multi > 0  # mixed lengths: really more than one group


def test_running_list_is_ordered_group_by_group_prefills_last():
    """The plug-in's order: every group contiguous in the running list, decoding rows before
    any request still prefilling (so the budget and preemption take whole groups)."""
    for plan, running in _run_plans(admission=True):
        prefilling = [r.in_prefill for r in running]
        assert prefilling == sorted(prefilling)
        positions = {r.request_id: i for i, r in enumerate(running)}
        for batch in plan.decode_batches:
            where = sorted(positions[r.request_id] for r in batch.requests)
            assert where == list(range(where[0], where[0] + len(where)))


def test_variants_know_the_plugin_and_its_lever():
    (plain, lever) = parse_variants(["vp=vllm-plugin,vpa=vllm-plugin:plugin_admission=1"])
    base = small_config()
    assert base.launch is AttentionLaunch.PER_BATCH
    assert plain.apply(base).launch is AttentionLaunch.GROUPED  # vLLM: one call per step
    assert (plain.apply(base).plugin_admission, lever.apply(base).plugin_admission) == \
        (False, True)
    with pytest.raises(ValueError, match="bad value for .plugin_admission"):
        parse_variants(["x=vllm-plugin:plugin_admission=yes"])
    w = varied(5)
    with pytest.raises(ValueError, match="launch=grouped"):
        simulate(w, all_at_once(w), "vllm-plugin", small_config())
    with pytest.raises(ValueError, match="plugin_admission"):
        simulate(w, all_at_once(w), "fcfs", small_config(plugin_admission=True))
    assert VllmPluginScheduler.name == "vllm-plugin"


def _throughput(policy: str, kernel: str, **kw) -> float:
    """Output tok/s of 120 requests (prompts 32..2000, all at once) on one H100."""
    w = synthetic("synthetic:varied:in=32-2000,out=32", 120, 2)
    cfg = small_config(kernel=kernel, launch="grouped", device_kv_gb=40.0, **kw)
    cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(
        cfg.scheduler, max_num_seqs=64, align_tolerance=TOLERANCE))
    res = simulate(w, all_at_once(w), policy, cfg)
    assert all(r.ok for r in res.records)
    return sum(r.output_len for r in res.records) / res.engine_stats["virtual_end_s"]


@pytest.mark.parametrize("kernel", ["split-kv", "per-seq"])
def test_prediction_with_unpadded_kernels_is_about_vllm(kernel):
    ratio = _throughput("vllm-plugin", kernel) / _throughput("fcfs", kernel)
    assert 0.95 <= ratio <= 1.02


def test_prediction_gains_only_against_padded_batching():
    padded = _throughput("vllm-plugin", "padded") / _throughput("fcfs", "padded")
    assert padded > 1.4
    # and with its groups padded it gets close to, not past, the unpadded kernel
    assert _throughput("vllm-plugin", "padded") <= 1.001 * _throughput("fcfs", "split-kv")
