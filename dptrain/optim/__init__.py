"""Optimizers and learning-rate schedules.

    optimizers.py  SGD (momentum, Nesterov, weight decay) and AdamW over segments of the flat
                   parameter buffer: each rank keeps state only for its shard (ZeRO-1)
    schedules.py   the learning rate at a step (LRSchedule: warmup; constant, step or cosine
                   decay), and the same as objects for ``lr=`` (Constant, WarmupCosine,
                   StepDecay)

May import: dptrain.backend, dptrain.engine, dptrain.distributed.flat.
"""
from dptrain.optim import schedules
from dptrain.optim.optimizers import (OPTIMIZERS, SKIP_SLOT, SGD, AdamW, Optimizer,
                                      no_decay_groups)
from dptrain.optim.schedules import LRSchedule

__all__ = ["Optimizer", "SGD", "AdamW", "OPTIMIZERS", "SKIP_SLOT", "LRSchedule", "schedules",
           "no_decay_groups"]
