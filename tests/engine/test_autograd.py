"""The engine: accumulation over shared uses, no_grad, detach, dtypes, errors."""
import numpy as np
import pytest

import dptrain as dp
import dptrain.engine.functional as F


def test_value_used_twice_accumulates():
    x = dp.tensor([2.0, 3.0], requires_grad=True)
    y = x * x + x  # dy/dx = 2x + 1
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [5.0, 7.0])


def test_diamond_graph():
    x = dp.tensor([1.5], requires_grad=True)
    a, b = x * 2.0, x.exp()
    (a * b).sum().backward()  # d/dx 2x e^x = 2e^x + 2x e^x
    np.testing.assert_allclose(x.grad.numpy(), 2 * np.exp(1.5) * (1 + 1.5), rtol=1e-6)


def test_backward_twice_accumulates_into_grad():
    x = dp.tensor([1.0, 2.0], requires_grad=True)
    (x * 3.0).sum().backward()
    (x * 3.0).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [6.0, 6.0])


def test_backward_with_explicit_gradient():
    x = dp.tensor(np.ones((2, 2)), requires_grad=True)
    (x * 2.0).backward(dp.tensor(np.array([[1.0, 2.0], [3.0, 4.0]])))
    np.testing.assert_allclose(x.grad.numpy(), [[2, 4], [6, 8]])


def test_no_grad_records_nothing():
    x = dp.tensor([1.0], requires_grad=True)
    with dp.no_grad():
        y = x * 2.0
    assert not y.requires_grad and y._ctx is None
    assert dp.is_grad_enabled()


def test_detach_cuts_the_graph():
    x = dp.tensor([3.0], requires_grad=True)
    y = x * x.detach()  # gradient flows only through the first factor
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [3.0])


def test_grad_only_for_inputs_that_require_it():
    x = dp.tensor([1.0, 2.0], requires_grad=True)
    c = dp.tensor([5.0, 6.0])
    (x * c).sum().backward()
    assert c.grad is None
    np.testing.assert_allclose(x.grad.numpy(), [5.0, 6.0])


def test_backward_on_constant_raises():
    with pytest.raises(RuntimeError, match="does not require grad"):
        dp.tensor([1.0]).backward()


def test_dtypes_default_float32_keep_float64_and_ints():
    assert dp.tensor([1.0, 2.0]).dtype == np.float32
    assert dp.tensor(np.zeros(3, dtype=np.float64)).dtype == np.float64
    assert dp.tensor(np.arange(3)).dtype.kind == "i"
    assert (dp.tensor([1.0]) + 1).dtype == np.float32


def test_tensor_api_surface():
    x = dp.tensor(np.arange(24, dtype=np.float64).reshape(2, 3, 4))
    assert x.shape == (2, 3, 4) and x.T.shape == (4, 3, 2)
    assert x.reshape(6, 4).shape == (6, 4) and x.flatten().shape == (2, 12)
    assert x[1, :, 2].numpy().tolist() == [14.0, 18.0, 22.0]
    assert x.max(axis=2).numpy()[0].tolist() == [3.0, 7.0, 11.0]
    assert float(x.mean().item()) == pytest.approx(11.5)
    assert isinstance(x.numpy(), np.ndarray)


def test_deep_chain_does_not_recurse():
    x = dp.tensor([1.0], requires_grad=True)
    y = x
    for _ in range(5000):
        y = y + 0.0
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [1.0])


def test_shape_errors_name_the_shapes():
    with pytest.raises(ValueError, match="4 channels"):
        F.conv2d(dp.tensor(np.zeros((1, 4, 5, 5))), dp.tensor(np.zeros((2, 3, 3, 3))))
    with pytest.raises(ValueError, match="features"):
        F.linear(dp.tensor(np.zeros((2, 3))), dp.tensor(np.zeros((4, 5))))
    with pytest.raises(ValueError, match="integer labels"):
        F.cross_entropy(dp.tensor(np.zeros((2, 3))), dp.tensor([0.5, 1.0]))


def _assert_same_bits(arrays, others):
    assert len(arrays) == len(others)
    for a, b in zip(arrays, others):
        assert a.tobytes() == b.tobytes()


