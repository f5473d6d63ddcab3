"""A real ``alignedserve serve`` process on the default model, started by the CLI exactly as a
user would, on a free 127.0.0.1 port (shared by the end-to-end and browser tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


def wait_until(predicate, timeout: float, period: float = 0.1) -> bool:
    """Poll ``predicate`` every ``period`` seconds until it holds or ``timeout`` passes; its
    last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(period)
    return predicate()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_or_none(url: str, path: str, timeout: float = 5.0) -> httpx.Response | None:
    try:
        return httpx.get(url + path, timeout=timeout)
    except httpx.HTTPError:
        return None


@contextmanager
def serve_default_model(*args: str, start_timeout_s: float = 600,
                        env: dict[str, str] | None = None
                        ) -> Iterator[tuple[str, subprocess.Popen]]:
    """(base URL, process) of ``alignedserve serve ARGS`` once /health answers 200; on exit
    SIGTERM (if still running), then kill after 60 s. Fails the test if it does not start."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="alignedserve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "alignedserve.entrypoints.cli", "serve", "--port", str(port),
           *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + start_timeout_s
    while (r := get_or_none(url, "/health", 2)) is None or r.status_code != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.seek(0)
            pytest.fail(f"server did not start (exit {proc.poll()}):\n{log.read()[-4000:]}")
        time.sleep(0.5)
    try:
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
        os.unlink(log.name)
