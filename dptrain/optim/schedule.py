"""Learning-rate schedules: linear warmup, then constant, step decay or cosine decay."""
from __future__ import annotations

import math


class LRSchedule:
    """Learning rate at a step: linear warmup, then constant, step decay or cosine decay."""

    KINDS = ("constant", "step", "cosine")
    # warmup_steps=None: this fraction of the run, at most this many steps.
    AUTO_WARMUP_FRACTION, AUTO_WARMUP_MAX = 0.2, 60

    def __init__(self, base_lr, kind="cosine", total_steps=1, warmup_steps=0, min_lr=0.0,
                 step_size=None, gamma=0.1):
        if kind not in self.KINDS:
            raise ValueError(f"unknown schedule {kind!r}; choose one of {', '.join(self.KINDS)}")
        self.base_lr, self.kind, self.min_lr, self.gamma = base_lr, kind, min_lr, gamma
        self.total_steps = max(1, total_steps)
        if warmup_steps is None:
            warmup_steps = min(self.AUTO_WARMUP_MAX,
                               int(self.AUTO_WARMUP_FRACTION * self.total_steps))
        self.warmup_steps = max(0, warmup_steps)
        self.step_size = step_size or max(1, self.total_steps // 3)

    def fit_warning(self) -> str | None:
        """Why this schedule does not fit its run, or None when it does."""
        if self.warmup_steps >= self.total_steps:
            return (f"the {self.warmup_steps}-step warmup is not shorter than the "
                    f"{self.total_steps}-step run: the learning rate never reaches {self.base_lr:g}"
                    " and never decays (lower --warmup-steps, or leave it out for "
                    f"{self.AUTO_WARMUP_FRACTION:.0%} of the run)")
        if self.warmup_steps > self.total_steps // 2:
            return (f"the {self.warmup_steps}-step warmup takes more than half of the "
                    f"{self.total_steps}-step run")
        return None

    def __call__(self, step: int) -> float:
        """The rate for 0-based `step`."""
        if step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.base_lr
        if self.kind == "step":
            return self.base_lr * self.gamma ** ((step - self.warmup_steps) // self.step_size)
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr + 0.5 * (self.base_lr - self.min_lr) * (1 + math.cos(math.pi * progress))
