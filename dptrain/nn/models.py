"""The models `--model` names. Each builder takes the dataset's image shape and class count."""
from __future__ import annotations

from dptrain.nn.layers import Conv2d, Flatten, Linear, MaxPool2d, ReLU, Sequential
from dptrain.nn.resnet import resnet18, resnet34, resnet50
from dptrain.nn.user import build_user_model, is_user_model
from dptrain.nn.vit import vit


def cnn(image_shape=(1, 48, 48), num_classes=7, widths=(32, 64, 128), hidden=256):
    """The reference CNN: three conv3x3+ReLU+maxpool2 blocks, then FC-ReLU-FC."""
    channels, height, width = image_shape
    layers = []
    for out in widths:
        layers += [Conv2d(channels, out, 3, padding=1), ReLU(), MaxPool2d(2)]
        channels, height, width = out, height // 2, width // 2
    if height == 0 or width == 0:
        raise ValueError(f"cnn: images of {image_shape[1]}x{image_shape[2]} are too small for "
                         f"{len(widths)} pooling stages")
    layers += [Flatten(), Linear(channels * height * width, hidden), ReLU(),
               Linear(hidden, num_classes)]
    return Sequential(*layers)


def mlp(image_shape=(1, 48, 48), num_classes=7, hidden=(512, 256)):
    """A multilayer perceptron on the flattened input (of any shape): Linear-ReLU per width in
    `hidden` (any number of layers, none included), then Linear to the classes."""
    features = 1
    for d in image_shape:
        features *= int(d)
    layers = [Flatten()]
    for width in hidden:
        layers += [Linear(features, width), ReLU()]
        features = width
    layers.append(Linear(features, num_classes))
    return Sequential(*layers)


MODELS = {"cnn": cnn, "mlp": mlp, "resnet18": resnet18, "resnet34": resnet34,
          "resnet50": resnet50, "vit": vit}


def build_model(name: str, image_shape, num_classes: int, hidden=None):
    """Model `name` for images of `image_shape`; `hidden` (widths of the hidden layers, the
    --hidden flag) applies to the mlp only. A `name` with a colon, ``FILE.py:FUNCTION`` or
    ``package.module:FUNCTION``, is a user's function returning a Module (dptrain.nn.user)."""
    if is_user_model(name):
        return build_user_model(name, image_shape, num_classes, hidden)
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    options = {}
    if hidden is not None:
        if name != "mlp":
            raise ValueError(f"--hidden applies to --model mlp, not {name}")
        options["hidden"] = tuple(hidden)
    return MODELS[name](image_shape=tuple(image_shape), num_classes=num_classes, **options)
