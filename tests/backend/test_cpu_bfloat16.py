"""The CPU backend's bfloat16 conversions (copy_, astype): the reference of the GPU's
convert_kernel that the bf16 gradient exchange uses on CPU ranks."""
import numpy as np

from dptrain import backend
from dptrain.backend.bfloat16 import BFLOAT16, from_bfloat16, to_bfloat16

cpu = backend.get("cpu")


def test_copy_rounds_to_nearest_even_and_widens_exactly():
    x = np.random.default_rng(0).standard_normal(1001).astype(np.float32)
    low = np.empty(x.shape, BFLOAT16)
    cpu.copy_(low, x)
    assert np.array_equal(low, to_bfloat16(x))
    back = np.full(x.shape, np.nan, np.float32)
    cpu.copy_(back, low)
    assert np.array_equal(back, from_bfloat16(low))
    assert np.abs(back - x).max() <= np.abs(x).max() * 2.0**-8


def test_astype_both_ways():
    x = np.array([1.0, -2.5, 3.0e38, 1e-30], np.float32)
    low = cpu.astype(x, BFLOAT16)
    assert low.dtype == BFLOAT16 and np.array_equal(cpu.astype(low, np.float32),
                                                   from_bfloat16(to_bfloat16(x)))
