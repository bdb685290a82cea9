"""Module and Parameter: the bookkeeping every layer and model shares (PyTorch-style)."""
from __future__ import annotations

import warnings
from collections import OrderedDict

import numpy as np

from dptrain import backend
from dptrain.engine.autograd import Tensor


class Parameter(Tensor):
    """A tensor that a Module owns and an optimizer updates.

    ``shadow``: under mixed-precision training, its 16-bit copy (a view of the flat buffers'
    shadow, dptrain.distributed.flat), which F.cast_parameter hands the layers instead of casting; None
    elsewhere."""

    shadow = None

    def __init__(self, data):
        super().__init__(data, requires_grad=True)


def _holds_modules(value) -> bool:
    """Whether value is a plain list, tuple or dict with a Module among its items (values)."""
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return False
    return any(isinstance(v, Module) for v in value)


class Module:
    """Holds parameters, buffers and sub-modules as attributes; names follow attribute paths.

    Buffers (``register_buffer``) are tensors a module keeps without training them, such as
    batch normalisation's running estimates: saved and loaded with the weights and moved with
    ``to()``, but not given to the optimizer."""

    def __init__(self):
        object.__setattr__(self, "_params", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_pre_hooks", [])
        object.__setattr__(self, "_state_hooks", [])

    def __setattr__(self, name, value):
        if isinstance(value, Parameter):
            self._params[name] = value
        elif name in self._buffers:
            if not isinstance(value, Tensor):
                raise TypeError(f"buffer {name!r} must be a Tensor, got {type(value).__name__}")
            self._buffers[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        elif _holds_modules(value):
            warnings.warn(
                f"{type(self).__name__}.{name} is a plain {type(value).__name__} of Modules: "
                "they are not registered (never trained, exchanged or saved); use "
                "nn.ModuleList or nn.ModuleDict", stacklevel=2)
        object.__setattr__(self, name, value)

    def forward(self, *args):
        raise NotImplementedError

    def input_layout(self, image_shape, dtype, be):
        """The layout (an InputLayout, dptrain.backend.input_layout) in which this model reads
        its input of images (C, H, W) `image_shape` as `dtype` activations on backend `be`,
        where its first layer lays its NCHW input out channels-last itself: a loader may then
        write its batches so in one pass and mark them (F.laid_out), and only a model whose
        input_layout names that layout may be given them. None (the default): NCHW."""
        return None

    def __call__(self, *args, **kwargs):
        for hook in self._pre_hooks:
            hook(self)
        return self.forward(*args, **kwargs)

    def register_forward_pre_hook(self, hook):
        """Call hook(module) before every forward (the reducer waits there for the module's
        parameters to finish their all-gather)."""
        self._pre_hooks.append(hook)

    def register_state_dict_pre_hook(self, hook):
        """Call hook(module) before every ``state_dict()`` of this module (DataParallel gathers
        there the parameter shards other ranks updated, dptrain.run.parallel)."""
        self._state_hooks.append(hook)

    # -- traversal
    def named_parameters(self, prefix: str = ""):
        for name, p in self._params.items():
            yield prefix + name, p
        for name, m in self._modules.items():
            yield from m.named_parameters(prefix + name + ".")

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def register_buffer(self, name: str, value):
        """Keep `value` (a Tensor or array, not trained) as buffer `name`, saved in state_dict."""
        tensor = value if isinstance(value, Tensor) else Tensor(np.asarray(value))
        self._buffers[name] = tensor
        object.__setattr__(self, name, tensor)

    def named_buffers(self, prefix: str = ""):
        for name, b in self._buffers.items():
            yield prefix + name, b
        for name, m in self._modules.items():
            yield from m.named_buffers(prefix + name + ".")

    def buffers(self):
        return [b for _, b in self.named_buffers()]

    def _named_state(self, prefix: str = ""):
        """Parameters then buffers of each module, depth first: PyTorch's state_dict order."""
        yield from ((prefix + n, p) for n, p in self._params.items())
        yield from ((prefix + n, b) for n, b in self._buffers.items())
        for name, m in self._modules.items():
            yield from m._named_state(prefix + name + ".")

    def modules(self):
        yield self
        for m in self._modules.values():
            yield from m.modules()

    def named_modules(self, prefix: str = ""):
        """(dotted name, module) of this module ("" for itself) and every sub-module."""
        yield prefix, self
        for name, m in self._modules.items():
            yield from m.named_modules(f"{prefix}.{name}" if prefix else name)

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())

    # -- mode and device
    def train(self, mode: bool = True):
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self):
        return self.train(False)

    def to(self, device: str):
        """Move every parameter and buffer to `device` (before an optimizer flattens them)."""
        be = backend.get(device)
        for p in self.parameters() + self.buffers():
            if p.device != device:
                p.data = be.asarray(p.numpy())
        return self

    # -- weights (parameters and buffers) as name -> array
    def state_dict(self) -> "OrderedDict[str, np.ndarray]":
        for hook in self._state_hooks:
            hook(self)
        return OrderedDict((name, t.numpy().copy()) for name, t in self._named_state())

    def load_state_dict(self, state, source: str = "state_dict"):
        """Copy arrays into the parameters and buffers in place; names and shapes must match
        exactly."""
        params = dict(self._named_state())
        missing = sorted(set(params) - set(state))
        unexpected = sorted(set(state) - set(params))
        if missing or unexpected:
            raise ValueError(
                f"{source}: parameter names do not match the model"
                + (f"; missing {', '.join(missing)}" if missing else "")
                + (f"; unexpected {', '.join(unexpected)}" if unexpected else "")
            )
        for name, p in params.items():
            value = np.asarray(state[name])
            if tuple(value.shape) != p.shape:
                raise ValueError(
                    f"{source}: {name} has shape {tuple(value.shape)}, the model expects {p.shape}"
                )
        for name, p in params.items():
            p.be.copy_(p.data, p.be.asarray(np.asarray(state[name], dtype=p.dtype)))
            # a parameter's 16-bit copy in mixed-precision training follows (buffers have none)
            if getattr(p, "shadow", None) is not None:
                p.be.copy_(p.shadow, p.data)
        return self
