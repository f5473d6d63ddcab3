"""Sampler: one decode step's logits -> one next token per row, honouring each row's SamplingParams.

Pipeline per row (vLLM order): repetition penalty -> presence/frequency penalties -> min_tokens ban
-> greedy argmax (temperature ~ 0) or temperature -> top-k -> top-p -> min-p -> draw.

Contracts (the engine relies on these):
* The caller's ``logits`` tensor is never written to; all edits happen on copies.
* Log-probs are those of the *raw* model distribution, ``log_softmax(logits)``, before any
  penalty, temperature or truncation (vLLM's default "raw logprobs"): they describe what the model
  believed, and do not change when a user turns sampling knobs.
* A row with its own ``generator`` draws exactly one uniform from it per step when sampled (none
  when greedy) and nothing else; every tensor op on a row depends only on that row, so its tokens are
  reproducible whatever other rows share the batch, in any order.
* Sampling is inverse-CDF over the processed distribution: one uniform per row instead of one random
  number per vocabulary entry (exponential race) keeps CPU cost at a cumsum + binary search.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from alignedserve.kernels import Kernels, kernels_for_path
from alignedserve.sampling_params import SamplingParams

# Temperatures below this are treated as greedy (as vLLM does): dividing by them overflows float32.
GREEDY_TEMPERATURE_EPS = 1e-5
# Top-p without top-k buckets logits by their gap below the row max (TOP_P_SPAN / TOP_P_BUCKETS
# logit units per bucket; gaps beyond the span share the last bucket, whose weights are < e^-32 of
# the max) and sorts only the bucket holding the cut: a full sort of a 49k vocabulary per row is
# ~10x the cost of these few passes.
TOP_P_BUCKETS = 1024
TOP_P_SPAN = 32.0
# Rows processed together: 16 x 49152 float32 = 3 MiB of temporaries, which stays in L2 cache.
DEFAULT_CHUNK_ROWS = 16

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits batch: a request's params and the token history penalties need."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far (penalties, min_tokens)
    generator: torch.Generator | None  # per-request when params.seed is set; None -> Sampler's own
    eos_token_ids: frozenset[int] = frozenset()


@dataclass(slots=True)
class SampleResult:
    """Per-row outputs, in row order; every list has one entry per input row."""

    token_ids: list[int]
    # Raw-model log-prob of each chosen token; None from the plain-greedy fast path, which is
    # taken only when no row asked for logprobs (a 49k-wide logsumexp per row is a visible
    # share of a decode step on CPU).
    logprobs: list[float | None]
    # params.logprobs set: the top-N {token_id: logprob} plus the chosen token, in descending
    # logprob order; None otherwise.
    top_logprobs: list[dict[int, float] | None]

    def extend(self, other: SampleResult) -> None:
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)
        self.top_logprobs.extend(other.top_logprobs)


class Sampler:
    """Chooses next tokens for a batch. Holds one generator for unseeded rows (not thread-safe:
    one Sampler per executor). ``seed`` makes those unseeded draws reproducible for a fixed batch.
    ``kernels`` runs the plain-greedy argmax (default: the PyTorch reference)."""

    def __init__(self, seed: int | None = None, kernels: Kernels | None = None, *,
                 chunk_rows: int = DEFAULT_CHUNK_ROWS) -> None:
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        self._chunk_rows = chunk_rows
        self._kernels = kernels or kernels_for_path("reference")
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        """Sample one token per row. ``logits``: [len(rows), vocab], any float dtype; everything
        but plain greedy widens them to float32 first (the argmax is the same either way)."""
        _check_shape(logits, rows)
        if self.plain_greedy(rows, logits.shape[1]):
            return self.greedy_logits(logits)
        # half-precision softmax/cumsum loses too much mass resolution
        logits = logits.float().contiguous()
        result = SampleResult([], [], [])
        for start in range(0, len(rows), self._chunk_rows):
            stop = start + self._chunk_rows
            result.extend(self._sample_chunk(logits[start:stop], rows[start:stop]))
        return result

    @staticmethod
    def plain_greedy(rows: list[SamplingRow], vocab: int) -> bool:
        """Whether every row takes the argmax of its raw logits and asks for nothing else
        (no log-probs, penalties or banned tokens): then the argmax is the whole result, and a
        caller may take it from anywhere that gives the same index (`greedy`)."""
        return all(_is_plain_greedy(row, vocab) for row in rows)

    @staticmethod
    def greedy(tokens: list[int]) -> SampleResult:
        """The result for plain-greedy rows whose argmax ``tokens`` are known."""
        return SampleResult(tokens, [None] * len(tokens), [None] * len(tokens))

    def greedy_logits(self, logits: torch.Tensor) -> SampleResult:
        """All rows plain greedy: a max per row; no log-probs (nobody asked for them). Runs on
        the logits' own dtype: widening to float32 is exact, so the argmax (first max on ties)
        is the same, and the widening pass over a 49k-wide row is skipped."""
        n = logits.shape[0]
        if n == 0:
            return SampleResult([], [], [])
        # One vectorised pass per row where the path has the kernel; max (not argmax, slower
        # on CPU) otherwise. Either way the first max wins ties.
        return self.greedy(self._kernels.argmax_rows(logits))

    def _sample_chunk(self, raw: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        x = process_logits(raw, rows)
        tokens = torch.empty(len(rows), dtype=torch.long, device=raw.device)
        greedy = [i for i, row in enumerate(rows) if _is_greedy(row.params)]
        sampled = [i for i, row in enumerate(rows) if not _is_greedy(row.params)]
        if greedy:
            tokens[greedy] = _take(x, greedy).max(dim=-1).indices
        if sampled:
            tokens[sampled] = self._draw(_take(x, sampled), [rows[i] for i in sampled])
        lse = torch.logsumexp(raw, dim=-1)
        chosen = (raw.gather(1, tokens[:, None]).squeeze(1) - lse).tolist()
        token_ids = tokens.tolist()
        top = _top_logprobs(raw, lse, token_ids, chosen, rows)
        return SampleResult(token_ids, chosen, top)

    def _draw(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, top-k/top-p, min-p, then one inverse-CDF draw per row. ``x`` is not
        modified (it may alias the caller's logits)."""
        temps = torch.tensor([r.params.temperature for r in rows], dtype=x.dtype, device=x.device)
        x = x / temps[:, None]  # fresh tensor: in-place edits below are safe
        _truncate_top_k_top_p(x, [r.params.top_k for r in rows], [r.params.top_p for r in rows])
        _apply_min_p(x, [r.params.min_p for r in rows])
        return _inverse_cdf_sample(x, self._uniforms(rows).to(device=x.device, dtype=x.dtype))

    def _uniforms(self, rows: list[SamplingRow]) -> torch.Tensor:
        """One U[0,1) per row: seeded rows from their own generator, the rest from ours."""
        values = [0.0] * len(rows)
        shared = [j for j, row in enumerate(rows) if row.generator is None]
        if shared:
            for j, u in zip(shared, torch.rand(len(shared), generator=self._generator).tolist()):
                values[j] = u
        for j, row in enumerate(rows):
            if row.generator is not None:
                gen = row.generator
                values[j] = torch.rand(1, generator=gen, device=gen.device).item()
        return torch.tensor(values)