def _mlp_grads(monkeypatch, direct, device="cpu", shared=False, zeroed=False):
    """Two backward passes of a small Linear-ReLU-Linear net, direct gradients on or off. Its
    parameters have a .grad from the first pass on, so the second may add in place; with
    `zeroed` they live in one flat buffer zeroed once before both passes (as an optimizer's
    zero_grad does), so the first may write. The grads after each pass, the parameters' hook
    calls in order, and the weight products that wrote (matmul_into_) or added (matmul_add_)
    into a .grad, in order."""
    from dptrain.backend import get
    from dptrain.distributed.flat import FlatParameters
    from dptrain.engine import autograd

    monkeypatch.setattr(autograd, "DIRECT_GRADS", direct)
    be, calls, products = get(device), [], []
    for name in ("matmul_into_", "matmul_add_"):
        real = getattr(be, name)
        monkeypatch.setattr(be, name, lambda *a, _n=name, _r=real, **k: products.append(_n)
                            or _r(*a, **k))
    rng = np.random.default_rng(3)
    ws = [dp.tensor(rng.standard_normal(s).astype(np.float32), requires_grad=True,
                    device=device) for s in [(16, 12), (16,), (5, 16), (5,)]]
    if zeroed:
        flat = FlatParameters(ws)
        be.fill_(flat.grad, 7.0)  # whatever was there: zero_grad clears it
        flat.zero_grad()
    for i, w in enumerate(ws):
        w.register_grad_hook(lambda t, i=i: calls.append(i))
    x = dp.tensor(rng.standard_normal((7, 12)).astype(np.float32), device=device)
    grads = []
    for _ in range(2):
        h = F.linear_relu(x, ws[0], ws[1])
        out = F.linear(h, ws[2], ws[3])
        if shared:  # the last weight used twice: its gradient goes back the usual way
            out = out + F.linear(h, ws[2])
        (out * out).sum().backward()
        grads.append([w.grad.numpy().copy() for w in ws])
    return grads, calls, list(products)  # (a later call's wrappers run through these)


@pytest.mark.parametrize("shared", [False, True])
def test_gradients_added_in_place_equal_added_after(monkeypatch, shared):
    """A leaf with a .grad that one op alone uses gets its gradient added by that op (Linear:
    matmul_add_ / bias_grad_add_); the grads are the same bits as computing and then adding
    them, and each leaf's hooks still run once per backward, in the same order."""
    direct, calls, added = _mlp_grads(monkeypatch, True, shared=shared)
    after, calls_after, added_after = _mlp_grads(monkeypatch, False, shared=shared)
    # the second pass, each weight
    assert added == ["matmul_add_"] * (1 if shared else 2) and added_after == []
    assert calls == calls_after and len(calls) == 8
    _assert_same_bits(direct[-1], after[-1])


