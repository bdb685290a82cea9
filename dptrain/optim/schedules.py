"""Learning-rate schedules as objects, for ``DataParallel(model, "adamw", lr=schedule)`` or an
optimizer's ``lr=``: each maps the 0-based step to the rate.

    from dptrain.optim import schedules
    lr = schedules.WarmupCosine(1e-3, total_steps=1000, warmup_steps=50, min_lr=1e-5)
    ddp = dp.DataParallel(model, "adamw", lr=lr)

The optimizer evaluates it on the host from its own step count before each step and writes
the rate into the device scalars the update reads (``hyper``), where ``ddp.lr = x`` wrote it
by hand before: the captured step replays unchanged (no re-capture, no extra launch). Any
callable ``step -> float`` (positive and finite) works as a schedule too. The formulas are
LRSchedule's (below), which `train --lr-schedule` uses.
"""
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


class Schedule:
    """A learning rate per 0-based step; ``base_lr`` its peak (the rate after warm-up)."""

    def __init__(self, rule: LRSchedule):
        self.rule = rule
        self.base_lr = rule.base_lr

    def __call__(self, step: int) -> float:
        return float(self.rule(int(step)))

    def __repr__(self):
        r = self.rule
        return (f"{type(self).__name__}(base_lr={r.base_lr:g}, warmup_steps={r.warmup_steps}, "
                f"total_steps={r.total_steps})")


class Constant(Schedule):
    """`lr` at every step, after an optional linear warm-up of `warmup_steps`."""

    def __init__(self, lr: float, warmup_steps: int = 0):
        super().__init__(LRSchedule(lr, "constant", max(1, warmup_steps + 1), warmup_steps))


class WarmupCosine(Schedule):
    """Linear warm-up from lr/warmup_steps to `lr` over `warmup_steps`, then cosine decay to
    `min_lr` at `total_steps` (and `min_lr` after)."""

    def __init__(self, lr: float, total_steps: int, warmup_steps: int = 0, min_lr: float = 0.0):
        if warmup_steps >= total_steps:
            raise ValueError(f"WarmupCosine: warmup_steps={warmup_steps} must be below "
                             f"total_steps={total_steps}")
        super().__init__(LRSchedule(lr, "cosine", total_steps, warmup_steps, min_lr=min_lr))


class StepDecay(Schedule):
    """`lr` times `gamma` every `step_size` steps (after an optional linear warm-up), as
    torch.optim.lr_scheduler.StepLR."""

    def __init__(self, lr: float, step_size: int, gamma: float = 0.1, warmup_steps: int = 0):
        if step_size < 1:
            raise ValueError(f"StepDecay: step_size must be a positive integer, got {step_size}")
        super().__init__(LRSchedule(lr, "step", warmup_steps + step_size, warmup_steps,
                                    step_size=step_size, gamma=gamma))


__all__ = ["LRSchedule", "Schedule", "Constant", "WarmupCosine", "StepDecay"]
