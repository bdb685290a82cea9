"""The PyTorch side of ``bench train``: the twin of one of our models and its training step.

``twin(model)`` (dptrain.run.torch_twin) builds the ``torch.nn.Sequential`` equal to one of our Sequential models
(Conv2d, Linear, ReLU, MaxPool2d, AvgPool2d, Flatten, Dropout) and loads our weights into it
(the names agree: "0.weight", ...); None for a model with other layers (no torch columns
for it). ``training_step(...)`` returns the step in one of PyTorch's modes (``MODES``), on
uint8 images already on the device, gathered and normalised inside the step as ours does.
"""
from __future__ import annotations

from dptrain.run.torch_twin import twin  # noqa: F401  (the model twins live with the product)

# mode -> what it is; eager / graph / compile run in fp32 or tf32 (MATMUL_PRECISIONS),
# graph-autocast-cl in bf16 or fp16 (AUTOCAST_PRECISIONS).
MODES = {
    "eager": "eager PyTorch",
    "graph": "the whole step captured in a CUDA graph and replayed",
    "compile": "torch.compile of the model (default mode), optimizer eager",
    "graph-autocast-cl": "autocast (bf16/fp16) + channels_last, captured in a CUDA graph",
}
MATMUL_PRECISIONS = ("fp32", "tf32")  # eager / graph / compile rows
AUTOCAST_PRECISIONS = ("bf16", "fp16")  # graph-autocast-cl rows


def available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def version() -> str:
    import torch

    return torch.__version__


def _optimizer(params, name, device_graph):
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if device_graph:  # replayable: step count on the device; fused is PyTorch's fastest
        try:
            return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True,
                                     capturable=True)
        except (RuntimeError, TypeError, ValueError):
            return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, capturable=True)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def set_matmul_precision(precision: str) -> None:
    """TF32 tensor cores in matmul and cuDNN convolutions for "tf32", plain fp32 otherwise."""
    import torch

    allow = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = allow
    torch.backends.cudnn.allow_tf32 = allow


def training_step(net, device, mode, precision, optimizer, images, labels, mean, std):
    """(step, sync) for `net` in `mode` on `device` (a device name PyTorch knows); `images`
    uint8 (N, C, H, W) and `labels` as NumPy arrays, moved to the device once."""
    import copy

    import torch
    import torch.nn.functional as tF

    net = copy.deepcopy(net).to(device)
    u8 = torch.from_numpy(images).to(device)
    y = torch.from_numpy(labels.astype("int64")).to(device)
    idx = torch.arange(len(labels), device=device)
    scale, shift = 1.0 / (255.0 * std), mean / std
    autocast = mode == "graph-autocast-cl"
    if autocast:
        net = net.to(memory_format=torch.channels_last)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    graph = mode in ("graph", "graph-autocast-cl")
    opt = _optimizer(net.parameters(), optimizer, graph)
    forward = torch.compile(net) if mode == "compile" else net
    set_matmul_precision(precision)

    def eager():
        x = u8.index_select(0, idx).float().mul_(scale).sub_(shift)
        if autocast:
            x = x.contiguous(memory_format=torch.channels_last)
            with torch.autocast(device_type=device, dtype=dtype):
                loss = tF.cross_entropy(forward(x), y)
        else:
            loss = tF.cross_entropy(forward(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()

    def sync():
        if u8.is_cuda:
            torch.cuda.synchronize()

    if not graph:
        return eager, sync
    side = torch.cuda.Stream()  # PyTorch's whole-step capture recipe
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            eager()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        eager()
    return g.replay, sync
