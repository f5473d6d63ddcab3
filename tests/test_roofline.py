"""benchmarks/roofline.py's pricing (`price`, `median_rates`) against hand-computed floors, and its
read-rate measurement."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from alignedserve.huge_pages import huge_pages_supported
from alignedserve.kernels import kernels_for_path
from alignedserve.model.config import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import roofline  # noqa: E402  (a script directory, not a package)

CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=64,
                     intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0)
RATES = roofline.Rates(read_bandwidth=1e9, prefill_per_token=1e-3, decode_step=0.01,
                       attention_rate=1e9, decode_rows=2)


def test_price_by_hand():
    # Two requests, 100-token prompts, 3 output tokens: the prefill samples each request's
    # first token, so each takes 2 decode steps, attending over 101 and 102 cached tokens.
    f = roofline.price(CONFIG, RATES, "synthetic:fixed:in=100,out=3", num_requests=2, seed=0)
    causal = 4.0 * 4 * 16 * (100 * 101 / 2) * 2  # heads x dim x causal pairs x layers
    assert f.prefill == pytest.approx(2 * (100 * 1e-3 + causal / 1e9))
    assert f.decode_linears == pytest.approx(2 * 0.01)
    token_bytes = 2 * 2 * 2 * 16 * 2.0  # layers x (K, V) x kv heads x dim x bf16
    assert f.kv_bytes == pytest.approx(2 * (101 + 102) * token_bytes)
    assert f.kv_reads == pytest.approx(f.kv_bytes / 1e9)
    assert f.floor == pytest.approx(f.prefill + f.decode_linears + f.kv_reads)
    assert f.ceiling == pytest.approx(6 / f.floor)
    # An 8-bit cache moves half the bytes.
    half = roofline.price(CONFIG, RATES, "synthetic:fixed:in=100,out=3", 2, 0, kv_bytes=1.0)
    assert half.kv_bytes == pytest.approx(f.kv_bytes / 2)


def test_median_rates_takes_each_rate_separately():
    slow = roofline.Rates(1e9, 2e-3, 0.03, 1e9, 64)
    fast = roofline.Rates(3e9, 1e-3, 0.01, 4e9, 64)
    odd = roofline.Rates(2e9, 5e-3, 0.02, 2e9, 64)
    m = roofline.median_rates([slow, fast, odd])
    assert (m.read_bandwidth, m.prefill_per_token, m.decode_step, m.attention_rate) == (
        2e9, 2e-3, 0.02, 2e9)
    assert m.decode_rows == 64


def test_best_rates_takes_each_rates_fastest_value():
    slow = roofline.Rates(1e9, 2e-3, 0.01, 4e9, 64)
    fast = roofline.Rates(3e9, 1e-3, 0.03, 1e9, 64)
    b = roofline.best_rates([slow, fast])
    assert (b.read_bandwidth, b.prefill_per_token, b.decode_step, b.attention_rate) == (
        3e9, 1e-3, 0.01, 4e9)
    assert roofline.price(CONFIG, b, "synthetic:fixed:in=100,out=3", 2, 0).floor <= min(
        roofline.price(CONFIG, r, "synthetic:fixed:in=100,out=3", 2, 0).floor
        for r in (slow, fast))


def test_read_rates_cover_both_kinds_of_memory_and_the_price_takes_the_faster(monkeypatch):
    rates = roofline.read_rates(64 << 20)
    kinds = {"4 KiB pages", "huge pages"} if huge_pages_supported() else {"4 KiB pages"}
    assert set(rates) == kinds
    assert all(r > 0 for r in rates.values())
    monkeypatch.setattr(roofline, "read_rates", lambda: {"4 KiB pages": 1e9, "huge pages": 3e9})
    rates = roofline.measure(CONFIG, kernels_for_path("reference"), decode_rows=2)
    assert (rates.read_bandwidth, rates.read_4k) == (3e9, 1e9)  # priced at the faster read
