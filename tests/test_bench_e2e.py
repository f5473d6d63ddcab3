"""End-to-end ``alignedserve bench`` with the default model: in-process, and against a real
``alignedserve serve`` process. Few requests, few tokens; checks that the report files exist
and agree with each other (request and token counts)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from alignedserve.kernels import isa, select_kernels

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[1]
# Short prompts and outputs: the point is the plumbing, not the speed.
WORKLOAD = ["--workload", "synthetic:uniform:in=8-40,out=2-4", "--num-requests", "4",
            "--no-progress", "--seed", "1"]


def _bench(argv: list[str]) -> int:
    from alignedserve.entrypoints.cli import main

    return main(["bench", *argv])


def _check_report(out: Path, n: int, in_process: bool) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["runs"]) == 1
    run = summary["runs"][0]
    m = run["metrics"]
    raw = json.loads((out / "runs" / run["name"] / "requests.json").read_text())
    reqs = raw["requests"]
    assert len(reqs) == n and raw["not_sent"] == 0
    assert m["completed"] == n and m["failed"] == 0
    assert all(r["ok"] and r["output_len"] == r["expected_output_len"] for r in reqs)
    assert all(2 <= r["expected_output_len"] <= 4 for r in reqs)
    assert m["output_tokens"] == sum(r["output_len"] for r in reqs)
    # Token-id prompts have exactly the workload's lengths, as the engine counted them.
    assert all(r["prompt_len_reported"] == r["prompt_len"] for r in reqs)
    assert m["input_tokens"] == sum(r["prompt_len"] for r in reqs)
    assert summary["workload"]["description"]["requests"] == n
    assert m["ttft"]["count"] == n and m["e2e"]["p50"] > 0
    report = (out / "report.md").read_text()
    assert run["name"] in report and "## Results" in report
    assert (out / "latency_cdf.png").stat().st_size > 1000
    if in_process:
        assert (out / "runs" / run["name"] / "steps.json").is_file()
        assert (out / f"kv_spread_{run['name']}.png").is_file()
    assert run["engine_stats"]["bubble_fraction"] is not None
    return run


def test_bench_in_process(tmp_path):
    out = tmp_path / "inproc"
    assert _bench(["--policy", "fcfs", "--max-model-len", "256", "--output-dir", str(out),
                   *WORKLOAD]) == 0
    run = _check_report(out, 4, in_process=True)
    assert all(r["count_source"] == "engine" for r in json.loads(
        (out / "runs" / run["name"] / "requests.json").read_text())["requests"])
    assert run["engine_stats"]["source"] == "engine.stats"
    assert run["notes"][0].startswith(f"engine kernel path: {select_kernels().path}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 75.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"the server did not become healthy within {timeout_s} s")


@pytest.fixture
def server_url(tmp_path):
    try:
        import alignedserve.entrypoints.server  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"the HTTP server is not importable yet: {exc}")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if "API_KEY" not in k}
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "alignedserve.entrypoints.cli", "serve", "--port", str(port),
             "--max-model-len", "256", "--log-level", "warning", "--no-access-log"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(url, proc)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_bench_against_a_real_server(server_url, tmp_path):
    out = tmp_path / "http"
    assert _bench(["--url", server_url, "--concurrency", "2", "--output-dir", str(out),
                   *WORKLOAD]) == 0
    run = _check_report(out, 4, in_process=False)
    reqs = json.loads((out / "runs" / run["name"] / "requests.json").read_text())["requests"]
    assert all(r["count_source"] == "usage" for r in reqs)
    assert run["engine_stats"]["source"] == "/metrics"
    version = next(n for n in run["notes"] if n.startswith("server /version: "))
    body = json.loads(version.removeprefix("server /version: "))
    assert body["kernel_path"] and body["cpu"] == isa.cpu_info().summary()  # this machine