def process_logits(raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Penalties then the min_tokens ban, i.e. everything before temperature/greedy.

    Returns ``raw`` itself when no row needs an edit (callers must not write to the result then),
    otherwise a contiguous edited copy. Exposed for tests and debugging.
    """
    vocab = raw.shape[1]
    bans = [_min_tokens_ban(row, vocab) for row in rows]
    if not (any(bans) or any(_has_penalties(row.params) for row in rows)):
        return raw
    x = raw.clone(memory_format=torch.contiguous_format)
    _apply_repetition_penalty(x, rows)
    _apply_presence_frequency(x, rows)
    _apply_min_tokens(x, bans)
    return x


# ---------------------------------------------------------------------------------------------
# Row classification


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE_EPS


def _has_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def _is_plain_greedy(row: SamplingRow, vocab: int) -> bool:
    """Greedy with nothing that changes or reports beyond the argmax: eligible for the fast path."""
    p = row.params
    return (_is_greedy(p) and p.logprobs is None and not _has_penalties(p)
            and not _min_tokens_ban(row, vocab))


def _min_tokens_ban(row: SamplingRow, vocab: int) -> list[int]:
    """Token ids that must not be produced yet: stop_token_ids, plus the EOS ids unless
    ignore_eos (then EOS does not end the request, so it need not be held back), while fewer
    than min_tokens tokens have been generated. Ids outside the vocabulary are dropped."""
    p = row.params
    if len(row.output_token_ids) >= p.min_tokens:
        return []
    banned = set(p.stop_token_ids)
    if not p.ignore_eos:
        banned |= row.eos_token_ids
    return sorted(t for t in banned if 0 <= t < vocab)


def _check_shape(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")


def _take(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """``x[idx]`` without the copy when ``idx`` is every row in order."""
    return x if idx == list(range(x.shape[0])) else x[idx]


# ---------------------------------------------------------------------------------------------
# Penalties and bans (in place on a private contiguous copy)


def _flat_positions(vocab: int, row_ids: list[int], seqs: list[Sequence[int]],
                    device: torch.device) -> torch.Tensor:
    """``row * vocab + token`` for every token of every selected row: indexes ``x.view(-1)``
    (built on the CPU, returned on ``device``, x's)."""
    lengths = torch.tensor([len(s) for s in seqs])
    tokens = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.long)
    return (torch.repeat_interleave(torch.tensor(row_ids), lengths) * vocab + tokens).to(device)


def _apply_repetition_penalty(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """HF/vLLM style, once per distinct token seen in prompt or output: positive logits are
    divided by the penalty, negative ones multiplied (so a penalty > 1 always discourages)."""
    sel = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    seqs = [list(itertools.chain(rows[i].prompt_token_ids, rows[i].output_token_ids)) for i in sel]
    if not any(seqs):
        return
    pos = _flat_positions(x.shape[1], sel, seqs, x.device)
    penalty = torch.tensor([rows[i].params.repetition_penalty for i in sel], dtype=x.dtype)
    penalty = torch.repeat_interleave(penalty, torch.tensor([len(s) for s in seqs]))
    penalty = penalty.to(x.device)
    flat = x.view(-1)
    old = flat[pos]
    # Duplicate positions all write the same value (computed from the untouched logit).
    flat[pos] = torch.where(old > 0, old / penalty, old * penalty)


def _apply_presence_frequency(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """OpenAI style, on generated tokens only: logit -= frequency * count + presence * (count > 0)."""
    sel = [i for i, r in enumerate(rows)
           if (r.params.presence_penalty or r.params.frequency_penalty) and r.output_token_ids]
    if not sel:
        return
    vocab = x.shape[1]
    pos = _flat_positions(vocab, sel, [rows[i].output_token_ids for i in sel], x.device)
    uniq, counts = torch.unique(pos, return_counts=True)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], dtype=x.dtype,
                        device=x.device)
    pres = torch.tensor([r.params.presence_penalty for r in rows], dtype=x.dtype,
                        device=x.device)
    row_of = uniq // vocab
    flat = x.view(-1)
    flat[uniq] -= freq[row_of] * counts.to(x.dtype) + pres[row_of]


def _apply_min_tokens(x: torch.Tensor, bans: list[list[int]]) -> None:
    row_ids = [i for i, ban in enumerate(bans) for _ in ban]
    if row_ids:
        x[row_ids, list(itertools.chain.from_iterable(bans))] = _NEG_INF


# ---------------------------------------------------------------------------------------------
# Truncation and drawing (in place on temperature-scaled copies)


def _truncate_top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> None:
    """Set to -inf every token outside the row's top-k, then outside the smallest prefix (by
    descending probability, renormalised over the top-k survivors) whose mass reaches top_p.

    Cuts are by value threshold, so tokens tied with the last kept one are kept too. Rows with a
    top-k sort only their k best; top-p-only rows find their cut with a histogram (no full sort).
    Every kept set depends only on its own row.
    """
    vocab = x.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    with_k = [i for i in range(x.shape[0]) if ks[i] < vocab]
    p_only = [i for i in range(x.shape[0]) if ks[i] == vocab and top_p[i] < 1.0]

    def as_tensor(values: list, idx: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([values[i] for i in idx], dtype=dtype, device=x.device)

    if with_k:
        sub = _take(x, with_k)
        cut = _sorted_cut(sub, as_tensor(ks, with_k, torch.long), as_tensor(top_p, with_k, x.dtype))
        _mask_below(x, with_k, sub, cut)
    if p_only:
        sub, p = _take(x, p_only), as_tensor(top_p, p_only, x.dtype)
        resolved, cut = _histogram_top_p_cut(sub, p)
        if not bool(resolved.all()):  # rounding put the cut outside its bucket: sort those rows
            bad = (~resolved).nonzero().squeeze(1)
            full = torch.full((len(bad),), vocab, dtype=torch.long, device=x.device)
            cut[bad] = _sorted_cut(sub[bad], full, p[bad])
        _mask_below(x, p_only, sub, cut)


def _mask_below(x: torch.Tensor, idx: list[int], sub: torch.Tensor, cut: torch.Tensor) -> None:
    """``x[idx] = sub`` with logits below each row's ``cut`` set to -inf (``sub`` is ``x[idx]``,
    possibly ``x`` itself)."""
    if sub is x:
        x.masked_fill_(x < cut[:, None], _NEG_INF)
    else:
        x[idx] = sub.masked_fill(sub < cut[:, None], _NEG_INF)


def _sorted_cut(sub: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Lowest kept logit per row of ``sub`` [P, vocab] for top-k ``k`` (vocab = off) then top-p
    ``p`` over the renormalised top-k, found by sorting each row's max(k) best logits."""
    vocab = sub.shape[1]
    width = int(k.max())
    if width < vocab:
        vals = sub.topk(width, dim=-1).values  # sorted descending
    else:
        vals = sub.sort(dim=-1, descending=True).values
    mass = (vals - vals[:, :1]).exp().cumsum(dim=-1)  # relative to the row max: no overflow
    before = F.pad(mass[:, :-1], (1, 0))  # mass strictly above each position
    total = mass.gather(1, (k - 1)[:, None])  # mass of the top-k survivors
    positions = torch.arange(width, device=sub.device)
    keep = (positions < k[:, None]) & ((before < p[:, None] * total) | (p[:, None] >= 1.0))
    n_keep = keep.sum(dim=-1).clamp(min=1)
    return vals.gather(1, (n_keep - 1)[:, None]).squeeze(1)


def _histogram_top_p_cut(sub: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p cut without sorting the vocabulary: bucket the logits by distance from the row max,
    find the bucket where the cumulative mass reaches ``p``, and sort only that bucket.

    Returns (resolved [P] bool, lowest kept logit [P]); a row is unresolved only if float rounding
    between the bucket sums and the in-bucket cumsum leaves nothing to keep in the cut bucket.
    """
    rows, scale = sub.shape[0], TOP_P_BUCKETS / TOP_P_SPAN
    top = sub.max(dim=-1, keepdim=True).values
    gap = top - sub  # >= 0; +inf for masked tokens, which land in the last bucket with no mass
    bucket = (gap * scale).clamp_(max=TOP_P_BUCKETS - 1).long()
    mass = torch.zeros(rows, TOP_P_BUCKETS, dtype=sub.dtype, device=sub.device)
    mass = mass.scatter_add_(1, bucket, gap.neg_().exp_()).cumsum_(dim=-1)  # gap is spent here
    target = p[:, None] * mass[:, -1:]
    cut_bucket = torch.searchsorted(mass, target).clamp_(max=TOP_P_BUCKETS - 1)  # first reaching it
    above = mass.gather(1, (cut_bucket - 1).clamp(min=0)) * (cut_bucket > 0)  # higher buckets' mass
    in_cut = bucket == cut_bucket
    vals = sub.masked_fill(~in_cut, _NEG_INF).topk(int(in_cut.sum(dim=-1).max()), dim=-1).values
    weights = (vals - top).exp()
    before = above + F.pad(weights.cumsum(dim=-1)[:, :-1], (1, 0))  # mass strictly above each
    n_keep = ((before < target) & (weights > 0)).sum(dim=-1)
    cut = vals.gather(1, (n_keep.clamp(min=1) - 1)[:, None]).squeeze(1)
    return n_keep > 0, cut


def _apply_min_p(x: torch.Tensor, min_p: list[float]) -> None:
    """Drop tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p)."""
    if not any(m > 0.0 for m in min_p):
        return
    log_min_p = torch.tensor([math.log(m) if m > 0.0 else _NEG_INF for m in min_p],
                             dtype=x.dtype, device=x.device)
    floor = x.max(dim=-1).values + log_min_p
    x.masked_fill_(x < floor[:, None], _NEG_INF)


def _inverse_cdf_sample(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token with ``cdf[t-1] <= u * total < cdf[t]``. Tokens at -inf add nothing to the cdf and so
    can never be chosen; if rounding makes ``u * total`` reach the total, the last token with
    positive weight is taken. Consumes ``x``."""
    x.sub_(x.max(dim=-1, keepdim=True).values).exp_()
    cdf = x.cumsum_(dim=-1)
    total = cdf[:, -1:].contiguous()  # searchsorted wants contiguous values
    idx = torch.searchsorted(cdf, u[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total)  # first position reaching the total: positive weight
    return torch.minimum(idx, last).squeeze(1)


def _top_logprobs(raw: torch.Tensor, lse: torch.Tensor, token_ids: list[int], chosen: list[float],
                  rows: list[SamplingRow]) -> list[dict[int, float] | None]:
    """Top-N raw log-probs for rows that asked, plus the chosen token (appended if outside the
    top-N, which keeps the dict in descending order)."""
    out: list[dict[int, float] | None] = [None] * len(rows)
    want = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not want:
        return out
    n_max = min(max(rows[i].params.logprobs for i in want), raw.shape[1])
    ids: list[list[int]] = [[] for _ in want]
    vals: list[list[float]] = [[] for _ in want]
    if n_max > 0:
        top_vals, top_ids = raw[want].topk(n_max, dim=-1)
        ids, vals = top_ids.tolist(), (top_vals - lse[want, None]).tolist()
    for j, i in enumerate(want):
        n = rows[i].params.logprobs
        entry = dict(zip(ids[j][:n], vals[j][:n]))
        entry.setdefault(token_ids[i], chosen[i])
        out[i] = entry
    return out
