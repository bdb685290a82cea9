"""The synthetic shapes dataset: purity, balance, geometry, splits, cache, difficulty;
the generic cache and worker pool it uses; the script that pre-generates it."""
import dataclasses
import glob
import hashlib
import importlib.util
import math
import os
import struct
import zlib

import numpy as np
import pytest

from dptrain.data import DATASETS, SyntheticDataset, get_dataset
from dptrain.data import cache as C
from dptrain.data import parallel as P
from dptrain.data import synthetic as S

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "datasets", "make_synthetic.py")


@pytest.fixture(scope="module")
def script():
    """datasets/make_synthetic.py, imported as a module."""
    spec = importlib.util.spec_from_file_location("make_synthetic", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def thousand():
    return S.generate(123, np.arange(1000))


def test_shapes_and_dtypes(thousand):
    images, labels = thousand
    assert images.shape == (1000, 1, 48, 48) and images.dtype == np.uint8
    assert labels.shape == (1000,) and labels.dtype == np.int64
    assert labels.min() == 0 and labels.max() == S.NUM_CLASSES - 1
    assert images.std() > 10  # not blank


def test_subset_equals_slice(thousand):
    images, labels = thousand
    # Out of order, repeated, across chunk boundaries (chunks hold 256 images).
    picks = np.array([900, 5, 17, 255, 256, 5, 999])
    sub_images, sub_labels = S.generate(123, picks)
    np.testing.assert_array_equal(sub_images, images[picks])
    np.testing.assert_array_equal(sub_labels, labels[picks])


def test_deterministic_and_seed_dependent(thousand):
    again, again_labels = S.generate(123, np.arange(1000))
    np.testing.assert_array_equal(again, thousand[0])
    np.testing.assert_array_equal(again_labels, thousand[1])
    other, other_labels = S.generate(124, np.arange(1000))
    assert (other != thousand[0]).any(axis=(1, 2, 3)).all()  # every image differs
    assert (other_labels != thousand[1]).any()


# Python 3.12 warns on any fork of a threaded process (BLAS or CUDA threads of the test
# run); the workers call neither, so the warning does not apply to them.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_parallel_equals_serial(thousand):
    images, labels = S.generate_parallel(123, np.arange(1000), workers=2, chunk=300)
    np.testing.assert_array_equal(images, thousand[0])
    np.testing.assert_array_equal(labels, thousand[1])


def test_labels_balanced_and_mixed():
    labels = S.labels_for(7, np.arange(7 * 500))
    assert np.bincount(labels, minlength=7).tolist() == [500] * 7
    assert (labels != np.arange(len(labels)) % 7).mean() > 0.5  # not simply i % 7
    scattered = S.labels_for(7, np.random.default_rng(0).integers(0, 10**9, 7000))
    assert np.bincount(scattered, minlength=7).min() > 850


def test_bad_indices():
    with pytest.raises(ValueError):
        S.generate(0, [-1, 2])
    with pytest.raises(ValueError):
        S.generate(0, [[1, 2]])
    with pytest.raises(ValueError):
        S.generate(0, [0.5])


def _star_area(r_tip):
    """Shoelace area of a pentagram with tip radius r_tip."""
    r_in = r_tip * math.cos(2 * math.pi / 5) / math.cos(math.pi / 5)
    pts = [((r_tip if k % 2 == 0 else r_in) * math.cos(k * math.pi / 5),
            (r_tip if k % 2 == 0 else r_in) * math.sin(k * math.pi / 5)) for k in range(10)]
    return 0.5 * abs(sum(x0 * y1 - x1 * y0 for (x0, y0), (x1, y1) in zip(pts, pts[1:] + pts[:1])))


def _lens_area(r1, r2, d):
    """Area shared by two circles of radii r1, r2 whose centres are d apart."""
    a1 = r1 * r1 * math.acos((d * d + r1 * r1 - r2 * r2) / (2 * d * r1))
    a2 = r2 * r2 * math.acos((d * d + r2 * r2 - r1 * r1) / (2 * d * r2))
    return a1 + a2 - 0.5 * math.sqrt((-d + r1 + r2) * (d + r1 - r2) * (d - r1 + r2) * (d + r1 + r2))


def test_shape_areas_match_geometry():
    """With noise, distractors and gradient off, the antialiased ink of each class equals
    its shape's area, computed independently of the renderer."""
    R = 12.0
    spec = S.SyntheticSpec(radius=(R, R), margin=1.1, outline_prob=0.0, background=(0.5, 0.5),
                           gradient=0.0, contrast=(0.4, 0.4), noise=(0.0, 0.0), distractors=0)
    r = 0.85 * R
    expected = {
        "circle": math.pi * r * r,
        "square": (1.44 * R) ** 2,
        "triangle": 3 * math.sqrt(3) / 4 * R * R,
        "star": _star_area(1.05 * R),
        "plus": (2 * 1.8 * 0.56 - 0.56 ** 2) * R * R,
        "crescent": math.pi * r * r - _lens_area(r, 0.8 * r, 0.45 * r),
        "arrow": (1.15 * 0.28 + 0.75 * 0.5 - 0.10 * 0.28) * R * R,
    }
    images, labels = S.generate(5, np.arange(70), spec)
    x = images[:, 0].astype(np.float64)
    background = 128.0  # 0.5 * 255, rounded
    ink = np.abs(x - background).sum(axis=(1, 2)) / 102.0  # full ink: |26 or 230 - 128|
    for c, name in enumerate(S.CLASSES):
        got = ink[labels == c]
        assert len(got) >= 5
        np.testing.assert_allclose(got, expected[name], rtol=0.02, err_msg=name)
    # An outlined shape puts ink along its boundary only: far less than the filled area.
    outlined = dataclasses.replace(spec, outline_prob=1.0, stroke=(2.0, 2.0))
    o_images, o_labels = S.generate(5, np.arange(70), outlined)
    o_ink = np.abs(o_images[:, 0].astype(np.float64) - background).sum(axis=(1, 2)) / 102.0
    circle = o_labels == 0
    np.testing.assert_allclose(o_ink[circle], 2 * math.pi * r * 2.0, rtol=0.05)


def test_spec_key_and_validation():
    assert S.SyntheticSpec().key() == S.SyntheticSpec(radius=[8, 20]).key()
    assert S.SyntheticSpec().key() != S.SyntheticSpec(noise=(0.0, 0.1)).key()
    with pytest.raises(ValueError):
        S.SyntheticSpec(noise=(0.2, 0.1))
    with pytest.raises(ValueError):
        S.SyntheticSpec(distractors=-1)


def test_splits_disjoint_and_no_duplicates():
    train = SyntheticDataset("train", 3000, seed=0, cache=False)
    val = SyntheticDataset("val", 3000, seed=0, cache=False)
    rows = lambda d: {img.tobytes() for img in d.images}
    train_rows, val_rows = rows(train), rows(val)
    assert len(train_rows) == 3000 and len(val_rows) == 3000
    assert not train_rows & val_rows
    assert train.stream_seed != val.stream_seed


def test_dataset_attributes_and_subset():
    data = SyntheticDataset("val", 500, seed=3, cache=False)
    assert len(data) == 500 and data.num_classes == 7 and data.image_shape == (1, 48, 48)
    assert data.images.shape == (500, 1, 48, 48) and data.labels.dtype == np.int64
    pixels = data.images / 255.0
    assert abs(pixels.mean() - data.mean) < 0.05 and abs(pixels.std() - data.std) < 0.05
    picks = [499, 0, 250]
    sub = data.subset(picks)
    np.testing.assert_array_equal(sub.images, data.images[picks])
    np.testing.assert_array_equal(sub.labels, data.labels[picks])
    direct = SyntheticDataset("val", 500, seed=3, indices=picks)
    np.testing.assert_array_equal(direct.images, sub.images)
    with pytest.raises(ValueError):
        SyntheticDataset("val", 500, indices=[500])
    with pytest.raises(ValueError):
        SyntheticDataset("test", 10, cache=False)
    with pytest.raises(ValueError):
        SyntheticDataset("train", 0, cache=False)


def test_default_normalization_is_the_rendered_one():
    """The default spec's (mean, std) is a constant, so no run renders its sample; it must
    stay what the sample gives (a change to the renderer changes it). Other specs render."""
    assert S.normalization() == S.rendered_normalization(S.DEFAULT_SPEC)
    plain = dataclasses.replace(S.DEFAULT_SPEC, distractors=0)
    assert S.normalization(plain) == S.rendered_normalization(plain)


def test_cache_round_trip(tmp_path):
    first = SyntheticDataset("train", 600, seed=1, cache_dir=str(tmp_path))
    assert not first.from_cache
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 3 and all(f.endswith((".npy", "-entry.json")) for f in files)  # no temporaries
    again = SyntheticDataset("train", 600, seed=1, cache_dir=str(tmp_path))
    assert again.from_cache
    np.testing.assert_array_equal(again.images, first.images)
    np.testing.assert_array_equal(again.labels, first.labels)
    # A bigger cached set serves a smaller request: images depend only on their index.
    smaller = SyntheticDataset("train", 100, seed=1, cache_dir=str(tmp_path))
    assert smaller.from_cache
    np.testing.assert_array_equal(smaller.images, first.images[:100])
    # Another seed, split or spec is another set.
    assert not SyntheticDataset("val", 100, seed=1, cache_dir=str(tmp_path)).from_cache
    assert not SyntheticDataset("train", 100, seed=2, cache_dir=str(tmp_path)).from_cache
    harder = S.SyntheticSpec(noise=(0.1, 0.2))
    assert not SyntheticDataset("train", 100, seed=1, cache_dir=str(tmp_path),
                                spec=harder).from_cache


def test_cache_ignores_incomplete_writes(tmp_path):
    data = SyntheticDataset("train", 50, seed=4, cache_dir=str(tmp_path))
    images_file = glob.glob(str(tmp_path / "*-images.npy"))[0]
    os.remove(images_file)  # as if killed between the two renames
    (tmp_path / ".tmp-abc.npy").write_bytes(b"partial")  # a killed writer's leftover
    rebuilt = SyntheticDataset("train", 50, seed=4, cache_dir=str(tmp_path))
    assert not rebuilt.from_cache
    np.testing.assert_array_equal(rebuilt.images, data.images)
    with open(images_file, "wb") as f:  # truncated or foreign content is not trusted
        f.write(b"garbage")
    assert not SyntheticDataset("train", 50, seed=4, cache_dir=str(tmp_path)).from_cache


def test_cache_names_and_labels_are_stable(tmp_path):
    """Existing caches keep working: the entry names and the integer-hashed labels of a
    seed are pinned (the pixels use float maths whose last bits may vary by platform)."""
    SyntheticDataset("train", 40, seed=2, cache_dir=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["synthetic-f51919fea2-seed2-train-n40-entry.json",
                                            "synthetic-f51919fea2-seed2-train-n40-images.npy",
                                            "synthetic-f51919fea2-seed2-train-n40-labels.npy"]
    labels = S.labels_for(123, np.arange(700))
    assert hashlib.sha256(labels.tobytes()).hexdigest()[:16] == "09dce121071370a2"


def test_generic_cache(tmp_path):
    d = str(tmp_path)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (30, 3, 4, 5), dtype=np.uint8)
    labels = rng.integers(0, 10, 30).astype(np.int64)
    assert C.load(d, "toy", 30, (3, 4, 5)) is None
    assert C.store(d, "toy", images, labels)
    assert C.cached_sizes(d, "toy") == [30] and C.cached_sizes(d, "to") == []
    got_images, got_labels = C.load(d, "toy", 30, (3, 4, 5))
    assert isinstance(got_images, np.memmap) and not got_images.flags.writeable
    np.testing.assert_array_equal(got_images, images)
    np.testing.assert_array_equal(got_labels, labels)
    prefix_images, _ = C.load(d, "toy", 12, (3, 4, 5))  # a larger entry serves its prefix
    np.testing.assert_array_equal(prefix_images, images[:12])
    assert C.load(d, "toy", 12, (3, 4, 5), prefix=False) is None  # ... unless told not to
    assert C.load(d, "toy", 31, (3, 4, 5)) is None
    assert C.load(d, "toy", 30, (3, 5, 4)) is None  # another image shape is another set
    # The name is matched literally, glob characters included.
    assert C.store(d, "odd[1]", images[:5], labels[:5])
    assert C.load(d, "odd[1]", 5, (3, 4, 5)) is not None and C.load(d, "odd1", 5, (3, 4, 5)) is None


def test_generic_cache_unwritable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")  # a file where the directory should be
    with pytest.warns(UserWarning, match="could not cache the dataset toy"):
        assert not C.store(str(blocker / "sub"), "toy", np.zeros((1, 1, 1, 1), np.uint8),
                           np.zeros(1, np.int64))


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_render_parallel_generic():
    """Any row renderer (a closure: it reaches the workers through fork) gives the rows a
    single process gives, in order, with progress up to the total."""
    offset = 7

    def render(idx, progress=None):
        rows = ((idx[:, None] * 31 + np.arange(6) + offset) % 256).astype(np.uint8)
        if progress is not None:
            progress(len(idx), len(idx))
        return rows.reshape(len(idx), 1, 2, 3)

    idx = np.arange(1000, dtype=np.int64)[::-1].copy()
    seen = []
    images = P.render_parallel(render, idx, (1, 2, 3), workers=3, chunk=128,
                               progress=lambda done, total: seen.append((done, total)))
    np.testing.assert_array_equal(images, render(idx))
    assert seen[-1] == (1000, 1000) and len(seen) == 8  # one call per span
    serial = P.render_parallel(render, idx, (1, 2, 3), workers=1)
    np.testing.assert_array_equal(serial, render(idx))
    assert P.auto_workers(10) == 1 and P.default_workers() >= 1


def test_default_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DPTRAIN_CACHE", str(tmp_path))
    SyntheticDataset("val", 20, seed=9)
    assert len(glob.glob(str(tmp_path / "synthetic-*-seed9-val-n20-*.npy"))) == 2


def test_registry():
    assert {"synthetic", "imagefolder", "mnist", "cifar10", "fer2013", "packed"} <= set(DATASETS)
    data = get_dataset("synthetic", "val", 30, seed=0, cache=False)
    assert isinstance(data, SyntheticDataset) and len(data) == 30
    with pytest.raises(ValueError, match="unknown dataset 'nope'; choose one of .*synthetic"):
        get_dataset("nope", "train", 10)


def test_png_writer_and_preview(tmp_path, script):
    gray = np.arange(35, dtype=np.uint8).reshape(5, 7) * 7
    path = tmp_path / "g.png"
    script.write_png(str(path), gray)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (7, 5)
    idat_len = struct.unpack(">I", data[33:37])[0]
    raw = zlib.decompress(data[41:41 + idat_len])
    rows = np.frombuffer(raw, np.uint8).reshape(5, 8)
    assert (rows[:, 0] == 0).all()
    np.testing.assert_array_equal(rows[:, 1:], gray)
    grid = script.preview(str(tmp_path / "p.png"), per_class=3, scale=1)
    assert grid.shape == (7 * 50 + 2, 3 * 50 + 2) and (tmp_path / "p.png").stat().st_size > 0
    # Row c holds images of class c, in the order they come in the training stream.
    images, labels = S.generate(S.split_seed(0, "train"), np.arange(3 * 7 * 3))
    for c in range(7):
        first = images[np.flatnonzero(labels == c)[0], 0]
        np.testing.assert_array_equal(grid[2 + c * 50: 2 + c * 50 + 48, 2:50], first)


def test_not_linearly_separable():
    """Softmax regression on raw pixels stays far from a CNN's >90%: the set needs
    spatial features."""
    train = SyntheticDataset("train", 3000, seed=0, cache=False)
    val = SyntheticDataset("val", 1000, seed=0, cache=False)

    def features(d):
        return ((d.images.reshape(len(d), -1) / 255.0 - d.mean) / d.std).astype(np.float32)

    x, y, xv = features(train), train.labels, features(val)
    w = np.zeros((x.shape[1], 7), np.float32)
    b = np.zeros(7, np.float32)
    m, v = np.zeros_like(w), np.zeros_like(w)
    onehot = np.eye(7, dtype=np.float32)[y]
    for t in range(1, 151):  # Adam on the full batch: fits the training set well
        z = x @ w + b
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        g = (p - onehot) / len(x)
        gw = x.T @ g
        m = 0.9 * m + 0.1 * gw
        v = 0.999 * v + 0.001 * gw * gw
        w -= 0.01 * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
        b -= 0.1 * g.sum(0)
    train_acc = ((x @ w + b).argmax(1) == y).mean()
    val_acc = ((xv @ w + b).argmax(1) == val.labels).mean()
    assert train_acc > 0.3  # the optimiser did its job: it can memorise
    assert val_acc < 0.6


def test_make_synthetic_cli(tmp_path, capsys, script):
    cli = script
    png = tmp_path / "shapes.png"
    args = ["--train", "300", "--val", "70", "--cache-dir", str(tmp_path / "c"),
            "--workers", "1", "--preview", str(png)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "train: 300 images generated and cached" in out and png.exists()
    assert len(os.listdir(tmp_path / "c")) == 6  # two entries of three files
    cli.main(args[:-2])
    assert "loaded from the cache" in capsys.readouterr().out
