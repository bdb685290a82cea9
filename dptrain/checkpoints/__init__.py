"""Checkpoints for exact resume: the on-disk format (``store``) and what a run saves and
restores (``state``). Model weights alone (``--save``/``--load``, a name -> array ``.npz`` with
its metadata) are ``weights``.

May import: backend, engine, nn, dist, optim, data (and the face); never run, cli or bench.
"""
from .state import CheckpointOptions, Checkpointing
from .store import CheckpointError, CheckpointStore, load

__all__ = ["CheckpointOptions", "Checkpointing", "CheckpointError", "CheckpointStore", "load"]
