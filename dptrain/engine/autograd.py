"""Reverse-mode automatic differentiation over backend arrays.

A Tensor wraps one raw array (NumPy or CuPy) and remembers the Function that
made it. ``backward()`` walks the recorded graph once in reverse topological
order; each Function turns its output gradient into input gradients using the
backend of its inputs. Gradients that reach a tensor along several paths are
summed, so a value used twice needs no special case.

A tensor's gradient parts are kept apart until its own op's backward runs: an op that can
add them in its own pass (``Function.takes_grad_sum``: batch norm's residual ReLU) gets them
as a GradSum; any other gets their sum, added in the order they arrived, as before. A part
may be a ``Spread`` (a strided shortcut's backward-data whose zeros are not written,
dptrain.backend.spread); alone, or for any other op, it is written out first (``total``).

Leaves that already hold a ``.grad`` (parameters, whose gradients are views of
one flat buffer) accumulate into it in place; this keeps the step free of
per-step allocations whose addresses change, which CUDA-graph capture needs.
Where such a leaf feeds one op only, that op's backward may add its gradient into
the ``.grad`` itself (``Function.grad_into``; Linear's split-K reduce and bias sums
and batch norm's sums kernel do the add, no separate pass); the sum is the same,
grad + g, so the result is too. Where that ``.grad`` holds zeros (``grads_zeroed``: the
optimizer's zero_grad says so, and nothing has added into it since), the op may write its
gradient instead (``Function.grad_is_zero``; Linear's weight product stores into the .grad,
no add pass): 0 + g is g. Mixed precision's 16-bit cast of a parameter hands the gradient
back unchanged, so its consumer may add the 16-bit gradient into the fp32 leaf's .grad
through it (``Function.grad_into_widened``; the convolution's backward-weight reducers do).

A ``LaidOut`` tensor is a network's input already laid out channels-last for its stem
convolution (``F.laid_out``): that convolution alone reads it, and ``Function.apply``
refuses it as any op's input, so a model that does not expect one fails rather than computes.
"""
from __future__ import annotations

import collections
import contextlib
import weakref

import numpy as np

from dptrain import backend
from dptrain.backend.bfloat16 import BFLOAT16, from_bfloat16
from dptrain.backend.spread import Spread

_grad_enabled = True
DIRECT_GRADS = True  # ops may add a leaf's gradient into its .grad (False: to compare)
# Leaves whose .grad holds zeros: set by grads_zeroed, cleared by the first gradient added.
_zeroed: "weakref.WeakSet[Tensor]" = weakref.WeakSet()


def grads_zeroed(leaves) -> None:
    """Say that these leaves' .grad arrays were just filled with zeros (an optimizer's
    zero_grad), so the first gradient that reaches each may be written rather than added.
    Whoever changes a .grad otherwise between this and backward must not call it."""
    _zeroed.update(t for t in leaves if t.grad is not None)


class no_grad(contextlib.ContextDecorator):
    """Context (or decorator) in which no graph is recorded."""

    def __enter__(self):
        global _grad_enabled
        self._prev, _grad_enabled = _grad_enabled, False

    def __exit__(self, *exc):
        global _grad_enabled
        _grad_enabled = self._prev


def is_grad_enabled() -> bool:
    return _grad_enabled


class GradSum(tuple):
    """A gradient that arrived in parts (arrays of one dtype), in arrival order, not yet added."""

    @property
    def dtype(self):
        return self[0].dtype

    def total(self, be):
        """The parts added in order: ((g0 + g1) + g2) ..., the bits of adding as they came."""
        acc = total(self[0], be)
        for g in self[1:]:
            acc = be.add(acc, total(g, be))
        return acc


def total(g, be):
    """g itself, the sum of a GradSum's parts, or a Spread's array."""
    return g.total(be) if isinstance(g, (GradSum, Spread)) else g


