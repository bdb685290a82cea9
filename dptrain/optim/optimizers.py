"""Optimizers over flat buffers.

An optimizer owns some [start, stop) segments of the flat parameter buffer (its
shard of each bucket; the whole buffer in a single process) and keeps state only
for them (ZeRO-1).
Under mixed precision the update ends by casting the updated shard into the flat buffers'
16-bit shadow (dptrain.distributed.flat), inside the step, so a captured graph replays that cast too.
Per-step scalars (learning rate, Adam's bias corrections) go into a small device
array ``hyper`` before each update, so the update itself reads no host values
and can be replayed from a captured CUDA graph. Slot ``SKIP_SLOT`` of ``hyper`` is
written on the device (by the non-finite check of dptrain.run.nonfinite): non-zero skips
the update. A skipped step still counts in ``steps`` (AdamW's bias correction).

``lr`` is a positive number or a schedule (dptrain.optim.schedules, or any callable mapping
the 0-based step to the rate): ``begin_step`` evaluates it on the host and writes the rate into
``hyper`` with the other scalars, so a captured step replays unchanged.

Parameter groups (``groups``: ``[{"params": [...], "weight_decay": 0.0}, ...]``, as PyTorch's
list of dicts; parameters in no group take the optimizer's own options) split each shard
segment where the group changes: one update launch per run of a group's parameters, so no
groups is one launch per segment, as ever. A group sets ``weight_decay`` only.

For checkpoints, ``gather_state`` collects the full state from every rank's shards
(name -> per-parameter arrays, independent of the world size) and ``scatter_state``
puts such a state back into this rank's shards, whatever world size wrote it.
"""
from __future__ import annotations

import bisect
import math

import numpy as np

from dptrain.distributed.flat import FlatParameters
from dptrain.errors import BadArgument

SKIP_SLOT = 3  # hyper[SKIP_SLOT] != 0: the optimizer kernels leave param and state untouched
GROUP_OPTIONS = ("weight_decay",)  # what a parameter group may set


