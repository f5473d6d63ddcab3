"""Drives vLLM's own scheduler classes in-process, step by step, with no model and no server:
the engine core's loop (schedule -> model output -> ``update_from_output``) with a stand-in for
the model that samples token 7 wherever vLLM asks for a token.

Run with vLLM's python (``scripts/setup_vllm.sh``), this repository on ``PYTHONPATH``:

    VLLM_PY tests/vllm_harness.py SPEC.json RESULT.json

``SPEC`` is ``{"runs": [RUN, ...], "classes": [NAME, ...]}``. Each ``classes`` entry is a
``--scheduler-cls`` value, resolved as vLLM resolves it (``SchedulerConfig.get_scheduler_cls``);
the result gives its MRO, and ``import_without_async`` what importing the plug-in gives on a
vLLM that lacks ``AsyncScheduler`` (its module blocked). Each RUN names ``scheduler`` (``vanilla``,
``vanilla-async``, ``plugin``, ``plugin-async``), ``requests`` (``[arrival_step, prompt_len,
max_tokens]`` each), and optionally ``env`` (variables set while the scheduler is built: the
plug-in reads its options there), ``max_num_seqs``, ``max_num_batched_tokens``,
``num_blocks`` (KV capacity in 16-token blocks: small values force preemption) and
``max_steps``. Async schedulers run with two steps in flight, as vLLM's engine core runs them
(the next step is scheduled before the previous one's tokens come back); the others with one.

The result has, per run: the scheduler's MRO (class names); per step the scheduled tokens per
request, the decode rows' KV lengths (rows caught up, ``is_prefill_chunk`` false, with an
output already) and how many of them were scheduled before their previous token came back;
per request its arrival, first-scheduled and finish steps and tokens received; and the
plug-in's own per-step records (``alignment_records``) where there is one.
``mixed_requests`` makes request lists; ``admissions``, ``passed_over`` and ``summary`` read a
run's result (plain Python, no vLLM:
the tests and ``benchmarks/vllm_plugin_counts.py`` import them).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

MODEL_CONFIG = {  # SmolLM2-135M's shape; only the config is read, no weights
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
    "num_hidden_layers": 30, "vocab_size": 49152, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 100000, "torch_dtype": "bfloat16",
    "tie_word_embeddings": True}
BLOCK = 16
TOKEN = 7


def _vllm_config(model_dir: str, run: dict[str, Any]):
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=4096,
                        dtype="bfloat16")
    sched = SchedulerConfig(max_num_seqs=run.get("max_num_seqs", 64),
                            max_num_batched_tokens=run.get("max_num_batched_tokens", 2048),
                            max_model_len=4096, is_encoder_decoder=False)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=False)
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache)
    config.cache_config.num_gpu_blocks = run.get("num_blocks", 4096)
    return config


def _scheduler_class(name: str) -> type:
    if name == "vanilla":
        from vllm.v1.core.sched.scheduler import Scheduler
        return Scheduler
    if name == "vanilla-async":
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        return AsyncScheduler
    from alignedserve.integrations import vllm as plugin
    return {"plugin": plugin.AlignedScheduler,
            "plugin-async": plugin.AlignedAsyncScheduler}[name]


def _build(config, cls: type, env: dict[str, str]):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                             dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=config.cache_config.num_gpu_blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return cls(vllm_config=config, kv_cache_config=kv,
                   structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _request(index: int, prompt_len: int, max_tokens: int, arrival: float):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    prompt = [100 + (index * 31 + i) % 30000 for i in range(prompt_len)]
    return Request(f"r{index}", prompt, params, None, arrival_time=arrival)


def _model_output(out, sampling: dict[str, bool]):
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[TOKEN] if sampling[r] else [] for r in ids])


class _Run:
    """One scheduler over one request list, with ``depth`` steps in flight."""

    def __init__(self, model_dir: str, run: dict[str, Any]):
        self.spec = run
        self.cls = _scheduler_class(run["scheduler"])
        self.scheduler = _build(_vllm_config(model_dir, run), self.cls, run.get("env", {}))
        self.depth = 2 if run["scheduler"].endswith("async") else 1
        self.arrivals = sorted((a, i, p, m) for i, (a, p, m) in enumerate(run["requests"]))
        self.steps: list[dict[str, Any]] = []
        self.first_scheduled: dict[str, int] = {}
        self.finished: dict[str, int] = {}
        self.received: collections.Counter[str] = collections.Counter()

    def _add_arrivals(self, step: int) -> None:
        while self.arrivals and self.arrivals[0][0] <= step:
            _, i, prompt_len, max_tokens = self.arrivals.pop(0)
            # distinct arrival times, as wall-clock ones are: step, then index within it
            self.scheduler.add_request(_request(i, prompt_len, max_tokens, step + i * 1e-6))

    def _schedule(self, step: int):
        s = self.scheduler
        out = s.schedule()
        sampling = {rid: not s.requests[rid].is_prefill_chunk for rid in out.num_scheduled_tokens}
        decoding = {rid: s.requests[rid].num_computed_tokens for rid, n in
                    out.num_scheduled_tokens.items() if n == 1 and sampling[rid]
                    and s.requests[rid].num_output_tokens
                    + s.requests[rid].num_output_placeholders > int(self.depth == 2)}
        for rid in out.num_scheduled_tokens:
            self.first_scheduled.setdefault(rid, step)
        # rows scheduled while their previous step's token was still in flight (async only)
        ahead = sum(1 for rid in decoding if s.requests[rid].num_output_placeholders >= 2)
        self.steps.append({"step": step, "scheduled": dict(out.num_scheduled_tokens),
                           "decode_lengths": sorted(decoding.values()), "ahead": ahead,
                           "preempted": sorted(out.preempted_req_ids or ())})
        return out, sampling

    def _update(self, out, sampling, step: int) -> None:
        outputs = self.scheduler.update_from_output(out, _model_output(out, sampling))
        for eco in outputs.values():
            for o in eco.outputs:
                self.received[o.request_id] += len(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = step

    def go(self) -> dict[str, Any]:
        s, queue, step = self.scheduler, collections.deque(), 0
        while self.arrivals or s.has_requests() or queue:
            if step >= self.spec.get("max_steps", 20000):
                raise RuntimeError(f"{self.spec['scheduler']}: not done after {step} steps")
            self._add_arrivals(step)
            if s.has_requests():
                queue.append(self._schedule(step))
                if len(queue) < self.depth and s.has_requests():
                    step += 1
                    continue
            if queue:
                self._update(*queue.popleft(), step)
            step += 1
        return self._result()

    def _result(self) -> dict[str, Any]:
        records = [dataclasses.asdict(r) for r in getattr(self.scheduler, "alignment_records", ())]
        return {"scheduler": self.spec["scheduler"], "mro": [c.__name__ for c in self.cls.__mro__],
                "budget": self.scheduler.max_num_scheduled_tokens,
                "steps": self.steps, "records": records,
                "requests": {f"r{i}": {"arrival": a, "prompt_len": p, "max_tokens": m,
                                       "first_scheduled": self.first_scheduled.get(f"r{i}"),
                                       "finished": self.finished.get(f"r{i}"),
                                       "received": self.received[f"r{i}"]}
                             for i, (a, p, m) in enumerate(self.spec["requests"])}}


def mixed_requests(count: int, seed: int, arrive_over: int) -> list[list[int]]:
    """``[arrival_step, prompt_len, max_tokens]``: prompts log-uniform 8..1200, outputs 8..40,
    arrivals spread over the first ``arrive_over`` steps."""
    rng = random.Random(seed)
    return [[rng.randrange(arrive_over + 1), int(8 * 150 ** rng.random()), rng.randrange(8, 41)]
            for _ in range(count)]


def admissions(run: dict[str, Any]) -> list[tuple[int, int, int]]:
    """``(first scheduled step, arrival step, index)`` per request, in admission order."""
    return sorted((r["first_scheduled"], r["arrival"], int(rid[1:]))
                  for rid, r in run["requests"].items())


def passed_over(run: dict[str, Any], max_wait: int | None) -> list[tuple[int, int, int]]:
    """``(step, passed, passer)``: a request admitted at ``step`` before one that entered the
    queue before it and was still waiting (only those that had waited ``max_wait`` steps;
    None: any). First admissions only: a preempted request coming back is vLLM's to place."""
    found = []
    order = admissions(run)
    for t, y_arrival, y in order:
        for t_x, x_arrival, x in order:
            if t_x > t and (x_arrival, x) < (y_arrival, y) and x_arrival <= t and \
                    (max_wait is None or t - x_arrival >= max_wait):
                found.append((t, x, y))
    return found