@pytest.mark.gpu
def test_gradients_added_in_place_on_the_gpu(monkeypatch):
    pytest.importorskip("cupy")
    from dptrain.backend import get

    with get("cuda").runtime.precision_scope("tf32"):
        direct, calls, added = _mlp_grads(monkeypatch, True, device="cuda")
        after, calls_after, _ = _mlp_grads(monkeypatch, False, device="cuda")
    assert added == ["matmul_add_"] * 2 and calls == calls_after
    _assert_same_bits(direct[-1], after[-1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_zeroed_grads_take_the_weight_products_written(monkeypatch, device):
    """After zero_grad, a weight's first gradient is stored into its .grad by the product
    (matmul_into_: no add pass), the same bits as adding it to the zeros; a second backward
    without zero_grad adds (gradient accumulation)."""
    from dptrain.backend import get

    if device == "cuda":
        pytest.importorskip("cupy")
    with get(device).runtime.precision_scope("tf32" if device == "cuda" else "fp32"):
        direct, _, products = _mlp_grads(monkeypatch, True, device, zeroed=True)
        after, _, products_after = _mlp_grads(monkeypatch, False, device, zeroed=True)
    assert products == ["matmul_into_"] * 2 + ["matmul_add_"] * 2 and products_after == []
    for got, want in zip(direct, after):
        _assert_same_bits(got, want)
    np.testing.assert_allclose(direct[1][0], 2 * direct[0][0], rtol=1e-6)


def test_a_grad_added_to_since_zero_grad_is_not_overwritten():
    """Any gradient added into a .grad clears zero_grad's mark: after a backward that reached
    w along two paths (summed by autograd, then added to .grad), a Linear that alone uses w
    adds its gradient too, not overwrites."""
    from dptrain.distributed.flat import FlatParameters

    rng = np.random.default_rng(6)
    w = dp.tensor(rng.standard_normal((3, 4)).astype(np.float32), requires_grad=True)
    flat = FlatParameters([w])
    flat.zero_grad()
    x = dp.tensor(rng.standard_normal((2, 4)).astype(np.float32))
    (F.linear(x, w).sum() + (w * w).sum()).backward()  # two uses: added by autograd
    first = w.grad.numpy().copy()
    F.linear(x, w).sum().backward()  # one use: the Linear is offered w's .grad
    want = first + np.broadcast_to(x.numpy().sum(0), (3, 4))
    np.testing.assert_allclose(w.grad.numpy(), want, rtol=1e-6)


def _bn_grads(monkeypatch, direct, device="cpu", x_dtype=np.float32):
    """Two backward passes of batch norm (+ ReLU) over x, weight and bias leaves with .grad
    from the first pass on; direct adds on or off: the grads and how often the sums' kernel
    added them into .grad itself."""
    from dptrain.backend import get
    from dptrain.engine import autograd

    monkeypatch.setattr(autograd, "DIRECT_GRADS", direct)
    be = get(device)
    added = []
    for name in ("batch_norm_backward_reduce", "batch_norm_backward_reduce_joined"):
        monkeypatch.setattr(be, name, lambda *a, add_to=None, real=getattr(be, name), **k: (
            added.append(add_to is not None) or real(*a, add_to=add_to, **k)))
    rng = np.random.default_rng(5)
    w, b = (dp.tensor(rng.standard_normal(6).astype(np.float32), requires_grad=True,
                      device=device) for _ in range(2))
    x = dp.tensor(rng.standard_normal((4, 6, 5, 5)).astype(np.float32), requires_grad=True,
                  device=device)
    for relu in (False, True):
        xs = F.cast(x, x_dtype) if x_dtype != np.float32 else x
        y = F.batch_norm(xs, w, b, relu=relu)
        (F.cast(y, np.float32) * F.cast(y, np.float32)).sum().backward()
    return [t.grad.numpy() for t in (w, b, x)], sum(added)


def test_batch_norm_parameter_grads_added_by_the_sums_kernel(monkeypatch):
    """Batch norm's weight and bias gradients are added into their .grad by the sums' last
    kernel where autograd offers it (the second pass): the same bits as adding them after."""
    direct, added = _bn_grads(monkeypatch, True)
    after, added_after = _bn_grads(monkeypatch, False)
    assert added == 1 and added_after == 0
    _assert_same_bits(direct, after)


def _residual_block_grads(monkeypatch, joined, device="cpu", x_dtype=np.float32, parts=2,
                          channels_last=False):
    """Gradients of a batch norm with residual and ReLU whose output feeds `parts` paths (a
    residual block's feeds two): its gradient arrives in parts, whose last add the batch norm
    does in its ReLU's pass (batch_norm_backward_reduce_joined given both parts) when
    `joined`, else autograd adds them all first. `channels_last`: (N, H, W, C) activations,
    whose batch norm runs on a reshape to (rows, C): the parts pass the view apart. The
    grads, and how often the batch norm joined two parts."""
    from dptrain.backend import get
    from dptrain.engine import ops

    monkeypatch.setattr(ops.BatchNorm, "takes_grad_sum", joined)
    be = get(device)
    calls, real = [], be.batch_norm_backward_reduce_joined

    def counted(ga, gb, *a, **k):
        calls.extend([1] if gb is not None else [])
        return real(ga, gb, *a, **k)

    monkeypatch.setattr(be, "batch_norm_backward_reduce_joined", counted)
    rng = np.random.default_rng(11)
    w, b = (dp.tensor(rng.standard_normal(6).astype(np.float32), requires_grad=True,
                      device=device) for _ in range(2))
    shape = (4, 5, 5, 6) if channels_last else (4, 6, 5, 5)
    x, r = (dp.tensor(rng.standard_normal(shape).astype(np.float32), requires_grad=True,
                      device=device) for _ in range(2))
    xs, rs = ((F.cast(t, x_dtype) if x_dtype != np.float32 else t) for t in (x, r))
    out = F.batch_norm(xs, w, b, residual=rs, relu=True, channels_last=channels_last)
    uses = [F.cast(out * float(k), np.float32) for k in range(2, 2 + parts)]
    loss = uses[0]
    for u in uses[1:]:
        loss = loss * u
    loss.sum().backward()
    return [t.grad.numpy() for t in (w, b, x, r)], len(calls)


@pytest.mark.parametrize("parts,channels_last", [(2, False), (3, False), (2, True)])
def test_gradient_parts_joined_in_the_relu_pass_equal_added_first(monkeypatch, parts,
                                                                  channels_last):
    """A tensor's gradient parts reach its op apart (GradSum) where the op adds them itself:
    batch norm's residual ReLU, one pass for the (last) add and the mask; a reshape passes
    them on apart. The same bits as autograd adding them first."""
    joined, calls = _residual_block_grads(monkeypatch, True, parts=parts,
                                          channels_last=channels_last)
    first, calls_first = _residual_block_grads(monkeypatch, False, parts=parts,
                                               channels_last=channels_last)
    assert calls == 1 and calls_first == 0
    _assert_same_bits(joined, first)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["batch_norm_parameter_grads", "gradient_parts"])
def test_fused_gradients_on_the_gpu_equal_added_after(monkeypatch, x_dtype, case):
    """The two tests above on the GPU: batch norm's parameter grads added into .grad by its
    sums' kernel, and a channels-last block output's gradient parts joined in the ReLU's
    pass; each fires once and gives the bits of adding after."""
    pytest.importorskip("cupy")
    from dptrain.backend.bfloat16 import BFLOAT16

    dt = BFLOAT16 if x_dtype == "bfloat16" else np.float32
    grads = {"batch_norm_parameter_grads": _bn_grads,
             "gradient_parts": lambda *a, **k: _residual_block_grads(*a, channels_last=True,
                                                                     **k)}[case]
    fused, count = grads(monkeypatch, True, device="cuda", x_dtype=dt)
    after, _ = grads(monkeypatch, False, device="cuda", x_dtype=dt)
    assert count == 1
    _assert_same_bits(fused, after)


def _conv_weight_grads(monkeypatch, direct, device="cpu", dtype=np.float16, geometry=None):
    """Two backward passes of a convolution whose weight, an fp32 leaf, reaches it as a 16-bit
    cast (mixed precision); direct adds on or off: the weight's .grad after each pass, its
    hook's calls, and how often the backward-weight pass was handed the .grad to add into.
    `geometry`: (x's shape (N, H, W, C), C_out, kernel, stride, padding), channels-last."""
    from dptrain.backend import get
    from dptrain.engine import autograd

    monkeypatch.setattr(autograd, "DIRECT_GRADS", direct)
    be, added, calls = get(device), [], []
    real = be.conv2d_backward_weight
    monkeypatch.setattr(be, "conv2d_backward_weight", lambda *a, add_to=None, **k: (
        added.append(add_to is not None) or real(*a, add_to=add_to, **k)))
    shape, cout, k, stride, pad = geometry or ((2, 6, 6, 8), 8, 3, 1, 1)
    rng = np.random.default_rng(7)
    kh, kw = k if isinstance(k, tuple) else (k, k)
    w = dp.tensor(rng.standard_normal((cout, shape[3], kh, kw)).astype(np.float32) * 0.1,
                  requires_grad=True, device=device)
    w.register_grad_hook(lambda t: calls.append(1))
    x = dp.tensor(rng.standard_normal(shape).astype(np.float32), device=device)
    grads = []
    for _ in range(2):
        y = F.conv2d(F.cast(x, dtype), F.cast_parameter(w, dtype), stride=stride, padding=pad,
                     channels_last=True)
        (F.cast(y, np.float32) * F.cast(y, np.float32)).sum().backward()
        grads.append(w.grad.numpy().copy())
    return grads, len(calls), sum(added)


def test_conv_weight_grad_added_through_its_cast(monkeypatch):
    """A 16-bit convolution adds its weight gradient into the fp32 leaf's .grad itself where
    autograd offers it (the second pass): the bits of adding it after, the hook called once a
    pass."""
    direct, hooks, added = _conv_weight_grads(monkeypatch, True)
    after, hooks_after, added_after = _conv_weight_grads(monkeypatch, False)
    assert (hooks, added, hooks_after, added_after) == (2, 1, 2, 0)
    _assert_same_bits(direct, after)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("geometry", [
    ((8, 28, 28, 64), 64, 3, 1, 1),     # the TMA kernel, its splits summed by the reducer
    ((4, 14, 14, 256), 512, 1, 2, 0),   # a strided 1x1 (ResNet-50's downsample)
    ((2, 40, 20, 8), 64, (7, 4), 1, (3, 0)),  # a stem over column pairs: the strip kernel
], ids=["3x3", "1x1s2", "strip"])
def test_conv_weight_grad_added_on_the_gpu(monkeypatch, x_dtype, geometry):
    """The same on the GPU, where the reducer adds into the fp32 .grad in its own pass (or,
    where a plan's kernel writes the gradient itself, add_ after it): the bits of adding it
    after. float32 offers the leaf's .grad itself (no cast)."""
    pytest.importorskip("cupy")
    from dptrain.backend.bfloat16 import BFLOAT16

    dt = {"bfloat16": BFLOAT16, "float16": np.float16, "float32": np.float32}[x_dtype]
    direct, hooks, added = _conv_weight_grads(monkeypatch, True, "cuda", dt, geometry)
    after, _, added_after = _conv_weight_grads(monkeypatch, False, "cuda", dt, geometry)
    assert (hooks, added, added_after) == (2, 1, 0)
    _assert_same_bits(direct, after)


def _shortcut_block_grads(monkeypatch, spread_later, dtype):
    """Gradients of a channels-last batch norm (residual, ReLU) whose output feeds a strided
    1x1 convolution (a ResNet shortcut) and a stride-1 one, on the GPU; spread_later on or
    off; and how often its joined sums read a Spread part where it lies."""
    from dptrain.backend import get
    from dptrain.backend.spread import Spread
    from dptrain.engine import ops

    monkeypatch.setattr(ops, "SPREAD_LATER", spread_later)
    be = get("cuda")
    spreads, real = [], be.batch_norm_backward_reduce_joined
    monkeypatch.setattr(be, "batch_norm_backward_reduce_joined", lambda ga, gb, *a, **k: (
        spreads.extend([1] if isinstance(gb, Spread) else []) or real(ga, gb, *a, **k)))
    rng = np.random.default_rng(5)
    c, shape = 64, (2, 9, 9, 64)
    w, b = (dp.tensor(rng.standard_normal(c).astype(np.float32), requires_grad=True,
                      device="cuda") for _ in range(2))
    x, r = (dp.tensor(rng.standard_normal(shape).astype(np.float32), requires_grad=True,
                      device="cuda") for _ in range(2))
    ws, wm = (dp.tensor(rng.standard_normal((co, c, 1, 1)).astype(np.float32) * 0.1,
                        requires_grad=True, device="cuda") for co in (128, 64))
    xs, rs = (F.cast(t, dtype) for t in (x, r))
    out = F.batch_norm(xs, w, b, residual=rs, relu=True, channels_last=True)
    short = F.conv2d(out, F.cast(ws, dtype), stride=2, channels_last=True)
    main = F.conv2d(out, F.cast(wm, dtype), channels_last=True)
    loss = (F.cast(short, np.float32) * F.cast(short, np.float32)).sum() + \
        (F.cast(main, np.float32) * F.cast(main, np.float32)).sum()
    loss.backward()
    return [t.grad.numpy() for t in (w, b, x, r, ws, wm)], len(spreads)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", ["float16", "bfloat16", "float32"])
def test_strided_shortcut_gradient_read_where_it_lies(monkeypatch, x_dtype):
    """A strided 1x1 shortcut's backward-data reaches the batch norm before it as a Spread,
    whose product its joined sums read where it lies: the bits of spreading it first."""
    pytest.importorskip("cupy")
    from dptrain.backend.bfloat16 import BFLOAT16

    dt = {"bfloat16": BFLOAT16, "float16": np.float16, "float32": np.float32}[x_dtype]
    later, count = _shortcut_block_grads(monkeypatch, True, dt)
    first, count_first = _shortcut_block_grads(monkeypatch, False, dt)
    assert (count, count_first) == (1, 0)
    _assert_same_bits(later, first)


def test_a_spread_part_is_added_as_its_array():
    """A Spread (dptrain.backend.spread) stays lazy through a reshape and is added as the
    array it stands for, written once."""
    from dptrain.backend import get
    from dptrain.backend.spread import Spread
    from dptrain.engine.autograd import GradSum, total

    be, rng = get("cpu"), np.random.default_rng(2)
    dense = rng.standard_normal((2, 3, 3, 4)).astype(np.float32)
    full = np.zeros((2, 5, 5, 4), np.float32)
    full[:, ::2, ::2] = dense
    stores = []
    spread = Spread(dense, full.shape, (2, 2), (0, 0),
                    lambda: stores.append(1) or full.copy())
    flat = spread.reshape(50, 4)
    assert isinstance(flat, Spread) and flat.shape == (50, 4) and not stores
    a = rng.standard_normal((50, 4)).astype(np.float32)
    got = GradSum((a, flat)).total(be)
    assert got.tobytes() == (a + full.reshape(50, 4)).tobytes()
    assert total(flat, be).shape == (50, 4) and len(stores) == 1  # written once
    with pytest.raises(ValueError, match="elements"):
        spread.reshape(3, 4)


def test_gradient_parts_of_other_ops_arrive_added():
    """An op that does not take parts gets one array: their sum in arrival order."""
    from dptrain.engine.autograd import Function, GradSum

    seen = []

    class Probe(Function):
        def forward(self, a):
            return a

        def backward(self, gy):
            seen.append(gy)
            return (gy,)

    x = dp.tensor([1.0, 2.0], requires_grad=True)
    y = Probe.apply(x)
    (y * 2.0 + y * 3.0).sum().backward()
    assert not isinstance(seen[0], GradSum)
    np.testing.assert_allclose(x.grad.numpy(), [5.0, 5.0])


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("model", ["cnn", "resnet18"])
def test_gradients_complete_last_layer_first(model, precision):
    """Each parameter's gradient completes as backward passes its layer, the last layers'
    first, also under mixed precision, where every layer reads a 16-bit cast of its fp32
    weight: the gradient exchange starts each bucket's reduce-scatter as it completes (the
    casts' backward once ran after all of backward's, so the whole exchange waited)."""
    import dptrain as dp
    import dptrain.engine.functional as F
    from dptrain.nn import build_model

    dp.manual_seed(0)
    net = build_model(model, (1, 16, 16), 3)
    ddp = dp.DataParallel(net, "sgd", precision=precision, lr=0.01)
    names = [n for n, _ in net.named_parameters()]
    done = []
    for n, p in net.named_parameters():
        p.register_grad_hook(lambda t, n=n: done.append(n))
    step = ddp.compile(lambda b: F.cross_entropy(ddp(b[0]), b[1]), capture=False)
    step((np.random.default_rng(0).random((2, 1, 16, 16), np.float32), np.arange(2)))
    layers = lambda order: list(dict.fromkeys(n.rsplit(".", 1)[0] for n in order))  # noqa: E731
    assert layers(done)[:3] == layers(reversed(names))[:3], done
    assert layers(done)[-1] == layers(names)[0], done
