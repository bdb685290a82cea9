"""Checkpoints for exact resume: the on-disk format (``store``) and what a run saves and
restores (``state``). Model weights alone (``--save``/``--load``) are dptrain.checkpoint."""
from .state import Checkpointing
from .store import CheckpointError, CheckpointStore, load

__all__ = ["Checkpointing", "CheckpointError", "CheckpointStore", "load"]
