"""ResNet-18 against PyTorch on the same weights and inputs (fp32, CPU): forward in training
mode (batch statistics), every parameter's gradient, the running estimates, and eval after
moving the weights back. The reference is torchvision's resnet18 layout written out in torch
here (same module names), so torchvision is not needed. Skipped without torch."""
import numpy as np
import pytest

import dptrain as dp
import dptrain.engine.functional as F
from dptrain import nn

torch = pytest.importorskip("torch")
tnn = torch.nn


class TorchBasicBlock(tnn.Module):
    def __init__(self, cin, c, stride):
        super().__init__()
        self.conv1 = tnn.Conv2d(cin, c, 3, stride, 1, bias=False)
        self.bn1 = tnn.BatchNorm2d(c)
        self.relu = tnn.ReLU()
        self.conv2 = tnn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bn2 = tnn.BatchNorm2d(c)
        self.downsample = None
        if stride != 1 or cin != c:
            self.downsample = tnn.Sequential(tnn.Conv2d(cin, c, 1, stride, bias=False),
                                             tnn.BatchNorm2d(c))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class TorchResNet18(tnn.Module):
    """torchvision.models.resnet18's module tree; `small` swaps in the 3x3 stem, no max-pool."""

    def __init__(self, channels, num_classes, small):
        super().__init__()
        self.conv1 = (tnn.Conv2d(channels, 64, 3, 1, 1, bias=False) if small
                      else tnn.Conv2d(channels, 64, 7, 2, 3, bias=False))
        self.bn1 = tnn.BatchNorm2d(64)
        self.relu = tnn.ReLU()
        self.maxpool = tnn.Identity() if small else tnn.MaxPool2d(3, 2, 1)
        cin = 64
        for i, c in enumerate((64, 128, 256, 512)):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", tnn.Sequential(TorchBasicBlock(cin, c, stride),
                                                         TorchBasicBlock(c, c, 1)))
            cin = c
        self.avgpool = tnn.AdaptiveAvgPool2d(1)
        self.fc = tnn.Linear(512, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("image_shape,batch", [((1, 32, 32), 4), ((3, 72, 72), 2)])
def test_resnet18_matches_torch(image_shape, batch):
    torch.manual_seed(0)
    dp.manual_seed(5)
    ours = nn.resnet18(image_shape, 10)
    assert ours.small_stem == (image_shape[1] <= 64)
    ref = TorchResNet18(image_shape[0], 10, small=ours.small_stem)
    state = ours.state_dict()
    assert list(state) == list(ref.state_dict())  # names and order, buffers included
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})  # ours -> torch

    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch,) + image_shape).astype(np.float32)
    y = np.arange(batch) % 10
    ref.train()
    logits_ref = ref(torch.from_numpy(x))
    tnn.functional.cross_entropy(logits_ref, torch.from_numpy(y)).backward()
    logits = ours(dp.tensor(x))
    F.cross_entropy(logits, dp.tensor(y)).backward()

    err = rel(logits.numpy(), logits_ref.detach().numpy())
    print(f"logits relative error {err:.2e}")
    assert err <= 1e-4
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        err = rel(p.grad.numpy(), ref_params[name].grad.numpy())
        assert err <= 1e-4, f"gradient of {name}: relative error {err:.2e}"
    ref_state = ref.state_dict()
    for name, value in ours.state_dict().items():
        if "running" in name:
            assert rel(value, ref_state[name].numpy()) <= 1e-4, name
        elif "num_batches_tracked" in name:
            assert int(value) == int(ref_state[name]) == 1, name

    # torch -> ours: the trained-mode estimates carry over, and eval agrees.
    moved = nn.resnet18(image_shape, 10)
    moved.load_state_dict({k: v.numpy() for k, v in ref.state_dict().items()})
    moved.eval()
    ref.eval()
    with torch.no_grad():
        expect = ref(torch.from_numpy(x)).numpy()
    with dp.no_grad():
        got = moved(dp.tensor(x)).numpy()
    assert rel(got, expect) <= 1e-4