def check_rate(lr, what="learning rate") -> float:
    """`lr` as a float; BadArgument unless it is positive and finite."""
    try:
        value = float(lr)
    except (TypeError, ValueError):
        raise BadArgument(f"{what} must be a positive number or a schedule, got {lr!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise BadArgument(f"{what} must be positive and finite, got {lr!r}")
    return value


class Optimizer:
    def __init__(self, params, lr, segments=None, groups=None):
        self.schedule = lr if callable(lr) else None
        lr = check_rate(self.schedule(0) if self.schedule else lr,
                        "the schedule's rate at step 0" if self.schedule else "learning rate")
        self.flat = params if isinstance(params, FlatParameters) else FlatParameters(params)
        self.be = self.flat.be
        self.segments = list(segments) if segments is not None else [(0, self.flat.numel)]
        self.numel = sum(stop - start for start, stop in self.segments)
        self.lr = lr
        self.steps = 0
        self.hyper = self.be.zeros((4,), self.flat.dtype)
        self.group_options = [{}]  # run group 0: the optimizer's own options
        self.runs = self._plan_runs(groups or [])

    def _plan_runs(self, groups):
        """(start, stop, offset in the shard's state, group) per update launch: the shard's
        segments, cut where the parameter group changes (see the module's docstring)."""
        flat, owner = self.flat, {}
        for i, group in enumerate(groups, start=1):
            group = dict(group)
            params = group.pop("params", None)
            if params is None:
                raise BadArgument(f"parameter group {i - 1} has no 'params'")
            unknown = sorted(set(group) - set(GROUP_OPTIONS))
            if unknown:
                raise BadArgument(f"parameter group {i - 1}: {', '.join(unknown)} cannot be set "
                                  f"per group (only {', '.join(GROUP_OPTIONS)})")
            for p in params:
                start = flat.offsets.get(id(p))
                if start is None:
                    raise BadArgument(f"parameter group {i - 1} holds a tensor that is not a "
                                      f"trained parameter of the model")
                if start in owner:
                    raise BadArgument(f"a parameter is in parameter groups {owner[start] - 1} "
                                      f"and {i - 1}")
                owner[start] = i
            self.group_options.append(group)
        starts = sorted(flat.offsets.values())
        runs, offset = [], 0
        for start, stop in self.segments:
            held = bisect.bisect_right(starts, start) - 1  # the parameter holding `start`
            first, group = start, owner.get(starts[held], 0) if held >= 0 else 0
            for o in starts[bisect.bisect_right(starts, start):bisect.bisect_left(starts, stop)]:
                if owner.get(o, 0) != group:
                    runs.append((first, o, offset + first - start, group))
                    first, group = o, owner.get(o, 0)
            runs.append((first, stop, offset + first - start, group))
            offset += stop - start
        return runs

    def option(self, name, group: int):
        """A run's value of option `name`: its group's, else the optimizer's own."""
        return self.group_options[group].get(name, getattr(self, name, None))

    def _state(self):
        return self.be.zeros((self.numel,), self.flat.dtype)

    def views(self, *states):
        """Per run of this rank's shard (a segment, without parameter groups): (options,
        param view, grad view, state views..., shadow view or None) — one kernel launch
        each; `options` maps each per-group option (``weight_decay``) to the run's value.
        `states` are arrays of the shard's length (``_state()``) or None."""
        shadow = self.flat.shadow
        for start, stop, offset, group in self.runs:
            n = stop - start
            options = {name: self.option(name, group) for name in GROUP_OPTIONS
                       if hasattr(self, name) or name in self.group_options[group]}
            yield (options, self.flat.data[start:stop], self.flat.grad[start:stop],
                   *(s[offset : offset + n] if s is not None else None for s in states),
                   shadow[start:stop] if shadow is not None else None)

    def _views(self, *states):
        """``views`` without the options (optimizers written before parameter groups)."""
        for _, *views in self.views(*states):
            yield tuple(views)

    def zero_grad(self):
        self.flat.zero_grad()

    def step(self):
        """Advance one step: write this step's scalars, then update the shard."""
        self.begin_step()
        self.update()

    def set_lr(self, lr):
        """From the next step on: a positive number (in place of any schedule) or a schedule."""
        self.schedule = lr if callable(lr) else None
        self.lr = check_rate(self.schedule(self.steps) if self.schedule else lr)

    def begin_step(self):
        """Count the step and write its scalars to the device (host side, outside any graph):
        the schedule's rate for this step first, where there is one."""
        if self.schedule is not None:
            self.lr = check_rate(self.schedule(self.steps), f"the schedule's rate at step "
                                                             f"{self.steps}")
        self.steps += 1
        self.be.set_scalar_(self.hyper, self.hyper_values())

    def hyper_values(self) -> list[float]:
        return [self.lr]

    # Whether update_shard writes the 16-bit shadow itself (the step ops' shadow=, in the
    # update's own pass); else update() casts it after.
    writes_shadow = False

    def update(self):
        """Update this rank's shard (device work only) and its 16-bit shadow, if any: the
        copy that the all-gather moves and the layers read."""
        self.update_shard()
        if not self.writes_shadow:
            self.flat.cast_shadow(self.segments)

    def update_shard(self):
        raise NotImplementedError

    # -- state for checkpoints: host copies of the shard's buffers
    def state_arrays(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        state = {k: self.be.to_numpy(v) for k, v in self.state_arrays().items()}
        return {"steps": self.steps, "lr": self.lr, **state}

    def load_state_dict(self, state: dict):
        self.steps, self.lr = int(state["steps"]), float(state["lr"])
        for k, v in self.state_arrays().items():
            self.be.copy_(v, self.be.asarray(np.asarray(state[k], dtype=self.flat.dtype)))

    # -- state for checkpoints: the whole state, gathered from every rank's shard
    def gather_state(self, comm, named_params) -> dict:
        """Every rank's shard of each state buffer, all-gathered over `comm` (a collective:
        every rank calls it) and cut per parameter: {state name: {param name: host array}}.
        The result does not depend on the world size or the bucket layout."""
        flat, be = self.flat, self.be
        out = {}
        for key, shard in self.state_arrays().items():
            full = be.zeros((flat.numel,), flat.dtype)
            offset = 0
            for bucket, (start, stop) in zip(flat.buckets, self.segments):
                be.copy_(full[start:stop], shard[offset : offset + stop - start])
                offset += stop - start
                if comm.size > 1:  # in place: this rank's slice is its own shard
                    comm.all_gather(full[start:stop], full[bucket.start : bucket.stop])
            host = be.to_numpy(full)
            out[key] = {name: host[flat.offsets[id(p)] : flat.offsets[id(p)] + p.size]
                        .reshape(p.shape).copy() for name, p in named_params}
        return out

    def scatter_state(self, state: dict, named_params, source="checkpoint"):
        """Write a state from gather_state (any world size) into this rank's shards, in
        place (the buffers a captured step reads stay where they are)."""
        flat, be = self.flat, self.be
        mine = self.state_arrays()
        if set(mine) != set(state):
            raise ValueError(f"{source}: optimizer state holds {sorted(state) or 'nothing'}, "
                             f"this optimizer needs {sorted(mine) or 'nothing'}")
        for key, shard in mine.items():
            full = np.zeros(flat.numel, dtype=flat.dtype)
            for name, p in named_params:
                if name not in state[key]:
                    raise ValueError(f"{source}: optimizer state {key} lacks {name}")
                value = np.asarray(state[key][name])
                if value.shape != tuple(p.shape):
                    raise ValueError(f"{source}: optimizer state {key} of {name} has shape "
                                     f"{value.shape}, the model expects {tuple(p.shape)}")
                start = flat.offsets[id(p)]
                full[start : start + p.size] = value.reshape(-1)
            host = np.concatenate([full[start:stop] for start, stop in self.segments])
            be.runtime.upload_(shard, host)


class SGD(Optimizer):
    """SGD with momentum, Nesterov momentum and (coupled) weight decay, as torch.optim.SGD."""

    def __init__(self, params, lr=0.01, momentum=0.0, weight_decay=0.0, nesterov=False,
                 segments=None, groups=None):
        super().__init__(params, lr, segments, groups)
        if not (momentum >= 0 and weight_decay >= 0):
            raise BadArgument(f"momentum and weight decay must be non-negative, got "
                              f"momentum={momentum!r}, weight_decay={weight_decay!r}")
        if nesterov and momentum == 0:
            raise BadArgument("nesterov momentum needs momentum > 0")
        self.momentum, self.weight_decay, self.nesterov = momentum, weight_decay, nesterov
        self.buf = self._state() if momentum else None

    writes_shadow = True

    def update_shard(self):
        for options, p, g, buf, shadow in self.views(self.buf):
            self.be.sgd_step_(p, g, buf, self.hyper, self.momentum, options["weight_decay"],
                              self.nesterov, shadow=shadow)

    def state_arrays(self):
        return {"momentum_buffer": self.buf} if self.buf is not None else {}


class AdamW(Optimizer):
    """Adam with decoupled weight decay, as torch.optim.AdamW."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 segments=None, groups=None):
        super().__init__(params, lr, segments, groups)
        if not (len(betas) == 2 and all(0 <= b < 1 for b in betas)) or not eps > 0 or \
                not weight_decay >= 0:
            raise BadArgument(f"AdamW needs betas in [0, 1), eps > 0 and weight_decay >= 0, got "
                              f"betas={betas!r}, eps={eps!r}, weight_decay={weight_decay!r}")
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay
        self.m, self.v = self._state(), self._state()

    def hyper_values(self):
        t = self.steps
        return [self.lr, 1.0 - self.beta1**t, 1.0 - self.beta2**t]

    writes_shadow = True

    def update_shard(self):
        for options, p, g, m, v, shadow in self.views(self.m, self.v):
            self.be.adamw_step_(p, g, m, v, self.hyper, self.beta1, self.beta2, self.eps,
                                options["weight_decay"], shadow=shadow)

    def state_arrays(self):
        return {"exp_avg": self.m, "exp_avg_sq": self.v}


OPTIMIZERS = {"sgd": SGD, "adamw": AdamW}


def no_decay_groups(model) -> list[dict]:
    """PyTorch's usual groups: no weight decay on biases and normalisation weights (the
    trained parameters of one dimension), the optimizer's own on the rest."""
    flat = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    return [{"params": flat, "weight_decay": 0.0}]
