"""Sampler tests: exact cases on hand-computed logits, statistical cases with fixed seeds."""

from __future__ import annotations

import math

import pytest
import torch

from alignedserve.model.sampler import (
    SampleResult,
    Sampler,
    SamplingRow,
    _sorted_cut,
    _truncate_top_k_top_p,
    process_logits,
)
from alignedserve.sampling_params import SamplingParams

EOS = 3


def row(prompt=(), output=(), seed: int | None = None, eos=frozenset(), **params) -> SamplingRow:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(SamplingParams(seed=seed, **params), list(prompt), list(output), gen,
                       frozenset(eos))


def random_logits(n: int, vocab: int, scale: float = 2.0, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def draw_many(logits_row: torch.Tensor, n: int, sampler_seed: int = 0, **params) -> list[int]:
    """``n`` independent draws from one distribution: one batch of identical unseeded rows."""
    logits = logits_row.expand(n, -1).contiguous()
    return Sampler(seed=sampler_seed)(logits, [row(**params) for _ in range(n)]).token_ids


# --- greedy -----------------------------------------------------------------------------------


def test_greedy_is_argmax_without_logprobs_unless_asked():
    logits = random_logits(40, 1000)
    before = logits.clone()
    out = Sampler(seed=0)(logits, [row(temperature=0.0) for _ in range(40)])
    assert isinstance(out, SampleResult)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 40  # the fast path skips the logsumexp
    assert out.top_logprobs == [None] * 40
    assert torch.equal(logits, before)


def test_greedy_on_bf16_logits_is_the_float32_argmax():
    """The engine hands the sampler bf16 logits; greedy must pick what float32 would, ties to
    the first index (bf16 has many exact ties), and the other paths must still work on them."""
    logits = (random_logits(64, 1000) * 4).to(torch.bfloat16)
    logits[3, [10, 500]] = logits[3].max() + 1  # an exact tie at the top
    out = Sampler(seed=0)(logits, [row(temperature=0.0) for _ in range(64)])
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.token_ids[3] == 10
    with_logprobs = Sampler(seed=0)(logits, [row(temperature=0.0, logprobs=0) for _ in range(64)])
    assert with_logprobs.token_ids == out.token_ids
    assert all(isinstance(lp, float) for lp in with_logprobs.logprobs)


@pytest.mark.parametrize("vocab", [1, 17, 49152, 49157])
def test_greedy_bf16_kernel_matches_torch_max_on_ties_infs_and_nans(vocab):
    """The compiled argmax (bf16 greedy fast path) against torch's max: first index on ties,
    inf and -inf rows, row tails that are not whole vectors; a NaN row falls back to torch."""
    logits = (random_logits(6, vocab) * 4).to(torch.bfloat16)
    logits[0, -1] = logits[0].max()  # a tie with an earlier maximum: the first one wins
    logits[1, vocab // 2] = float("inf")
    logits[2] = float("-inf")
    logits[3, vocab - 1] = float("nan")
    logits[4, 0] = float("nan")
    strided = torch.cat([logits, logits], dim=1)[:, :vocab]  # rows with a stride > vocab
    for x in (logits, strided):
        out = Sampler(seed=0)(x, [row(temperature=0.0) for _ in range(6)])
        assert out.token_ids == x.max(dim=-1).indices.tolist()


def test_greedy_with_logprobs_reports_raw_logprobs():
    logits = random_logits(40, 1000)
    out = Sampler(seed=0)(logits, [row(temperature=0.0, logprobs=0) for _ in range(40)])
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-5)


def test_empty_batch_and_shape_check():
    assert Sampler()(torch.empty(0, 10), []).token_ids == []
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 10), [row()])


