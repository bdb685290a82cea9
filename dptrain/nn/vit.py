"""A small vision transformer (``--model vit``) for the project's image sets.

Image (B, C, H, W) -> patches by a strided convolution (``patch_embed``, kernel = stride =
patch size) -> tokens (B, N, D) -> a learned class token in front (``cls_token`` (1, 1, D),
repeated over the batch) -> plus a learned positional embedding (``pos_embed`` (1, N+1, D),
added by broadcasting) -> dropout -> ``depth`` pre-LN encoder blocks (``blocks.i``, PyTorch's
TransformerEncoderLayer layout) -> LayerNorm (``norm``) -> the class token's features ->
``head`` (Linear D -> classes). Names as timm's ViT where they exist.
"""
from __future__ import annotations

import numpy as np

from dptrain.engine import functional as F
from dptrain.nn.layers import Conv2d, Dropout, Linear, Sequential, in_dtype_of
from dptrain.nn.module import Module, Parameter
from dptrain.nn.transformer import LayerNorm, TransformerEncoderLayer
from dptrain.engine.rng import init_rng


def default_patch_size(height: int, width: int) -> int:
    """The largest patch size from 8 down to 4 that tiles the image exactly, else 8."""
    for p in range(8, 3, -1):
        if height % p == 0 and width % p == 0:
            return p
    return 8


class VisionTransformer(Module):
    def __init__(self, image_shape=(1, 48, 48), num_classes=7, patch_size=None, dim=64,
                 depth=4, heads=4, mlp_dim=None, dropout=0.1):
        super().__init__()
        channels, height, width = image_shape
        p = default_patch_size(height, width) if patch_size is None else int(patch_size)
        if p <= 0 or p > min(height, width):
            raise ValueError(f"vit: patch size {p} does not fit {height}x{width} images")
        if dim % heads:
            raise ValueError(f"vit: dim {dim} does not divide by heads {heads}")
        self.patch_size = p
        self.num_patches = (height // p) * (width // p)
        self.patch_embed = Conv2d(channels, dim, p, stride=p)
        self.cls_token = Parameter(
            (init_rng().standard_normal((1, 1, dim)) * 0.02).astype(np.float32))
        self.pos_embed = Parameter(
            (init_rng().standard_normal((1, self.num_patches + 1, dim)) * 0.02)
            .astype(np.float32))
        self.pos_drop = Dropout(dropout)
        mlp_dim = 4 * dim if mlp_dim is None else mlp_dim
        self.blocks = Sequential(*[TransformerEncoderLayer(dim, heads, mlp_dim, dropout)
                                   for _ in range(depth)])
        self.norm = LayerNorm(dim)
        self.head = Linear(dim, num_classes)

    def forward(self, x):
        patches = self.patch_embed(x)  # (B, D, H/p, W/p)
        b, d = patches.shape[:2]
        tokens = patches.reshape(b, d, -1).transpose(0, 2, 1)  # (B, N, D)
        cls_token, pos_embed = in_dtype_of(tokens, self.cls_token, self.pos_embed)
        cls = F.broadcast_to(cls_token, (b, 1, d))
        x = self.pos_drop(F.concatenate([cls, tokens], axis=1) + pos_embed)
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def vit(image_shape=(1, 48, 48), num_classes=7, **options):
    """The small ViT of `--model vit`: patch 8 (or the largest of 8..4 that tiles the image),
    dim 64, depth 4, heads 4, MLP 256, dropout 0.1; `options` override any of them."""
    return VisionTransformer(image_shape, num_classes, **options)
