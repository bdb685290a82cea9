"""Central-difference gradient checking in float64 against autodiff's backward."""
from __future__ import annotations

import numpy as np

import dptrain as dp


def gradcheck(fn, *arrays, eps=1e-6, rtol=1e-5, atol=1e-7, seed=0):
    """Check d(sum(w * fn(*inputs)))/d(input) for every float input, w a random weighting."""
    rng = np.random.default_rng(seed)
    inputs = [dp.tensor(np.asarray(a), requires_grad=np.asarray(a).dtype.kind == "f") for a in arrays]
    out = fn(*inputs)
    weight = rng.standard_normal(out.shape)
    (out * dp.tensor(weight)).sum().backward()

    def objective():
        with dp.no_grad():
            return float((fn(*inputs).numpy() * weight).sum())

    for i, t in enumerate(inputs):
        if not t.requires_grad:
            continue
        numeric = np.zeros(t.shape)
        flat = t.data.reshape(-1)
        for j in range(flat.size):
            orig = flat[j]
            flat[j] = orig + eps
            plus = objective()
            flat[j] = orig - eps
            minus = objective()
            flat[j] = orig
            numeric.reshape(-1)[j] = (plus - minus) / (2 * eps)
        analytic = t.grad.numpy()
        np.testing.assert_allclose(analytic, numeric, rtol=rtol, atol=atol,
                                   err_msg=f"gradient of input {i} (shape {t.shape})")
