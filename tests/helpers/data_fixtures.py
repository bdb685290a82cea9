"""Small dataset files in every format the loaders read, written by the tests themselves."""
from __future__ import annotations

import gzip
import os
import pickle
import struct

import numpy as np


def rand_images(rng, n, c, h, w):
    return rng.integers(0, 256, (n, c, h, w), dtype=np.uint8)


def write_idx(path, array, gz=False, magic=None):
    array = np.ascontiguousarray(array, np.uint8)
    magic = 0x800 + array.ndim if magic is None else magic
    raw = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()
    if gz:
        raw, path = gzip.compress(raw), path + ".gz"
    with open(path, "wb") as f:
        f.write(raw)
    return path


def write_mnist(folder, rng, n_train=30, n_test=12, gz=False, side=28):
    """MNIST-style IDX files; returns {split: (images (n, 1, H, W), labels)}."""
    os.makedirs(folder, exist_ok=True)
    out = {}
    for prefix, split, n in (("train", "train", n_train), ("t10k", "val", n_test)):
        images = rand_images(rng, n, 1, side, side)
        labels = rng.integers(0, 10, n).astype(np.uint8)
        write_idx(os.path.join(folder, f"{prefix}-images-idx3-ubyte"), images[:, 0], gz)
        write_idx(os.path.join(folder, f"{prefix}-labels-idx1-ubyte"), labels, gz)
        out[split] = (images, labels.astype(np.int64))
    return out


def write_cifar(folder, rng, per_batch=6, binary=False, protocol=2):
    """CIFAR-10 batches (python pickles or .bin); returns {split: (images, labels)}."""
    os.makedirs(folder, exist_ok=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    parts = {"train": [], "val": []}
    for name in names:
        images = rand_images(rng, per_batch, 3, 32, 32)
        labels = rng.integers(0, 10, per_batch)
        parts["val" if name == "test_batch" else "train"].append((images, labels))
        if binary:
            records = np.concatenate([labels.astype(np.uint8)[:, None],
                                      images.reshape(per_batch, -1)], axis=1)
            records.tofile(os.path.join(folder, name + ".bin"))
        else:
            batch = {"batch_label": "batch", "labels": [int(v) for v in labels],
                     "data": images.reshape(per_batch, -1), "filenames": ["x.png"] * per_batch}
            with open(os.path.join(folder, name), "wb") as f:
                pickle.dump(batch, f, protocol=protocol)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
             "truck"]
    if binary:
        with open(os.path.join(folder, "batches.meta.txt"), "w") as f:
            f.write("\n".join(names) + "\n")
    else:
        with open(os.path.join(folder, "batches.meta"), "wb") as f:
            pickle.dump({"label_names": names, "num_cases_per_batch": per_batch}, f, protocol=2)
    return {s: (np.concatenate([p[0] for p in v]), np.concatenate([p[1] for p in v]))
            for s, v in parts.items()}


def write_fer(path, rng, n_train=20, n_public=7, n_private=3, side=48):
    """A FER-2013 CSV; returns {split: (images, labels)} (PrivateTest rows are unused)."""
    rows, out = [], {}
    for usage, split, n in (("Training", "train", n_train), ("PublicTest", "val", n_public),
                            ("PrivateTest", None, n_private)):
        images = rand_images(rng, n, 1, side, side)
        labels = rng.integers(0, 7, n)
        for img, label in zip(images, labels):
            rows.append(f"{label},{' '.join(map(str, img.reshape(-1)))},{usage}")
        if split:
            out[split] = (images, labels)
    with open(path, "w") as f:
        f.write("emotion,pixels,Usage\n" + "\n".join(rows) + "\n")
    return out


def write_image_folder(root, rng, classes=("cat", "dog", "eel"), per_class=4, size=(9, 7),
                       mode="L", ext=".png", nested=True):
    """Class folders of images (size = (H, W)); returns [(path, label, array)] in the order
    the loader reads them (classes sorted, files sorted within each)."""
    from PIL import Image

    items = []
    for label, name in enumerate(sorted(classes)):
        for i in range(per_class):
            sub = os.path.join(root, name, "deep") if nested and i % 2 else os.path.join(root, name)
            os.makedirs(sub, exist_ok=True)
            shape = size if mode == "L" else size + (3,)
            arr = rng.integers(0, 256, shape, dtype=np.uint8)
            path = os.path.join(sub, f"img{i:02d}{ext}")
            Image.fromarray(arr, mode).save(path, **({"lossless": True} if ext == ".webp" else {}))
            items.append((path, label, arr))
    return items


def export_digits(root, val_every=5):
    """scikit-learn's 8x8 digits (1,797 images, shipped in its wheel) as PNG class folders
    DIR/train/<digit>/ and DIR/val/<digit>/ (every ``val_every``-th image to val), the grey
    levels 0..16 scaled to 0..255."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    for i, (img, label) in enumerate(zip(images, digits.target)):
        split = "val" if i % val_every == 0 else "train"
        folder = os.path.join(root, split, str(label))
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(img, "L").save(os.path.join(folder, f"{i:04d}.png"))
    return len(images)
