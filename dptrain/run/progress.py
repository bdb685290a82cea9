"""A progress bar for long work: tqdm when installed and stderr is a terminal, a line every
few seconds otherwise (a log file gets no carriage-return frames)."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, enabled: bool = True, desc: str = "train"):
        self.enabled, self.total, self.last_print = enabled, total, 0.0
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True,
                                mininterval=1.0, file=sys.stderr)
            except ImportError:
                pass
        self.done, self.text = 0, ""

    def advance(self, step: int):
        """Move to `step` (called every step: on a slow device the bar moves with each one;
        tqdm redraws at most once a second, the fallback prints every 5 seconds)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(step - self.done)
        elif time.monotonic() - self.last_print > 5 or step == self.total:
            print(f"step {step}/{self.total}" + (f": {self.text}" if self.text else ""),
                  file=sys.stderr, flush=True)
            self.last_print = time.monotonic()
        self.done = step

    def update(self, step: int, **stats):
        """Move to `step` and show `stats` (the latest metrics) beside the bar."""
        if not self.enabled:
            return
        self.text = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                              for k, v in stats.items())
        if self.bar is not None:
            self.bar.set_postfix_str(self.text, refresh=False)
        self.advance(step)

    def note(self, text: str):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
