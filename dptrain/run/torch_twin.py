"""`train --torch`: the same run again in PyTorch, for curves to compare with ours.

After our run, rank 0 builds the model's PyTorch twin (same layers, same state-dict names),
loads the initial weights our run started from (same seed, or the same --load file), and
trains it one process at our global batch on the same batches: the sampler of one rank at
the global batch draws exactly the union of our ranks' batches. Same optimizer, learning-rate
schedule, logging and evaluation steps. It writes LOGDIR/torch/metrics.jsonl, summary.json and
config.json, so `python -m dptrain plot LOGDIR` draws both runs. Twins exist for Sequential
stacks of Conv2d, Linear, ReLU, pooling, Flatten and Dropout (cnn, mlp), for resnet18,
resnet34 and resnet50 (torchvision's, with our stem for the image size) and for vit
(nn.TransformerEncoderLayer blocks); other models are refused with one line. Dropout draws
other masks than ours.
"""
from __future__ import annotations

import importlib.util
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from dptrain.errors import UsageError


def require_torch() -> None:
    if importlib.util.find_spec("torch") is None:
        raise UsageError("--torch: PyTorch is not installed here (pip install torch)")


def torch_model(torch, model, source: str):
    """The PyTorch twin of one of our models, holding a copy of its weights (``twin`` below,
    shared with `bench train`)."""
    net = twin(model)
    if net is None:
        raise UsageError(f"--torch: {source} has no PyTorch twin here (Sequential stacks of "
                         f"Conv2d/Linear/ReLU/pooling/Flatten/Dropout, resnet18/34/50 "
                         f"with torchvision, and vit)")
    return net


def _normalizer(torch, dataset, device):
    """uint8 (B, C, H, W) -> float32, as the device loader: x / 255, then (x - mean) / std."""
    shape = (1, -1, 1, 1)
    mean = torch.tensor(np.asarray(dataset.mean, np.float32)).reshape(shape).to(device)
    std = torch.tensor(np.asarray(dataset.std, np.float32)).reshape(shape).to(device)
    return lambda x: (x.float() / 255.0 - mean) / std


def _evaluate(torch, net, images, labels, normalize, batch_size=1000) -> dict:
    F = torch.nn.functional
    net.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for start in range(0, labels.shape[0], batch_size):
            logits = net(normalize(images[start:start + batch_size]))
            y = labels[start:start + batch_size]
            loss += F.cross_entropy(logits, y, reduction="sum").item()
            correct += int((logits.argmax(1) == y).sum().item())
    net.train()
    n = labels.shape[0]
    return {"val_loss": loss / n, "val_accuracy": correct / n}


