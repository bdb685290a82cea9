"""Datasets read from files: every format's pixels, labels and splits survive loading and
`data pack` exactly; bad files end in one line naming the file, exit code 2."""
import os
import pickle

import numpy as np
import pytest
from data_fixtures import (write_cifar, write_fer, write_idx, write_image_folder, write_mnist)

from dptrain.cli import main as cli_main
from dptrain.data import get_dataset
from dptrain.data.formats import imagefolder
from dptrain.data.formats.common import channel_stats


@pytest.fixture
def rng():
    return np.random.default_rng(7)


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "cache")


def load(name, data_dir, cache_dir, **options):
    return (get_dataset(name, "train", None, 0, cache_dir, data_dir=str(data_dir), **options),
            get_dataset(name, "val", None, 0, cache_dir, data_dir=str(data_dir), **options))


def assert_split(data, images, labels, class_names=None):
    assert data.images.dtype == np.uint8 and data.labels.dtype == np.int64
    np.testing.assert_array_equal(np.asarray(data.images), images)
    np.testing.assert_array_equal(data.labels, labels)
    assert data.image_shape == images.shape[1:]
    if class_names is not None:
        assert data.class_names == tuple(class_names) and data.num_classes == len(class_names)


def assert_stats(train, val):
    mean, std = channel_stats(np.asarray(train.images))
    x = np.asarray(train.images, np.float64) / 255.0
    np.testing.assert_allclose(mean, x.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(std, x.std(axis=(0, 2, 3)), rtol=1e-9)
    assert train.mean == val.mean == tuple(mean) and train.std == val.std == tuple(std)


def run_cli(capsys, *args):
    code = cli_main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_usage_error(capsys, args, *names):
    code, _, err = run_cli(capsys, *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for name in names:
        assert str(name) in lines[0], lines[0]
    return lines[0]


def train_args(dataset, data_dir, cache_dir, *more):
    return ["train", "--device", "cpu", "--dataset", dataset, "--data-dir", data_dir,
            "--cache-dir", cache_dir, "--no-progress", "--max-steps", "1", "--batch-size", "2",
            *more]


# ----------------------------------------------------------------------------- MNIST


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx(tmp_path, rng, cache, gz):
    truth = write_mnist(str(tmp_path / "m"), rng, gz=gz)
    train, val = load("mnist", tmp_path / "m", cache)
    assert_split(train, *truth["train"], [str(i) for i in range(10)])
    assert_split(val, *truth["val"])
    assert_stats(train, val)
    # --channels 3 repeats the grey plane; --image-size resizes
    train3 = get_dataset("mnist", "train", None, 0, cache, data_dir=str(tmp_path / "m"),
                         channels=3, image_size=14)
    assert train3.image_shape == (3, 14, 14)
    assert (train3.images[:, 0] == train3.images[:, 2]).all()


def test_mnist_second_run_reads_the_cache(tmp_path, rng, cache, monkeypatch):
    from dptrain.data.formats import mnist

    truth = write_mnist(str(tmp_path / "m"), rng)
    load("mnist", tmp_path / "m", cache)

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded again")

    monkeypatch.setattr(mnist, "decode", no_decode)
    train, _ = load("mnist", tmp_path / "m", cache)
    assert_split(train, *truth["train"])
    # a changed source file (size, mtime) is another key: decoded again
    path = tmp_path / "m" / "train-labels-idx1-ubyte"
    os.utime(path, ns=(1, 1))
    with pytest.raises(AssertionError, match="decoded again"):
        load("mnist", tmp_path / "m", cache)


def test_mnist_bad_files(tmp_path, rng, cache, capsys):
    d = tmp_path / "m"
    write_mnist(str(d), rng)
    images = d / "train-images-idx3-ubyte"
    labels = d / "train-labels-idx1-ubyte"
    good_images, good_labels = images.read_bytes(), labels.read_bytes()
    args = train_args("mnist", d, cache)

    write_idx(str(images), rng.integers(0, 256, (30, 28, 28)), magic=0x0803 + 0x10000)
    assert "wrong magic" in assert_usage_error(capsys, args, images)
    images.write_bytes(good_images[:-5])
    assert "truncated" in assert_usage_error(capsys, args, images)
    images.write_bytes(b"")
    assert_usage_error(capsys, args, images)
    images.write_bytes(b"\x1f\x8b" + b"not really gzip")
    assert "gzip" in assert_usage_error(capsys, args, images)
    images.write_bytes(good_images)
    bad = bytearray(good_labels)
    bad[8 + 5] = 12
    labels.write_bytes(bytes(bad))
    line = assert_usage_error(capsys, args, labels)
    assert "label 12 at record 5 is out of range [0, 10)" in line
    labels.write_bytes(good_labels)
    os.remove(d / "t10k-labels-idx1-ubyte")
    assert_usage_error(capsys, args, "t10k-labels-idx1-ubyte")


# ----------------------------------------------------------------------------- CIFAR-10


@pytest.mark.parametrize("binary,protocol", [(False, 2), (False, 4), (False, 5), (True, None)])
def test_cifar10(tmp_path, rng, cache, binary, protocol):
    d = tmp_path / ("cifar-10-batches-bin" if binary else "cifar-10-batches-py")
    truth = write_cifar(str(d), rng, binary=binary, protocol=protocol or 2)
    train, val = load("cifar10", tmp_path, cache)  # the parent folder also works
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
             "truck"]
    assert_split(train, *truth["train"], names)
    assert_split(val, *truth["val"], names)
    assert train.image_shape == (3, 32, 32) and len(train.mean) == 3
    assert_stats(train, val)
    gray = get_dataset("cifar10", "train", None, 0, cache, data_dir=str(tmp_path), channels=1)
    from PIL import Image
    img = truth["train"][0][0].transpose(1, 2, 0)
    np.testing.assert_array_equal(gray.images[0, 0], np.asarray(Image.fromarray(img).convert("L")))


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned-by-pickle",))


def test_cifar10_refuses_foreign_pickles(tmp_path, rng, cache, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "c"
    write_cifar(str(d), rng)
    batch = d / "data_batch_3"
    batch.write_bytes(pickle.dumps({"data": _Evil(), "labels": [0]}))
    line = assert_usage_error(capsys, train_args("cifar10", d, cache), batch)
    assert "refusing the global" in line and not (tmp_path / "pwned-by-pickle").exists()
    batch.write_bytes(pickle.dumps({"data": np.array([None, 1], dtype=object), "labels": [0]}))
    assert "refusing dtype" in assert_usage_error(capsys, train_args("cifar10", d, cache), batch)
    batch.write_bytes(pickle.dumps({"data": np.zeros((2, 100), np.uint8), "labels": [0, 1]}))
    assert "(n, 3072)" in assert_usage_error(capsys, train_args("cifar10", d, cache), batch)
    batch.write_bytes(b"")
    assert_usage_error(capsys, train_args("cifar10", d, cache), batch)


def test_cifar10_binary_bad_files(tmp_path, rng, cache, capsys):
    d = tmp_path / "c"
    write_cifar(str(d), rng, binary=True)
    batch = d / "data_batch_2.bin"
    raw = bytearray(batch.read_bytes())
    batch.write_bytes(bytes(raw[:-1]))
    assert "truncated" in assert_usage_error(capsys, train_args("cifar10", d, cache), batch)
    raw[3073 * 2] = 10  # the third record's label
    batch.write_bytes(bytes(raw))
    line = assert_usage_error(capsys, train_args("cifar10", d, cache), batch)
    assert "label 10 at record 2" in line


# ----------------------------------------------------------------------------- FER-2013


def test_fer2013(tmp_path, rng, cache):
    truth = write_fer(str(tmp_path / "fer2013.csv"), rng)
    for where in (tmp_path, tmp_path / "fer2013.csv"):  # the folder or the file
        train, val = load("fer2013", where, cache)
        assert_split(train, *truth["train"], ["angry", "disgust", "fear", "happy", "sad",
                                             "surprise", "neutral"])
        assert_split(val, *truth["val"])
        assert_stats(train, val)


def test_fer2013_bad_rows(tmp_path, rng, cache, capsys):
    path = tmp_path / "fer2013.csv"
    write_fer(str(path), rng)
    lines = path.read_text().splitlines()
    good = list(lines)
    lines[3] = "9" + lines[3][1:]
    path.write_text("\n".join(lines))
    line = assert_usage_error(capsys, train_args("fer2013", path, cache), path)
    assert "line 4: label 9 is out of range [0, 7)" in line
    lines = list(good)
    lines[2] = lines[2].replace(" ", " 1 ", 1)
    path.write_text("\n".join(lines))
    assert "line 3: 2305 pixels" in assert_usage_error(capsys, train_args("fer2013", path, cache),
                                                       path)
    path.write_text("")
    assert_usage_error(capsys, train_args("fer2013", path, cache), path)


# ----------------------------------------------------------------------------- image folders


@pytest.mark.parametrize("mode,ext", [("L", ".png"), ("RGB", ".png"), ("RGB", ".bmp"),
                                      ("L", ".webp")])
def test_image_folder_lossless(tmp_path, rng, cache, mode, ext):
    items = write_image_folder(str(tmp_path / "d"), rng, mode=mode, ext=ext)
    data = get_dataset("imagefolder", "train", None, 0, cache, data_dir=str(tmp_path / "d"),
                       val_fraction=0.25)
    val = get_dataset("imagefolder", "val", None, 0, cache, data_dir=str(tmp_path / "d"),
                      val_fraction=0.25)
    assert data.class_names == ("cat", "dog", "eel")
    assert len(data) == 9 and len(val) == 3
    arrays = [a if mode == "L" else a.transpose(2, 0, 1) for _, _, a in items]
    want = np.stack(arrays).reshape(len(items), 1 if mode == "L" else 3, 9, 7)
    labels = np.array([label for _, label, _ in items])
    everything = np.concatenate([data.images, val.images])
    rows = {row.tobytes(): i for i, row in enumerate(want)}
    order = [rows[row.tobytes()] for row in everything]  # every image exactly once
    assert sorted(order) == list(range(len(items)))
    np.testing.assert_array_equal(np.concatenate([data.labels, val.labels]), labels[order])
    assert_stats(data, val)


def test_image_folder_jpeg_and_mixed(tmp_path, rng, cache, capsys):
    from PIL import Image

    root = tmp_path / "d"
    write_image_folder(str(root / "train"), rng, mode="RGB", ext=".jpg", per_class=2)
    write_image_folder(str(root / "val"), rng, mode="L", ext=".png", per_class=1)
    train, val = load("imagefolder", root, cache)
    assert train.image_shape == (3, 9, 7) and len(train) == 6 and len(val) == 3
    first = root / "train" / "cat" / "img00.jpg"  # folders sorted by path, as torchvision
    np.testing.assert_array_equal(train.images[0].transpose(1, 2, 0),
                                  np.asarray(Image.open(first).convert("RGB")))
    assert (val.images[:, 0] == val.images[:, 1]).all()  # grey images in an RGB dataset
    # another size: an error naming the file unless --image-size
    odd = root / "train" / "dog" / "odd.png"
    Image.fromarray(rng.integers(0, 256, (5, 5), dtype=np.uint8)).save(odd)
    line = assert_usage_error(capsys, train_args("imagefolder", root, cache), odd)
    assert "--image-size" in line
    sized = get_dataset("imagefolder", "train", None, 0, cache, data_dir=str(root),
                        image_size=6, channels=1)
    assert sized.image_shape == (1, 6, 6) and len(sized) == 7
    want = np.asarray(Image.open(first).convert("L").resize((6, 6), Image.BILINEAR))
    np.testing.assert_array_equal(sized.images[0, 0], want)


def test_image_folder_bad_files(tmp_path, rng, cache, capsys, monkeypatch):
    root = tmp_path / "d"
    items = write_image_folder(str(root), rng, per_class=3, nested=False)
    args = train_args("imagefolder", root, cache)
    empty = root / "dog" / "zzz-empty.png"
    empty.write_bytes(b"")
    assert "empty file" in assert_usage_error(capsys, args, empty)
    empty.unlink()
    text = root / "eel" / "notes.jpg"
    text.write_text("not an image")
    assert_usage_error(capsys, args, text)
    text.unlink()
    good = open(items[1][0], "rb").read()
    truncated = root / "cat" / "truncated.png"
    truncated.write_bytes(good[: len(good) // 2])
    assert_usage_error(capsys, args, truncated)
    # --on-bad-image skip: left out, counted and reported
    (root / "eel" / "bad.gif").write_bytes(b"GIF89a garbage")
    data = get_dataset("imagefolder", "train", None, 0, cache, data_dir=str(root),
                       on_bad_image="skip", val_fraction=0.2)
    err = capsys.readouterr().err
    assert "skipped 2 unreadable image(s)" in err and str(truncated) in err
    val = get_dataset("imagefolder", "val", None, 0, cache, data_dir=str(root),
                      on_bad_image="skip", val_fraction=0.2)
    assert len(data) + len(val) == 9
    truncated.unlink()
    (root / "eel" / "bad.gif").unlink()
    # a decompression bomb is refused from its header
    monkeypatch.setattr(imagefolder, "MAX_PIXELS", 62)
    line = assert_usage_error(capsys, args, items[0][0])
    assert "exceeds the limit" in line
    monkeypatch.undo()
    # an empty class folder, no class folders at all
    (root / "fox").mkdir()
    (root / "fox" / "readme.txt").write_text("no images here")
    assert "empty class folder" in assert_usage_error(capsys, args, root / "fox")
    empty_root = tmp_path / "nothing"
    empty_root.mkdir()
    assert "no class folders" in assert_usage_error(
        capsys, train_args("imagefolder", empty_root, cache), empty_root)


def test_val_fraction_split_is_deterministic_and_seeded(tmp_path, rng, cache):
    write_image_folder(str(tmp_path / "d"), rng, per_class=10, nested=False)

    def split(seed, fraction=0.3):
        return [get_dataset("imagefolder", s, None, seed, cache, data_dir=str(tmp_path / "d"),
                            val_fraction=fraction) for s in ("train", "val")]

    a, b = split(0), split(0)
    assert len(a[0]) == 21 and len(a[1]) == 9
    np.testing.assert_array_equal(a[1].images, b[1].images)
    c = split(1)
    assert not np.array_equal(a[1].images, c[1].images)
    subset = get_dataset("imagefolder", "train", 5, 0, cache, data_dir=str(tmp_path / "d"),
                         val_fraction=0.3)
    assert len(subset) == 5
    assert {r.tobytes() for r in subset.images} <= {r.tobytes() for r in a[0].images}


def test_missing_data_dir_and_bad_options(tmp_path, capsys):
    assert "--data-dir" in assert_usage_error(
        capsys, ["train", "--device", "cpu", "--dataset", "mnist"])
    assert_usage_error(capsys, ["train", "--device", "cpu", "--dataset", "mnist", "--data-dir",
                                tmp_path / "nope"], tmp_path / "nope")
    assert "--val-fraction" in assert_usage_error(
        capsys, ["train", "--device", "cpu", "--dataset", "imagefolder", "--data-dir", tmp_path,
                 "--val-fraction", "1.5"])


# ----------------------------------------------------------------------------- packing


@pytest.mark.parametrize("kind", ["mnist", "cifar10", "fer2013", "imagefolder"])
def test_pack_round_trip(tmp_path, rng, cache, capsys, kind):
    src = tmp_path / "src"
    if kind == "mnist":
        write_mnist(str(src), rng, gz=True)
    elif kind == "cifar10":
        write_cifar(str(src), rng)
    elif kind == "fer2013":
        src.mkdir()
        write_fer(str(src / "fer2013.csv"), rng)
    else:
        write_image_folder(str(src), rng, mode="RGB", per_class=5)
    out = tmp_path / "packed"
    code, text, err = run_cli(capsys, "data", "pack", src, out, "--cache-dir", cache)
    assert code == 0, err
    assert f"packed {kind}" in text
    before = load(kind, src, cache)
    after = load("packed", out, cache)
    for a, b in zip(before, after):
        assert_split(b, np.asarray(a.images), a.labels, a.class_names)
        assert (b.mean, b.std) == (a.mean, a.std)
    code, text, err = run_cli(capsys, "data", "info", out, "--verify")
    assert code == 0 and "SHA-256 verified" in text and f"{len(before[0])} images" in text


def test_packed_damage_is_reported(tmp_path, capsys, cache):
    out = tmp_path / "p"
    code, _, err = run_cli(capsys, "data", "synth", "--images", 50, "--val-images", 10, out)
    assert code == 0, err
    train, val = load("packed", out, cache)
    assert len(train) == 50 and len(val) == 10 and train.image_shape == (1, 48, 48)
    from dptrain.data.synthetic import generate, split_seed
    images, labels = generate(split_seed(0, "train"), np.arange(50))
    np.testing.assert_array_equal(train.images, images)
    np.testing.assert_array_equal(train.labels, labels)
    target = out / "train-images.npy"
    raw = bytearray(target.read_bytes())
    raw[-1] ^= 0xFF
    target.write_bytes(bytes(raw))
    assert "SHA-256" in assert_usage_error(capsys, train_args("packed", out, cache), target)
    target.write_bytes(bytes(raw[:-10]))
    assert "truncated" in assert_usage_error(capsys, train_args("packed", out, cache), target)
    (out / "header.json").write_text("{")
    assert_usage_error(capsys, train_args("packed", out, cache), out / "header.json")
    code, _, err = run_cli(capsys, "data", "pack", tmp_path / "missing", tmp_path / "o2")
    assert code == 2 and str(tmp_path / "missing") in err