class Function:
    """One differentiable primitive. Subclasses define forward and backward on raw arrays.

    ``forward(self, *arrays, **params)`` returns the output array; it may keep what
    backward needs on ``self``. ``backward(self, gy)`` returns one gradient per
    positional input (None where no gradient is needed). ``self.be`` is the
    backend of the inputs and ``self.needs_grad[i]`` says whether input i wants one (set
    before forward runs; a backward runs only where gradients are enabled).
    """

    be = None
    needs_grad: tuple = ()
    inputs: tuple = ()
    into: tuple = ()  # per input: the .grad backward may add into (set by Tensor.backward)
    widened: tuple = ()  # per input: a 16-bit cast's leaf's fp32 .grad (set likewise)
    takes_grad_sum = False  # backward accepts a GradSum as gy (and adds it itself)
    hands_grad_to_leaf = False  # backward returns gy as it is, for one input, a leaf

    @classmethod
    def apply(cls, *tensors: "Tensor", **params) -> "Tensor":
        if LaidOut in map(type, tensors):
            _refuse_laid_out(cls.__name__, tensors)
        fn = cls()
        fn.be = tensors[0].be
        fn.needs_grad = tuple(t.requires_grad for t in tensors)  # forward may read it too
        out = fn.forward(*(t.data for t in tensors), **params)
        requires_grad = _grad_enabled and any(fn.needs_grad)
        result = Tensor(out, requires_grad=requires_grad)
        if requires_grad:
            fn.inputs = tensors
            result._ctx = fn
        return result

    def forward(self, *arrays, **params):
        raise NotImplementedError

    def backward(self, gy):
        raise NotImplementedError

    def grad_into(self, i: int, dtype):
        """The ``.grad`` array of input i (a leaf that this op alone uses) that backward may
        add input i's gradient, of `dtype`, into in place, returning that very array; None
        where it returns a new gradient. Only a 32- or 64-bit ``.grad`` of the gradient's own
        dtype: there the add in place gives add_'s bits (into a 16-bit one a kernel would
        round once where computing and then adding round twice)."""
        into = self.into[i] if i < len(self.into) else None
        ok = into is not None and into.dtype == dtype and into.dtype.itemsize >= 4
        return into if ok else None

    def grad_into_widened(self, i: int):
        """The fp32 ``.grad`` of the leaf whose 16-bit cast (ops.CastParameter) is input i,
        where this op alone uses the cast and the cast alone the leaf: backward may add input
        i's 16-bit gradient into it in place, rounded to 16 bits first (add_'s bits of that
        gradient), returning that very array, which saves the leaf's accumulating pass; None
        where it returns the gradient."""
        return self.widened[i] if i < len(self.widened) else None

    def grad_is_zero(self, i: int) -> bool:
        """Whether the .grad that grad_into(i, ...) offers holds zeros, so backward may write
        input i's gradient into it rather than add it (the same result)."""
        return i < len(self.into) and self.into[i] is not None and self.inputs[i] in _zeroed


def _refuse_laid_out(op: str, tensors):
    """A ValueError: no op reads a laid-out input as the array it seems to be."""
    layout = next(tuple(t.layout) for t in tensors if type(t) is LaidOut)
    raise ValueError(f"{op}: an input laid out {layout} for a stem convolution (F.laid_out) "
                     f"reached it; only the first convolution of a model whose input_layout "
                     f"names that layout reads one (nn.Conv2d with nchw_input, channels-last)")


def _default_dtype(data):
    """float32 unless the caller handed us a float64 (or integer) array."""
    if isinstance(data, (list, tuple, float, int, bool)):
        arr = np.asarray(data)
        return np.float32 if arr.dtype.kind == "f" else arr.dtype
    dtype = np.dtype(data.dtype)
    return np.float32 if dtype == np.float16 else dtype


