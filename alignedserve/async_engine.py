"""AsyncEngine: an asyncio front for the synchronous LLMEngine, for the HTTP server.

The engine is built and run in one background thread that owns it exclusively, so every torch
operation of the model happens on that thread. (OpenMP keeps a worker pool per thread that
starts parallel regions; with a second pool alive, libgomp counts more threads than CPUs and
stops spinning between regions, so each region starts by waking sleeping workers. Building in
one thread and stepping in another cost a large share of throughput; docs/architecture.md.)
Callers on the event loop submit commands (add, abort) through a thread-safe queue; the engine
thread applies them between steps and hands each RequestOutput back to the caller's
asyncio.Queue with ``call_soon_threadsafe``. Every accepted request ends with a finished output
or an exception in its stream; leaving a stream early (client gone) aborts the request and
frees its KV.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from alignedserve.engine import LLMEngine
from alignedserve.outputs import RequestOutput
from alignedserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineOverloaded(Exception):
    """The bounded queue of pending requests is full; retry later."""


class EngineDead(Exception):
    """The engine thread has stopped."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass(slots=True)
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, make_engine: Callable[[], LLMEngine], max_pending: int = 4096):
        """Build the engine with ``make_engine`` on the engine thread and start serving.

        Blocks until the engine is built; an exception from ``make_engine`` is raised here.
        """
        self.max_pending = max_pending
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._pending = 0  # accepted and not yet finished (touched only on the event loop)
        self._ids = itertools.count()
        self.failed_steps = 0  # engine steps that raised (their requests failed; serving went on)
        self._stop = threading.Event()
        self._built: queue.SimpleQueue = queue.SimpleQueue()  # None, or the build's exception
        self._thread = threading.Thread(target=self._run, args=(make_engine,), name="engine",
                                        daemon=True)
        self.engine: LLMEngine  # set by the engine thread before it reports success
        self._thread.start()
        error = self._built.get()
        if error is not None:
            self._thread.join()
            raise error

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive and accepting work."""
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def num_pending(self) -> int:
        return self._pending

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs until finished. Raises ValueError for invalid requests."""
        if not self._thread.is_alive():
            raise EngineDead("the engine thread has stopped")
        if self._pending >= self.max_pending:
            raise EngineOverloaded(f"{self._pending} requests pending; the queue is full")
        sink: asyncio.Queue = asyncio.Queue()
        self._pending += 1
        self._commands.put(_Add(request_id, prompt, params, sink, asyncio.get_running_loop()))
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._pending -= 1
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout)

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self, make_engine: Callable[[], LLMEngine]) -> None:
        try:
            self.engine = make_engine()
        except BaseException as exc:  # handed to the constructor, which raises it
            self._built.put(exc)
            return
        self._built.put(None)
        while not self._stop.is_set():
            idle = not self.engine.has_unfinished()
            self._apply_commands(block=idle)
            if self.engine.has_unfinished():
                self._step()
        self._fail_all(EngineDead("the engine is shutting down"))
        self.engine.close()

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
                self._sinks.pop(command.request_id, None)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                command = None

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params)
        except Exception as exc:  # invalid request: tell its caller, keep serving
            command.loop.call_soon_threadsafe(command.sink.put_nowait, exc)
            return
        self._sinks[command.request_id] = (command.sink, command.loop)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a failed step fails its requests, not the server
            log.exception("engine step failed")
            self.failed_steps += 1
            self._fail_all(RuntimeError(f"engine step failed: {exc}"))
            return
        # One cross-thread wake-up per event loop per step, not one per request.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            entry = self._sinks.get(out.request_id)
            if entry is None:
                continue
            sink, loop = entry
            if out.finished:
                del self._sinks[out.request_id]
            batches.setdefault(loop, []).append((sink, out))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _fail_all(self, exc: Exception) -> None:
        for request_id, (sink, loop) in list(self._sinks.items()):
            self.engine.abort_request(request_id)
            try:
                loop.call_soon_threadsafe(sink.put_nowait, exc)
            except RuntimeError:  # the caller's loop is closed
                pass
        self._sinks.clear()


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    """Runs on the caller's event loop: hand each output to its request's stream."""
    for sink, out in items:
        sink.put_nowait(out)
