"""Comparing two saved weight files (.npz from `train --save`) array by array."""
import numpy as np


def assert_same_weights(path_a, path_b, rtol=1e-5):
    """Every array of a equals b's within `rtol` of a's largest magnitude (__meta__ aside)."""
    with np.load(path_a) as a, np.load(path_b) as b:
        for name in a.files:
            if name == "__meta__":
                continue
            rel = np.abs(a[name] - b[name]).max() / (np.abs(a[name]).max() + 1e-12)
            assert rel <= rtol, f"{name}: relative difference {rel:.2e}"
