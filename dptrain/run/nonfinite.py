"""Non-finite losses and gradients: found on the device every step, acted on at metric reads.

Inside the (captured) step, after the gradient exchange and before the update:

    flag  = 1 if this rank's loss or its shard of the averaged gradient holds a NaN/inf
    flag  = sum of flag over the ranks (one tiny all-reduce), then normalised to 0/1
    skip  = flag (``--skip-nonfinite N``, N > 0) or skip OR flag (the default: sticky)
    count += skip                     (steps not applied since the last read)

``skip`` is slot ``SKIP_SLOT`` of the optimizer's ``hyper``: the optimizer kernels leave
parameters and state untouched when it is non-zero, so a bad step changes nothing, on every
rank alike (the flag is all-reduced). No value reaches the host inside the step.

With fp16 loss scaling (``scaler``, dptrain.run.amp) a non-finite *gradient* under a finite loss
is an overflow of the scaled 16-bit gradients, not a failure: it has its own flag (all-reduced
in the same call), skips that one step on every rank and halves the scale, and is not
counted here. A non-finite loss still goes through the rules above.

``read(step)`` runs on the host where the loop already synchronises (metric reads, before a
checkpoint, at the end). By default the first bad step stops the run with exit code 3:
since the skip is sticky, every step from the first bad one on is counted, which names it
(``step - count + 1``), and the weights stay those before it. With ``--skip-nonfinite N``
bad steps are skipped one by one and the run stops once more than N were skipped.
"""
from __future__ import annotations

from dptrain.errors import NonFiniteError
from dptrain.optim import SKIP_SLOT


class NonFiniteGuard:
    def __init__(self, optimizer, comm, skip_budget: int = 0, scaler=None):
        be, dtype = optimizer.be, optimizer.flat.dtype
        self.be, self.opt, self.comm, self.scaler = be, optimizer, comm, scaler
        self.skip_budget = int(skip_budget)
        self.sticky = self.skip_budget == 0
        self.flags = be.zeros((2,), dtype)  # [bad loss (or gradient), overflowed gradient]
        self.flag, self.overflow = self.flags[0:1], self.flags[1:2]
        self.count = be.zeros((1,), dtype)
        self.skip = optimizer.hyper[SKIP_SLOT : SKIP_SLOT + 1]
        # the guard's own (sticky) decision: the skip slot itself, unless overflows join it
        self.decision = self.skip if scaler is None else be.zeros((1,), dtype)
        self.skipped = 0  # steps skipped so far (host count, updated at reads)

    def __call__(self, loss):
        """Device work only: decide whether this step's update is applied (see above). With
        a loss scale the gradient is unscaled in the pass that checks it, and the decision,
        the count and the scale's update take one launch after the all-reduce."""
        be, grad, segments = self.be, self.opt.flat.grad, self.opt.segments
        be.fill_(self.flags, 0.0)
        be.nonfinite_flag_(self.flag, loss)
        for start, stop in segments:
            if self.scaler is None:
                be.nonfinite_flag_(self.flag, grad[start:stop])
            else:  # overflow read on the scaled values, then divided by the scale used
                be.unscale_check_(grad[start:stop], self.scaler.scale, self.overflow)
        self.comm.all_reduce(self.flags, "sum")  # a bad value on any rank skips on every rank
        if self.scaler is None:
            be.nonfinite_decide_(self.flags, self.decision, self.count, self.sticky)
        else:  # skip on a failure or an overflow; an overflow halves the scale
            be.nonfinite_decide_(self.flags, self.decision, self.count, self.sticky,
                                 self.scaler.state, self.skip, self.scaler.interval)

    def read(self, step: int) -> int:
        """Host side (synchronises): the steps skipped since the last read, up to `step`.
        Raises NonFiniteError when the run must stop."""
        n = int(round(float(self.be.to_numpy(self.count).reshape(-1)[0])))
        if n == 0:
            return 0
        self.be.fill_(self.count, 0.0)
        if self.sticky:
            raise NonFiniteError(
                f"non-finite loss or gradient at step {step - n + 1}; stopped (that update and "
                f"any after it were not applied; --skip-nonfinite N skips up to N such steps)")
        self.skipped += n
        if self.skipped > self.skip_budget:
            raise NonFiniteError(
                f"{self.skipped} steps with a non-finite loss or gradient by step {step}, more "
                f"than --skip-nonfinite {self.skip_budget}; stopped (none of them was applied)")
        return n
