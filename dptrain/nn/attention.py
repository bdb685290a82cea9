"""Multi-head attention in PyTorch's layout (``torch.nn.MultiheadAttention``, batch_first).

Parameters: ``in_proj_weight`` (3D, D) holding the query, key and value projections stacked in
that order, ``in_proj_bias`` (3D,), and ``out_proj`` (a Linear D -> D), initialised as PyTorch
does (Xavier-uniform in_proj_weight, zero biases), so a state_dict moves both ways. Masks are
flags: ``causal`` (key j > query i masked) and ``key_lengths`` (B,) ints (keys j >=
key_lengths[b] masked: PyTorch's key_padding_mask for padding at the end of each sequence).
"""
from __future__ import annotations

import math

import numpy as np

from dptrain.engine import functional as F
from dptrain.nn import fusion
from dptrain.nn.layers import Linear, in_dtype_of
from dptrain.nn.module import Module, Parameter
from dptrain.engine.rng import init_rng


class MultiHeadAttention(Module):
    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"MultiHeadAttention: embed_dim {embed_dim} does not divide by "
                             f"num_heads {num_heads}")
        self.embed_dim, self.num_heads, self.dropout = embed_dim, num_heads, dropout
        self.head_dim = embed_dim // num_heads
        bound = math.sqrt(6.0 / (embed_dim + 3 * embed_dim))  # xavier_uniform_ on (3D, D)
        self.in_proj_weight = Parameter(
            init_rng().uniform(-bound, bound, (3 * embed_dim, embed_dim)).astype(np.float32))
        self.in_proj_bias = Parameter(np.zeros(3 * embed_dim, np.float32)) if bias else None
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias)
        if bias:
            self.out_proj.bias.data[...] = 0  # PyTorch zeroes out_proj.bias

    def _heads(self, x):
        """(B, T, D) -> (B, H, T, head_dim)."""
        b, t, _ = x.shape
        return x.reshape(b, t, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)

    def forward(self, query, key=None, value=None, key_lengths=None, causal=False):
        """Attention of query (B, Tq, D) over key / value (B, Tk, D) (default: the query, i.e.
        self-attention); returns (B, Tq, D)."""
        if query.ndim != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(f"MultiHeadAttention: expected (batch, seq, {self.embed_dim}) "
                             f"input, got {query.shape}")
        b, tq, d = query.shape
        w, bias = in_dtype_of(query, self.in_proj_weight, self.in_proj_bias)
        if key is None and value is None:  # one projection for q, k and v
            out = F.self_attention(F.linear(query, w, bias), self.num_heads, causal=causal,
                                   key_lengths=key_lengths, dropout_p=self.dropout,
                                   training=self.training, fused=fusion.enabled())
            return self.out_proj(out)
        key = query if key is None else key
        value = key if value is None else value
        parts = [(w[i * d:(i + 1) * d],) + ((bias[i * d:(i + 1) * d],) if bias is not None
                                             else ()) for i in range(3)]
        q, k, v = (self._heads(F.linear(x, *p)) for x, p in zip((query, key, value), parts))
        out = F.scaled_dot_product_attention(q, k, v, causal=causal, key_lengths=key_lengths,
                                             dropout_p=self.dropout, training=self.training,
                                             fused=fusion.enabled())
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(b, tq, d))
