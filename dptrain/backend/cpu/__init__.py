"""The NumPy backend: the reference every other backend is tested against.

``ops`` holds the array ops (one function per name in ``dptrain.backend.OPS``), ``runtime``
the trivial runtime of a device that is the host itself.
"""
from dptrain.backend.cpu.ops import *  # noqa: F401,F403 - the array ops, by name
from dptrain.backend.cpu.ops import name  # noqa: F401
from dptrain.backend.cpu.runtime import runtime  # noqa: F401
