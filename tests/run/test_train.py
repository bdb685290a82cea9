"""The training loop on the synthetic data: the reference CNN's loss falls."""
import json

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