def train_twin(cfg, device: str, global_batch: int, echo=print) -> dict:
    """Train the PyTorch twin of the run `cfg` (defaults resolved) describes; returns its
    summary. `device` is ours ("cpu" or "cuda"), a valid torch device name as it stands."""
    import torch

    from dptrain.checkpoints.weights import load_weights
    from dptrain.data import StrideSampler, get_dataset
    from dptrain.run.config import data_options
    from dptrain.run.metrics import MetricsLog
    from dptrain.nn import build_model
    from dptrain.optim import LRSchedule
    from dptrain.engine.rng import manual_seed

    dev = torch.device(device)
    # Our mixed precision as PyTorch's: autocast to the 16-bit type, dynamic loss scaling
    # with our settings for fp16.
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    tf32 = cfg.precision in ("auto", "tf32") or autocast is not None
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    scaler = torch.amp.GradScaler(dev.type, init_scale=cfg.loss_scale,
                                  growth_interval=cfg.loss_scale_interval,
                                  enabled=autocast is torch.float16)
    torch.manual_seed(cfg.seed)
    options = data_options(cfg)  # the files and reading options our run used
    train_set = get_dataset(cfg.dataset, "train", cfg.train_images, cfg.seed, cfg.cache_dir,
                            **options)
    val_set = get_dataset(cfg.dataset, "val", cfg.val_images, cfg.seed, cfg.cache_dir, **options)
    manual_seed(cfg.seed)  # as train() before building the model: the same initial weights
    ours = build_model(cfg.model, train_set.image_shape, train_set.num_classes)
    if cfg.load:
        load_weights(ours, cfg.load)
    net = torch_model(torch, ours, f"model {cfg.model}").to(dev)
    if cfg.optimizer == "sgd":
        opt = torch.optim.SGD(net.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                              weight_decay=cfg.weight_decay, nesterov=cfg.nesterov)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def on_device(dataset):
        return (torch.from_numpy(np.array(dataset.images, dtype=np.uint8)).to(dev),
                torch.from_numpy(np.array(dataset.labels, dtype=np.int64)).to(dev))

    (x_train, y_train), (x_val, y_val) = on_device(train_set), on_device(val_set)
    normalize = _normalizer(torch, train_set, dev)
    sampler = StrideSampler(len(train_set.labels), global_batch, 1, 0, seed=cfg.seed,
                            drop_last=cfg.drop_last)
    steps_per_epoch = len(sampler)
    total = steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    schedule = LRSchedule(cfg.lr, cfg.lr_schedule, total, cfg.warmup_steps)
    eval_every = cfg.eval_every or steps_per_epoch
    log_dir = str(Path(cfg.log_dir) / "torch") if cfg.log_dir else None
    log = MetricsLog(log_dir)
    log.config({**asdict(cfg), "framework": f"torch {torch.__version__}"})
    echo(f"dptrain: the PyTorch {torch.__version__} twin on {dev}, {total} steps"
         + (f", into {log_dir}" if log_dir else ""))

    loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
    correct = torch.zeros((), dtype=torch.int64, device=dev)
    step, window, last_loss, last_eval = 0, 0, float("nan"), {}
    started = window_start = time.perf_counter()
    try:
        for epoch in range(cfg.epochs):
            batches = sampler.epoch_batches(epoch)
            for local in range(min(steps_per_epoch, total - step)):
                for group in opt.param_groups:
                    group["lr"] = schedule(step)
                idx = torch.from_numpy(np.asarray(batches[local], dtype=np.int64)).to(dev)
                with torch.autocast(dev.type, dtype=autocast, enabled=autocast is not None):
                    logits = net(normalize(x_train[idx])).float()
                loss = torch.nn.functional.cross_entropy(logits, y_train[idx])
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                loss_sum += loss.detach()
                correct += (logits.detach().argmax(1) == y_train[idx]).sum()
                step, window = step + 1, window + 1
                if step % cfg.log_every == 0 or step == total:
                    now = time.perf_counter()
                    last_loss = loss_sum.item() / window
                    log.write({"step": step, "epoch": epoch, "loss": last_loss,
                               "accuracy": correct.item() / (window * global_batch),
                               "lr": schedule(step - 1),
                               "images_per_s": window * global_batch / (now - window_start)})
                    loss_sum.zero_()
                    correct.zero_()
                    window, window_start = 0, time.perf_counter()
                if step % eval_every == 0 or step == total:
                    last_eval = _evaluate(torch, net, x_val, y_val, normalize)
                    log.write({"step": step, "epoch": epoch, **last_eval})
            if step >= total:
                break
    finally:
        log.close()
    summary = {"framework": f"torch {torch.__version__}", "train_loss": last_loss,
               "val_loss": last_eval.get("val_loss"),
               "val_accuracy": last_eval.get("val_accuracy"), "steps": step,
               "images": step * global_batch, "device": device,
               "wall_s": time.perf_counter() - started}
    log.summary(summary)
    echo(f"dptrain: PyTorch twin done: train_loss {last_loss:.4f}, val_accuracy "
         f"{summary['val_accuracy']:.4f}")
    return summary


