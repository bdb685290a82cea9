"""`bench train --channels`: 3-channel images reach our step, the FLOP count and PyTorch's
step in the same shape (PyTorch's side stubbed, so this runs without torch)."""
import json

import pytest

from dptrain.bench import flops, torch_step
from dptrain.bench import train as bench


def test_three_channels_reach_both_sides(tmp_path, monkeypatch):
    seen = []

    def fake_training_step(net, device, mode, precision, optimizer, images, labels, mean, std):
        seen.append((mode, images.shape, labels.shape))
        return (lambda: None), (lambda: None), None

    monkeypatch.setattr(torch_step, "available", lambda: True)
    monkeypatch.setattr(torch_step, "version", lambda: "stub")
    monkeypatch.setattr(torch_step, "training_step", fake_training_step)
    monkeypatch.setattr(bench, "twin", lambda model: object())
    out = []
    code = bench.main(["--device", "cpu", "--models", "cnn", "--channels", "3", "--image-size",
                       "16", "--batch-sizes", "2", "--steps", "1", "--repeats", "1",
                       "--warmup", "1", "--precisions", "fp32", "--json",
                       str(tmp_path / "t.json")], echo=out.append)
    assert code == 0
    assert seen == [("eager", (2, 3, 16, 16), (2,))]
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["image_shape"] == [3, 16, 16]
    ours = [r for r in doc["rows"] if r["impl"] == "dptrain"]
    assert len(ours) == 1 and ours[0]["ms"] > 0
    # the first convolution reads 3 channels: more FLOPs than the 1-channel count
    assert ours[0]["flops_per_image"] == flops.training_flops_per_image("cnn", (3, 16, 16), 7)
    assert ours[0]["flops_per_image"] > flops.training_flops_per_image("cnn", (1, 16, 16), 7)
    assert "3x16x16 images" in "\n".join(out)


def test_channels_other_than_1_or_3_are_refused():
    with pytest.raises(SystemExit) as exc:
        bench.main(["--channels", "2"])
    assert exc.value.code == 2
