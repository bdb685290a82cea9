"""`data pack --max-size S`: image folders of any sizes decoded by processes into centre
squares, the same store as one process, written atomically; bad inputs refused in one line
with nothing written; training reads the store and random-resized-crops it."""
import json
import os

import numpy as np
import pytest

from dptrain.cli import main as cli_main
from dptrain.cli.data import CHUNK
from dptrain.data.formats import imagefolder, packed

Image = pytest.importorskip("PIL.Image")


def run_cli(capsys, *args):
    try:
        code = cli_main([str(a) for a in args])
    except SystemExit as exc:  # argparse's errors
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def folder(tmp_path, per_class=40, bad=False, val=False):
    """Two classes of RGB images of random sizes, PNG and JPEG; optionally a bad file and a
    val/ split."""
    rng = np.random.default_rng(0)
    root = tmp_path / "src"
    for split in (["train", "val"] if val else [""]):
        for name in ("cat", "dog"):
            d = root / split / name
            d.mkdir(parents=True)
            for i in range(per_class if split != "val" else 5):
                h, w = rng.integers(12, 70, 2)
                ext = "jpg" if i % 2 else "png"
                Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8)).save(d / f"{i:03}.{ext}")
    if bad:
        (root / ("train" if val else "") / "dog" / "zz.jpg").write_bytes(b"not an image")
    return root


def entries(path):
    return sorted(os.listdir(path))


def test_read_square_keeps_the_centre_of_the_resized_shorter_side(tmp_path):
    img = np.zeros((20, 40, 3), np.uint8)
    img[:, 10:30] = 255  # the centre 20 columns white: the centre square after resizing
    Image.fromarray(img).save(tmp_path / "a.png")
    square = imagefolder.read_square(str(tmp_path / "a.png"), 3, 10)
    assert square.shape == (3, 10, 10)
    assert square[:, :, 1:-1].min() == 255  # the black sides only blur into the edge columns
    np.testing.assert_array_equal(square, square[:, :, ::-1])
    small = imagefolder.read_square(str(tmp_path / "a.png"), 1, 40)  # upscaled too
    assert small.shape == (1, 40, 40)


