"""The training loop on the synthetic data: the reference CNN's loss falls; a ResNet above
64 px trains on batches its loaders lay out for its stem."""
import json

import numpy as np

from dptrain.run.config import TrainConfig

from dptrain.run.train import train


def test_cnn_loss_falls_on_synthetic_data(tmp_path):
    cfg = TrainConfig(device="cpu", model="cnn", dataset="synthetic", train_images=8320,
                      val_images=256, epochs=1, max_steps=130, batch_size=64, warmup_steps=60,
                      log_every=10, cache_dir=str(tmp_path / "cache"), log_dir=str(tmp_path / "L"),
                      progress=False)
    summary = train(cfg, echo=lambda _: None)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "L" / "metrics.jsonl").open()
              if '"loss"' in line]
    assert losses[0] > 1.8  # chance level for 7 classes is ln 7 = 1.95
    assert losses[-1] < 1.2, losses
    assert summary["val_accuracy"] > 0.5


RESNET_72 = '''
from dptrain import nn


def build(image_shape, num_classes):  # channels-last on the CPU too: the stem lays out its input
    return nn.resnet18(image_shape, num_classes, widths=(8, 8, 16, 16), channels_last=True)
'''


def test_resnet_above_64px_trains_on_batches_laid_out_for_its_stem(tmp_path, monkeypatch):
    """A ResNet-18 at 3x72x72 (MNIST resized, 3 channels: ImageNet's stem) trains and
    evaluates on batches its loaders lay out for the stem (the stem padded to 8 channels over
    pairs of columns, as on the GPU) in the pass that normalises them, the stem's own pass
    never run, to the weights of the same run on NCHW batches."""
    from data_fixtures import write_mnist

    from dptrain.backend import cpu
    from dptrain.nn.resnet import ResNet

    write_mnist(str(tmp_path / "m"), np.random.default_rng(0), n_train=16, n_test=6)
    (tmp_path / "resnet72.py").write_text(RESNET_72)
    monkeypatch.setattr(cpu, "conv2d_channels_last_pad", lambda c, kh, kw, dtype: (
        -c % 8 if (c, kh, kw) in ((3, 7, 7), (6, 7, 4)) else 0))
    layouts, passes = [], []
    gather, lay_out = cpu.gather_normalize, cpu.to_channels_last
    monkeypatch.setattr(cpu, "gather_normalize", lambda *a, layout=None, **k: (
        layouts.append(layout) or gather(*a, layout=layout, **k)))
    monkeypatch.setattr(cpu, "to_channels_last", lambda *a: passes.append(a) or lay_out(*a))

    def run(name):
        cfg = TrainConfig(device="cpu", model=f"{tmp_path / 'resnet72.py'}:build",
                          dataset="mnist", data_dir=str(tmp_path / "m"), channels=3,
                          image_size=72, batch_size=4, epochs=1, max_steps=2,
                          cache_dir=str(tmp_path / "cache"), save=str(tmp_path / name),
                          progress=False)
        summary = train(cfg, echo=lambda _: None)
        assert np.isfinite(summary["val_loss"])
        return np.load(tmp_path / name)

    laid = run("laid.npz")
    assert set(layouts) == {(1, 1, 2, 8)} and not passes  # train's and val's batches
    monkeypatch.setattr(ResNet, "input_layout", lambda self, *args: None)
    nchw = run("nchw.npz")
    assert None in layouts and passes  # the stem laid its NCHW input out itself
    assert sorted(laid.files) == sorted(nchw.files)
    for name in laid.files:
        assert laid[name].tobytes() == nchw[name].tobytes(), name
