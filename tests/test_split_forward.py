"""SplitForward (two micro-batches of a decode step at once) and what it rests on: the compiled
kernels release the GIL, and a row's tokens do not depend on the split."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from alignedserve.config import EngineConfig
from alignedserve.engine import LLMEngine
from alignedserve.executor.runner import SPLIT_MIN_ROWS
from alignedserve.executor.split_forward import SplitForward
from alignedserve.kernels.linear import PackedLinear
from alignedserve.sampling_params import SamplingParams
from tests.conftest import kernel_path_params
from tests.test_engine_parity import document


def test_halves_run_at_once_on_their_own_thread_counts():
    caller = torch.get_num_threads()
    split = SplitForward((1, 1))
    try:
        assert torch.get_num_threads() == caller
        meet = threading.Barrier(2, timeout=30)  # breaks unless both halves run at once

        def half() -> tuple[int, bool]:
            meet.wait()
            return torch.get_num_threads(), torch.is_inference_mode_enabled()

        assert split.run(half, half) == ((1, True), (1, True))
    finally:
        split.close()


def test_an_exception_in_either_half_reaches_the_caller_after_both_finish():
    split = SplitForward((1, 1))
    finished = threading.Event()

    def slow_ok() -> int:
        finished.wait(0.2)
        finished.set()
        return 1

    def failing() -> int:
        raise ValueError("half failed")

    try:
        with pytest.raises(ValueError, match="half failed"):
            split.run(slow_ok, failing)
        assert finished.is_set()
        assert split.run(lambda: 2, lambda: 3) == (2, 3)  # the workers survive
    finally:
        split.close()


def test_compiled_kernels_release_the_gil(compiled):
    """With a 100 s switch interval, another Python thread runs during a call only where the
    call itself lets go of the GIL."""
    layer = PackedLinear(torch.randn(2048, 2048, dtype=torch.bfloat16), None, compiled)
    x = torch.randn(512, 2048, dtype=torch.bfloat16)
    if layer.kernel_max_rows < x.shape[0]:
        pytest.skip(f"the {compiled.path} path's own linear does not take {x.shape[0]} rows")
    ticks, stop = [0], threading.Event()

    def count() -> None:
        while not stop.is_set():
            ticks[0] += 1
            stop.wait(0.0005)  # blocks, so the GIL goes back to the main thread

    interval = sys.getswitchinterval()
    counter = threading.Thread(target=count)
    counter.start()
    try:
        while ticks[0] == 0:
            stop.wait(0.001)
        sys.setswitchinterval(100.0)
        # A thread already waiting for the GIL still uses the old interval: let the counter
        # start its next waits under the new one.
        time.sleep(0.05)
        before = ticks[0]
        for _ in range(10):  # ~0.1 s or more: ~100 ticks where the GIL is free, ~4 where not
            layer(x)
        during = ticks[0] - before
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        counter.join()
    assert during >= 20, f"no other Python thread ran while the kernel computed ({during} ticks)"


@pytest.mark.model
@pytest.mark.parametrize("path", kernel_path_params(("amx", "avx512_bf16", "avx2")))
def test_split_decode_steps_give_the_same_tokens(default_model_fp32, path, monkeypatch):
    """A batch big enough to split, generated with the split on and off: the same tokens, and
    the split did run."""
    doc = document(default_model_fp32.tokenizer)
    lengths = [17 + (i * 53) % 400 for i in range(SPLIT_MIN_ROWS + 8)]
    prompts = [doc[i * 7:i * 7 + n] for i, n in enumerate(lengths)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    splits = [0]
    run = SplitForward.run

    def counted(self, first, second):
        splits[0] += 1
        return run(self, first, second)

    monkeypatch.setattr(SplitForward, "run", counted)
    tokens = {}
    for split in (True, False):
        engine = LLMEngine(EngineConfig(kernel_path=path, split_decode=split, num_threads=2,
                                        policy="fcfs"))  # one batch of all rows
        assert (engine.executor.split is not None) == split
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        outputs = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
        engine.close()
        tokens[split] = outputs
    assert splits[0] > 0, "no step was split"
    assert tokens[True] == tokens[False]
