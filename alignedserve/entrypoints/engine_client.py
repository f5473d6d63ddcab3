"""Running one HTTP request's work on the AsyncEngine: admission, fan-out, cancellation, drain.

Everything here lives on the server's event loop (no locks needed); only
``ServerLifecycle.request_drain`` may be called from elsewhere (a signal handler).

Lifecycle of an ``EngineRun``: the handler validates, ``Admission.try_acquire``s the run's
sequences (503 when the queue bound would be passed), then creates the run, whose tasks start
the engine requests at once. The run ends when every task has ended: finished, failed,
cancelled (client gone), or failed by the lifecycle (shutdown grace expired). On end it releases
its sequences exactly once and reports each engine request's last output to ``on_request_end``
(metrics). A task that ends without a finished output has aborted its engine request, because
``AsyncEngine.generate`` aborts in its ``finally``; that is what frees the KV of a client that
disconnects mid-stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence

from starlette.types import Receive

from alignedserve.async_engine import EngineDead, EngineOverloaded
from alignedserve.engine import QueueFull
from alignedserve.entrypoints.engine_backend import EngineBackend
from alignedserve.entrypoints.openai_errors import APIError, bad_request, overloaded, server_error
from alignedserve.outputs import RequestOutput
from alignedserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)
RequestEndHook = Callable[[RequestOutput | None], None]


class ServerShuttingDown(Exception):
    """The shutdown grace period ran out before this request finished."""


class EngineRequestFailed(Exception):
    """The engine finished a request with an error or aborted it on its own."""


class ClientGone(Exception):
    """The client disconnected before its (non-streaming) answer was ready."""


class Admission:
    """Bounds the sequences accepted but not yet finished (running + queued in the engine).

    Invariant: ``0 <= in_use <= limit``. Counting sequences rather than requests makes ``n``
    and prompt lists cost what they cost the engine.
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError("the admission limit must be >= 1")
        self.limit = limit
        self.in_use = 0

    def try_acquire(self, count: int) -> bool:
        if self.in_use + count > self.limit:
            return False
        self.in_use += count
        return True

    def release(self, count: int) -> None:
        self.in_use -= count
        assert self.in_use >= 0, "admission released more than it acquired"


class EngineRun:
    """The engine requests (one per prompt, all with the same params) behind one HTTP request."""

    def __init__(self, engine: EngineBackend, request_id: str, prompts: Sequence[list[int]],
                 params: SamplingParams, on_end: Callable[[EngineRun], None],
                 on_request_end: RequestEndHook):
        self.request_id = request_id
        self.num_prompts = len(prompts)
        self.params = params
        self._engine = engine
        self._on_end = on_end
        self._on_request_end = on_request_end
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(prompts)
        ids = [f"{request_id}-{i}" for i in range(len(prompts))] if len(prompts) > 1 \
            else [request_id]
        self._tasks = [asyncio.create_task(self._pump(i, ids[i], prompt))
                       for i, prompt in enumerate(prompts)]

    @property
    def num_sequences(self) -> int:
        return self.num_prompts * self.params.n

    async def _pump(self, index: int, request_id: str, prompt: list[int]) -> None:
        last: RequestOutput | None = None
        try:
            stream = self._engine.generate(request_id, prompt, self.params)
            async with contextlib.aclosing(stream):
                async for out in stream:
                    last = out
                    if out.finished and (failure := _failure_of(out)):
                        raise EngineRequestFailed(failure)
                    self._queue.put_nowait((index, out))
        except Exception as exc:  # delivered to the reader; the engine request is over either way
            self._queue.put_nowait((index, exc))
        finally:
            self._queue.put_nowait((index, None))
            self._open -= 1
            try:
                self._on_request_end(last)
            except Exception:  # metrics must never leak an admission slot
                log.exception("recording the end of %s failed", request_id)
            if self._open == 0:
                self._on_end(self)

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) in arrival order; raises the first failure."""
        remaining = self.num_prompts
        while remaining:
            index, item = await self._queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item

    async def final_outputs(self) -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for index, out in self.events():
            finals[index] = out
        if len(finals) != self.num_prompts or not all(o.finished for o in finals.values()):
            raise EngineRequestFailed("the engine ended a request without a final output")
        return [finals[i] for i in range(self.num_prompts)]

    def fail(self, exc: Exception) -> None:
        """Make the reader raise ``exc`` now, and abort every unfinished engine request."""
        self._queue.put_nowait((-1, exc))
        self.close()

    def close(self) -> None:
        """Abort whatever has not finished (idempotent; a no-op once all tasks ended)."""
        for task in self._tasks:
            task.cancel()


def _failure_of(out: RequestOutput) -> str | None:
    if out.error:
        return out.error
    reasons = {o.finish_reason for o in out.outputs}
    if "error" in reasons:
        return "the engine failed this request"
    if "abort" in reasons:
        return "the engine aborted this request"
    return None


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def final_outputs_unless_gone(run: EngineRun, receive: Receive) -> list[RequestOutput]:
    """Wait for a run's final outputs; if the client disconnects first, abort the run.

    Raises ClientGone in that case (nobody is left to answer). Whatever happens, nothing of
    the run is left running on return: after a failure of one prompt the others are aborted.
    """
    collect = asyncio.ensure_future(run.final_outputs())
    gone = asyncio.ensure_future(_wait_disconnect(receive))
    answered = False
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        answered = collect.done()
    finally:
        gone.cancel()
        collect.cancel()  # no-op when done
        run.close()  # no-op once every engine request has ended
    if not answered:
        raise ClientGone("the client disconnected")
    return collect.result()


def api_error_of(exc: BaseException, retry_after_s: int) -> APIError:
    """Map an engine-side failure to the HTTP error the client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (EngineOverloaded, QueueFull)):
        return overloaded(f"the server is overloaded: {exc}", retry_after_s)
    if isinstance(exc, (EngineDead, ServerShuttingDown)):
        return server_error(f"the server is shutting down: {exc}", status=503)
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    return server_error(f"the request failed: {exc}")


