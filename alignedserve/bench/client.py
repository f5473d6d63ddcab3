"""Drive an OpenAI-compatible server over HTTP with a ``Load``: streaming requests sent at
their due times (under an optional concurrency cap), one record per request.

Ctrl-C during a run cancels the requests in flight, marks them, and returns the partial
result (``interrupted=True``) so a report can still be written; a second Ctrl-C raises
``KeyboardInterrupt`` as usual.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from alignedserve.bench.load import Load
from alignedserve.bench.openai_stream import request_body, stream_request
from alignedserve.bench.progress import Progress
from alignedserve.bench.prom import engine_stats_from_metrics, parse_metrics
from alignedserve.bench.records import RequestRecord, RunResult


@dataclass(frozen=True, slots=True)
class HttpTarget:
    """A server: ``url`` is its base (``http://host:port``; a trailing ``/v1`` is dropped).
    ``model`` None = the first id listed by ``GET /v1/models``."""

    url: str
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 3600.0

    @property
    def base(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class TargetUnavailable(RuntimeError):
    """The server could not be reached or refused the warm-up request."""


async def detect_model(client: Any, target: HttpTarget) -> str:
    try:
        async with client.get(f"{target.base}/v1/models", headers=target.headers) as resp:
            resp.raise_for_status()
            return (await resp.json(content_type=None))["data"][0]["id"]
    except Exception as exc:  # any failure here means we cannot benchmark this target
        raise TargetUnavailable(f"{target.base}: cannot list models ({exc}); is the server "
                                f"up? (pass --model-name to skip detection)") from exc


async def _optional_get(client: Any, target: HttpTarget, path: str) -> str | None:
    """The body of ``GET path`` as text, or None where the server has no such endpoint or
    the request fails: peers need not have ours (/metrics, /version)."""
    try:
        async with client.get(f"{target.base}{path}", headers=target.headers) as resp:
            return await resp.text() if resp.status == 200 else None
    except Exception:
        return None


async def scrape_metrics(client: Any, target: HttpTarget) -> dict[tuple[str, str], float] | None:
    """The server's Prometheus metrics, or None when it has no usable /metrics."""
    text = await _optional_get(client, target, "/metrics")
    return None if text is None else parse_metrics(text)


async def server_version(client: Any, target: HttpTarget) -> str | None:
    """The server's ``GET /version`` body as compact JSON (ours names its kernel path and CPU,
    vLLM's its version), or None where it has none: a run's notes record what it measured."""
    text = await _optional_get(client, target, "/version")
    try:
        body = json.loads(text) if text is not None else None
    except ValueError:  # not JSON: no version to record
        return None
    return None if body is None else json.dumps(body, sort_keys=True, separators=(",", ":"))


async def _warmup(client: Any, target: HttpTarget, model: str, load: Load) -> None:
    url = target.base + load.options.path
    for i in range(load.warmup):
        rec = RequestRecord(-1 - i, 16, 4, 0.0)
        body = request_body(model, load.warmup_prompt(i), 4, load.options)
        try:
            await stream_request(client, url, body, rec, time.monotonic(), load.options,
                                 target.headers)
        except Exception as exc:
            raise TargetUnavailable(f"{url}: warm-up request failed: {exc}") from exc
        if not rec.ok:
            raise TargetUnavailable(f"{url}: warm-up request failed: {rec.error}")


async def _one(client: Any, url: str, body: dict[str, Any], rec: RequestRecord, t0: float,
               load: Load, target: HttpTarget, progress: Progress) -> None:
    try:
        await stream_request(client, url, body, rec, t0, load.options, target.headers)
    except asyncio.CancelledError:
        rec.ok, rec.error, rec.end_s = False, "interrupted", time.monotonic() - t0
        raise
    except Exception as exc:  # network trouble fails this request, not the run
        rec.ok, rec.error = False, f"{type(exc).__name__}: {exc}"
        rec.end_s = time.monotonic() - t0
    progress.done(rec)


async def _dispatch(client: Any, target: HttpTarget, model: str, load: Load,
                    records: list[RequestRecord], t0: float, progress: Progress) -> None:
    """Send every request at its due time, waiting for a free slot under the cap."""
    slots = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    url = target.base + load.options.path
    tasks: list[asyncio.Task] = []
    try:
        for spec, rec in zip(load.requests, records):
            delay = rec.scheduled_s - (time.monotonic() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is not None:
                await slots.acquire()
            if load.out_of_time(time.monotonic() - t0):
                break
            body = request_body(model, load.prompts.build(spec.index, spec.prompt_len),
                                spec.output_len, load.options)
            task = asyncio.create_task(_one(client, url, body, rec, t0, load, target, progress))
            if slots is not None:
                task.add_done_callback(lambda _t: slots.release())
            tasks.append(task)
        await asyncio.gather(*tasks, return_exceptions=True)
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _run_interruptibly(coro: Any) -> bool:
    """Await ``coro`` with Ctrl-C cancelling it; True if it was interrupted."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(coro)
    installed = True

    def on_sigint() -> None:
        loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C is a hard stop
        task.cancel()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
        installed = False
    try:
        await task
        return False
    except asyncio.CancelledError:
        if not task.cancelled():
            raise
        return True
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)


async def run_http_async(target: HttpTarget, load: Load, label: str,
                         show_progress: bool = True) -> RunResult:
    # aiohttp, not httpx: reading a stream costs the client about a third of the CPU per chunk,
    # and on a small machine the client's CPU is taken from the server it measures
    # (docs/results/2026-12-06-zen5-lighter-bench-client.md). No overall deadline: a read may
    # wait up to timeout_s; no connection limit (the load's concurrency cap applies);
    # read_bufsize bounds one SSE line (a chunk with many log-probs can be long).
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=target.timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                     read_bufsize=1 << 22) as client:
        model = target.model or await detect_model(client, target)
        version = await server_version(client, target)
        await _warmup(client, target, model, load)
        before = await scrape_metrics(client, target)
        records = load.new_records()
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        progress = Progress(len(records), label, show_progress)
        t0 = time.monotonic()
        try:
            interrupted = await _run_interruptibly(
                _dispatch(client, target, model, load, records, t0, progress))
        finally:
            progress.close()
        after = await scrape_metrics(client, target)
    stats = engine_stats_from_metrics(before, after)
    notes = [f"model name sent: {model}"]
    if version is not None:
        notes.append(f"server /version: {version}")
    return RunResult(label, target.base, None, 0, records, started, interrupted, stats, None, notes)


def run_http(target: HttpTarget, load: Load, label: str, show_progress: bool = True) -> RunResult:
    """Synchronous entry point (runs its own event loop)."""
    return asyncio.run(run_http_async(target, load, label, show_progress))
