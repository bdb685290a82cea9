"""Forward values of conv2d, pooling, log_softmax and cross_entropy against plain loops."""
import math

import numpy as np
import pytest

import dptrain as dp
import dptrain.engine.functional as F

rng = np.random.default_rng(7)


def loop_conv2d(x, w, b, stride, padding):
    n, c, h, wd = x.shape
    co, _, kh, kw = w.shape
    (sh, sw), (ph, pw) = stride, padding
    ho, wo = (h + 2 * ph - kh) // sh + 1, (wd + 2 * pw - kw) // sw + 1
    y = np.zeros((n, co, ho, wo))
    for i in range(n):
        for o in range(co):
            for r in range(ho):
                for q in range(wo):
                    acc = b[o] if b is not None else 0.0
                    for ci in range(c):
                        for u in range(kh):
                            for v in range(kw):
                                hh, ww = r * sh + u - ph, q * sw + v - pw
                                if 0 <= hh < h and 0 <= ww < wd:
                                    acc += x[i, ci, hh, ww] * w[o, ci, u, v]
                    y[i, o, r, q] = acc
    return y


def loop_pool(x, kernel, stride, padding, reduce):
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    y = np.zeros((n, c, ho, wo))
    for i in range(n):
        for ci in range(c):
            for r in range(ho):
                for q in range(wo):
                    vals = []
                    for u in range(kh):
                        for v in range(kw):
                            hh, ww = r * sh + u - ph, q * sw + v - pw
                            inside = 0 <= hh < h and 0 <= ww < w
                            vals.append(x[i, ci, hh, ww] if inside else None)
                    if reduce == "max":
                        y[i, ci, r, q] = max(v for v in vals if v is not None)
                    else:  # padding counts as zeros in the divisor, as in PyTorch
                        y[i, ci, r, q] = sum(v for v in vals if v is not None) / (kh * kw)
    return y


@pytest.mark.parametrize("xs,ws,stride,padding", [
    ((2, 3, 7, 5), (4, 3, 3, 3), (1, 1), (1, 1)),
    ((1, 2, 8, 6), (3, 2, 3, 2), (2, 1), (1, 2)),
    ((2, 1, 9, 7), (2, 1, 5, 5), (2, 2), (2, 2)),
    ((3, 33, 7, 5), (5, 33, 1, 1), (1, 1), (0, 0)),
])
@pytest.mark.parametrize("bias", [True, False])
def test_conv2d_matches_loops(xs, ws, stride, padding, bias):
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    b = rng.standard_normal(ws[0]) if bias else None
    args = (dp.tensor(x), dp.tensor(w)) + ((dp.tensor(b),) if bias else ())
    got = F.conv2d(*args, stride=stride, padding=padding).numpy()
    np.testing.assert_allclose(got, loop_conv2d(x, w, b, stride, padding), rtol=1e-10, atol=1e-10)


POOLS = [((2, 3, 6, 6), (2, 2), (2, 2), (0, 0)), ((1, 2, 7, 5), (3, 3), (2, 2), (1, 1)),
         ((2, 1, 5, 8), (2, 3), (1, 2), (1, 1)), ((3, 2, 7, 5), (3, 2), (3, 1), (0, 1))]


@pytest.mark.parametrize("xs,k,s,p", POOLS)
@pytest.mark.parametrize("reduce", ["max", "avg"])
def test_pooling_matches_loops(xs, k, s, p, reduce):
    x = rng.standard_normal(xs)
    fn = F.max_pool2d if reduce == "max" else F.avg_pool2d
    got = fn(dp.tensor(x), k, s, p).numpy()
    np.testing.assert_allclose(got, loop_pool(x, k, s, p, reduce), rtol=1e-12)


def test_float32_forward_stays_float32():
    x = dp.tensor(rng.standard_normal((2, 3, 6, 6)).astype(np.float32))
    w = dp.tensor(rng.standard_normal((4, 3, 3, 3)).astype(np.float32))
    y = F.max_pool2d(F.conv2d(x, w, padding=1).relu(), 2)
    assert y.dtype == np.float32 and y.shape == (2, 4, 3, 3)


def test_log_softmax_matches_formula_and_is_stable():
    x = rng.standard_normal((5, 7)) * 50  # large logits would overflow a naive exp
    got = F.log_softmax(dp.tensor(x)).numpy()
    for i in range(5):
        m = max(x[i])
        lse = m + math.log(sum(math.exp(v - m) for v in x[i]))
        np.testing.assert_allclose(got[i], x[i] - lse, rtol=1e-10, atol=1e-12)
    assert np.isfinite(got).all()


def test_cross_entropy_matches_loops():
    x = rng.standard_normal((6, 4)) * 3
    labels = rng.integers(0, 4, size=6)
    want = 0.0
    for i in range(6):
        lse = math.log(sum(math.exp(v) for v in x[i]))
        want += lse - x[i, labels[i]]
    got = F.cross_entropy(dp.tensor(x), dp.tensor(labels)).item()
    assert got == pytest.approx(want / 6, rel=1e-12)