def summary(run: dict[str, Any], tolerance: int) -> dict[str, float]:
    """Scheduler-level counts of one run (no timing): steps; per decode step the decode rows,
    their length groups within ``tolerance`` and the bubble a padded kernel would have over
    the whole batch and per group (from the steps vLLM scheduled, so the same for every
    scheduler); from the plug-in's records, the share of admissions that fit a running group
    (NaN without the plug-in); admissions out of arrival order; the longest and mean wait for
    admission (steps); the mean churn of the scheduled set per step and how often a request
    left it and came back (``step_churn``, ``rejoins``); the share of steps that used the whole
    token budget; preemptions."""
    from alignedserve.integrations.alignment import DecodeStepRecord

    decode = [DecodeStepRecord.of(s["step"], s["decode_lengths"], tolerance)
              for s in run["steps"] if s["decode_lengths"]]
    waits = [r["first_scheduled"] - r["arrival"] for r in run["requests"].values()]
    admitted = sum(r["admitted"] for r in run["records"])
    fitting = sum(r["admitted_fitting"] for r in run["records"])

    def mean(key: str) -> float:
        return sum(getattr(r, key) for r in decode) / len(decode)

    sets = [set(s["scheduled"]) for s in run["steps"]]
    return {"steps": len(run["steps"]), "rows": mean("rows"), "groups": mean("groups"),
            "bubble": mean("bubble"), "group_bubble": mean("group_bubble"),
            "fitting_share": fitting / admitted if admitted else float("nan"),
            "out_of_order": len(passed_over(run, None)), "max_wait": max(waits),
            "mean_wait": sum(waits) / len(waits),
            "churn": sum(step_churn(run)) / len(sets), "rejoins": rejoins(sets),
            "budget_bound": sum(sum(s["scheduled"].values()) >= run["budget"]
                                for s in run["steps"]) / len(sets),
            "preemptions": sum(len(s["preempted"]) for s in run["steps"])}


