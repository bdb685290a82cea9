"""ModuleList and ModuleDict: sub-modules held by index or by name, registered as PyTorch does.

Their children are registered under ``"0"``, ``"1"``, ... (a list) or their keys (a dict), so
their parameters are trained, exchanged and saved as ``layers.0.weight`` / ``blocks.name.weight``.
Neither has a forward of its own: the module that holds one decides how to call its children.
The children live only in ``_modules`` (not as attributes), so a key such as ``"items"`` cannot
hide a method.
"""
from __future__ import annotations

from dptrain.nn.module import Module


def _check_module(value, where: str):
    if not isinstance(value, Module):
        raise TypeError(f"{where} holds Modules only, got {type(value).__name__}")
    return value


class ModuleList(Module):
    """A list of Modules: indexing (negative and slices), len, iteration, append, extend."""

    def __init__(self, modules=None):
        super().__init__()
        if modules is not None:
            self.extend(modules)

    def _index(self, i: int) -> str:
        n = len(self._modules)
        if not -n <= i < n:
            raise IndexError(f"ModuleList index {i} out of range (length {n})")
        return str(i % n)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return ModuleList(list(self._modules.values())[i])
        return self._modules[self._index(i)]

    def __setitem__(self, i, module):
        self._modules[self._index(i)] = _check_module(module, "ModuleList")

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def append(self, module):
        self._modules[str(len(self._modules))] = _check_module(module, "ModuleList")
        return self

    def extend(self, modules):
        for module in modules:
            self.append(module)
        return self


class ModuleDict(Module):
    """Modules by name, in insertion order: [], in, len, iteration over keys, keys, items,
    values, update."""

    def __init__(self, modules=None):
        super().__init__()
        if modules is not None:
            self.update(modules)

    def __getitem__(self, key: str):
        return self._modules[key]

    def __setitem__(self, key: str, module):
        if not isinstance(key, str) or not key or "." in key:
            raise KeyError(f"ModuleDict key must be a non-empty string without '.', got {key!r}")
        self._modules[key] = _check_module(module, "ModuleDict")

    def __delitem__(self, key: str):
        del self._modules[key]

    def __contains__(self, key):
        return key in self._modules

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules)

    def keys(self):
        return self._modules.keys()

    def items(self):
        return self._modules.items()

    def values(self):
        return self._modules.values()

    def update(self, modules):
        pairs = modules.items() if hasattr(modules, "items") else modules
        for key, module in pairs:
            self[key] = module
        return self
