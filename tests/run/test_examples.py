"""The scripts of examples/ run as a user runs them, with 2 ranks on the CPU, and learn."""
import re
import subprocess
import sys

import numpy as np
import pytest

from mpilaunch import ROOT, env, mpi_command, needs_mpi

pytestmark = needs_mpi


def run_example(tmp_path, script, *args, ranks=2, learns=True):
    cmd = [sys.executable, str(ROOT / "examples" / script), "--device", "cpu", *args]
    result = subprocess.run(mpi_command(ranks, cmd) if ranks > 1 else cmd, capture_output=True,
                            text=True, cwd=tmp_path, env=env(tmp_path / "cache"), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    if not learns:
        return result
    first, last = map(float, re.search(r"loss (\S+) -> (\S+)", result.stdout).groups())
    assert last < 0.8 * first, result.stdout  # it learns
    return result


def write_image_folder(root, per_class=16, size=16):
    """Three classes a small CNN can tell apart: bright left half, bright top half, dark."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c, name in enumerate(("left", "top", "dark")):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            img = rng.integers(0, 90, (size, size))
            if c == 0:
                img[:, : size // 2] += 150
            elif c == 1:
                img[: size // 2] += 150
            Image.fromarray(img.astype(np.uint8)).save(root / name / f"{i}.png")


def test_custom_cnn_on_an_image_folder(tmp_path):
    pytest.importorskip("PIL")
    write_image_folder(tmp_path / "photos")
    run_example(tmp_path, "custom_cnn_imagefolder.py", "--data-dir", str(tmp_path / "photos"),
                "--image-size", "16", "--epochs", "6", "--batch-size", "8")


def test_regression_mlp_on_arrays(tmp_path):
    run_example(tmp_path, "regression_mlp.py", "--epochs", "4")


def test_regression_mlp_resumes_from_its_checkpoints(tmp_path):
    """Stopped after 2 epochs at 1 rank and resumed at 2, it logs the last 2 epochs as the
    uninterrupted run at 2 ranks does (printed to 4 decimals: to 1 in the last)."""
    def epochs(result):
        return {int(e): float(mse) for e, mse in
                re.findall(r"epoch (\d+): mse (\S+)", result.stdout)}

    whole = epochs(run_example(tmp_path, "regression_mlp.py", "--epochs", "4",
                               "--batch-size", "64"))
    run_example(tmp_path, "regression_mlp.py", "--epochs", "2", "--batch-size", "128",
                "--checkpoint-dir", "ckpt", ranks=1, learns=False)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "step-00000016", "step-00000032"]
    resumed = epochs(run_example(tmp_path, "regression_mlp.py", "--epochs", "4",
                                 "--batch-size", "64", "--checkpoint-dir", "ckpt", "--resume",
                                 learns=False))
    assert sorted(whole) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    for epoch, mse in resumed.items():
        assert abs(mse - whole[epoch]) <= 1.5e-4, (epoch, mse, whole[epoch])


def test_finetune_resnet18_with_a_frozen_body(tmp_path):
    run_example(tmp_path, "finetune_resnet18.py", "--weights", "r18.npz", "--out", "ft.npz",
                "--epochs", "3", "--images", "48")
    before, after = np.load(tmp_path / "r18.npz"), np.load(tmp_path / "ft.npz")
    assert np.array_equal(before["layer1.0.conv1.weight"], after["layer1.0.conv1.weight"])
    assert after["fc.weight"].shape[0] == 4
