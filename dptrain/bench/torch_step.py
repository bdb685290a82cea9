"""The PyTorch side of ``bench train``: the twin of one of our models and its training step.

``twin(model)`` (dptrain.run.torch_twin) builds the PyTorch module equal to one of our models
(Sequential stacks of Conv2d, Linear, ReLU, MaxPool2d, AvgPool2d, Flatten, Dropout;
torchvision's resnet18/34/50; the ViT with nn.TransformerEncoderLayer blocks) and loads our
weights into it (the names agree: "0.weight", ...); None for a model with other layers (no
torch columns for it). ``training_step(...)`` returns the step in one of PyTorch's modes
(``MODES``), on uint8 images already on the device, gathered and normalised inside the step
as ours does, with the seconds its first step took where the mode compiles.
"""
from __future__ import annotations

import time


# mode -> what it is; MATMUL_MODES run in fp32 or tf32 (MATMUL_PRECISIONS), AUTOCAST_MODES in
# bf16 or fp16 (AUTOCAST_PRECISIONS).
MODES = {
    "eager": "eager PyTorch",
    "graph": "the whole step captured in a CUDA graph and replayed",
    "compile": "torch.compile of the model (default mode), optimizer eager",
    "graph-autocast-cl": "autocast (bf16/fp16) + channels_last, captured in a CUDA graph",
    "compile-max-autotune": "autocast (bf16/fp16) + channels_last, torch.compile of the model "
                            "with mode='max-autotune' (Triton GEMM autotuning, CUDA graphs), "
                            "optimizer eager",
}
MATMUL_MODES = ("eager", "graph", "compile")
AUTOCAST_MODES = ("graph-autocast-cl", "compile-max-autotune")
COMPILE_MODES = ("compile", "compile-max-autotune")  # their first step's time is reported
# max-autotune's compile can take minutes: it runs only when --torch-modes names it
DEFAULT_MODES = ("eager", "graph", "compile", "graph-autocast-cl")
MATMUL_PRECISIONS = ("fp32", "tf32")  # MATMUL_MODES rows
AUTOCAST_PRECISIONS = ("bf16", "fp16")  # AUTOCAST_MODES rows


def rows(precisions, modes, graphs) -> list[tuple[str, str]]:
    """(precision, mode) of the PyTorch rows for our `precisions` and the chosen `modes`: the
    matmul modes in our fp32/tf32 precisions, the autocast modes in bf16 always (the precision
    to beat) and fp16 when we run it; on a device without graphs (the CPU) only eager."""
    if not graphs:
        return [(p, "eager") for p in precisions if p in MATMUL_PRECISIONS and "eager" in modes]
    out = [(p, m) for p in precisions if p in MATMUL_PRECISIONS
           for m in MATMUL_MODES if m in modes]
    out += [(p, m) for p in AUTOCAST_PRECISIONS if p in precisions or p == "bf16"
            for m in AUTOCAST_MODES if m in modes]
    return out


def available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def release_memory() -> None:
    """PyTorch's cached device memory back to the device (our steps need it next); nothing
    where PyTorch was never imported."""
    import gc
    import sys

    torch = sys.modules.get("torch")
    gc.collect()
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


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
    """(step, sync, compile_s) for `net` in `mode` on `device` (a device name PyTorch knows);
    `images` uint8 (N, C, H, W) and `labels` as NumPy arrays, moved to the device once.
    compile_s: the wall time of the first step in the compile modes (torch.compile is lazy:
    tracing, Inductor's code generation and max-autotune's benchmarking of kernel choices all
    happen there), None in the others."""
    import copy

    import torch
    import torch.nn.functional as tF

    net = copy.deepcopy(net).to(device)
    u8 = torch.from_numpy(images).to(device)
    y = torch.from_numpy(labels.astype("int64")).to(device)
    idx = torch.arange(len(labels), device=device)
    scale, shift = 1.0 / (255.0 * std), mean / std
    autocast = mode in AUTOCAST_MODES
    if autocast:
        net = net.to(memory_format=torch.channels_last)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    graph = mode in ("graph", "graph-autocast-cl")
    autotune = mode == "compile-max-autotune"
    opt = _optimizer(net.parameters(), optimizer, graph)
    if mode in COMPILE_MODES:
        # each row compiles afresh: no recompile limit reached, no batch dimension made
        # dynamic by the previous row's shape, the previous row's CUDA graphs freed
        torch._dynamo.reset()
    if autotune:
        # gradients allocated up front: backward accumulates into them in place instead of
        # handing the optimizer buffers of the CUDA-graph pool that the next replay reuses
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
        forward = torch.compile(net, mode="max-autotune")
    else:
        forward = torch.compile(net) if mode == "compile" else net
    set_matmul_precision(precision)

    def eager():
        if autotune:  # each call is a new iteration for the compiled CUDA graphs
            torch.compiler.cudagraph_mark_step_begin()
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

    if mode in COMPILE_MODES:
        start = time.perf_counter()
        eager()
        sync()
        return eager, sync, time.perf_counter() - start
    if not graph:
        return eager, sync, None
    side = torch.cuda.Stream()  # PyTorch's whole-step capture recipe
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            eager()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        eager()
    return g.replay, sync, None
