"""Same answer under any load: a greedy request's tokens do not depend on what else runs.

On every compiled kernel path this CPU has, four requests of 16-1200 tokens are generated
alone, then again among twelve other mixed-length requests that arrive while they run, with a
per-step token budget small enough that prompts are cut into chunks at different places
(bf16 model, bf16 and fp8 caches). The tokens must be identical. docs/architecture.md
("Batch invariance") says which reductions this rests on.
"""

from __future__ import annotations

import pytest

from alignedserve.config import EngineConfig, SchedulerConfig
from alignedserve.engine import LLMEngine
from alignedserve.sampling_params import SamplingParams
from alignedserve.kernels.linear import AMX_MAX_ROWS
from tests.conftest import kernel_path_params
from tests.test_engine_parity import document

pytestmark = pytest.mark.model

TARGETS = (16, 150, 700, 1200)
FILLERS = (40, 333, 511, 900, 1500, 64, 200, 777, 20, 1000, 90, 640)
NEW_TOKENS = 24


def _run(engine: LLMEngine, requests: list[tuple[str, list[int]]],
         params: SamplingParams) -> dict[str, list[int]]:
    """Greedy outputs; the second half of ``requests`` arrives one every other step."""
    half = (len(requests) + 1) // 2
    for rid, prompt in requests[:half]:
        engine.add_request(rid, prompt, params)
    pending, outputs, steps = list(requests[half:]), {}, 0
    while engine.has_unfinished() or pending:
        if pending and steps % 2 == 0:
            engine.add_request(*pending.pop(0), params)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        steps += 1
    return outputs


def _check_alone_and_in_a_batch(default_model_fp32, engine: LLMEngine) -> None:
    doc = document(default_model_fp32.tokenizer)
    targets = [(f"t{i}", doc[i * 37:i * 37 + n]) for i, n in enumerate(TARGETS)]
    fillers = [(f"f{i}", doc[5 + i * 23:5 + i * 23 + n]) for i, n in enumerate(FILLERS)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    alone = {}
    for request in targets:
        alone.update(_run(engine, [request], params))
    mixed = [x for pair in zip(fillers[:4], targets) for x in pair] + fillers[4:]
    batch = _run(engine, mixed, params)
    engine.close()
    for rid, _ in targets:
        assert batch[rid] == alone[rid], f"{rid}: alone and in a batch differ"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e5m2"])
@pytest.mark.parametrize("path", kernel_path_params(("amx", "avx512_bf16", "avx512", "avx2")))
def test_tokens_are_the_same_alone_and_in_a_batch(default_model_fp32, path, kv_cache_dtype):
    engine = LLMEngine(EngineConfig(kernel_path=path, kv_cache_dtype=kv_cache_dtype,
                                    scheduler=SchedulerConfig(max_num_batched_tokens=512)))
    _check_alone_and_in_a_batch(default_model_fp32, engine)


@pytest.mark.parametrize("path", kernel_path_params(("amx", "avx512_bf16", "avx512", "avx2")))
def test_batch_invariant_holds_at_any_step_size(default_model_fp32, path):
    """With ``batch_invariant`` and the default step budget (2048 tokens), steps of more than
    1024 rows occur: on the amx path those go to oneDNN unless batch invariance is asked for
    (every other path is invariant either way)."""
    config = EngineConfig(kernel_path=path, batch_invariant=True)
    assert config.scheduler.max_num_batched_tokens > AMX_MAX_ROWS
    engine = LLMEngine(config)
    assert engine.kernels.batch_invariant
    _check_alone_and_in_a_batch(default_model_fp32, engine)
