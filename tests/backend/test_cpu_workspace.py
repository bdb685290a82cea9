"""The CPU backend keeps no hidden state: a workspace is owned by the caller and never
changes a result, whatever the call order."""
import __future__
import types

import numpy as np
import pytest

import dptrain as dp
import dptrain.engine.functional as F
from dptrain import backend, nn
from dptrain.backend.cpu import conv, ops, workspace

cpu = backend.get("cpu")

# (x shape, w shape, stride, padding): C_in*kh*kw below and above the per-image GEMM limit.
CONVS = [
    ((3, 2, 9, 7), (5, 2, 3, 3), (1, 1), (1, 1)),
    ((2, 8, 8, 6), (6, 8, 3, 3), (1, 1), (1, 1)),
    ((2, 16, 9, 8), (4, 16, 3, 2), (2, 1), (0, 1)),
]
POOLS = [((2, 3, 8, 6), (2, 2), (2, 2), (0, 0)), ((2, 3, 7, 5), (2, 2), (2, 2), (0, 0)),
         ((2, 2, 7, 6), (3, 3), (2, 2), (1, 1))]


def _rand(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def _conv_case(seed, xs, ws, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x, w, b = _rand(rng, xs, dtype), _rand(rng, ws, dtype), _rand(rng, ws[:1], dtype)
    return x, w, b


def _gy(seed, x, w, stride, padding):
    y = cpu.conv2d_forward(x, w, None, stride, padding)
    return _rand(np.random.default_rng(seed), y.shape, x.dtype)


def _equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("xs,ws,stride,padding", CONVS)
def test_interleaved_convolutions_give_each_input_its_own_gradient(xs, ws, stride, padding):
    xa, w, b = _conv_case(1, xs, ws)
    xb, _, _ = _conv_case(2, xs, ws)
    gya, gyb = _gy(3, xa, w, stride, padding), _gy(4, xa, w, stride, padding)
    ref_gw = cpu.conv2d_backward_weight(xa, gya, w.shape, stride, padding)
    ref_gx = cpu.conv2d_backward_data(gya, w, xs, stride, padding)

    ws_ = cpu.new_workspace()
    cpu.conv2d_forward(xa, w, b, stride, padding, workspace=ws_)
    cpu.conv2d_forward(xb, w, b, stride, padding, workspace=ws_)
    _equal(cpu.conv2d_backward_weight(xa, gya, w.shape, stride, padding, workspace=ws_), ref_gw)
    # backward-data of one gy, then backward-weight of another, on the same workspace
    cpu.conv2d_backward_data(gyb, w, xs, stride, padding, workspace=ws_)
    _equal(cpu.conv2d_backward_data(gya, w, xs, stride, padding, workspace=ws_), ref_gx)
    cpu.conv2d_backward_data(gyb, w, xs, stride, padding, workspace=ws_)
    _equal(cpu.conv2d_backward_weight(xa, gya, w.shape, stride, padding, workspace=ws_), ref_gw)


def test_kept_columns_are_not_reused_for_other_parameters_or_a_new_array():
    x, w, b = _conv_case(5, (2, 8, 8, 6), (6, 8, 3, 3))
    ws_ = cpu.new_workspace()
    cpu.conv2d_forward(x, w, b, (1, 1), (1, 1), workspace=ws_)
    # same x, other padding: the forward's columns do not apply
    gy = _gy(6, x, w, (1, 1), (0, 0))
    _equal(cpu.conv2d_backward_weight(x, gy, w.shape, (1, 1), (0, 0), workspace=ws_),
           cpu.conv2d_backward_weight(x, gy, w.shape, (1, 1), (0, 0)))
    # the input dies; a new array (perhaps at the same address) must not find its columns
    cpu.conv2d_forward(x, w, b, (1, 1), (1, 1), workspace=ws_)
    del x
    x2, _, _ = _conv_case(7, (2, 8, 8, 6), (6, 8, 3, 3))
    gy = _gy(8, x2, w, (1, 1), (1, 1))
    _equal(cpu.conv2d_backward_weight(x2, gy, w.shape, (1, 1), (1, 1), workspace=ws_),
           cpu.conv2d_backward_weight(x2, gy, w.shape, (1, 1), (1, 1)))


def _every_op_once(seed, ws_):
    """Each workspace-taking op on fresh inputs; returns the results."""
    out = []
    for xs, wshape, stride, padding in CONVS:
        x, w, b = _conv_case(seed, xs, wshape)
        gy = _gy(seed + 1, x, w, stride, padding)
        out.append(cpu.conv2d_forward(x, w, b, stride, padding, workspace=ws_))
        out.append(cpu.conv2d_backward_data(gy, w, xs, stride, padding, workspace=ws_))
        out.append(cpu.conv2d_backward_weight(x, gy, wshape, stride, padding, workspace=ws_))
    rng = np.random.default_rng(seed)
    for xs, k, s, p in POOLS:
        x = _rand(rng, xs)
        y, idx = cpu.max_pool2d_forward(x, k, s, p, workspace=ws_)
        out += [y, idx, cpu.max_pool2d_backward(_rand(rng, y.shape), idx, xs, workspace=ws_)]
    y = cpu.relu(_rand(rng, (3, 4, 5, 6)))
    out.append(cpu.relu_backward(y, _rand(rng, y.shape), workspace=ws_))
    return out


@pytest.mark.parametrize("use_workspace", [False, True])
def test_same_call_twice_around_other_calls_gives_identical_results(use_workspace):
    ws_ = cpu.new_workspace() if use_workspace else None
    first = [a.copy() for a in _every_op_once(10, ws_)]
    _every_op_once(20, ws_)
    second = _every_op_once(10, ws_)
    for a, b in zip(first, second):
        _equal(a, b)


def test_results_with_and_without_a_workspace_are_identical_and_never_alias_it():
    ws_ = cpu.new_workspace()
    with_ws = _every_op_once(30, ws_)
    kept = [a.copy() for a in with_ws]
    without = _every_op_once(30, None)
    for a, b in zip(with_ws, without):
        _equal(a, b)
    scratch_arrays = list(ws_._arrays.values())
    assert scratch_arrays, "the ops used no scratch memory at all"
    for a in with_ws:
        assert not any(np.shares_memory(a, s) for s in scratch_arrays)
    _every_op_once(40, ws_)  # later calls on the same workspace leave earlier results alone
    for a, b in zip(with_ws, kept):
        _equal(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_workspace_survives_a_change_of_shape_and_dtype(dtype):
    ws_ = cpu.new_workspace()
    for xs in [(2, 8, 8, 6), (3, 8, 5, 7), (2, 8, 8, 6)]:
        x, w, b = _conv_case(50, xs, (6, 8, 3, 3), dtype)
        gy = _gy(51, x, w, (1, 1), (1, 1))
        _equal(cpu.conv2d_forward(x, w, b, (1, 1), (1, 1), workspace=ws_),
               cpu.conv2d_forward(x, w, b, (1, 1), (1, 1)))
        _equal(cpu.conv2d_backward_weight(x, gy, w.shape, (1, 1), (1, 1), workspace=ws_),
               cpu.conv2d_backward_weight(x, gy, w.shape, (1, 1), (1, 1)))


def test_a_foreign_workspace_is_refused():
    x, w, b = _conv_case(60, (1, 2, 5, 5), (3, 2, 3, 3))
    with pytest.raises(TypeError, match="new_workspace"):
        cpu.conv2d_forward(x, w, b, (1, 1), (1, 1), workspace=object())


def test_cpu_op_modules_hold_no_mutable_state():
    """Every module-level name of the op modules is a function, class, module, constant or
    the runtime (which owns the random generator by design)."""
    constant = (int, float, str, bytes, tuple, frozenset, type(None), np.dtype,
                __future__._Feature)
    for module in (ops, conv, workspace):
        for name, value in vars(module).items():
            if name.startswith("__") or value is ops.runtime:
                continue
            ok = isinstance(value, constant + (types.FunctionType, types.BuiltinFunctionType,
                                              types.ModuleType, type))
            ok = ok or getattr(value, "__module__", "").startswith("numpy")  # NumPy functions
            assert ok, f"{module.__name__}.{name} is module-level state ({type(value).__name__})"


def test_layers_keep_one_workspace_and_match_the_functional_api():
    rng = np.random.default_rng(70)
    dp.manual_seed(0)
    layer, pool = nn.Conv2d(3, 8, 3, padding=1), nn.MaxPool2d(2)
    workspaces = None
    for _ in range(3):
        x_np = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
        gy = rng.standard_normal((2, 8, 4, 4)).astype(np.float32)
        x = dp.tensor(x_np, requires_grad=True)
        y = pool(layer(x).relu())
        y.backward(dp.tensor(gy))
        got = [y.numpy(), layer.weight.grad.numpy(), layer.bias.grad.numpy(), x.grad.numpy()]

        w = dp.tensor(layer.weight.numpy(), requires_grad=True)
        b = dp.tensor(layer.bias.numpy(), requires_grad=True)
        x2 = dp.tensor(x_np, requires_grad=True)
        y2 = F.max_pool2d(F.conv2d(x2, w, b, padding=1).relu(), 2)
        y2.backward(dp.tensor(gy))
        for a, b_ in zip(got, [y2.numpy(), w.grad.numpy(), b.grad.numpy(), x2.grad.numpy()]):
            _equal(a, b_)
        layer.weight.grad = layer.bias.grad = None
        if workspaces is None:
            workspaces = layer.workspace(x), pool.workspace(x)
            assert isinstance(workspaces[0], cpu.Workspace) and workspaces[0].nbytes() > 0
        assert (layer.workspace(x), pool.workspace(x)) == workspaces  # kept across steps
