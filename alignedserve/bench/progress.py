"""A progress bar for a run (tqdm on stderr), counting finished requests."""

from __future__ import annotations

from typing import Any

from alignedserve.bench.records import RequestRecord


class Progress:
    """Counts finished requests and output tokens; a no-op when disabled."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self._bar: Any = None
        self.failed = 0
        self.tokens = 0
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=label, unit="req", dynamic_ncols=True)

    def done(self, rec: RequestRecord) -> None:
        self.failed += 0 if rec.ok else 1
        self.tokens += rec.output_len if rec.ok else 0
        if self._bar is not None:
            self._bar.set_postfix(out_tok=self.tokens, failed=self.failed, refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
