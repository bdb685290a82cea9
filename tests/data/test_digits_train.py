"""End to end on real images: scikit-learn's digits (shipped in its wheel) exported to PNG
class folders, trained through `--dataset imagefolder` on the CPU."""
import json

import pytest
from data_fixtures import export_digits

from dptrain.cli import main as cli_main

pytest.importorskip("sklearn")


def test_imagefolder_digits_reach_90_percent(tmp_path, capsys):
    export_digits(str(tmp_path / "digits"))
    log = tmp_path / "log"
    code = cli_main(["train", "--device", "cpu", "--dataset", "imagefolder", "--data-dir",
                     str(tmp_path / "digits"), "--cache-dir", str(tmp_path / "cache"),
                     "--model", "mlp", "--epochs", "4", "--batch-size", "32",
                     "--warmup-steps", "20", "--log-dir", str(log), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((log / "summary.json").read_text())
    assert summary["val_accuracy"] >= 0.90, summary
