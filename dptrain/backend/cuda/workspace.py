"""The CUDA backend's workspace: channels-last copies one convolution pass makes and another
pass of the same layer reads again.

The Hopper convolution kernels gather from NHWC copies of their operands: the forward copies
x, backward-data copies gy, and backward-weight needs both again. A layer's workspace
(``new_workspace()``, passed as ``workspace=``) keeps each copy under a name, tagged with the
array it was made from (held by reference, matched by identity, so a new array at a recycled
address never matches) and its shape and dtype; backward-weight takes it back instead of
copying again, and taking it drops it, so no copy outlives the step that needs it. A copy
that no later pass takes is replaced by the next one of that name. With ``workspace=None``
every pass makes its own copies, and so does a forward after ``expect_backward(False)`` (an
evaluation keeps nothing alive for a backward that never comes). A workspace never changes a
result: the copy is exactly
what the taker would have made from that same array, which (as any saved activation) must
not be modified in place between the two calls.
"""
from __future__ import annotations


class Workspace:
    """Kept copies by name (see the module docstring); not for several threads at once."""

    def __init__(self):
        self._kept = {}  # name -> (source array, (shape, dtype), copy)
        self._keeping = True

    def expect_backward(self, flag: bool) -> None:
        """Whether a backward pass will take what the next passes keep; False drops what is
        kept and keeps nothing until it is True again."""
        self._keeping = bool(flag)
        if not flag:
            self._kept.clear()

    def keep(self, name: str, source, copy) -> None:
        if self._keeping:
            self._kept[name] = (source, (source.shape, source.dtype), copy)

    def take(self, name: str, source):
        """The copy kept under `name` from this very `source`, or None; either way the name
        holds nothing afterwards."""
        kept = self._kept.pop(name, None)
        if kept is None or kept[0] is not source or kept[1] != (source.shape, source.dtype):
            return None
        return kept[2]


def keep(workspace, name, source, copy):
    """Keep `copy` in `workspace` (which may be None: nothing kept); returns `copy`."""
    if workspace is not None:
        workspace.keep(name, source, copy)
    return copy


def take(workspace, name, source, make):
    """The copy of `source` kept under `name`, or make(source)."""
    kept = workspace.take(name, source) if workspace is not None else None
    return make(source) if kept is None else kept