class ServerLifecycle:
    """Graceful shutdown: drain, then fail what is still running after ``grace_s``.

    States: serving -> draining (new requests get 503; running ones continue) -> expired
    (every run still open is failed with ServerShuttingDown, which handlers turn into an
    explicit error). Runs register here while open.
    """

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.draining = False
        self.runs: set[EngineRun] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def request_drain(self) -> None:
        """Signal-handler safe: schedule ``begin_drain`` on the server's loop."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.begin_drain)

    def begin_drain(self) -> None:
        if self.draining:
            return
        self.draining = True
        asyncio.get_running_loop().call_later(self.grace_s, self.expire)

    def expire(self) -> None:
        for run in list(self.runs):
            run.fail(ServerShuttingDown(f"the shutdown grace period ({self.grace_s:g}s) ran out"))


class EngineClient:
    """The handlers' one door to the engine: admits, starts and tracks ``EngineRun``s."""

    def __init__(self, engine: EngineBackend, admission: Admission, lifecycle: ServerLifecycle,
                 on_request_end: RequestEndHook, on_rejected: Callable[[str], None],
                 retry_after_s: int = 1):
        self.engine = engine
        self.admission = admission
        self.lifecycle = lifecycle
        self.retry_after_s = retry_after_s
        self._on_request_end = on_request_end
        self._on_rejected = on_rejected

    def start(self, request_id: str, prompts: Sequence[list[int]],
              params: SamplingParams) -> EngineRun:
        """Admit and start a run, or raise the APIError that refuses it."""
        if self.lifecycle.draining:
            self._on_rejected("shutting_down")
            raise server_error("the server is shutting down", status=503)
        needed = len(prompts) * params.n
        if needed > self.admission.limit:
            raise bad_request(f"this request needs {needed} sequences (prompts x n) but the server "
                              f"holds at most {self.admission.limit} at once",
                              "n" if params.n > 1 else "prompt")
        if not self.admission.try_acquire(needed):
            self._on_rejected("queue_full")
            raise overloaded(f"the server is at its queue bound ({self.admission.limit} "
                             f"sequences in flight); retry later", self.retry_after_s)
        run = EngineRun(self.engine, request_id, prompts, params, self._ended, self._on_request_end)
        self.lifecycle.runs.add(run)
        return run

    def _ended(self, run: EngineRun) -> None:
        self.admission.release(run.num_sequences)
        self.lifecycle.runs.discard(run)

    def api_error(self, exc: BaseException) -> APIError:
        return api_error_of(exc, self.retry_after_s)
