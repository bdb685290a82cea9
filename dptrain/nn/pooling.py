"""Global average pooling: torch.nn.AdaptiveAvgPool2d with output size 1."""
from __future__ import annotations

from dptrain.engine import functional as F
from dptrain.nn.module import Module


class AdaptiveAvgPool2d(Module):
    """The mean of each channel over H and W: (N, C, H, W) -> (N, C, 1, 1); a
    ``channels_last`` one (see nn.Conv2d) (N, H, W, C) -> (N, 1, 1, C)."""

    def __init__(self, output_size=1):
        super().__init__()
        self.output_size = output_size
        if F._pair(output_size, "output_size") != (1, 1):
            raise ValueError(f"AdaptiveAvgPool2d: only output_size 1 is supported, "
                             f"got {output_size!r}")
        self.channels_last = False

    def forward(self, x):
        return F.adaptive_avg_pool2d(x, self.output_size, channels_last=self.channels_last)
