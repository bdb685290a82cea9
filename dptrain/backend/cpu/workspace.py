"""The CPU backend's workspace: memory and work that ops may reuse between calls.

No CPU op keeps anything between calls by itself. A caller that wants reuse makes a
``Workspace`` with ``new_workspace()`` and passes it to the ops as ``workspace=``; the ops
that can use one (convolution, max-pooling) then take their large temporaries from it and
leave there work that a later call on the same input can pick up (a convolution's im2col
columns, for its weight gradient). With ``workspace=None`` every op allocates what it needs
and keeps nothing.

A workspace never changes a result, whatever the call order:

* A scratch array (``array``) holds temporaries only. No op returns it or a view of it, so
  a later call may overwrite it freely.
* Kept work (``remember`` / ``recall``) is tagged with the array it was derived from, held
  through a weak reference, and with a key of the op's parameters. ``recall`` hands it back
  only for that very array (a new array at a recycled address never matches) and that key.
  Taking the scratch array for writing drops its tag first, so a tag never outlives the
  contents it describes. As with any saved activation, the source array must not be
  modified in place between the two calls.

Why reuse pays, with the figures, is in NOTES.md (fresh large arrays cost page faults).
A workspace is not for use from several threads at once.
"""
from __future__ import annotations

import weakref

import numpy as np

from dptrain.backend.registry import op


class Workspace:
    """Scratch arrays, one per name, and the work kept in them (see the module docstring)."""

    def __init__(self):
        self._arrays = {}  # name -> array
        self._tags = {}  # name -> (weak reference to the source array, key)

    def array(self, name, shape, dtype):
        """The scratch array `name` of this shape and dtype, contents undefined.

        One array per name: asking for another shape or dtype replaces it. Whatever was
        remembered in it is forgotten, since the caller is about to overwrite it.
        """
        self._tags.pop(name, None)
        shape, dtype = tuple(shape), np.dtype(dtype)
        a = self._arrays.get(name)
        if a is None or a.shape != shape or a.dtype != dtype:
            self._arrays.pop(name, None)  # free the old one before allocating its successor
            a = self._arrays[name] = np.empty(shape, dtype=dtype)
        return a

    def expect_backward(self, flag: bool) -> None:
        """Whether a backward pass will read what the next forward keeps. The scratch arrays
        are reused either way, so the CPU keeps its work regardless (the CUDA workspace keeps
        nothing for a forward without a backward)."""

    def remember(self, name, source, key):
        """Record that scratch array `name` now holds work derived from `source` with `key`."""
        self._tags[name] = (weakref.ref(source), key)

    def recall(self, name, source, key):
        """Scratch array `name` if it holds the work of this very `source` and `key`, else None."""
        tag = self._tags.get(name)
        if tag is None or tag[0]() is not source or tag[1] != key:
            return None
        return self._arrays[name]

    def nbytes(self):
        """Bytes held in scratch arrays."""
        return sum(a.nbytes for a in self._arrays.values())

    def clear(self):
        """Drop every array and everything remembered."""
        self._arrays.clear()
        self._tags.clear()

    def __repr__(self):
        return f"Workspace({len(self._arrays)} arrays, {self.nbytes() / 2**20:.1f} MiB)"


@op
def new_workspace():
    """A fresh, empty workspace for the ops that take ``workspace=``."""
    return Workspace()


def checked(workspace):
    """`workspace` itself, after checking that it is a CPU workspace or None."""
    if workspace is not None and not isinstance(workspace, Workspace):
        raise TypeError(f"cpu: workspace must come from cpu.new_workspace() or be None, "
                        f"got {type(workspace).__name__}")
    return workspace


def scratch(workspace, name, shape, dtype):
    """A temporary array: from `workspace` when there is one, else freshly allocated."""
    if workspace is None:
        return np.empty(shape, dtype=dtype)
    return workspace.array(name, shape, dtype)
