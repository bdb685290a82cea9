"""Shared test set-up: the `gpu` marker skips where no GPU (or no CuPy) is present."""
import pytest

from dptrain.backend import cuda_available

HAVE_GPU = cuda_available()


def pytest_collection_modifyitems(config, items):
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