class Tensor:
    """An n-dimensional array on one device, with an optional gradient."""

    __slots__ = ("data", "grad", "requires_grad", "_ctx", "_grad_hooks", "__weakref__")
    __array_priority__ = 100  # so ndarray + Tensor defers to Tensor.__radd__

    def __init__(self, data, requires_grad: bool = False):
        self.data = data
        self.grad: Tensor | None = None
        self.requires_grad = bool(requires_grad)
        self._ctx: Function | None = None
        self._grad_hooks: list = []

    # -- basic properties
    @property
    def be(self):
        return backend.get(backend.device_of(self.data))

    @property
    def device(self) -> str:
        return backend.device_of(self.data)

    @property
    def shape(self) -> tuple:
        return tuple(self.data.shape)

    @property
    def dtype(self):
        return np.dtype(self.data.dtype)

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        return int(self.data.size)

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, device={self.device}{grad})"

    def numpy(self) -> np.ndarray:
        """A NumPy copy of the data (synchronises with the device); bfloat16 data (uint16
        bits, dptrain.backend.bfloat16) comes back as its float32 values."""
        data = self.be.to_numpy(self.data)
        return from_bfloat16(data) if data.dtype == BFLOAT16 else data

    def item(self) -> float:
        return self.numpy().item()

    def detach(self) -> "Tensor":
        return Tensor(self.data, requires_grad=False)

    def to(self, device: str) -> "Tensor":
        if device == self.device:
            return self
        return Tensor(backend.get(device).asarray(self.numpy()), self.requires_grad)

    def register_grad_hook(self, hook):
        """Call hook(tensor) once this leaf's gradient is complete in a backward pass."""
        self._grad_hooks.append(hook)

    # -- autodiff
    def backward(self, grad: "Tensor | None" = None):
        """Accumulate d(self)/d(leaf) * grad into every leaf's .grad that requires one."""
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad")
        be = self.be
        seed = be.full(self.shape, 1.0, self.data.dtype) if grad is None else grad.data
        grads = {id(self): seed}
        order = _topological_order(self)
        uses = collections.Counter(id(i) for node in order if node._ctx is not None
                                   for i in node._ctx.inputs)
        added = set()  # leaves whose gradient an op added into their .grad itself
        for node in reversed(order):
            g = grads.pop(id(node), None)
            fn = node._ctx
            if fn is None and id(node) in added:
                node._run_grad_hooks()
                continue
            if g is None:
                continue
            if fn is None:
                node._accumulate(total(g, be))
                continue
            if not fn.takes_grad_sum or isinstance(g, Spread):  # a Spread only as a part
                g = total(g, be)
            fn.into = tuple(i.grad.data if DIRECT_GRADS and i._ctx is None and i.requires_grad
                            and i.grad is not None and uses[id(i)] == 1 else None
                            for i in fn.inputs)
            fn.widened = tuple(_widened_grad(i, uses) if DIRECT_GRADS else None
                               for i in fn.inputs)
            for inp, gi, need, into, wide in zip(fn.inputs, fn.backward(g), fn.needs_grad,
                                                 fn.into, fn.widened):
                if gi is None or not need:
                    continue
                if gi is into or gi is wide:  # the op added it into a leaf's .grad itself
                    leaf = inp if gi is into else inp._ctx.inputs[0]  # (the cast's: no pass)
                    added.add(id(leaf))
                    _zeroed.discard(leaf)
                    continue
                prev = grads.get(id(inp))
                if prev is None:  # (a GradSum passed on by a view stays parts)
                    grads[id(inp)] = gi
                    continue
                if isinstance(gi, GradSum):  # parts arriving second are added first, as ever
                    gi = gi.total(be)
                if inp._ctx is not None and inp.dtype == prev.dtype == gi.dtype:
                    # parts, for the op that made inp
                    grads[id(inp)] = GradSum((*(prev if isinstance(prev, GradSum) else (prev,)),
                                              gi))
                    continue
                prev, gi = total(prev, be), total(gi, be)  # a leaf's, or mixed dtypes: added now
                if inp.dtype not in (prev.dtype, gi.dtype):
                    # two 16-bit gradients of an fp32 leaf (ops.CastParameter): sum in fp32
                    prev, gi = (be.astype(v, inp.dtype) for v in (prev, gi))
                grads[id(inp)] = be.add(prev, gi)

    def _accumulate(self, g):
        # g may be 16-bit for an fp32 leaf (ops.CastParameter): add_ casts as it adds
        _zeroed.discard(self)
        if self.grad is None:
            self.grad = Tensor(self.be.astype(g, self.dtype) if g.dtype != self.dtype
                               else self.be.copy(g))
        else:
            self.be.add_(self.grad.data, g)
        self._run_grad_hooks()

    def _run_grad_hooks(self):
        for hook in self._grad_hooks:
            hook(self)