def step_churn(run: dict[str, Any]) -> list[int]:
    """Per step, requests that entered or left the scheduled set since the previous step."""
    sets = [set(s["scheduled"]) for s in run["steps"]]
    return [len(a ^ b) for a, b in zip([set()] + sets, sets)]


def rejoins(sets: list[set[str]]) -> int:
    """Times a request left the scheduled set and was scheduled again later: what vLLM's
    persistent batch removes and re-adds (finishing requests leave for good)."""
    last = {rid: t for t, ids in enumerate(sets) for rid in ids}
    return sum(1 for t in range(1, len(sets)) for rid in sets[t - 1] - sets[t] if last[rid] > t)


def _resolved_mro(name: str) -> list[str]:
    from vllm.config import SchedulerConfig

    config = SchedulerConfig(max_model_len=4096, is_encoder_decoder=False, scheduler_cls=name)
    return [c.__name__ for c in config.get_scheduler_cls().__mro__]


def _import_without_async() -> dict[str, Any]:
    """Import the plug-in afresh as if vLLM had no ``AsyncScheduler`` (then restore)."""
    import importlib

    blocked, plugin = "vllm.v1.core.sched.async_scheduler", "alignedserve.integrations.vllm"
    saved = {k: sys.modules.pop(k) for k in (blocked, plugin) if k in sys.modules}
    sys.modules[blocked] = None  # type: ignore[assignment]  # makes the import fail
    try:
        module = importlib.import_module(plugin)
        try:
            getattr(module, "AlignedAsyncScheduler")
            error = None
        except AttributeError as exc:
            error = str(exc)
        return {"sync_mro": [c.__name__ for c in module.AlignedScheduler.__mro__],
                "async_error": error}
    finally:
        sys.modules.pop(blocked, None)
        sys.modules.pop(plugin, None)
        sys.modules.update(saved)
        package = sys.modules["alignedserve.integrations"]
        if plugin in saved:  # the import also rebound the package's attribute
            package.vllm = saved[plugin]
        else:
            del package.vllm


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out: dict[str, Any] = {"classes": {n: _resolved_mro(n) for n in spec.get("classes", [])}}
    if spec.get("classes"):
        out["import_without_async"] = _import_without_async()
    with tempfile.TemporaryDirectory(prefix="alignedserve-harness-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(MODEL_CONFIG))
        out["runs"] = [_Run(tmp, run).go() for run in spec.get("runs", [])]
    Path(sys.argv[2]).write_text(json.dumps(out))  # not stdout: vLLM logs there


if __name__ == "__main__":
    main()
