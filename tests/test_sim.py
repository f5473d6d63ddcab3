"""The simulator: the real schedulers on the cost model. No model, no GPU, seconds."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alignedserve.bench.arrivals import gamma_offsets
from alignedserve.bench.workloads import RequestSpec, Workload, synthetic
from alignedserve.config import SchedulerConfig
from alignedserve.kv.store import HOST, KVHandle, KVOp, KVOpKind, KVStore
from alignedserve.sched.plan import StepPlan
from alignedserve.sched.registry import POLICIES, make_scheduler
from alignedserve.sim.config import SimConfig
from alignedserve.sim.costmodel import AttentionKernel, CostModel
from alignedserve.sim.executor import SimulatedExecutor
from alignedserve.sim.hardware import GiB, node_profile
from alignedserve.sim.models import load_model_profile
from alignedserve.sim.runner import simulate
from alignedserve.sim.variants import parse_variants
from alignedserve.step_stats import record_step
from tests.fakes import FakeExecutor

POLICY_NAMES = sorted(POLICIES)
LLAMA = load_model_profile("llama-2-7b")


def small_config(**kw) -> SimConfig:
    """Llama-2-7B on one H100 with a tiny KV budget, so pools, swaps and waits all happen."""
    sched = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, kv_reserve_tokens=32,
                            max_cohort_rows=8)
    base = dict(model=LLAMA, node=node_profile("h100", 1), scheduler=sched,
                device_kv_gb=3.0, host_kv_gb=12.0, prefetch_link_tokens=0)
    return SimConfig(**{**base, **kw})


def varied(n: int = 40, seed: int = 0) -> Workload:
    return synthetic("synthetic:varied:in=16-600,out=24", n, seed)


def all_at_once(w: Workload) -> list[float]:
    return [0.0] * len(w.requests)


def poisson(w: Workload, rate: float = 20.0, seed: int = 0) -> list[float]:
    return gamma_offsets(len(w.requests), rate, 1.0, seed)


# ---- conservation -------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("timed", [False, True])
def test_every_request_finishes_with_exact_token_counts(policy, timed):
    w = varied()
    offsets = poisson(w) if timed else all_at_once(w)
    res = simulate(w, offsets, policy, small_config())
    assert len(res.records) == len(w.requests)
    for rec, spec in zip(res.records, w.requests):
        assert rec.index == spec.index and rec.ok and not rec.count_mismatch
        assert rec.output_len == spec.output_len
        assert rec.sent_s <= rec.first_token_s <= rec.end_s
    assert res.engine_stats["decode_tokens"] + sum(1 for _ in w.requests) >= sum(
        s.output_len for s in w.requests)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_data_parallel_replicas_conserve_requests(policy):
    w = varied(30)
    cfg = small_config(node=node_profile("a100", 2), topology="dp", dispatch="least-loaded")
    res = simulate(w, poisson(w, 50.0), policy, cfg)
    assert res.engine_stats["replicas"] == 2
    assert [r.output_len for r in res.records] == [s.output_len for s in w.requests]
    assert all(r.ok for r in res.records)


@pytest.mark.parametrize("dispatch", ["kv", "kv+length", "round-robin"])
def test_the_served_replica_router_runs_over_many_simulated_replicas(dispatch):
    """The same routing code as ``serve --replicas``, over 2 nodes x 2 devices."""
    w = varied(60)
    cfg = small_config(node=node_profile("a100", 2), topology="dp", dispatch=dispatch, nodes=2)
    res = simulate(w, poisson(w, 80.0), "aligned", cfg)
    assert res.engine_stats["replicas"] == 4
    assert all(r.ok for r in res.records) and len(res.records) == 60
    assert "2 node(s)" in res.notes[0] and dispatch in res.notes[0]
    with pytest.raises(ValueError, match="nodes"):
        small_config(nodes=2)  # several nodes only as data-parallel replicas


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_staging_devices_carry_prefetch_and_everything_finishes(policy):
    w = varied(40)
    cfg = small_config(node=node_profile("h100", 2), prefetch_link_tokens=64)
    res = simulate(w, all_at_once(w), policy, cfg)
    assert all(r.ok for r in res.records)
    if policy == "aligned":  # the small link budget pushes prefetch onto the peer device
        assert res.engine_stats["copy_bytes_by_route"].get("peer", 0) > 0


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_plans_are_executable_and_sampled_rows_match_a_checking_executor(policy):
    """The simulated executor answers exactly the rows a real one would, on valid plans."""
    cfg = small_config()
    store = KVStore.for_devices(cfg.device_kv_bytes(), cfg.host_kv_bytes(),
                                LLAMA.kv_bytes_per_token)
    sim = SimulatedExecutor(cfg.cost_model(), cfg.node, LLAMA.kv_bytes_per_token)
    checker = FakeExecutor(store)
    sched = make_scheduler(policy, cfg.scheduler_config(), store, clock=lambda: sim.now)
    from tests.fakes import make_request

    for i, spec in enumerate(varied(25).requests):
        sched.add_request(make_request(str(i), spec.prompt_len, spec.output_len))
    steps = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        before = sim.now
        out = sim.execute(plan)
        assert out.sampled.keys() == checker.execute(plan).sampled.keys()
        assert sim.now >= before and out.compute_s >= 0 and out.copy_wait_s >= 0
        sched.update(plan, out)
        store.check_invariants()
        steps += 1
        assert steps < 20_000
    assert store.used("dev0") == 0 and store.used(HOST) == 0


# ---- determinism and monotonicity ------------------------------------------------------
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_same_seed_same_result(policy):
    def run():
        w = varied(30, seed=3)
        res = simulate(w, poisson(w, 15.0, seed=3), policy, small_config())
        return [r.to_json() for r in res.records], json.dumps(res.engine_stats, sort_keys=True)

    assert run() == run()


FASTER = [dict(flops=2.0), dict(mem_bw=2.0), dict(link_bw=4.0),
          dict(flops=1.5, mem_bw=1.5, link_bw=1.5)]


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("faster", FASTER, ids=lambda f: ",".join(f"{k}x{v}" for k, v in f.items()))
def test_more_bandwidth_or_flops_never_slows_a_run(policy, faster):
    # All requests at t=0: the plan sequence does not depend on time, so every step is
    # priced on both machines and each must be no slower.
    w = varied(40)
    base = small_config()
    fast = dataclasses.replace(base, node=base.node.scaled(**faster))
    slow_res = simulate(w, all_at_once(w), policy, base)
    fast_res = simulate(w, all_at_once(w), policy, fast)
    assert fast_res.engine_stats["virtual_end_s"] <= slow_res.engine_stats["virtual_end_s"]
    for a, b in zip(fast_res.records, slow_res.records):
        assert a.end_s <= b.end_s + 1e-12


def test_more_host_link_bandwidth_shortens_a_swapping_run():
    w = varied(40)
    base = small_config()
    slow = simulate(w, all_at_once(w), "aligned", base).engine_stats
    fast = simulate(w, all_at_once(w), "aligned",
                    dataclasses.replace(base, node=base.node.scaled(link_bw=10.0))).engine_stats
    assert slow["copy_wait_s"] > 0 and fast["copy_wait_s"] < slow["copy_wait_s"]
    assert fast["virtual_end_s"] < slow["virtual_end_s"]


# ---- the cost model ----------------------------------------------------------------------
def _models(**kw):
    node = node_profile("h100", 1)
    return {k: CostModel(LLAMA, node.device, node.host, k, **kw) for k in AttentionKernel}


def test_kernel_models_on_a_mixed_batch_are_ordered():
    def costs(lengths):
        rows, total, longest = len(lengths), sum(lengths), max(lengths)
        return [m.decode_attention_s(rows, total, longest) for m in _models().values()]

    mixed = [64, 100, 300, 900, 3000, 4000]
    padded, per_seq, split = costs(mixed * 10)  # enough rows to fill the GPU: padding shows
    assert padded > 2 * per_seq and per_seq >= split
    padded, per_seq, split = costs(mixed)  # few rows: the longest block's tail shows
    assert padded >= per_seq > 2 * split


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 8192), min_size=1, max_size=300))
def test_kernel_models_are_ordered_on_any_batch(lengths):
    rows, total, longest = len(lengths), sum(lengths), max(lengths)
    cost = {k: m.decode_attention_s(rows, total, longest) for k, m in _models().items()}
    padded, per_seq, split = (cost[k] for k in AttentionKernel)
    assert padded >= per_seq >= split > 0


def test_aligned_batch_costs_the_same_padded_or_not():
    m = _models()
    same = [m[k].decode_attention_s(64, 64 * 1000, 1000) for k in
            (AttentionKernel.PADDED, AttentionKernel.PER_SEQ)]
    assert same[0] == pytest.approx(same[1])


def test_per_seq_tail_is_set_by_the_longest_when_rows_are_few():
    per_seq = _models()[AttentionKernel.PER_SEQ]
    # one long row among few: the kernel takes as long as the long row alone
    assert per_seq.decode_attention_s(2, 4000 + 10, 4000) == pytest.approx(
        per_seq.decode_attention_s(1, 4000, 4000))
    # many rows: throughput-bound, the longest hides behind the rest
    assert per_seq.decode_attention_s(256, 256 * 2000, 4000) == pytest.approx(
        per_seq.decode_attention_s(256, 256 * 2000, 2000))


def test_linear_layers_are_memory_bound_at_decode_and_compute_bound_at_prefill():
    m = _models()[AttentionKernel.SPLIT_KV]
    assert m.linear_s(1) == pytest.approx(m.linear_s(8), rel=0.05)  # weight reads dominate
    assert m.linear_s(8192) == pytest.approx(2 * m.linear_s(4096), rel=0.05)  # FLOPs dominate


def test_model_profiles_match_published_sizes():
    assert LLAMA.params == pytest.approx(6.74e9, rel=0.01)
    assert LLAMA.kv_bytes_per_token == 512 * 1024
    assert load_model_profile("llama-3-8b").kv_bytes_per_token == 128 * 1024
    assert load_model_profile("smollm2-135m").params == pytest.approx(134.5e6, rel=0.02)


# ---- copies ------------------------------------------------------------------------------
def _ops(*ops):
    return [KVOp(kind, KVHandle(h), tier, cap) for kind, h, tier, cap in ops]


def test_prefetch_overlaps_the_previous_step_but_a_synchronous_move_does_not():
    cfg = small_config()
    bpt = LLAMA.kv_bytes_per_token
    tokens = 2048  # 1 GiB: ~20 ms on PCIe Gen5
    copy_s = tokens * bpt / cfg.node.host_link.rate
    alloc = (KVOpKind.ALLOC, 1, HOST, tokens)
    begin, end = (KVOpKind.MOVE_BEGIN, 1, "dev0", tokens), (KVOpKind.MOVE_END, 1, "dev0", tokens)

    sync = SimulatedExecutor(cfg.cost_model(), cfg.node, bpt)
    out = sync.execute(StepPlan(0, kv_ops=_ops(alloc, begin, end)))
    assert out.copy_wait_s == pytest.approx(copy_s, rel=0.01)

    overlapped = SimulatedExecutor(cfg.cost_model(), cfg.node, bpt)
    first = overlapped.execute(StepPlan(0, kv_ops=_ops(alloc, begin)))
    assert first.copy_wait_s == 0.0
    overlapped.now += copy_s / 2  # half the copy happens under (simulated) compute
    second = overlapped.execute(StepPlan(1, kv_ops=_ops(end)))
    assert second.copy_wait_s == pytest.approx(copy_s / 2, rel=0.05)


def test_a_staged_batch_waits_for_its_first_hop_and_rides_nvlink():
    cfg = small_config(node=node_profile("h100", 2))
    bpt = LLAMA.kv_bytes_per_token
    ex = SimulatedExecutor(cfg.cost_model(), cfg.node, bpt)
    ex.execute(StepPlan(0, kv_ops=_ops((KVOpKind.ALLOC, 1, HOST, 4096),
                                       (KVOpKind.MOVE_BEGIN, 1, "dev1", 4096))))
    out = ex.execute(StepPlan(1, kv_ops=_ops((KVOpKind.MOVE_END, 1, "dev1", 4096),
                                             (KVOpKind.MOVE_BEGIN, 1, "dev0", 4096),
                                             (KVOpKind.MOVE_END, 1, "dev0", 4096))))
    pcie = 4096 * bpt / cfg.node.host_link.rate
    nvlink = 4096 * bpt / cfg.node.peer_link.rate
    assert out.copy_wait_s == pytest.approx(pcie + nvlink, rel=0.05)
    assert ex.totals.copy_bytes == {"h2d": 4096 * bpt, "peer": 4096 * bpt}


# ---- records and the command line ---------------------------------------------------------
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_step_records_equal_the_engines_record_step(policy):
    from alignedserve.sim import runner

    cfg = small_config()
    rep = runner._Replica(policy, cfg, cfg.cost_model())
    for spec in varied(12).requests:
        rep.add(runner._make_live(spec, 0.0, LLAMA.max_model_len, False))
    while rep.scheduler.has_unfinished():
        plan = rep.scheduler.schedule()
        out = rep.executor.execute(plan)
        mine = rep._step_record(plan, out)
        assert mine == record_step(plan, out, rep.store)
        rep.scheduler.update(plan, out)


def test_variants_parse_and_reject_bad_settings():
    vs = parse_variants(["aligned,fcfs", "pad=static:kernel=padded:max_num_seqs=8",
                         "arr=aligned:admission=fcfs"])
    assert [v.label for v in vs] == ["aligned", "fcfs", "pad", "arr"]
    cfg = vs[2].apply(small_config())
    assert cfg.kernel is AttentionKernel.PADDED and cfg.scheduler.max_num_seqs == 8
    assert vs[3].apply(small_config()).scheduler.admission == "fcfs"
    for bad in ["nope", "x=aligned:colour=red", "aligned:max_num_seqs=lots", "fcfs,fcfs"]:
        with pytest.raises(ValueError):
            parse_variants([bad])


def test_too_long_requests_are_refused_with_a_clear_error():
    w = Workload("long", (RequestSpec(0, 4000, 200),))
    with pytest.raises(ValueError, match="max-total-len"):
        simulate(w, [0.0], "fcfs", small_config())


def test_budgets_follow_the_hardware():
    cfg = SimConfig(LLAMA, node_profile("h100", 4))
    dev = cfg.device_kv_bytes()
    assert len(dev) == 4 and dev[0] < dev[1]  # weights live on the compute device only
    assert dev[0] == pytest.approx(80 * GiB * 0.9 - LLAMA.weight_bytes, rel=1e-6)
    assert cfg.scheduler_config().prefetch_link_tokens > 0
    # one device too: a real link has a finite budget, which also caps the host pool
    assert SimConfig(LLAMA, node_profile("h100", 1)).scheduler_config().prefetch_link_tokens > 0
    tiny = dataclasses.replace(node_profile("a100", 1).device, mem_bytes=10 * GiB)
    with pytest.raises(ValueError, match="does not fit"):
        node = dataclasses.replace(node_profile("a100", 1), device=tiny)
        SimConfig(LLAMA, node).device_kv_bytes()


def test_simulate_command_writes_the_benchmark_report(tmp_path, capsys):
    from alignedserve.entrypoints.cli import main

    out = tmp_path / "sim"
    rc = main(["simulate", "--workload", "synthetic:varied:in=16-800,out=16", "--num-requests",
               "30", "--hardware", "a100", "--num-devices", "2", "--model", "llama-3-8b",
               "--policies", "aligned,fcfs", "pad=static:kernel=padded", "--rate", "20",
               "--output-dir", str(out)])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [r["label"] for r in summary["runs"]] == ["aligned", "fcfs", "pad"]
    assert all(r["metrics"]["completed"] == 30 for r in summary["runs"])
    assert all(r["count_mismatches"] == 0 for r in summary["runs"])
    assert (out / "report.md").is_file() and (out / "latency_cdf.png").is_file()
    for name in ("aligned", "fcfs", "pad"):
        reqs = json.loads((out / "runs" / name / "requests.json").read_text())["requests"]
        assert sum(r["output_len"] for r in reqs) == 30 * 16
    printed = capsys.readouterr().out
    assert "Simulator breakdown" in printed and "| pad |" in printed


# ---- calibration (real engine, tiny random model) -------------------------------------------
def _tiny_model_dir(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.model_utils import tiny_hf_model

    tiny_hf_model("llama", max_position_embeddings=512, eos_token_id=2).save_pretrained(str(path))
    vocab = {f"w{i}": i for i in range(252)} | {"<unk>": 252, "<s>": 253, "</s>": 254}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(path))
    return path


def test_calibrate_fits_writes_a_loadable_profile_and_validates(tmp_path, capsys):
    pytest.importorskip("transformers")
    from alignedserve.entrypoints.cli import main

    model_dir = _tiny_model_dir(tmp_path / "tiny")
    profile = tmp_path / "cpu.json"
    assert main(["calibrate", "--model", str(model_dir), "--quick", "--output", str(profile)]) == 0
    data = json.loads(profile.read_text())
    cal = data["calibration"]
    assert cal["steps_measured"] >= 6 and cal["fit"]["gemm_flops"] > 0
    assert {r["policy"] for r in cal["validation"]} == {"fcfs", "aligned"}
    for row in cal["validation"]:
        assert row["output_tok_s"]["measured"] > 0 and row["output_tok_s"]["simulated"] > 0
    node = node_profile("cpu-local", profile_path=profile)
    assert node.device.name == "cpu-local" and node.single_copy_queue
    assert "held-out workload" in capsys.readouterr().out


def test_fit_recovers_known_rates_from_synthetic_steps():
    from alignedserve.sim.calibrate import StepShape, _known, fit_steps

    model = load_model_profile("smollm2-135m")
    truth = dict(flops=500e9, bw=50e9, overhead=2e-3, row=50e-6, attn_flops=100e9, attn_bw=8e9)
    shapes = [((( 0, p),) if p else (), (L,) * b, b + (1 if p else 0))
              for p, b, L in [(512, 0, 0), (1024, 0, 0), (128, 0, 0), (0, 1, 100), (0, 16, 300),
                              (0, 64, 50), (0, 32, 1000), (256, 8, 200), (0, 128, 20)]]
    steps = []
    for chunks, decode, sampled in shapes:
        s = StepShape(chunks, decode, sampled, 0.0)
        t = _known([s], model, truth["flops"], truth["bw"])[0] + truth["overhead"]
        t += truth["row"] * (len(decode) + len(chunks))
        t += sum(n * (n + 1) // 2 for _, n in chunks) * model.attn_flops_per_pair_layer \
            * model.num_layers / truth["attn_flops"]
        t += sum(decode) * model.kv_bytes_per_token / truth["attn_bw"]
        steps.append(StepShape(chunks, decode, sampled, t))
    fit = fit_steps(steps, model, truth["bw"])
    assert fit.median_rel_error < 0.02
    assert fit.gemm_flops == pytest.approx(truth["flops"], rel=0.1)
    assert fit.attn_bw == pytest.approx(truth["attn_bw"], rel=0.1)
    assert fit.step_overhead_s == pytest.approx(truth["overhead"], rel=0.1)