def twin(model):
    """The torch.nn.Module equal to `model` with its weights (a Sequential for our Sequential
    stacks, torchvision's resnet18/34/50, the ViT below), or None."""
    import numpy as np
    import torch
    import torch.nn as tnn

    from dptrain import nn

    if isinstance(model, nn.ResNet):
        return _resnet_twin(model)
    if isinstance(model, nn.VisionTransformer):
        return _vit_twin(model)
    if not isinstance(model, nn.Sequential):
        return None
    layers = []
    for layer in model:
        if isinstance(layer, nn.Conv2d):
            cout, cin, kh, kw = layer.weight.shape
            layers.append(tnn.Conv2d(cin, cout, (kh, kw), layer.stride, layer.padding,
                                     bias=getattr(layer, "bias", None) is not None))
        elif isinstance(layer, nn.Linear):
            layers.append(tnn.Linear(layer.in_features, layer.out_features,
                                     bias=getattr(layer, "bias", None) is not None))
        elif isinstance(layer, nn.ReLU):
            layers.append(tnn.ReLU())
        elif isinstance(layer, nn.MaxPool2d):
            layers.append(tnn.MaxPool2d(*layer.args))
        elif isinstance(layer, nn.AvgPool2d):
            layers.append(tnn.AvgPool2d(*layer.args))
        elif isinstance(layer, nn.Flatten):
            layers.append(tnn.Flatten(layer.start_axis))
        elif isinstance(layer, nn.Dropout):
            layers.append(tnn.Dropout(layer.p))
        else:
            return None
    net = tnn.Sequential(*layers)
    net.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v))
                         for k, v in model.state_dict().items()})
    return net


def _resnet_twin(model):
    """torchvision's ResNet of our layout (basic or bottleneck blocks, the same counts: its
    resnet18, resnet34 or resnet50) with our stem (input channels; for small images a 3x3
    stride-1 conv and no max-pool) and our weights: the state_dict names are torchvision's.
    None when torchvision is missing or the widths are not torchvision's."""
    import torch.nn as tnn

    try:
        from torchvision.models import resnet as tv
    except ImportError:
        return None
    block = tv.Bottleneck if model.block.expansion == 4 else tv.BasicBlock
    cout, cin, kh, kw = model.conv1.weight.shape
    net = tv.ResNet(block, list(model.blocks), num_classes=model.fc.out_features)
    net.conv1 = tnn.Conv2d(cin, cout, (kh, kw), 1 if kh == 3 else 2, kh // 2, bias=False)
    if model.maxpool is None:
        net.maxpool = tnn.Identity()
    return _with_our_weights(net, model)


def _vit_twin(model):
    """Our VisionTransformer in torch: the same module names (patch_embed, cls_token,
    pos_embed, pos_drop, blocks.i as nn.TransformerEncoderLayer(batch_first, norm_first,
    exact GELU), norm, head) and forward, holding our weights. None if they do not load."""
    import torch
    import torch.nn as tnn

    class ViT(tnn.Module):  # defined here: importing this module never needs torch
        def __init__(self):
            super().__init__()
            cout, cin, p, _ = model.patch_embed.weight.shape
            self.patch_embed = tnn.Conv2d(cin, cout, p, stride=p)
            self.cls_token = tnn.Parameter(torch.zeros(model.cls_token.shape))
            self.pos_embed = tnn.Parameter(torch.zeros(model.pos_embed.shape))
            self.pos_drop = tnn.Dropout(model.pos_drop.p)
            self.blocks = tnn.Sequential(*[
                tnn.TransformerEncoderLayer(
                    b.linear1.in_features, b.self_attn.num_heads, b.linear1.out_features,
                    b.dropout.p, activation="gelu", layer_norm_eps=b.norm1.eps,
                    batch_first=True, norm_first=True)
                for b in model.blocks])
            self.norm = tnn.LayerNorm(model.norm.weight.shape[0], eps=model.norm.eps)
            self.head = tnn.Linear(model.head.in_features, model.head.out_features)

        def forward(self, x):
            tokens = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, N, D)
            # class token and positions in the tokens' dtype, as ours under autocast
            cls = self.cls_token.to(tokens.dtype).expand(tokens.shape[0], -1, -1)
            x = torch.cat([cls, tokens], dim=1) + self.pos_embed.to(tokens.dtype)
            x = self.norm(self.blocks(self.pos_drop(x)))
            return self.head(x[:, 0])

    net = ViT()
    return _with_our_weights(net, model)


def _with_our_weights(net, model):
    """`net` (a torch module) holding `model`'s weights, or None where they do not fit it."""
    import numpy as np
    import torch

    try:
        net.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v))
                             for k, v in model.state_dict().items()})
    except RuntimeError:
        return None
    return net
