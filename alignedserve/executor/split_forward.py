"""``SplitForward``: runs two halves of a step at once, each on its own share of the cores
(``ModelRunner`` uses it for steps of many decode rows and at most a small prompt part).

A decode step's linears are bound by arithmetic and its attention by memory reads. Run as one
batch, every op takes all cores in turn, so while attention streams the KV caches the
arithmetic units wait, and while the linears compute the memory bus idles. Run as two
independent halves (micro-batches) on two worker threads, one half's attention tends to
overlap the other half's linears; the halves never synchronise inside the step. Every kernel
releases the GIL (``csrc/release_gil.h``) and computes a row's result independently of the
rows beside it, so the split changes no output.

Each worker thread runs its torch ops on a fixed number of intra-op threads: torch's OpenMP
thread count is a per-thread setting (the caller's own stays as it was). Each shared library
that inlines ATen's ``at::parallel_for`` resets a thread's count to the process default on its
first loop in that thread, so a worker makes those first loops (``enter_thread``) while the
default is its own count; otherwise each half would run an OpenMP team as wide as the
caller's, and the two halves would oversubscribe the cores.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import torch

T = TypeVar("T")


class SplitForward:
    """Two single-thread executors; worker i's torch ops use ``threads[i]`` intra-op threads.

    Invariant: after construction the calling thread's torch thread count is what it was
    (the workers' setting goes through torch's global default, which is restored).
    """

    def __init__(self, threads: tuple[int, int], enter_thread: Callable[[], None]) -> None:
        """``enter_thread`` runs once in each worker, on its thread count: it must make the
        worker's first parallel loop in every compiled library the halves call
        (``Kernels.enter_thread``). It has no default: a caller that forgets it gets halves
        whose first kernel call widens their thread count (see the module docstring)."""
        caller = torch.get_num_threads()
        self._workers = [ThreadPoolExecutor(1, thread_name_prefix=f"alignedserve-half{i}",
                                            initializer=_use_threads,
                                            initargs=(n, enter_thread))
                         for i, n in enumerate(threads)]
        for worker in self._workers:  # start each thread (its initializer) now, one at a time
            worker.submit(lambda: None).result()
        torch.set_num_threads(caller)  # the workers set the global default; restore it

    def run(self, first: Callable[[], T], second: Callable[[], T]) -> tuple[T, T]:
        """``first()`` on worker 0 and ``second()`` on worker 1, at once, under
        ``torch.inference_mode``; both results, or the first exception raised."""
        futures = [w.submit(_inference, f) for w, f in zip(self._workers, (first, second))]
        wait(futures)  # both finish before either result (or exception) is taken
        return futures[0].result(), futures[1].result()

    def close(self) -> None:
        for worker in self._workers:
            worker.shutdown(wait=True)


def _use_threads(n: int, enter_thread: Callable[[], None]) -> None:
    torch.get_num_threads()  # libtorch sets a thread's count from the default on first use
    torch.set_num_threads(n)  # this thread's count, and the default until the constructor's
    with torch.inference_mode():
        enter_thread()  # other libraries' first use, while the default is n
    torch.set_num_threads(n)  # again, in case another thread changed the default meanwhile


def _inference(fn: Callable[[], T]) -> T:
    with torch.inference_mode():  # a thread-local mode: the caller's does not carry over
        return fn()