def test_processes_equal_one_process_bitwise(tmp_path, capsys):
    src = folder(tmp_path, per_class=CHUNK + 7, bad=True)  # chunks with a skipped image
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        code, stdout, err = run_cli(capsys, "data", "pack", src, out, "--max-size", 24,
                                    "--workers", workers, "--on-bad-image", "skip")
        assert code == 0, err
        assert "1 skipped" in stdout and "ETA" in err and "zz.jpg" in err
        outs.append(out)
    for name in entries(outs[0]):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    images, labels, header = packed.load_split(str(outs[0]), "train")
    assert images.shape == (2 * (CHUNK + 7), 3, 24, 24)
    assert header["stored"] == {"layout": "center-square", "max_size": 24}
    # rows in the folder's order, each the reference decode of its file
    _, items = imagefolder.scan(str(src))
    items = [(p, lbl) for p, lbl in items if not p.endswith("zz.jpg")]
    np.testing.assert_array_equal(labels, [lbl for _, lbl in items])
    for row in (0, CHUNK, len(items) - 1):
        np.testing.assert_array_equal(images[row], imagefolder.read_square(items[row][0], 3, 24))
    x = np.asarray(images, np.float64) / 255
    np.testing.assert_allclose(header["mean"], x.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(header["std"], x.std(axis=(0, 2, 3)), rtol=1e-9)
    assert entries(tmp_path) == ["src", "w1", "w2"]  # no temporary folders left


def test_val_folder_and_info(tmp_path, capsys):
    src = folder(tmp_path, per_class=6, val=True)
    out = tmp_path / "out"
    assert run_cli(capsys, "data", "pack", src, out, "--max-size", 16, "--workers", 2)[0] == 0
    header = json.loads((out / "header.json").read_text())
    assert header["splits"]["train"]["count"] == 12 and header["splits"]["val"]["count"] == 10
    code, stdout, _ = run_cli(capsys, "data", "info", out)
    assert code == 0
    assert "3x16x16" in stdout and "shorter side resized to 16" in stdout
    assert "classes: 2" in stdout and "bytes:" in stdout and "22 images" in stdout


def test_a_bad_image_leaves_nothing_behind(tmp_path, capsys):
    src = folder(tmp_path, per_class=5, bad=True)
    code, _, err = run_cli(capsys, "data", "pack", src, tmp_path / "out", "--max-size", 8)
    assert code == 2 and "zz.jpg" in err.strip().splitlines()[-1]
    assert entries(tmp_path) == ["src"]


def test_an_interrupted_pack_leaves_the_old_store(tmp_path, capsys, monkeypatch):
    src = folder(tmp_path, per_class=5)
    out = tmp_path / "out"
    assert run_cli(capsys, "data", "pack", src, out, "--max-size", 8, "--workers", 1)[0] == 0
    before = {n: (out / n).read_bytes() for n in entries(out)}

    def interrupted(job):
        raise KeyboardInterrupt
    monkeypatch.setattr(imagefolder, "decode_squares", interrupted)
    code, _, err = run_cli(capsys, "data", "pack", src, out, "--max-size", 12, "--workers", 1,
                           "--overwrite")
    assert code != 0 and "interrupted" in err
    assert entries(tmp_path) == ["out", "src"]
    assert {n: (out / n).read_bytes() for n in entries(out)} == before


@pytest.mark.parametrize("args,names", [
    (["--max-size", "0"], ["--max-size", "0"]),
    (["--max-size", "x"], ["--max-size", "'x'"]),
    (["--max-size", "5000"], ["--max-size 5000"]),
    (["--max-size", "8", "--image-size", "8"], ["--max-size 8", "--image-size 8"]),
    (["--workers", "2"], ["--workers 2"]),
    (["--max-size", "8", "--workers", "0"], ["--workers", "0"]),
])
def test_bad_options_are_refused_in_one_line(tmp_path, capsys, args, names):
    src = folder(tmp_path, per_class=2)
    code, _, err = run_cli(capsys, "data", "pack", src, tmp_path / "out", *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert all(n in lines[0] for n in names), lines[0]
    assert entries(tmp_path) == ["src"]


def test_max_size_needs_an_image_folder(tmp_path, capsys):
    from data_fixtures import write_mnist

    write_mnist(tmp_path / "mnist", np.random.default_rng(1))
    code, _, err = run_cli(capsys, "data", "pack", tmp_path / "mnist", tmp_path / "out",
                           "--max-size", "8")
    assert code == 2 and "is mnist" in err and not (tmp_path / "out").exists()


def test_training_random_resized_crops_the_store(tmp_path, capsys):
    src = folder(tmp_path, per_class=12)
    out = tmp_path / "out"
    assert run_cli(capsys, "data", "pack", src, out, "--max-size", 20, "--workers", 1)[0] == 0
    code, stdout, err = run_cli(capsys, "train", "--device", "cpu", "--dataset", "packed",
                                "--data-dir", out, "--cache-dir", tmp_path / "cache",
                                "--no-progress", "--max-steps", 2, "--batch-size", 4,
                                "--augment", "random-resized-crop", "--image-size", 12,
                                "--log-dir", tmp_path / "log", "--save", tmp_path / "w.npz")
    assert code == 0, err
    assert "done: 2 steps" in stdout
    # `eval` of those weights sees the run's own view: resize + centre crop to 12
    summary = json.loads((tmp_path / "log" / "summary.json").read_text())
    code, _, err = run_cli(capsys, "eval", "--load", tmp_path / "w.npz", "--device", "cpu",
                           "--cache-dir", tmp_path / "cache", "--out", tmp_path / "e.json")
    assert code == 0, err
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["images"] == 2 and result["accuracy"] == summary["val_accuracy"]


@pytest.mark.parametrize("args,names", [
    (["--augment", "zoom"], ["--augment", "'zoom'"]),
    (["--rrc-scale", "0.5,0.2"], ["--rrc-scale", "'0.5,0.2'"]),
    (["--rrc-scale", "0,1"], ["--rrc-scale", "'0,1'"]),
    (["--rrc-ratio", "1"], ["--rrc-ratio", "'1'"]),
    (["--rrc-ratio", "nan,2"], ["--rrc-ratio", "'nan,2'"]),
])
def test_bad_augment_options_are_refused_in_one_line(tmp_path, capsys, args, names):
    code, _, err = run_cli(capsys, "train", "--device", "cpu", "--log-dir", tmp_path / "log",
                           *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert all(n in lines[0] for n in names), lines[0]
    assert not (tmp_path / "log").exists()


@pytest.mark.parametrize("argv,toml,want", [
    ([], "", None),
    (["--augment"], "", "crop-flip"),
    (["--augment", "--lr", "0.1"], "", "crop-flip"),
    (["--augment", "random-resized-crop"], "", "random-resized-crop"),
    ([], "augment = true\n", "crop-flip"),
    ([], "augment = false\n", None),
    ([], 'augment = "random-resized-crop"\nrrc-scale = "0.25,1"\n', "random-resized-crop"),
])
def test_augment_flag_forms(tmp_path, argv, toml, want):
    from dptrain.cli.config import apply_config
    from dptrain.cli.train import train_parser

    parser = train_parser()
    if toml:
        (tmp_path / "c.toml").write_text(toml)
        argv = argv + ["--config", str(tmp_path / "c.toml")]
    apply_config(parser, argv)
    args = parser.parse_args(argv)
    assert args.augment == want
    assert args.rrc_scale == ((0.25, 1.0) if "rrc-scale" in toml else (0.08, 1.0))