@pytest.mark.parametrize("temperature", [0.3, 1.0, 7.0])
def test_top_k_1_is_greedy_at_any_temperature(temperature):
    logits = random_logits(64, 500, seed=1)
    rows = [row(temperature=temperature, top_k=1) for _ in range(64)]
    assert Sampler(seed=5)(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_and_tiny_temperature_are_greedy():
    logits = random_logits(32, 3000, scale=0.5, seed=2)  # flat: forces the full-sort width
    argmax = logits.argmax(-1).tolist()
    assert Sampler(seed=1)(logits, [row(top_p=1e-6) for _ in range(32)]).token_ids == argmax
    assert Sampler(seed=1)(logits, [row(temperature=1e-7) for _ in range(32)]).token_ids == argmax


def test_mixed_batch_greedy_and_sampled():
    logits = random_logits(24, 200, seed=3)
    rows = [row(temperature=0.0) if i % 3 == 0 else row(temperature=1.0, top_k=5, seed=i)
            for i in range(24)]
    out = Sampler(seed=0)(logits, rows)
    top5 = logits.topk(5, -1).indices
    for i, tok in enumerate(out.token_ids):
        if i % 3 == 0:
            assert tok == int(logits[i].argmax())
        else:
            assert tok in top5[i].tolist()
    assert any(out.token_ids[i] != int(logits[i].argmax()) for i in range(24) if i % 3)


# --- truncation -------------------------------------------------------------------------------

PROBS = [0.5, 0.3, 0.1, 0.06, 0.04]


@pytest.mark.parametrize("params, allowed", [
    (dict(min_p=0.15), {0, 1, 2}),                # floor 0.075
    (dict(top_p=0.7), {0, 1}),                    # mass above token 2 is 0.8 >= 0.7
    (dict(top_k=3), {0, 1, 2}),
    # top-p renormalises over the top-k survivors: 0.5/0.9 + 0.3/0.9 = 0.89 >= 0.85 drops token 2
    (dict(top_k=3, top_p=0.85), {0, 1}),
    (dict(top_p=0.85), {0, 1, 2}),
])
def test_truncation_keeps_exactly_the_allowed_set(params, allowed):
    logits = torch.tensor(PROBS).log()
    tokens = draw_many(logits, 3000, **params)
    assert set(tokens) == allowed


def reference_cut(x: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """Straightforward full-sort top-k then top-p (renormalised), by value threshold."""
    vocab = x.shape[0]
    vals = x.sort(descending=True).values[: (k if 0 < k < vocab else vocab)]
    probs = torch.softmax(vals.double(), 0)
    before = torch.cumsum(probs, 0) - probs
    n_keep = max(1, int((before < p).sum())) if p < 1.0 else len(vals)
    return x >= vals[n_keep - 1]


def test_top_k_top_p_matches_full_sort_reference():
    vocab = 5000
    # Peaked to flat rows put the top-p cut in very different histogram buckets; masked tokens
    # (-inf, as min_tokens leaves them) fill the last bucket; p=0.9999 cuts deep in the tail.
    scales = [8.0, 3.0, 0.05, 8.0, 1.0, 0.2, 2.0, 2.0, 0.5]
    x = torch.cat([random_logits(1, vocab, s, seed=i) for i, s in enumerate(scales)])
    x[6, ::7] = float("-inf")
    cases = [(0, 0.9), (50, 0.95), (0, 0.5), (0, 1.0), (3000, 0.99), (0, 0.3), (0, 0.8),
             (0, 0.9999), (1, 0.5)]
    work = x.clone()
    _truncate_top_k_top_p(work, [k for k, _ in cases], [p for _, p in cases])
    for i, (k, p) in enumerate(cases):
        expected = reference_cut(x[i], k, p)
        assert torch.equal(torch.isfinite(work[i]), expected & torch.isfinite(x[i])), f"row {i}"
        assert torch.equal(work[i][expected], x[i][expected])
    # The sort fallback agrees with the histogram on the top-p-only rows.
    p_only = [i for i, (k, p) in enumerate(cases) if k == 0 and p < 1.0]
    cut = _sorted_cut(x[p_only], torch.full((len(p_only),), vocab),
                      torch.tensor([cases[i][1] for i in p_only]))
    assert torch.equal(cut, work[p_only].nan_to_num(posinf=0, neginf=float("inf")).min(-1).values)


# --- distributions and seeds ------------------------------------------------------------------


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_empirical_distribution_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, -0.5])
    tokens = draw_many(logits, 20000, temperature=temperature)
    # df = 5; the 0.999 quantile is 20.5.
    assert chi_square(tokens, torch.softmax(logits / temperature, 0)) < 20.5


def test_seeded_row_distribution_matches_softmax():
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0]])
    sampler, r = Sampler(), row(seed=123)
    tokens = [sampler(logits, [r]).token_ids[0] for _ in range(3000)]
    assert chi_square(tokens, torch.softmax(logits[0], 0)) < 16.3  # df = 3, 0.999 quantile


def seeded_run(seed: int, steps: list[torch.Tensor], position: int, partners: list[dict],
               chunk_rows: int) -> list[int]:
    """Tokens of one seeded row over several steps, batched at ``position`` among ``partners``."""
    target = row(seed=seed, temperature=0.9, top_p=0.9, top_k=0, min_p=0.01)
    others = [row(**p) for p in partners]
    sampler = Sampler(chunk_rows=chunk_rows)  # unseeded: partners' draws differ every run
    tokens = []
    for step, logits in enumerate(steps):
        rows = others[:position] + [target] + others[position:]
        batch = random_logits(len(rows), logits.shape[0], seed=1000 + step + position)
        batch[position] = logits
        tokens.append(sampler(batch, rows).token_ids[position])
        target.output_token_ids.append(tokens[-1])
    return tokens


