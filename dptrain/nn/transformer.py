"""Transformer building blocks: LayerNorm, GELU and a pre-LN encoder block.

``TransformerEncoderLayer`` is PyTorch's ``nn.TransformerEncoderLayer(d_model, nhead,
dim_feedforward, dropout, activation="gelu", batch_first=True, norm_first=True)``, with the same
parameter names (self_attn.in_proj_weight, linear1, linear2, norm1, norm2, ...):

    x = x + dropout1(self_attn(norm1(x)))
    x = x + dropout2(linear2(dropout(gelu(linear1(norm2(x))))))
"""
from __future__ import annotations

import numpy as np

from dptrain.engine import functional as F
from dptrain.nn.attention import MultiHeadAttention
from dptrain.nn.layers import Dropout, Linear
from dptrain.nn.module import Module, Parameter


class LayerNorm(Module):
    """Normalise over the last axis of size `dim`, then scale by weight (ones) and shift by
    bias (zeros), as torch.nn.LayerNorm(dim)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = Parameter(np.ones(dim, np.float32))
        self.bias = Parameter(np.zeros(dim, np.float32))

    def forward(self, x):  # 16-bit x: float32 weight and bias, float32 math (as batch norm)
        return F.layer_norm(x, self.weight, self.bias, self.eps)


class GELU(Module):
    def forward(self, x):
        return F.gelu(x)


class TransformerEncoderLayer(Module):
    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048,
                 dropout: float = 0.1, layer_norm_eps: float = 1e-5):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, nhead, dropout=dropout)
        self.linear1 = Linear(d_model, dim_feedforward)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model)
        self.norm1 = LayerNorm(d_model, layer_norm_eps)
        self.norm2 = LayerNorm(d_model, layer_norm_eps)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.activation = GELU()

    def forward(self, x, key_lengths=None, causal=False):
        # Module.__call__ passes positional arguments: (query, key, value, key_lengths, causal)
        x = x + self.dropout1(self.self_attn(self.norm1(x), None, None, key_lengths, causal))
        h = self.dropout(self.activation(self.linear1(self.norm2(x))))
        return x + self.dropout2(self.linear2(h))
