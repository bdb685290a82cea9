"""Debug hooks that run after each training step: checks and fault injection for tests.

Each hook is a callable ``hook(step)``; the loop calls them in order after every step and
knows nothing of what they do. They synchronise with the device, so none is on by default.
The fault injectors are test switches (dptrain/switches.py):

    DPTRAIN_TEST_FAULT     "RANK:STEP": that rank raises after that step
    DPTRAIN_TEST_STALL     "RANK:STEP:SECONDS": that rank sleeps after that step
    DPTRAIN_TEST_KILL      "RANK:STEP": that rank SIGKILLs itself after that step
    DPTRAIN_TEST_OVERFLOW  "RANK:STEP" (STEP >= 2): fp16 gradients of that rank overflow at
                           that step (its loss scale is raised after step STEP-1, so that
                           step's logged scale shows it, and lowered after STEP)
"""
from __future__ import annotations

import hashlib
import os
import signal
import time

from dptrain import switches

OVERFLOW_FACTOR = 2.0**40  # far beyond fp16's range (65504) from any loss scale in use


def verify_replicas(flat, world, step):
    """Raise unless every rank holds bit-identical parameters (a host sync; for testing)."""
    if world.size == 1:
        return
    digest = hashlib.sha256(flat.be.to_numpy(flat.data).tobytes()).hexdigest()
    digests = world.mpi_comm.allgather(digest)
    if len(set(digests)) != 1:
        raise RuntimeError(f"step {step}: parameters differ across ranks: {digests}")


def step_hooks(cfg, world, reducer, flat, scaler=None) -> list:
    """The hooks that `cfg` and the environment ask for."""
    hooks = []
    overflow = switches.value("TEST_OVERFLOW")
    if overflow and scaler is not None:
        rank, at = (int(v) for v in overflow.split(":"))

        def blow_up(step):  # this rank's loss scale x 2^40 for step `at` only: a real overflow
            if world.rank == rank and step in (at - 1, at):
                factor = OVERFLOW_FACTOR if step == at - 1 else 1.0 / OVERFLOW_FACTOR
                state = flat.be.to_numpy(scaler.state).copy()
                state[0] *= factor
                flat.be.runtime.upload_(scaler.state, state)
        hooks.append(blow_up)
    if cfg.verify_replicas:
        def check(step):
            reducer.sync_parameters()
            verify_replicas(flat, world, step)
        hooks.append(check)
    fault = switches.value("TEST_FAULT")
    if fault:
        def inject(step):
            if fault == f"{world.rank}:{step}":
                raise RuntimeError(f"injected fault on rank {world.rank} at step {step} "
                                   f"({switches.var('TEST_FAULT')})")
        hooks.append(inject)
    stall = switches.value("TEST_STALL")
    if stall:
        rank, at, seconds = stall.split(":")

        def sleep(step):  # stands for a rank that stops answering before a collective
            if f"{rank}:{at}" == f"{world.rank}:{step}":
                time.sleep(float(seconds))
        hooks.append(sleep)
    kill = switches.value("TEST_KILL")
    if kill:
        def die(step):  # a crash no handler sees: the process just ends
            if kill == f"{world.rank}:{step}":
                os.kill(os.getpid(), signal.SIGKILL)
        hooks.append(die)
    return hooks