def test_seed_reproducible_regardless_of_batch():
    vocab = 3000
    steps = [random_logits(1, vocab, scale=1.5, seed=50 + s)[0] for s in range(8)]
    # top_k=2500 lies between the candidate widths and the vocab: it changes the width at which
    # the target row's top-p cut is found, which must not change the cut.
    partners = [dict(temperature=0.0), dict(top_k=2500), dict(top_p=0.5, seed=9),
                dict(repetition_penalty=1.3, prompt=[1, 2, 3]), dict(logprobs=3, top_k=10),
                dict(temperature=2.0, min_tokens=4, eos={EOS})]
    alone = seeded_run(7, steps, 0, [], chunk_rows=16)
    assert len(set(alone)) > 1
    assert seeded_run(7, steps, 0, [], chunk_rows=16) == alone
    assert seeded_run(7, steps, 3, partners, chunk_rows=16) == alone
    assert seeded_run(7, steps, 6, partners[::-1], chunk_rows=4) == alone
    assert seeded_run(7, steps, 1, partners[2:], chunk_rows=1) == alone


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(1, 100)  # uniform: two seeds agree on a token with probability 1/100
    runs = []
    for seed in range(20):
        sampler, r = Sampler(), row(seed=seed)
        runs.append([sampler(logits, [r]).token_ids[0] for _ in range(10)])
    agreements = sum(a == b for i, x in enumerate(runs) for y in runs[i + 1:] for a, b in zip(x, y))
    # 190 seed pairs x 10 steps = 1900 comparisons, ~19 agreements expected if independent.
    assert agreements < 45
    assert len({tuple(r) for r in runs}) == 20


# --- penalties and bans -----------------------------------------------------------------------


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    r = row(prompt=[0, 1], output=[1, 3, 3], repetition_penalty=2.0,
            frequency_penalty=0.5, presence_penalty=0.25)
    # repetition over {0, 1, 3}: 2 -> 1, -1 -> -2, 3 -> 1.5
    # then token 1 (count 1): -= 0.5 + 0.25; token 3 (count 2): -= 1.0 + 0.25
    expected = torch.tensor([[1.0, -2.75, 0.5, 0.25, -2.0]])
    before = logits.clone()
    assert torch.allclose(process_logits(logits, [r]), expected)
    assert torch.equal(logits, before)


def test_penalties_are_per_row_and_only_where_asked():
    logits = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    rows = [row(prompt=[0], output=[2], presence_penalty=1.0),       # output only
            row(prompt=[0], output=[2], repetition_penalty=0.5),     # prompt + output, <1 boosts
            row(prompt=[0], output=[2, 2], frequency_penalty=-1.0)]  # negative encourages
    expected = torch.tensor([[1.0, 1.0, 0.0], [2.0, 1.0, 2.0], [1.0, 1.0, 3.0]])
    assert torch.allclose(process_logits(logits, rows), expected)
    assert process_logits(logits, [row(), row(), row()]) is logits  # nothing to do: no copy


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    assert Sampler()(logits, [row(output=[0], temperature=0.0)]).token_ids == [0]
    assert Sampler()(logits, [row(output=[0], temperature=0.0,
                                  repetition_penalty=2.0)]).token_ids == [1]


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0, 7.0]])  # EOS=3 best, stop id 4 next
    def greedy(output, **kw):
        r = row(output=output, temperature=0.0, eos={EOS}, stop_token_ids=[4], **kw)
        return Sampler()(logits, [r]).token_ids[0]
    assert greedy([1], min_tokens=3) == 2
    assert greedy([1, 1], min_tokens=3) == 2
    assert greedy([1, 1, 1], min_tokens=3) == EOS
    assert greedy([1], min_tokens=0) == EOS
    assert greedy([1], min_tokens=3, ignore_eos=True) == EOS  # EOS does not stop: not held back
    sampled = draw_many(logits[0], 500, min_tokens=2, stop_token_ids=[4], eos={EOS})
    assert EOS not in sampled and 4 not in sampled


# --- logprobs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n_top", [0, 1, 5])
def test_logprobs_are_raw_and_top_n_sorted_and_complete(n_top):
    logits = random_logits(10, 50, seed=4)
    rows = [row(logprobs=n_top, temperature=1.5, top_k=20, repetition_penalty=1.5,
                prompt=[1, 2], output=[3], seed=i) for i in range(10)]
    out = Sampler()(logits, rows)
    ref = torch.log_softmax(logits, -1)
    for i, (tok, lp, top) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs)):
        assert math.isclose(lp, float(ref[i, tok]), abs_tol=1e-5)
        assert top is not None and top[tok] == lp
        best = ref[i].topk(n_top).indices.tolist() if n_top else []
        assert list(top)[:n_top] == best
        assert set(top) == set(best) | {tok}
        values = list(top.values())
        assert values == sorted(values, reverse=True)
        for t, v in top.items():
            assert math.isclose(v, float(ref[i, t]), abs_tol=1e-5)


def test_logprobs_only_for_rows_that_ask():
    logits = random_logits(3, 30, seed=5)
    out = Sampler(seed=0)(logits, [row(temperature=0.0, logprobs=2), row(temperature=0.0), row()])
    assert out.top_logprobs[0] is not None and len(out.top_logprobs[0]) == 2
    assert out.top_logprobs[1] is None and out.top_logprobs[2] is None
    assert out.token_ids[:2] == logits[:2].argmax(-1).tolist()