class LaidOut(Tensor):
    """A network's input batch that arrives already laid out channels-last as its stem
    convolution reads it (``F.laid_out``), ``layout`` a dptrain.backend.input_layout
    InputLayout: only that convolution takes it (as it is, skipping its own layout pass);
    every op refuses it (Function.apply), so it is never computed on as the array it seems."""

    __slots__ = ("layout",)

    def __init__(self, data, layout):
        super().__init__(data)
        self.layout = layout


def _widened_grad(t: Tensor, uses):
    """The fp32 .grad of the leaf that t is the 16-bit cast of, where t's consumer alone uses
    t and the cast alone the leaf (Function.grad_into_widened); else None."""
    cast = t._ctx
    if cast is None or not cast.hands_grad_to_leaf or uses[id(t)] != 1:
        return None
    leaf = cast.inputs[0]
    ok = (leaf._ctx is None and leaf.requires_grad and leaf.grad is not None
          and uses[id(leaf)] == 1 and leaf.grad.dtype == np.float32 and t.dtype.itemsize == 2)
    return leaf.grad.data if ok else None


def _parameter_like(t: Tensor) -> bool:
    """A leaf, or made by one op from trained leaves only (a parameter's cast)."""
    return t._ctx is None or all(i._ctx is None and i.requires_grad for i in t._ctx.inputs)


def _topological_order(root: Tensor) -> list:
    """Tensors reachable from root that require grad, every input before its consumers."""
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        if node._ctx is not None:
            # parameters pushed first are reached last, so each lands right after its
            # consumers in the reversed order: its gradient completes (and its bucket's
            # reduce-scatter starts) as backward passes its layer, not at the very end. A
            # parameter is a leaf or an op of leaves only (mixed precision's 16-bit cast of
            # an fp32 weight: pushed among the activations, every cast's backward ran last
            # and the whole exchange waited for the end of backward). The order among the
            # other tensors, and so every sum, is unchanged.
            inputs = [i for i in node._ctx.inputs if i.requires_grad and id(i) not in seen]
            for inp in sorted(inputs, key=lambda t: not _parameter_like(t)):
                stack.append((inp, False))
    return order


def as_tensor(value, like: Tensor) -> Tensor:
    """Wrap a Python scalar or array as a constant on like's device and dtype."""
    if isinstance(value, Tensor):
        return value
    return Tensor(like.be.asarray(np.asarray(value, dtype=like.dtype)))


def tensor(data, requires_grad: bool = False, device: str = "cpu", dtype=None) -> Tensor:
    """A new tensor from an array-like: float32 by default, float64 and integers kept."""
    if isinstance(data, Tensor):
        data = data.numpy()
    data = backend.get(backend.device_of(data)).to_numpy(data) if hasattr(data, "dtype") else data
    dtype = np.dtype(dtype) if dtype is not None else _default_dtype(data)
    be = backend.get(device)
    return Tensor(be.asarray(np.asarray(data, dtype=dtype)), requires_grad=requires_grad)
