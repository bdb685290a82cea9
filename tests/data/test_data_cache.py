"""The dataset cache checks every entry against its manifest's SHA-256: a corrupt or
truncated entry is reported by path and regenerated, never trained on, never a permanent
failure (synthetic and decoded entries alike)."""
import glob
import os

import numpy as np
import pytest
from data_fixtures import write_mnist

from dptrain.data import SyntheticDataset, get_dataset


def damage(path, how, rng):
    if how == "empty":
        open(path, "wb").close()
    elif how == "random":  # same size, random bytes after the .npy header
        raw = bytearray(open(path, "rb").read())
        raw[128:] = rng.integers(0, 256, len(raw) - 128, dtype=np.uint8).tobytes()
        open(path, "wb").write(bytes(raw))
    elif how == "truncate":
        raw = open(path, "rb").read()
        open(path, "wb").write(raw[:-7])


@pytest.mark.parametrize("target,how", [
    ("labels", "empty"), ("labels", "random"), ("images", "random"), ("images", "truncate"),
    ("images", "empty"), ("entry", "empty"), ("entry", "random")])
def test_corrupt_synthetic_entry_is_reported_and_regenerated(tmp_path, target, how):
    rng = np.random.default_rng(0)
    fresh = SyntheticDataset("train", 120, seed=3, cache_dir=str(tmp_path))
    images, labels = np.array(fresh.images), np.array(fresh.labels)
    suffix = {"labels": "-labels.npy", "images": "-images.npy", "entry": "-entry.json"}[target]
    path = glob.glob(str(tmp_path / f"*{suffix}"))[0]
    if target == "entry" and how == "random":
        open(path, "wb").write(rng.integers(0, 256, 300, dtype=np.uint8).tobytes())
    else:
        damage(path, how, rng)
    with pytest.warns(UserWarning, match="dataset cache entry .*regenerating") as caught:
        again = SyntheticDataset("train", 120, seed=3, cache_dir=str(tmp_path))
    assert any(os.path.basename(path) in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    assert not again.from_cache
    np.testing.assert_array_equal(again.images, images)
    np.testing.assert_array_equal(again.labels, labels)
    third = SyntheticDataset("train", 120, seed=3, cache_dir=str(tmp_path))  # healed
    assert third.from_cache
    np.testing.assert_array_equal(third.images, images)


def test_corrupt_decoded_entry_is_regenerated(tmp_path):
    rng = np.random.default_rng(1)
    truth = write_mnist(str(tmp_path / "m"), rng)
    cache = str(tmp_path / "cache")

    def train():
        return get_dataset("mnist", "train", None, 0, cache, data_dir=str(tmp_path / "m"))

    train()
    labels_file = glob.glob(os.path.join(cache, "mnist-*-train-*-labels.npy"))[0]
    damage(labels_file, "random", rng)
    with pytest.warns(UserWarning, match=os.path.basename(labels_file)):
        data = train()
    np.testing.assert_array_equal(data.labels, truth["train"][1])
    np.testing.assert_array_equal(data.images, truth["train"][0])
