"""SplitForward (two micro-batches of a decode step at once) and what it rests on: the compiled
kernels release the GIL, and a row's tokens do not depend on the split."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from alignedserve.config import EngineConfig, SchedulerConfig
from alignedserve.engine import LLMEngine
from alignedserve.executor.runner import SPLIT_MIN_ROWS, ModelRunner
from alignedserve.executor.split_forward import SplitForward
from alignedserve.kernels.linear import PackedLinear
from alignedserve.sampling_params import SamplingParams
from tests.conftest import kernel_path_params
from tests.test_engine_parity import document


def test_halves_run_at_once_on_their_own_thread_counts():
    caller = torch.get_num_threads()
    split = SplitForward((1, 1), enter_thread=lambda: None)  # no compiled kernels here
    try:
        assert torch.get_num_threads() == caller
        meet = threading.Barrier(2, timeout=30)  # breaks unless both halves run at once

        def half() -> tuple[int, bool]:
            meet.wait()
            return torch.get_num_threads(), torch.is_inference_mode_enabled()

        assert split.run(half, half) == ((1, True), (1, True))
    finally:
        split.close()


def test_workers_keep_their_thread_count_through_compiled_kernels(compiled):
    """A compiled library's first parallel loop in a thread resets the thread's count to the
    process default; the workers make that loop at start (``enter_thread``), so the kernels a
    half calls keep its one thread instead of starting an OpenMP team as wide as the caller's."""
    caller = torch.get_num_threads()
    torch.set_num_threads(2)  # a default above the halves' own count, on any machine
    split = SplitForward((1, 1), compiled.enter_thread)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    weight = torch.ones(64, dtype=torch.bfloat16)
    layer = PackedLinear(torch.randn(128, 64, dtype=torch.bfloat16), None, compiled)

    def half() -> int:
        compiled.rms_norm(x, weight, 1e-6)
        layer(x)
        return torch.get_num_threads()

    try:
        assert split.run(half, half) == (1, 1)
    finally:
        split.close()
        torch.set_num_threads(caller)


def test_an_exception_in_either_half_reaches_the_caller_after_both_finish():
    split = SplitForward((1, 1), enter_thread=lambda: None)  # no compiled kernels here
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


def test_the_split_is_off_unless_asked_for():
    from alignedserve.entrypoints.args import engine_config_from_args
    from alignedserve.entrypoints.cli import build_parser

    def split(*argv: str) -> bool:
        return engine_config_from_args(build_parser().parse_args(argv)).split_decode

    assert not split("serve")
    assert split("serve", "--split-decode")
    assert not split("generate", "--prompt", "hi")
    assert split("generate", "--prompt", "hi", "--split-decode")
    assert not EngineConfig().split_decode  # LLM.generate and in-process engines


@pytest.mark.model
@pytest.mark.parametrize("path", kernel_path_params(("amx", "avx512_bf16", "avx512", "avx2")))
def test_split_steps_give_the_same_tokens(default_model_fp32, path, monkeypatch):
    """Forty requests decoding together while four more arrive (their prompts cut into chunks
    beside the decode rows), generated with the split on and off: the same tokens, and both
    decode-only and mixed steps were split."""
    doc = document(default_model_fp32.tokenizer)
    rows = SPLIT_MIN_ROWS + 8
    first = [doc[i * 7:i * 7 + 12 + i % 9] for i in range(rows)]
    late = [doc[300 + i * 11:300 + i * 11 + 45 + 7 * i] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    split_kinds: list[bool] = []  # per split step: whether it had a prompt part
    split_hidden = ModelRunner._split_hidden

    def spy(self, segments, ids, positions, decode):
        split_kinds.append(bool(segments))
        return split_hidden(self, segments, ids, positions, decode)

    monkeypatch.setattr(ModelRunner, "_split_hidden", spy)
    tokens = {}
    for split in (True, False):
        # fcfs: all rows in one decode batch; the token budget leaves a prompt part of at
        # most half the decode rows once all forty decode.
        engine = LLMEngine(EngineConfig(
            kernel_path=path, split_decode=split, num_threads=2, policy="fcfs",
            scheduler=SchedulerConfig(max_num_batched_tokens=rows + rows // 2)))
        assert (engine.executor.split is not None) == split
        for i, prompt in enumerate(first):
            engine.add_request(f"r{i}", prompt, params)
        outputs, steps = {}, 0
        while engine.has_unfinished():
            if steps == 16:
                for i, prompt in enumerate(late):
                    engine.add_request(f"late{i}", prompt, params)
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
            steps += 1
        engine.close()
        tokens[split] = outputs
    assert False in split_kinds and True in split_kinds, split_kinds
    assert len(tokens[True]) == rows + len(late)
    assert tokens[True] == tokens[False]
