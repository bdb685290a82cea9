"""The CUDA workspace (dptrain/backend/cuda/workspace.py): a layer's convolution passes hand
their channels-last copies of x and gy to backward-weight, which gives bitwise the result it
gets copying them itself; a copy is taken once, only for the very array it was made from, and
nothing is kept for a forward without a backward."""
import numpy as np
import pytest

from convcheck import DTYPES, fresh_conv_plans, inputs
import dptrain as dp
from dptrain import backend
from dptrain.nn import Conv2d

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

SHAPES = ((4, 64, 12, 12), (128, 64, 3, 3), (2, 2), (1, 1))  # a ResNet down-sampling conv


@pytest.fixture(scope="module")
def cu():
    return backend.get("cuda")


@pytest.fixture(autouse=True)
def fresh_plans(cu):
    with fresh_conv_plans(cu):
        yield


def _passes(cu, x, w, gy, stride, pad, ws):
    y = cu.conv2d_forward(x, w, None, stride, pad, workspace=ws)
    gx = cu.conv2d_backward_data(gy, w, x.shape, stride, pad, workspace=ws)
    gw = cu.conv2d_backward_weight(x, gy, w.shape, stride, pad, workspace=ws)
    return [cu.to_numpy(a).tobytes() for a in (y, gx, gw)]


@pytest.mark.parametrize("dt", DTYPES)
def test_kept_copies_give_bitwise_the_same_gradients(cu, dt):
    xs, wshape, stride, pad = SHAPES
    x, w, gy = (cu.asarray(a) for a in inputs(dt, xs, wshape, stride, pad))
    ws = cu.new_workspace()
    assert _passes(cu, x, w, gy, stride, pad, ws) == _passes(cu, x, w, gy, stride, pad, None)
    assert not ws._kept  # backward-weight took both copies


@pytest.mark.parametrize("dt", DTYPES[2:])
def test_a_copy_serves_only_its_own_array(cu, dt):
    xs, wshape, stride, pad = SHAPES
    x, w, gy = (cu.asarray(a) for a in inputs(dt, xs, wshape, stride, pad))
    other = x.copy()
    other[0] = other[1]  # same shape and dtype, other values
    ws = cu.new_workspace()
    cu.conv2d_forward(x, w, None, stride, pad, workspace=ws)
    got = cu.conv2d_backward_weight(other, gy, w.shape, stride, pad, workspace=ws)
    want = cu.conv2d_backward_weight(other, gy, w.shape, stride, pad)
    assert cu.to_numpy(got).tobytes() == cu.to_numpy(want).tobytes()


def test_a_forward_without_backward_keeps_nothing(cu):
    xs, wshape, stride, pad = SHAPES
    dt = DTYPES[2].values[0]
    x, w, _ = (cu.asarray(a) for a in inputs(dt, xs, wshape, stride, pad))
    ws = cu.new_workspace()
    cu.conv2d_forward(x, w, None, stride, pad, workspace=ws)
    assert ws._kept  # a training forward keeps x's copy for backward-weight
    ws.expect_backward(False)
    assert not ws._kept
    cu.conv2d_forward(x, w, None, stride, pad, workspace=ws)
    assert not ws._kept


def test_a_layer_keeps_nothing_under_no_grad(cu):
    layer = Conv2d(64, 128, 3, stride=2, padding=1).to("cuda")
    x = dp.tensor(np.random.default_rng(0).standard_normal((4, 64, 12, 12), dtype=np.float32),
                  device="cuda")
    with dp.no_grad():
        layer(x)
    assert not layer.workspace.workspace._kept
    layer(x).sum().backward()
    assert not layer.workspace.workspace._kept  # kept by the forward, taken by backward
