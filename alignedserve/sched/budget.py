"""How many prompt tokens a step may carry: a token cap, and a step-time target.

A step that carries prompt chunks makes every decode row in it wait for those chunks. A fixed
token budget that suits a fast CPU (2048 prompt tokens in about a second with AVX512-BF16)
makes each decode row on a slower one wait several seconds per token, and under trace load
that is what sets a request's end-to-end latency (docs/results/, the Zen 3 trace run). So,
as Sarathi-Serve derives its token budget from a time-between-tokens goal, the prompt share of
a step is sized from the time it takes on *this* machine:

    prompt tokens = clamp(target_s * rate, floor, cap)

``rate`` is the prompt tokens per second of whole steps (prompt and decode work together) that
the budget bounded, as a moving average. With a step of P prompt tokens costing ``c`` seconds
each beside ``d`` seconds of decode work, rate = P / (P c + d) and the next budget is
target_s P / (P c + d): its fixed point is P = (target_s - d) / c, the budget at which a step
lasts ``target_s``, and it is stable (the map's slope there is d / target_s < 1). Steps that
carried less than half the budget (a short prompt's last chunk) say little about the rate and
are not observed, so they cannot shrink the budget.

Pure bookkeeping: the scheduler feeds it each step's prompt tokens and measured compute time.
"""

from __future__ import annotations


class PromptBudget:
    """Prompt tokens per step: ``cap`` until a step has been timed, then ``target_s`` worth
    at the measured rate, within [``floor``, ``cap``], rounded down to ``quantum`` tokens.

    ``target_s <= 0`` disables the time target (the budget is always ``cap``).
    """

    def __init__(self, cap: int, target_s: float, floor: int, quantum: int = 64,
                 smoothing: float = 0.25):
        self.cap = cap
        self.target_s = target_s
        self.floor = min(floor, cap)
        self.quantum = quantum
        self.smoothing = smoothing
        self.rate: float | None = None  # prompt tokens per second of step, moving average
        self._tokens = cap

    def tokens(self) -> int:
        """The most prompt tokens the next step may carry."""
        return self._tokens

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        """Account one step that carried ``prompt_tokens`` and took ``seconds`` to compute."""
        if self.target_s <= 0 or seconds <= 0 or 2 * prompt_tokens < self._tokens:
            return
        rate = prompt_tokens / seconds
        self.rate = rate if self.rate is None else self.rate + self.smoothing * (rate - self.rate)
        tokens = int(self.target_s * self.rate) // self.quantum * self.quantum
        self._tokens = max(self.floor, min(self.cap, tokens))
